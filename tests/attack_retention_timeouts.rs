//! Attack on retention's timeouts: "a statement that hits the timeout is tried again at
//! once with half the batch, and the reaper's next passes start from that batch and
//! double it back" (README, "What retention costs"), and "the bound holds behind
//! PgBouncer too". A pass that hits a timeout must shrink rather than fail for ever.

mod common;
#[path = "common/pgbouncer.rs"]
mod pgbouncer;

use std::time::Duration;

use common::*;
use leasehold::store::PruneOptions;
use leasehold::{Store, StoreOptions};
use pgbouncer::PgBouncer;

const WEEK: Duration = Duration::from_secs(7 * 24 * 3600);

async fn exec(db: &TestDb, sql: &str) {
    let sql = sql.replace("{s}", &format!("\"{}\"", db.schema));
    sqlx::raw_sql(&sql).execute(&db.owner).await.unwrap();
}

/// One pass as the reaper runs it: the batch carried from the last pass that answered
/// (kept after timeouts, doubled back towards 10,000 otherwise), unchanged after an error.
async fn reaper_like_passes(store: &Store, passes: usize, timeout: Duration) -> Vec<String> {
    let mut batch = leasehold::store::DEFAULT_PRUNE_BATCH;
    let mut seen = Vec::new();
    for _ in 0..passes {
        let mut options = PruneOptions::new(WEEK);
        options.batch = batch;
        options.statement_timeout = timeout;
        match within(90, "a retention pass", store.prune_with(&options)).await {
            Ok(r) => {
                batch = if r.timeouts > 0 {
                    r.batch
                } else {
                    (r.batch * 2).min(leasehold::store::DEFAULT_PRUNE_BATCH)
                };
                seen.push(format!(
                    "ok: jobs {} effects {} timeouts {} batch {} in {:?}",
                    r.jobs, r.effects, r.timeouts, r.batch, r.elapsed
                ));
            }
            Err(e) => seen.push(format!("error: {e}")),
        }
    }
    seen
}

/// A long-lived job (a watcher that snoozed every few seconds for a month) ends done
/// with 1,000,000 history rows; it is the oldest job retention has to delete, and with its
/// history it cannot be deleted within the pass's statement timeout even alone. Behind
/// it, 50 ordinary jobs and an expired ledger row of a job long gone are due. The pass
/// must shrink its way past the big job (or leave it) and keep pruning the rest: a
/// batch of 1 that still times out is an error, and the same oldest row is first again
/// in every pass, so nothing behind it would ever be deleted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_job_whose_deletion_outlasts_the_timeout_does_not_stop_retention_for_ever() {
    bounded(async {
        let db = TestDb::new("atk_ret_poison_row").await;
        exec(
            &db,
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts,
                                   finished_at, created_at)
             VALUES ('default', 'watch', 'done', '{}', 2, 1,
                     now() - interval '30 days', now() - interval '60 days');
             INSERT INTO {s}.job_events (job_id, generation, event, at)
             SELECT (SELECT min(id) FROM {s}.jobs), g, 'snoozed',
                    now() - interval '60 days' + g * interval '2 seconds'
             FROM generate_series(1, 1000000) g;
             INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts,
                                   finished_at, created_at)
             SELECT 'default', 'noop', 'done', '{}', 2, 1,
                    now() - interval '8 days', now() - interval '8 days'
             FROM generate_series(1, 50) g;
             INSERT INTO {s}.job_events (job_id, generation, event, at)
             SELECT id, 1, 'completed', finished_at FROM {s}.jobs WHERE kind = 'noop';
             INSERT INTO {s}.effects (effect_key, job_id, generation, fingerprint, outcome, keep_until)
             VALUES ('gone/charge', 987654321, 1, 'fp', '\"ok\"', now() - interval '1 day');",
        )
        .await;
        let passes = reaper_like_passes(&db.store, 3, Duration::from_millis(200)).await;
        let ordinary_left = db.count_where("jobs", "kind = 'noop'").await;
        let ledger_left = db.count_where("effects", "true").await;
        eprintln!("passes: {passes:#?}; ordinary jobs left {ordinary_left}, ledger rows left {ledger_left}");
        db.drop().await;
        assert_eq!(
            (ordinary_left, ledger_left),
            (0, 0),
            "three reaper passes left {ordinary_left} of 50 due jobs and {ledger_left} expired \
             ledger row(s) behind one job too big for the timeout: {passes:#?}"
        );
    })
    .await
}

