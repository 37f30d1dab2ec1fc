//! `Store::queue_gauges`, the database half of `/metrics`: it counts open and parked
//! jobs per queue, leaves the done history out, and reads it through indexes only, so a
//! scrape costs the same at any history size.

mod common;

use common::*;
use leasehold::store::QueueGauges;

/// `n` done jobs of `queue`, written directly: history the gauges must not walk.
async fn add_done_history(db: &TestDb, queue: &str, n: i64) {
    sqlx::query(&format!(
        "INSERT INTO {} (queue, kind, state, payload, payload_bytes, max_attempts, finished_at)
         SELECT $1, 'k', 'done', '{{}}', 2, 1, now() FROM generate_series(1, $2)",
        db.table("jobs")
    ))
    .bind(queue)
    .bind(n)
    .execute(&db.pool)
    .await
    .unwrap();
}

fn of<'a>(gauges: &'a [QueueGauges], queue: &str) -> &'a QueueGauges {
    gauges
        .iter()
        .find(|g| g.queue == queue)
        .unwrap_or_else(|| panic!("no gauges for {queue}: {gauges:?}"))
}

#[tokio::test]
async fn gauges_count_pending_and_held_jobs_per_queue_and_leave_done_out() {
    bounded(async {
        let db = TestDb::new("gauges_counts").await;
        for _ in 0..3 {
            db.store.enqueue(job("k").with_queue("a")).await.unwrap();
        }
        let held = db.store.enqueue(job("k").with_queue("b")).await.unwrap();
        db.store.hold(held).await.unwrap();
        add_done_history(&db, "a", 50).await;
        add_done_history(&db, "c", 50).await;

        let gauges = db.store.queue_gauges().await.unwrap();
        let queues: Vec<&str> = gauges.iter().map(|g| g.queue.as_str()).collect();
        assert_eq!(
            queues,
            ["a", "b"],
            "a queue with only history is not listed"
        );
        let a = of(&gauges, "a");
        assert_eq!(a.by_state.get("pending"), Some(&3));
        assert_eq!(a.by_state.get("done"), None);
        assert!(a.oldest_eligible_secs > 0.0, "{a:?}");
        let b = of(&gauges, "b");
        assert_eq!(b.by_state.get("held"), Some(&1));
        assert_eq!(b.blocked_keys, 0, "an unkeyed held job blocks no key");
        assert_eq!(b.oldest_eligible_secs, 0.0);
        db.drop().await;
    })
    .await
}

/// Sequential scans of the test's jobs table so far, as the statistics collector saw
/// them (`pg_stat_force_next_flush` on the connection that ran the statements first).
async fn seq_scans(db: &TestDb, runner: &sqlx::PgPool) -> i64 {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(runner)
        .await
        .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query_scalar(
        "SELECT seq_scan FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = 'jobs'",
    )
    .bind(&db.schema)
    .fetch_one(&mut *conn)
    .await
    .unwrap()
}

#[tokio::test]
async fn gauges_never_scan_the_jobs_table_whatever_its_history() {
    bounded(async {
        let db = TestDb::new("gauges_plan").await;
        add_done_history(&db, "a", 20_000).await;
        db.store
            .enqueue(job("k").with_queue("a").with_key("acct"))
            .await
            .unwrap();
        let held = db.store.enqueue(job("k").with_queue("a")).await.unwrap();
        db.store.hold(held).await.unwrap();
        sqlx::query(&format!("ANALYZE {}", db.table("jobs")))
            .execute(&db.pool)
            .await
            .unwrap();
        // One connection, so the statistics flush below is the one that ran the gauges.
        let runner = db.other_store_sized("runner", 1).await;

        let before = seq_scans(&db, runner.pool()).await;
        let gauges = runner.queue_gauges().await.unwrap();
        let after = seq_scans(&db, runner.pool()).await;

        assert_eq!(of(&gauges, "a").by_state.get("held"), Some(&1));
        assert_eq!(
            after - before,
            0,
            "the gauges scanned the whole jobs table ({} done rows)",
            20_000
        );
        // The check can fail: a statement that does scan the table is counted.
        let mut probe = runner.pool().acquire().await.unwrap();
        sqlx::query(&format!(
            "SELECT count(*) FROM {} WHERE payload_bytes = 2",
            db.table("jobs")
        ))
        .execute(&mut *probe)
        .await
        .unwrap();
        drop(probe);
        assert!(seq_scans(&db, runner.pool()).await > after);
        db.drop().await;
    })
    .await
}
