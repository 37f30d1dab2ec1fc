//! Attack: a claimed-ahead job an operator cancels while it waits for a slot, when the
//! slot frees before the give-back.
//!
//! Promises: once its process has heard of the cancel (a notification, then a renewal),
//! a cancelled job's handler never runs; an attempt is counted only when its handler
//! started (a job claimed ahead "has not run": its attempt is given back). A handler that
//! starts in the moment between the cancel's commit and its process hearing of it runs,
//! as the README says of a cancel that finds its job claimed (`CancelOutcome::Requested`).

mod common;
#[path = "common/scripted.rs"]
mod scripted;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::{within, TestDb};
use leasehold::{CancelOutcome, Config, JobState, Scheduler, StoreOptions};
use scripted::{scripted, work, Script, Scripted};
use worker::{config_with_lease, run_in_system, wait_until, POOL};

fn one_slot_config(db: &TestDb) -> Config {
    // A long lease: no give-back after a lease's wait comes within the test.
    let mut config = config_with_lease(&db.schema, Duration::from_secs(20));
    config.concurrency = 1;
    config.claim_ahead = 4;
    config.claim_ahead_window = None;
    config
}

#[test]
fn a_job_cancelled_while_claimed_ahead_and_then_given_a_slot_ends_cancelled_with_no_attempt_counted(
) {
    run_in_system(within(60, "cancelled ahead job given a slot", async {
        let db = TestDb::with_options("a5_cbs_attempts", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let a = Scheduler::builder(db.pool.clone(), one_slot_config(&db))
            .register(h.clone())
            .start()
            .await
            .unwrap();
        let running = a
            .enqueue_job(scripted(Script {
                gate: Some("finish".into()),
                ..work("running", 0)
            }))
            .await
            .unwrap();
        h.started("running", 10).await;
        let head = a
            .enqueue_job(scripted(work("head", 0)).with_key("acct"))
            .await
            .unwrap();
        let next = a
            .enqueue_job(scripted(work("next", 0)).with_key("acct"))
            .await
            .unwrap();
        wait_until(10, "the head to be claimed ahead", || async {
            a.metrics().ready == 1
        })
        .await;
        assert_eq!(db.store.job(head).await.unwrap().attempts, 1);
        assert_eq!(
            db.store.cancel(head, "not needed").await.unwrap(),
            CancelOutcome::Requested
        );
        // Long enough for the notification and a renewal to tell the waiting attempt.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        h.open("finish");
        wait_until(10, "the head to end and the key to move on", || async {
            db.store.job(head).await.unwrap().state == JobState::Cancelled
                && db.store.job(next).await.unwrap().state == JobState::Done
                && db.store.job(running).await.unwrap().state == JobState::Done
        })
        .await;
        assert!(
            h.runs_of(head).is_empty(),
            "the cancelled job's handler ran"
        );
        let job = db.store.job(head).await.unwrap();
        let history: Vec<String> = db
            .store
            .history(head)
            .await
            .unwrap()
            .into_iter()
            .map(|e| format!("{}: {}", e.event, e.detail.unwrap_or_default()))
            .collect();
        assert_eq!(
            job.attempts, 0,
            "its handler never started, yet the cancelled job keeps its claim's attempt \
             (a give-back would have returned it): {job:?}; history {history:?}"
        );
        a.shutdown().await.unwrap();
        db.drop().await;
    }))
}
