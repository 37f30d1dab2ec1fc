//! Attack: an operator's cancel that waited for its key row, then retention.
//!
//! Promise: retention never deletes a job that finished less than 5 minutes ago,
//! whatever `keep` says (`store::DEFAULT_PRUNE_FLOOR`), so a job's `finished_at` must be
//! when it finished.
//!
//! `Store::cancel` of a job that is not running locks the key row, then the job row. It
//! wrote `finished_at = now()`: the time its transaction began, before any lock wait. A
//! cancel that waited behind a producer's open transaction on the key (an `enqueue_in`
//! in a long business transaction) for longer than the floor committed a job whose
//! `finished_at` was already past the floor, and the first retention pass deleted it
//! (the attack held the key 310 s; the test holds it 3 s and checks the time written).

mod common;

use std::time::{Duration, Instant};

use common::*;
use leasehold::{CancelOutcome, JobState};

const HELD: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_an_operator_cancelled_a_moment_ago_after_waiting_for_its_key_is_not_pruned_by_the_default_floor(
) {
    tokio::time::timeout(HELD + Duration::from_secs(60), async {
        let db = TestDb::new("a5_rs_cancel_wait").await;
        let id = db.store.enqueue(keyed("k", "acct", 1)).await.unwrap();
        // A producer's business transaction enqueues the key's next job and stays open.
        let mut producer = db.owner.begin().await.unwrap();
        let next = db
            .store
            .enqueue_in(&mut producer, keyed("k", "acct", 2))
            .await
            .unwrap();
        let store = db.store.clone();
        let cancel = tokio::spawn(async move { store.cancel(id, "not needed").await });
        lock_waiting(&db, &db.app_name).await;
        tokio::time::sleep(HELD).await;
        producer.commit().await.unwrap();
        let outcome = within(10, "the cancel", cancel).await.unwrap().unwrap();
        let cancelled_at = Instant::now();
        assert_eq!(outcome, CancelOutcome::Cancelled);
        assert_eq!(db.store.job(id).await.unwrap().state, JobState::Cancelled);
        let finished_at = db.store.job(id).await.unwrap().finished_at.unwrap();
        let db_now: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(&db.pool)
            .await
            .unwrap();

        // Written when the cancel was, not when its transaction began (HELD earlier).
        let lag = db_now - finished_at;
        assert!(
            lag < chrono::Duration::seconds(1),
            "cancelled {:?} ago, the job's finished_at {finished_at} reads {} ms before the \
             database's now {db_now}: a cancel that waits the floor out would be pruned at once",
            cancelled_at.elapsed(),
            lag.num_milliseconds()
        );
        let report = db.store.prune(Duration::ZERO, 100).await.unwrap();
        assert!(
            db.store.job(id).await.is_ok(),
            "a job cancelled a moment ago was pruned by a pass with the default floor: {report:?}"
        );
        assert_eq!(db.store.job(next).await.unwrap().state, JobState::Pending);
        db.drop().await;
    })
    .await
    .expect("test exceeded its deadline");
}

/// Wait until a backend named `app_name` (the test's own pool) waits for a lock.
async fn lock_waiting(db: &TestDb, app_name: &str) {
    within(10, "the cancel to wait for the key row", async {
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'",
            )
            .bind(app_name)
            .fetch_one(&db.owner)
            .await
            .unwrap();
            if waiting > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}
