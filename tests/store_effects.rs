//! Effects outside the job row: an external effect is keyed by job and step (never by
//! generation), recorded in the ledger under the fence, and looked up by a retry before
//! acting, so an interrupted attempt never makes the effect happen twice. A completion
//! whose reply was lost is asked again and returns the stored result.

mod common;
#[path = "common/handler.rs"]
mod handler;

use common::*;
use handler::{effect_key, Path, TestHandler};
use leasehold::store::RecordOutcome;
use leasehold::{ClaimedJob, CompleteOutcome, Generation, JobState, StoreOptions};

const KEEP: std::time::Duration = std::time::Duration::from_secs(7 * 24 * 3600);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effect_done_but_completion_lost_is_not_repeated_by_the_retry() {
    bounded(async {
        let db = TestDb::with_options("effects_completion_lost", StoreOptions::default(), 3).await;
        let h = TestHandler::new(&db).await;
        let id = db.store.enqueue(job("charge")).await.unwrap();
        let key = effect_key(&db, id).await;

        // A claims, runs its handler (the charge happens and the ledger records it) ...
        // and dies before completing.
        let a_store = db.other_store_sized("a", 1).await;
        let a = owner("a");
        let a_job = a_store.claim(&claim_req(&a, 1)).await.unwrap().remove(0);
        let a_run = h.run(&a_store, &a_job).await;
        assert_eq!(a_run.path, Path::Acted);
        let a_outcome = a_run.result.clone().expect("A holds the fence");
        db.kill_and_wait("a").await;
        a_store.pool().close().await;
        assert_eq!(
            db.state_of(id).await,
            "running",
            "A's completion never happened"
        );

        // The lease passes; B claims the retry.
        let at = secs_after(a_job.lease_until, 1);
        assert_eq!(
            db.store
                .reap(&owner("r"), &fixed_backoff(1), 10, Some(at))
                .await
                .unwrap()
                .retried,
            vec![id]
        );
        let b = owner("b");
        let b_job = db
            .store
            .claim(&claim_at(&b, 1, secs_after(at, 2)))
            .await
            .unwrap()
            .remove(0);
        assert_eq!(b_job.generation, Generation(2));

        // The ledger has A's charge; B's handler gets its outcome instead of charging
        // again.
        let found = db.ledger(id).await.expect("the ledger has A's charge");
        assert_eq!(found.job, id);
        assert_eq!(found.generation, Generation(1));
        let b_run = h.run(&db.store, &b_job).await;
        assert_eq!(
            b_run.path,
            Path::Ledger,
            "B must reuse A's recorded charge: {b_run:?}"
        );
        let b_outcome = b_run.result.clone().unwrap();
        assert_eq!(b_outcome, a_outcome);
        assert_eq!(
            db.store
                .complete(&b_job.fence(), Some(b_outcome.clone()))
                .await
                .unwrap(),
            CompleteOutcome::Completed
        );

        // Even if B tried to record again, the first outcome wins.
        let second = db
            .store
            .record_effect(
                &b_job.fence(),
                &key,
                &found.fingerprint,
                &serde_json::json!("other"),
                KEEP,
            )
            .await
            .unwrap();
        assert!(
            matches!(second, RecordOutcome::Stale),
            "B's fence ended with its completion: {second:?}"
        );

        let rec = db.store.job(id).await.unwrap();
        assert_eq!(rec.state, JobState::Done);
        assert_eq!(rec.result, Some(a_outcome));
        db.assert_effect_once(id, 1, 1).await;
        assert_eq!(db.count_where("effects", "true").await, 1);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_worker_cannot_record_an_effect_after_a_newer_claim() {
    bounded(async {
        let db = TestDb::new("effects_stale_record").await;
        let h = TestHandler::new(&db).await;
        let id = db.store.enqueue(job("charge")).await.unwrap();
        let key = effect_key(&db, id).await;
        let a = owner("a");
        let a_job = db.store.claim(&claim_req(&a, 1)).await.unwrap().remove(0);

        // A stalls before its charge; its lease passes and B claims generation 2.
        let at = secs_after(a_job.lease_until, 1);
        db.store
            .reap(&owner("r"), &fixed_backoff(1), 10, Some(at))
            .await
            .unwrap();
        let b = owner("b");
        let b_job = db
            .store
            .claim(&claim_at(&b, 1, secs_after(at, 2)))
            .await
            .unwrap()
            .remove(0);

        // B charges and records first; A wakes up and runs its handler: it gets B's
        // outcome and does not charge. Recording by hand under A's fence is refused.
        let b_run = h.run(&db.store, &b_job).await;
        assert_eq!(b_run.path, Path::Acted);
        let b_outcome = b_run.result.clone().unwrap();
        let a_run = h.run(&db.store, &a_job).await;
        assert_eq!(
            (a_run.path, a_run.applied_by()),
            (Path::Ledger, Some(2)),
            "stale A must get B's recorded outcome, not charge: {a_run:?}"
        );
        let fingerprint = db.ledger(id).await.unwrap().fingerprint;
        let late = db
            .store
            .record_effect(
                &a_job.fence(),
                &key,
                &fingerprint,
                &serde_json::json!("A"),
                KEEP,
            )
            .await
            .unwrap();
        assert_eq!(late, RecordOutcome::Stale);

        // B records the same key again (a retried write): the first outcome comes back.
        match db
            .store
            .record_effect(
                &b_job.fence(),
                &key,
                &fingerprint,
                &serde_json::json!("again"),
                KEEP,
            )
            .await
            .unwrap()
        {
            RecordOutcome::AlreadyRecorded(rec) => {
                assert_eq!(rec.outcome, b_outcome);
                assert_eq!(rec.generation, Generation(2));
            }
            other => panic!("expected AlreadyRecorded, got {other:?}"),
        }
        assert_eq!(
            db.store.complete(&b_job.fence(), None).await.unwrap(),
            CompleteOutcome::Completed
        );
        assert_eq!(db.state_of(id).await, "done");
        db.assert_effect_once(id, 2, 2).await;
        db.drop().await;
    })
    .await
}

/// A worker delivering a claimed job: if this generation's completion already
/// committed (an earlier reply was lost) the stored result is reused; otherwise the
/// handler runs and the job is completed.
async fn deliver(
    db: &TestDb,
    h: &TestHandler,
    j: &ClaimedJob,
    result: &serde_json::Value,
) -> CompleteOutcome {
    let status = db.store.completion_status(&j.fence()).await.unwrap();
    if let CompleteOutcome::AlreadyCompleted { .. } = status {
        return status;
    }
    h.run(&db.store, j).await.result.unwrap();
    db.store
        .complete(&j.fence(), Some(result.clone()))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_reply_lost_asking_again_returns_stored_result_without_rerun() {
    bounded(async {
        let db = TestDb::new("effects_reply_lost").await;
        let h = TestHandler::new(&db).await;
        let id = db.store.enqueue(job("report")).await.unwrap();
        let me = owner("w");
        let j = db.store.claim(&claim_req(&me, 1)).await.unwrap().remove(0);
        let result = serde_json::json!({ "rows": 42, "text": "ünïcødé ✓" });

        // The handler runs and the completion commits, but its reply is "lost".
        let _lost_reply = deliver(&db, &h, &j, &result).await;
        assert_eq!(h.runs().len(), 1);

        // Asking again (same fence) says it is already done and returns the stored
        // result; the handler is not run again.
        let again = deliver(&db, &h, &j, &serde_json::json!("a different result")).await;
        assert_eq!(
            again,
            CompleteOutcome::AlreadyCompleted {
                result: Some(result.clone())
            }
        );
        assert_eq!(h.runs().len(), 1, "the handler ran once");
        let completed_again = db
            .store
            .complete(&j.fence(), Some(serde_json::json!("other")))
            .await
            .unwrap();
        assert_eq!(
            completed_again,
            CompleteOutcome::AlreadyCompleted {
                result: Some(result.clone())
            }
        );
        let batch = db
            .store
            .complete_many(&me, &[(j.attempt(), None)])
            .await
            .unwrap();
        assert_eq!(
            batch,
            vec![CompleteOutcome::AlreadyCompleted {
                result: Some(result.clone())
            }]
        );

        // Another owner asking with the same generation is not told it completed.
        let mut imposter = j.fence();
        imposter.owner = owner("x");
        assert_eq!(
            db.store.completion_status(&imposter).await.unwrap(),
            CompleteOutcome::Stale
        );

        // Nobody can claim it again either.
        assert!(db
            .store
            .claim(&claim_at(&owner("b"), 10, far_future()))
            .await
            .unwrap()
            .is_empty());
        let rec = db.store.job(id).await.unwrap();
        assert_eq!(rec.state, JobState::Done);
        assert_eq!(rec.result, Some(result));
        db.assert_effect_once(id, 1, 1).await;
        assert_eq!(
            db.count_where(
                "job_events",
                &format!("job_id = {} AND event = 'completed'", id.0)
            )
            .await,
            1
        );
        db.drop().await;
    })
    .await
}
