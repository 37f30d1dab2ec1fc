//! Lease expiry: a worker that dies after its claim committed leaves a running lease;
//! nothing is claimable while it runs, the reaper (judging by the database clock, moved
//! here with the `at` test clock) records the expiry and puts the job back with backoff,
//! and the next claim gets the next generation. A lost attempt that wakes up, or an
//! operator's retry of a dead job, never repeats the effect the ledger holds.

mod common;
#[path = "common/handler.rs"]
mod handler;

use chrono::{DateTime, Utc};
use common::*;
use handler::{Path, TestHandler};
use leasehold::{CompleteOutcome, Generation, JobState, StoreOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_killed_after_claim_commit_is_reaped_and_reclaimed_with_next_generation() {
    bounded(async {
        let db = TestDb::with_options("lease_killed_after_claim", StoreOptions::default(), 3).await;
        let h = TestHandler::new(&db).await;
        let id = db.store.enqueue(job("k")).await.unwrap();

        // A claims on its own pool; its session dies before the job runs.
        let a_store = db.other_store_sized("a", 1).await;
        let a = owner("a");
        let got = a_store.claim(&claim_req(&a, 1)).await.unwrap();
        assert_eq!(got.len(), 1);
        let lease_until = got[0].lease_until;
        assert_eq!(got[0].generation, Generation(1));
        db.kill_and_wait("a").await;
        a_store.pool().close().await;

        // While the lease runs: nothing to claim, nothing to reap.
        let b = owner("b");
        let reaper = owner("reaper");
        assert!(db.store.claim(&claim_req(&b, 10)).await.unwrap().is_empty());
        assert!(db
            .store
            .reap(&reaper, &fixed_backoff(5), 100, None)
            .await
            .unwrap()
            .is_empty());
        assert_eq!(db.state_of(id).await, "running");
        assert_eq!(db.count_where("lease_expiries", "true").await, 0);

        // The lease has passed (test clock): the reaper takes the job back and says so.
        let at = secs_after(lease_until, 1);
        let report = db
            .store
            .reap(&reaper, &fixed_backoff(5), 100, Some(at))
            .await
            .unwrap();
        assert_eq!(report.retried, vec![id]);
        // Its session died before the job ran (no renewal recorded a start): the
        // attempt is given back, not spent.
        assert_eq!(report.unstarted, vec![id]);
        assert!(report.dead.is_empty());
        let (job_id, generation, exp_owner, exp_lease_until, reaped_by, new_state): (
            i64,
            i64,
            String,
            DateTime<Utc>,
            String,
            String,
        ) = sqlx::query_as(&format!(
            "SELECT job_id, generation, owner, lease_until, reaped_by, new_state FROM {}",
            db.table("lease_expiries")
        ))
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!((job_id, generation), (id.0, 1));
        assert_eq!(exp_owner, a.as_str());
        assert_eq!(exp_lease_until, lease_until);
        assert_eq!(reaped_by, reaper.as_str());
        assert_eq!(new_state, "pending");
        let rec = db.store.job(id).await.unwrap();
        assert_eq!(rec.state, JobState::Pending);
        assert_eq!(
            rec.attempts, 0,
            "an attempt that never started is not spent"
        );
        assert_eq!(
            rec.available_at, at,
            "a job that never started is claimable again at once, without backoff"
        );
        assert!(rec.last_error.unwrap().contains("lease expired"));

        // A second reaper at the same instant finds nothing and records nothing twice.
        assert!(db
            .store
            .reap(&owner("reaper2"), &fixed_backoff(5), 100, Some(at))
            .await
            .unwrap()
            .is_empty());
        assert_eq!(db.count_where("lease_expiries", "true").await, 1);

        // B claims the next generation at once, as the same attempt number.
        let again = db.store.claim(&claim_at(&b, 10, at)).await.unwrap();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].id, id);
        assert_eq!(again[0].generation, Generation(2));
        assert_eq!(
            again[0].attempt, 1,
            "the attempt that never started is not counted"
        );
        let b_run = h.run(&db.store, &again[0]).await;
        assert_eq!(b_run.path, Path::Acted);
        assert_eq!(
            db.store.complete(&again[0].fence(), None).await.unwrap(),
            CompleteOutcome::Completed
        );
        assert_eq!(db.state_of(id).await, "done");

        // Only A's session died; A's process was stalled, not gone. It wakes up on a
        // fresh connection and runs the handler of its lost attempt: the ledger hands
        // it B's outcome, the effect does not happen again, and its completion is stale.
        let a_again = db.other_store_sized("a-again", 1).await;
        let a_run = h.run(&a_again, &got[0]).await;
        assert_eq!(
            (a_run.path, a_run.applied_by()),
            (Path::Ledger, Some(2)),
            "A's stale attempt must get generation 2's recorded outcome, not act: {a_run:?}"
        );
        assert_eq!(
            a_again.complete(&got[0].fence(), None).await.unwrap(),
            CompleteOutcome::Stale
        );
        a_again.pool().close().await;
        db.assert_effect_once(id, 2, 2).await;
        let events: Vec<String> = db
            .store
            .history(id)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.event)
            .collect();
        assert_eq!(events, vec!["claimed", "reaped", "claimed", "completed"]);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_lease_with_attempts_spent_makes_the_job_dead() {
    bounded(async {
        let db = TestDb::new("lease_expiry_dead").await;
        let h = TestHandler::new(&db).await;
        let id = db
            .store
            .enqueue(job("k").with_max_attempts(1))
            .await
            .unwrap();
        let a = owner("a");
        let got = db.store.claim(&claim_req(&a, 1)).await.unwrap();
        // A's handler starts (its renewal records the start), runs its effect while the
        // lease holds, then stalls past it.
        let renewed = db
            .store
            .renew(&a, &[got[0].attempt()], LEASE)
            .await
            .unwrap();
        assert_eq!(renewed.renewed.len(), 1);
        assert_eq!(h.run(&db.store, &got[0]).await.path, Path::Acted);
        let at = secs_after(renewed.renewed[0].1, 1);
        let report = db
            .store
            .reap(&owner("reaper"), &fixed_backoff(5), 100, Some(at))
            .await
            .unwrap();
        assert_eq!(report.dead, vec![id]);
        assert!(report.retried.is_empty());
        assert_eq!(db.state_of(id).await, "dead");
        assert_eq!(
            db.count_where("lease_expiries", "new_state = 'dead'").await,
            1
        );
        assert!(db
            .store
            .claim(&claim_at(&owner("b"), 10, far_future()))
            .await
            .unwrap()
            .is_empty());
        // The stale worker's completion does not resurrect it.
        assert_eq!(
            db.store.complete(&got[0].fence(), None).await.unwrap(),
            CompleteOutcome::Stale
        );
        assert_eq!(db.state_of(id).await, "dead");
        // The dead job keeps its effect in the ledger: an operator's retry runs the
        // handler again, which gets A's outcome instead of acting a second time.
        db.assert_effect_once(id, 1, 1).await;
        db.store.retry_dead(id).await.unwrap();
        let retry = db
            .store
            .claim(&claim_at(&owner("b"), 1, far_future()))
            .await
            .unwrap()
            .remove(0);
        assert_eq!(retry.generation, Generation(2));
        let rerun = h.run(&db.store, &retry).await;
        assert_eq!(
            (rerun.path, rerun.applied_by()),
            (Path::Ledger, Some(1)),
            "the retried dead job must reuse its recorded outcome, not act: {rerun:?}"
        );
        assert_eq!(
            db.store.complete(&retry.fence(), None).await.unwrap(),
            CompleteOutcome::Completed
        );
        db.assert_effect_once(id, 1, 1).await;
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_moves_the_deadline_and_keeps_the_reaper_away() {
    bounded(async {
        let db = TestDb::new("lease_renewal").await;
        let h = TestHandler::new(&db).await;
        let id = db.store.enqueue(job("k")).await.unwrap();
        let a = owner("a");
        let mut req = claim_req(&a, 1);
        req.lease = std::time::Duration::from_secs(5);
        let got = db.store.claim(&req).await.unwrap();
        let first_deadline = got[0].lease_until;
        let report = db
            .store
            .renew(&a, &[got[0].attempt()], std::time::Duration::from_secs(600))
            .await
            .unwrap();
        assert!(report.lost.is_empty());
        let new_deadline = report.renewed[0].1;
        assert!(new_deadline > secs_after(first_deadline, 500));
        // Past the first deadline but before the renewed one: not reaped.
        assert!(db
            .store
            .reap(
                &owner("r"),
                &fixed_backoff(1),
                10,
                Some(secs_after(first_deadline, 1))
            )
            .await
            .unwrap()
            .is_empty());
        // The handler, still within its renewed lease, runs and completes.
        assert_eq!(h.run(&db.store, &got[0]).await.path, Path::Acted);
        assert_eq!(
            db.store.complete(&got[0].fence(), None).await.unwrap(),
            CompleteOutcome::Completed
        );
        assert_eq!(db.state_of(id).await, "done");
        db.assert_effect_once(id, 1, 1).await;
        db.drop().await;
    })
    .await
}
