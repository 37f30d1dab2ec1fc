//! `--only prune`: what one retention pass costs when nothing is due, by the history kept.
//!
//! A table of `n` done jobs finished an hour ago (over `n / 4` keys, each with its key row
//! and a history row), `n / 10` effect-ledger rows kept 30 days more, and 1,000 dead
//! letters finished a month ago, inserted by SQL and never analyzed; then
//! `Store::prune_with` (7 days, batch 10,000, the keys' pass too) timed [`PASSES`] times
//! per run, on one table per size: its time and the rows it read should not grow with `n`. Sizes:
//! 10^5 and 10^6 in the full run, 10^5 with `--quick`; `--prune-rows 100000,1000000,10000000`
//! for others (10^7 takes minutes to insert).

use std::time::{Duration, Instant};

use leasehold::store::PruneOptions;
use leasehold::Store;

use super::report::{Row, Stat};
use super::sections::Run;
use super::setup;

const SECTION: &str = "retention (one pass, nothing due; rows retained, never analyzed)";
const SCHEMA: &str = "bench_prune";
/// Passes timed per run.
const PASSES: usize = 10;
const WEEK: Duration = Duration::from_secs(7 * 24 * 3600);

impl Run {
    pub async fn prune(&mut self, sizes: &[i64]) {
        for &n in sizes {
            let mut ms = Vec::new();
            let mut read = 0;
            // One table per size (10^7 rows take minutes to insert), measured `runs` times.
            let store = setup::fresh_schema(&self.pool, SCHEMA, self.history).await;
            let t = Instant::now();
            fill(&store, n).await;
            setup::checkpoint(&store).await;
            say!(
                "prune: {n} rows inserted in {:.1} s",
                t.elapsed().as_secs_f64()
            );
            let mut options = PruneOptions::new(WEEK);
            options.keys = true;
            for r in 0..self.runs {
                for _ in 0..PASSES {
                    let t = Instant::now();
                    let report = store.prune_with(&options).await.expect("prune");
                    ms.push(t.elapsed().as_secs_f64() * 1000.0);
                    assert_eq!(report.deleted(), 0, "nothing is due: {report:?}");
                    read = read.max(report.read);
                }
                say!(
                    "run {}/{}: a pass at {n} retained rows: median {:.2} ms, {read} rows read",
                    r + 1,
                    self.runs,
                    Stat::of(ms.clone()).median()
                );
            }
            self.rows.push(Row::new(
                SECTION,
                format!("prune pass, {n} jobs kept ({read} candidate rows read)"),
                Stat::of(ms),
                "ms",
            ));
        }
        setup::drop_schema(&self.pool, SCHEMA).await;
    }
}

/// `n` done jobs finished an hour ago over `n / 4` keys, with their key rows and a
/// history row each; `n / 10` ledger rows kept 30 days; 1,000 dead letters.
async fn fill(store: &Store, n: i64) {
    let s = store.schema().quoted();
    let keys = (n / 4).max(1);
    for sql in [
        format!(
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts,
                                   attempts, generation, owner, job_key, key_seq, finished_at)
             SELECT 'default', 'noop', 'done', '{{}}', 2, 25, 1, 1, 'bench:old',
                    'k' || (g % {keys}), 1 + g / {keys}, now() - interval '1 hour'
             FROM generate_series(1, {n}) g"
        ),
        format!(
            "INSERT INTO {s}.job_keys (queue, job_key, next_seq, open_jobs)
             SELECT 'default', 'k' || k, 5, 0 FROM generate_series(0, {keys} - 1) k"
        ),
        format!(
            "INSERT INTO {s}.job_events (job_id, generation, event, at)
             SELECT g, 1, 'completed', now() - interval '1 hour' FROM generate_series(1, {n}) g"
        ),
        format!(
            "INSERT INTO {s}.effects (effect_key, job_id, generation, fingerprint, outcome, keep_until)
             SELECT 'e/' || g, g, 1, 'fp', '\"ok\"', now() + interval '30 days'
             FROM generate_series(1, {n} / 10) g"
        ),
        format!(
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts,
                                   finished_at, last_error)
             SELECT 'default', 'noop', 'dead', '{{}}', 2, 1, now() - interval '30 days', 'gave up'
             FROM generate_series(1, 1000) g"
        ),
    ] {
        sqlx::query(&sql)
            .execute(store.pool())
            .await
            .expect("fill the prune table");
    }
}
