//! `--only stats`: what one collection of the operator figures costs on a big table.
//!
//! `Store::queue_stats` (what `leasehold status` shows) and `Store::queue_gauges` (what
//! `/metrics` serves) at 10^6 done and 10^5 pending rows, plus some held, dead and
//! running rows and 1,000 recent lease expiries: first on the table as inserted, never
//! analyzed (autovacuum off, or a bulk load before it runs: the state users meet), then
//! after `VACUUM (ANALYZE)`. The plans go to the report.

use std::time::Instant;

use leasehold::Store;

use super::report::{Goal, Row, Stat};
use super::sections::Run;
use super::setup;

const SECTION: &str =
    "operator figures (one collection; 10^6 done + 10^5 pending rows in the full run)";
const SCHEMA: &str = "bench_stats";
/// Collections timed per run after the first.
const REPEATS: usize = 10;

impl Run {
    pub async fn stats(&mut self) {
        let (done, pending) = self.sizes.stats_rows;
        let mut cells: [Vec<f64>; 5] = Default::default();
        for r in 0..self.runs {
            let store = setup::fresh_schema(&self.pool, SCHEMA, self.history).await;
            fill(&store, done, pending).await;
            setup::checkpoint(&store).await;
            let first = timed(|| store.queue_stats()).await;
            let fresh = median_of(&store, false).await;
            let fresh_gauges = median_of(&store, true).await;
            setup::vacuum_analyze(&store).await;
            sqlx::query(&format!("VACUUM (ANALYZE) {SCHEMA}.lease_expiries"))
                .execute(store.pool())
                .await
                .expect("vacuum lease_expiries");
            let tuned = median_of(&store, false).await;
            let tuned_gauges = median_of(&store, true).await;
            say!(
                "run {}/{}: queue_stats first {first:.1} ms, then {fresh:.1} ms (gauges {fresh_gauges:.1}); \
                 after VACUUM ANALYZE {tuned:.1} ms (gauges {tuned_gauges:.1})",
                r + 1,
                self.runs
            );
            for (cell, v) in cells
                .iter_mut()
                .zip([first, fresh, fresh_gauges, tuned, tuned_gauges])
            {
                cell.push(v);
            }
            if r + 1 == self.runs {
                self.explains.push((
                    format!("Store::queue_stats, {done} done + {pending} pending rows, after VACUUM ANALYZE"),
                    store.explain_queue_stats().await.expect("explain"),
                ));
            }
        }
        let [first, fresh, fresh_gauges, tuned, tuned_gauges] = cells;
        let limit = Goal::AtMost(50.0);
        for (name, stat, goal) in [
            ("queue_stats, first collection, never analyzed", first, None),
            ("queue_stats, never analyzed", fresh, Some(limit)),
            (
                "queue_gauges (/metrics), never analyzed",
                fresh_gauges,
                Some(limit),
            ),
            ("queue_stats, after VACUUM ANALYZE", tuned, Some(limit)),
            (
                "queue_gauges (/metrics), after VACUUM ANALYZE",
                tuned_gauges,
                Some(limit),
            ),
        ] {
            let mut row = Row::new(SECTION, name, Stat::of(stat), "ms");
            if let Some(g) = goal {
                row = row.goal(g);
            }
            self.rows.push(row);
        }
        setup::drop_schema(&self.pool, SCHEMA).await;
    }
}

/// `done` finished jobs, `pending` due ones, 1,000 each of held, dead (keyed, blocking
/// their keys, each with a job waiting) and running, and 1,000 lease expiries of the
/// last minute.
async fn fill(store: &Store, done: i64, pending: i64) {
    setup::insert_rows(store, "done", done).await;
    setup::insert_rows(store, "pending", pending).await;
    setup::insert_rows(store, "held", 1_000).await;
    let s = store.schema().quoted();
    for sql in [
        format!(
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts,
                                   job_key, key_seq, finished_at, last_error)
             SELECT 'default', 'noop', 'dead', '{{}}', 2, 1, 'k' || g, 1, now(), 'gave up'
             FROM generate_series(1, 1000) g"
        ),
        format!(
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts,
                                   job_key, key_seq)
             SELECT 'default', 'noop', 'waiting', '{{}}', 2, 1, 'k' || g, 2
             FROM generate_series(1, 1000) g"
        ),
        format!(
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts,
                                   attempts, generation, owner, claimed_at, lease_until)
             SELECT 'default', 'noop', 'running', '{{}}', 2, 5, 1, 1, 'bench:w', now(),
                    now() + interval '1 hour'
             FROM generate_series(1, 1000) g"
        ),
        format!(
            "INSERT INTO {s}.lease_expiries (job_id, generation, owner, lease_until, reaped_at,
                                             reaped_by, new_state)
             SELECT g, 1, 'bench:w', now() - interval '1 minute', now() - interval '1 minute',
                    'bench:r', 'pending'
             FROM generate_series(1, 1000) g"
        ),
    ] {
        sqlx::query(&sql)
            .execute(store.pool())
            .await
            .expect("fill the stats table");
    }
}

/// Milliseconds one call of `f` took.
async fn timed<F, Fut, T>(f: F) -> f64
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = leasehold::Result<T>>,
{
    let t = Instant::now();
    f().await.expect("collect the figures");
    t.elapsed().as_secs_f64() * 1000.0
}

/// Median of [`REPEATS`] collections of the stats (or the gauges).
async fn median_of(store: &Store, gauges: bool) -> f64 {
    let mut ms = Vec::with_capacity(REPEATS);
    for _ in 0..REPEATS {
        ms.push(if gauges {
            timed(|| store.queue_gauges()).await
        } else {
            timed(|| store.queue_stats()).await
        });
    }
    Stat::of(ms).median()
}