/// A pool of `size` client connections to the test database through `bouncer`.
async fn through(bouncer: &PgBouncer, app_name: &str, size: u32) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(
            bouncer
                .options()
                .database(&test_db_name())
                .application_name(app_name),
        )
        .await
        .expect("connect through pgbouncer")
}

/// The same bound through a real PgBouncer in transaction mode (the crate's own test of
/// this sets `transaction_pooler` but connects straight to PostgreSQL): 2,000 due jobs
/// whose history deletes slowly, a 300 ms statement timeout, two server connections
/// shared by the pruner and a producer enqueueing meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_real_pgbouncer_a_pass_that_hits_its_timeout_shrinks_its_batch() {
    bounded(async {
        let options = StoreOptions {
            transaction_pooler: true,
            ..StoreOptions::default()
        };
        let db = TestDb::with_options("atk_ret_bouncer_timeout", options.clone(), 2).await;
        exec(
            &db,
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts,
                                   finished_at, created_at)
             SELECT 'default', 'noop', 'done', '{}', 2, 1,
                    now() - interval '8 days', now() - interval '8 days'
             FROM generate_series(1, 2000) g;
             INSERT INTO {s}.job_events (job_id, generation, event, at)
             SELECT id, 1, 'completed', finished_at FROM {s}.jobs;
             CREATE FUNCTION {s}.slow_event_delete() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_sleep(0.001); RETURN OLD; END $$;
             CREATE TRIGGER slow_event_delete BEFORE DELETE ON {s}.job_events
             FOR EACH ROW EXECUTE FUNCTION {s}.slow_event_delete();",
        )
        .await;
        let bouncer = PgBouncer::start(2);
        let pool = through(&bouncer, &db.app_name_of("bounced"), 4).await;
        let store = Store::new(pool, &db.schema, options).unwrap();
        let producer = store.clone();
        let enqueues = tokio::spawn(async move {
            let mut worst = Duration::ZERO;
            for n in 0..40 {
                let started = std::time::Instant::now();
                producer
                    .enqueue(keyed("k", &format!("p-{}", n % 7), n))
                    .await
                    .unwrap();
                worst = worst.max(started.elapsed());
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            worst
        });
        let mut prune = PruneOptions::new(WEEK);
        prune.batch = 2_000;
        prune.statement_timeout = Duration::from_millis(300);
        let started = std::time::Instant::now();
        let report = within(30, "a pass behind pgbouncer", store.prune_with(&prune))
            .await
            .unwrap_or_else(|e| panic!("the pass behind pgbouncer failed: {e}"));
        eprintln!("behind pgbouncer: {report:?} in {:?}", started.elapsed());
        assert!(
            report.timeouts >= 1 && report.batch < 2_000 && report.jobs > 0,
            "{report:?}"
        );
        let mut left = db.count_where("jobs", "kind = 'noop'").await;
        assert_eq!(report.jobs as i64, 2_000 - left);
        prune.batch = report.batch;
        let mut passes = 0;
        while left > 0 {
            passes += 1;
            assert!(passes < 400, "no end to the passes: {left} left");
            let pass = within(30, "a pass", store.prune_with(&prune))
                .await
                .unwrap();
            assert!(pass.jobs > 0, "no progress behind pgbouncer: {pass:?}");
            prune.batch = pass.batch;
            left = db.count_where("jobs", "kind = 'noop'").await;
        }
        let worst = within(30, "the producer", enqueues).await.unwrap();
        assert!(
            worst < Duration::from_secs(1),
            "an enqueue behind the same pgbouncer waited {worst:?} during the passes"
        );
        drop(bouncer);
        db.drop().await;
    })
    .await
}
