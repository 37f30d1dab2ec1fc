//! Fenced writes find their jobs by id, whatever the planner knows: on a table that was
//! never analyzed and holds tens of thousands of running jobs, a batch of completions or
//! renewals must not walk an index of running jobs (it did, when the reaper's index was
//! partial on `state = 'running'`: migration 12). Asserted on the database's own
//! statistics of the reaper's index, read after the writing session has ended (a
//! session reports them as it exits).

mod common;

use std::time::Duration;

use common::*;
use leasehold::{NewJob, Store, StoreOptions};

/// Index scans of `index` in the schema, as the statistics report them.
async fn index_scans(db: &TestDb, index: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(idx_scan), 0)::int8 FROM pg_stat_user_indexes
         WHERE schemaname = $1 AND indexrelname = $2",
    )
    .bind(&db.schema)
    .bind(index)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_renewals_look_jobs_up_by_id_on_a_never_analyzed_table() {
    bounded(async {
        let db = TestDb::with_options("write_plan_by_id", StoreOptions::default(), 2).await;
        let jobs: Vec<NewJob> = (0..30_000)
            .map(|i| NewJob::from_json("k", serde_json::json!({ "n": i })))
            .collect();
        db.store.enqueue_copy(jobs).await.unwrap();
        let w = owner("w");
        let mut running = Vec::new();
        for _ in 0..30 {
            running.extend(db.store.claim(&claim_req(&w, 1000)).await.unwrap());
        }
        assert_eq!(running.len(), 30_000);

        // The writes, on a session of their own, which then ends.
        let pool = db.other_pool("writer", 1).await;
        let writer = Store::new(pool.clone(), &db.schema, StoreOptions::default()).unwrap();
        let renewed: Vec<_> = running[..50].iter().map(|j| j.attempt()).collect();
        let report = writer
            .renew(&w, &renewed, Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(report.renewed.len(), 50);
        let items: Vec<_> = running[..50].iter().map(|j| (j.attempt(), None)).collect();
        let outcomes = writer.complete_many(&w, &items).await.unwrap();
        assert!(outcomes
            .iter()
            .all(|o| *o == leasehold::CompleteOutcome::Completed));
        pool.close().await;
        // A session reports its statistics as it exits.
        db.kill_and_wait("writer").await;
        // Statistics are read once per transaction: this read is fresh.
        let leased =
            index_scans(&db, "jobs_leased").await + index_scans(&db, "jobs_running_by_lease").await;
        let by_id = index_scans(&db, "jobs_pkey").await;
        assert!(by_id > 0, "the writer's statistics were not reported");
        assert_eq!(
            leased, 0,
            "a completion or renewal walked the index of leased jobs ({by_id} scans by id)"
        );
        db.drop().await;
    })
    .await
}
