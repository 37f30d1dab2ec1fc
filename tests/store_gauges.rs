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

/// A lease expiry of job `id` (generation `generation`) recorded `ago` before now.
async fn add_expiry(db: &TestDb, id: i64, generation: i64, ago: &str) {
    sqlx::query(&format!(
        "INSERT INTO {} (job_id, generation, owner, lease_until, reaped_at, reaped_by, new_state)
         VALUES ($1, $2, 'w', now() - $3::interval, now() - $3::interval, 'r', 'pending')",
        db.table("lease_expiries")
    ))
    .bind(id)
    .bind(generation)
    .bind(ago)
    .execute(&db.pool)
    .await
    .unwrap();
}

async fn first_done_id(db: &TestDb, queue: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT min(id) FROM {} WHERE queue = $1 AND state = 'done'",
        db.table("jobs")
    ))
    .bind(queue)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn queue_stats_count_recent_lease_expiries_and_never_scan_a_never_analyzed_history() {
    bounded(async {
        let db = TestDb::new("stats_recent").await;
        add_done_history(&db, "a", 20_000).await;
        add_done_history(&db, "c", 10).await;
        db.store.enqueue(job("k").with_queue("a")).await.unwrap();
        let held = db.store.enqueue(job("k").with_queue("b")).await.unwrap();
        db.store.hold(held).await.unwrap();
        let (a, c) = (first_done_id(&db, "a").await, first_done_id(&db, "c").await);
        add_expiry(&db, a, 1, "2 minutes").await;
        add_expiry(&db, a, 2, "1 second").await;
        add_expiry(&db, a, 3, "1 hour").await;
        add_expiry(&db, c, 1, "5 minutes").await;
        // No ANALYZE: the state of a fresh table with autovacuum off or not yet run.
        let runner = db.other_store_sized("runner", 1).await;

        let before = seq_scans(&db, runner.pool()).await;
        let stats = runner.queue_stats().await.unwrap();
        let after = seq_scans(&db, runner.pool()).await;
        assert_eq!(
            after - before,
            0,
            "queue_stats scanned the jobs table (20,010 done rows, never analyzed)"
        );

        let queues: Vec<&str> = stats.iter().map(|s| s.queue.as_str()).collect();
        assert_eq!(
            queues,
            ["a", "b", "c"],
            "c has no open job but a recent expiry: {stats:?}"
        );
        assert_eq!(stats[0].by_state.get("pending"), Some(&1));
        assert_eq!(
            stats[0].by_state.get("done"),
            None,
            "history is not counted"
        );
        assert_eq!(
            stats[0].recent_lease_expiries, 2,
            "the expiry of an hour ago is outside the window"
        );
        assert_eq!(stats[1].by_state.get("held"), Some(&1));
        assert_eq!(stats[1].recent_lease_expiries, 0);
        assert_eq!(stats[2].recent_lease_expiries, 1);
        assert!(stats[2].by_state.is_empty());

        // The census counts the history, at the cost of a scan.
        let counts = runner.job_counts().await.unwrap();
        assert_eq!(counts["a"]["done"], 20_000);
        assert_eq!(counts["a"]["pending"], 1);
        assert_eq!(counts["c"]["done"], 10);
        assert!(seq_scans(&db, runner.pool()).await > after);
        db.drop().await;
    })
    .await
}

#[tokio::test]
async fn oldest_eligible_is_the_earliest_due_job_across_priority_levels() {
    bounded(async {
        let db = TestDb::new("gauges_levels").await;
        let ago = |mins: i64| chrono::Utc::now() - chrono::Duration::minutes(mins);
        let ahead = chrono::Utc::now() + chrono::Duration::hours(1);
        // Queue a: the earliest head of one level is not due; another level's head is
        // due 10 minutes ago, a third's 3 minutes ago.
        for (priority, at) in [(-5, ahead), (0, ago(3)), (7, ago(10)), (7, ahead)] {
            db.store
                .enqueue(
                    job("k")
                        .with_queue("a")
                        .with_priority(priority)
                        .with_run_at(at),
                )
                .await
                .unwrap();
        }
        // Queue b: nothing due at any level.
        for priority in [1, 2] {
            db.store
                .enqueue(
                    job("k")
                        .with_queue("b")
                        .with_priority(priority)
                        .with_run_at(ahead),
                )
                .await
                .unwrap();
        }
        // Queue c: waiting jobs only (a keyed head, held, with two behind it).
        let head = db
            .store
            .enqueue(job("k").with_queue("c").with_key("acct"))
            .await
            .unwrap();
        db.store.hold(head).await.unwrap();
        for _ in 0..2 {
            db.store
                .enqueue(job("k").with_queue("c").with_key("acct"))
                .await
                .unwrap();
        }

        let gauges = db.store.queue_gauges().await.unwrap();
        let a = of(&gauges, "a");
        assert_eq!(a.by_state.get("pending"), Some(&4));
        assert!(
            (595.0..660.0).contains(&a.oldest_eligible_secs),
            "the job due 10 minutes ago, whatever its level: {a:?}"
        );
        let b = of(&gauges, "b");
        assert_eq!(b.by_state.get("pending"), Some(&2));
        assert_eq!(b.oldest_eligible_secs, 0.0, "nothing is due: {b:?}");
        let c = of(&gauges, "c");
        assert_eq!(c.by_state.get("waiting"), Some(&2));
        assert_eq!(c.by_state.get("held"), Some(&1));
        assert_eq!(c.blocked_keys, 1);
        assert_eq!(c.by_state.get("pending"), None);
        db.drop().await;
    })
    .await
}
