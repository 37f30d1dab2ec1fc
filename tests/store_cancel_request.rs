//! Cancel of a running keyed head is a request: the job stays running, its key does not
//! move on, its owner hears of it at renewal; the key moves on only once that attempt
//! has ended — by failure (cancelled), by lease expiry (the reaper cancels it) or by
//! completion (done: the work happened).

mod common;

use common::*;
use leasehold::{
    CancelOutcome, ClaimedJob, CompleteOutcome, FailOutcome, Failure, JobId, JobState, OwnerId,
};

struct Requested {
    db: TestDb,
    w: OwnerId,
    head: ClaimedJob,
    successor: JobId,
}

/// A running head of key `acct` with a waiting successor, and an operator's cancel of
/// the head: checks everything that must hold while the request is pending.
async fn cancel_requested(test: &str) -> Requested {
    let db = TestDb::new(test).await;
    let ids = db
        .store
        .enqueue_many(vec![keyed("k", "acct", 1), keyed("k", "acct", 2)])
        .await
        .unwrap();
    let w = owner("w");
    let t0 = chrono::Utc::now();
    let mut got = db.store.claim(&claim_at(&w, 10, t0)).await.unwrap();
    assert_eq!(got.len(), 1);
    let head = got.remove(0);
    assert_eq!(head.id, ids[0]);

    assert_eq!(
        db.store.cancel(head.id, "stop it").await.unwrap(),
        CancelOutcome::Requested
    );
    let rec = db.store.job(head.id).await.unwrap();
    assert_eq!(
        rec.state,
        JobState::Running,
        "a running job is not cancelled at once"
    );
    assert!(rec.cancel_requested_at.is_some());
    assert_eq!(
        db.store.job(ids[1]).await.unwrap().state,
        JobState::Waiting,
        "the key waits for the attempt to end"
    );
    assert!(
        db.store
            .claim(&claim_at(&w, 10, far_future()))
            .await
            .unwrap()
            .is_empty(),
        "nothing of the key may be claimable while its head may still run"
    );
    // A second cancel is still just the same request.
    assert_eq!(
        db.store.cancel(head.id, "again").await.unwrap(),
        CancelOutcome::Requested
    );
    let renewal = db.store.renew(&w, &[head.attempt()], LEASE).await.unwrap();
    assert_eq!(renewal.cancel_requested, vec![head.attempt()]);
    assert_eq!(
        renewal.renewed.iter().map(|r| r.0.job).collect::<Vec<_>>(),
        vec![head.id],
        "the owner keeps its lease until it stops"
    );
    assert!(renewal.lost.is_empty());
    Requested {
        db,
        w,
        head,
        successor: ids[1],
    }
}

/// The successor is the one claimable job now; run it.
async fn successor_runs(r: &Requested) {
    let got =
        r.db.store
            .claim(&claim_at(&r.w, 10, far_future()))
            .await
            .unwrap();
    assert_eq!(
        got.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![r.successor]
    );
    assert_eq!(
        r.db.store.complete(&got[0].fence(), None).await.unwrap(),
        CompleteOutcome::Completed
    );
}

async fn events(db: &TestDb, id: JobId) -> Vec<String> {
    db.store
        .history(id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.event)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_requested_head_that_fails_is_cancelled_and_its_key_moves_on() {
    bounded(async {
        let r = cancel_requested("cancel_req_fail").await;
        let stopped =
            r.db.store
                .fail(
                    &r.head.fence(),
                    &Failure {
                        reason: "stopped: cancelled".into(),
                        permanent: false,
                        retry_after: None,
                    },
                    &fixed_backoff(1),
                )
                .await
                .unwrap();
        assert_eq!(
            stopped,
            FailOutcome::Cancelled,
            "not retried: the operator asked"
        );
        assert_eq!(
            r.db.store.job(r.head.id).await.unwrap().state,
            JobState::Cancelled
        );
        successor_runs(&r).await;
        assert_eq!(
            events(&r.db, r.head.id).await,
            vec!["claimed", "cancel_requested", "cancelled"]
        );
        r.db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_requested_head_whose_lease_expires_is_cancelled_by_the_reaper() {
    bounded(async {
        let r = cancel_requested("cancel_req_reap").await;
        let at = secs_after(r.head.lease_until, 1);
        let report =
            r.db.store
                .reap(&owner("reaper"), &fixed_backoff(1), 10, Some(at))
                .await
                .unwrap();
        assert_eq!(report.cancelled, vec![r.head.id], "{report:?}");
        assert!(
            report.retried.is_empty() && report.dead.is_empty(),
            "{report:?}"
        );
        let rec = r.db.store.job(r.head.id).await.unwrap();
        assert_eq!(rec.state, JobState::Cancelled);
        assert_eq!(
            r.db.store.job(r.successor).await.unwrap().state,
            JobState::Pending,
            "the reaper promoted the successor"
        );
        // The owner that comes back late is told it no longer holds the job.
        assert_eq!(
            r.db.store.complete(&r.head.fence(), None).await.unwrap(),
            CompleteOutcome::Stale
        );
        successor_runs(&r).await;
        assert_eq!(
            events(&r.db, r.head.id).await,
            vec!["claimed", "cancel_requested", "reaped"]
        );
        r.db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_requested_head_that_completes_is_done_and_its_key_moves_on() {
    bounded(async {
        let r = cancel_requested("cancel_req_done").await;
        assert_eq!(
            r.db.store
                .complete(&r.head.fence(), Some(serde_json::json!("paid")))
                .await
                .unwrap(),
            CompleteOutcome::Completed,
            "the work happened: its completion is accepted"
        );
        let rec = r.db.store.job(r.head.id).await.unwrap();
        assert_eq!(
            (rec.state, rec.result),
            (JobState::Done, Some(serde_json::json!("paid")))
        );
        successor_runs(&r).await;
        assert_eq!(
            events(&r.db, r.head.id).await,
            vec!["claimed", "cancel_requested", "completed"]
        );
        r.db.drop().await;
    })
    .await
}
