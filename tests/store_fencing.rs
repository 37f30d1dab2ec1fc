//! Fencing: a worker whose generation is no longer the row's cannot complete, fail,
//! renew or record an effect — even while the row is `running` again under a newer
//! generation, and even when the newer generation belongs to the same owner (so it is
//! the generation check that refuses, not the state or owner check). A stale attempt
//! that runs its handler anyway gets the current generation's effect from the ledger.

mod common;
#[path = "common/handler.rs"]
mod handler;

use common::*;
use handler::{Opts, Path, TestHandler};
use leasehold::store::RecordOutcome;
use leasehold::{
    ClaimedJob, CompleteOutcome, FailOutcome, Failure, Generation, JobId, JobState, OwnerId,
};
use sqlx::Connection;

/// Claim and release the job until its generation is `generation`: releases do not
/// count attempts, so the job still has all of them.
async fn advance_generation_to(db: &TestDb, id: JobId, generation: i64) {
    let warm = owner("warmup");
    for g in 1..=generation {
        let got = db.store.claim(&claim_req(&warm, 1)).await.unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].id, got[0].generation), (id, Generation(g)));
        let released = db
            .store
            .release_many(&warm, &[got[0].attempt()], "warm-up")
            .await
            .unwrap();
        assert_eq!(released, vec![id]);
    }
    let rec = db.store.job(id).await.unwrap();
    assert_eq!(
        (rec.state, rec.generation, rec.attempts),
        (JobState::Pending, Generation(generation), 0)
    );
}

/// A's lease passes and `next_owner` claims the next generation.
async fn expire_and_reclaim(db: &TestDb, a_job: &ClaimedJob, next_owner: &OwnerId) -> ClaimedJob {
    let at = secs_after(a_job.lease_until, 1);
    let report = db
        .store
        .reap(&owner("reaper"), &fixed_backoff(1), 10, Some(at))
        .await
        .unwrap();
    assert_eq!(report.retried, vec![a_job.id]);
    let got = db
        .store
        .claim(&claim_at(next_owner, 1, secs_after(at, 2)))
        .await
        .unwrap();
    assert_eq!(got.len(), 1);
    got.into_iter().next().unwrap()
}

/// A handler whose business write lives in the same database: it applies the effect and
/// completes in one transaction, so a refused completion rolls the effect back.
async fn run_in_one_transaction(
    db: &TestDb,
    j: &ClaimedJob,
    result: serde_json::Value,
) -> CompleteOutcome {
    let mut conn = db.pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    db.apply_effect_in(&mut tx, &format!("{}/write", j.id), j.id, j.generation)
        .await;
    let outcome = db
        .store
        .complete_in(&mut tx, &j.fence(), Some(result))
        .await
        .unwrap();
    if outcome == CompleteOutcome::Completed {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
    outcome
}

async fn assert_running_under(db: &TestDb, id: JobId, generation: i64, who: &OwnerId) {
    let rec = db.store.job(id).await.unwrap();
    assert_eq!(rec.state, JobState::Running);
    assert_eq!(rec.generation, Generation(generation));
    assert_eq!(rec.owner.as_deref(), Some(who.as_str()));
    assert_eq!(rec.result, None);
    assert!(rec.lease_until.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_completion_by_generation_7_is_stale_while_generation_8_runs() {
    bounded(async {
        let db = TestDb::new("fencing_late_completion").await;
        let h = TestHandler::new(&db).await;
        let id = db.store.enqueue(job("k")).await.unwrap();
        advance_generation_to(&db, id, 6).await;

        let a = owner("a");
        let a_job = db.store.claim(&claim_req(&a, 1)).await.unwrap().remove(0);
        assert_eq!(a_job.generation, Generation(7));

        // A stalls before its handler runs; its lease passes; B claims generation 8 and
        // runs the handler: the effect happens and the ledger records it under 8.
        let b = owner("b");
        let b_job = expire_and_reclaim(&db, &a_job, &b).await;
        assert_eq!(b_job.generation, Generation(8));
        let b_run = h.run(&db.store, &b_job).await;
        assert_eq!(b_run.path, Path::Acted);

        // A wakes up and runs its handler anyway: the ledger hands it B's outcome and
        // the effect does not happen again.
        let a_run = h.run(&db.store, &a_job).await;
        assert_eq!(
            (a_run.path, a_run.applied_by()),
            (Path::Ledger, Some(8)),
            "stale generation 7 must get generation 8's recorded outcome, not act: {a_run:?}"
        );
        db.assert_effect_once(id, 8, 8).await;

        // Every write A still tries is refused, and the row stays B's.
        assert_eq!(
            run_in_one_transaction(&db, &a_job, serde_json::json!("from A")).await,
            CompleteOutcome::Stale
        );
        assert_eq!(
            db.store.complete(&a_job.fence(), None).await.unwrap(),
            CompleteOutcome::Stale
        );
        assert_eq!(
            db.store.completion_status(&a_job.fence()).await.unwrap(),
            CompleteOutcome::Stale
        );
        let renew = db.store.renew(&a, &[a_job.attempt()], LEASE).await.unwrap();
        assert_eq!(renew.lost, vec![a_job.attempt()]);
        assert!(renew.renewed.is_empty());
        let fail = db
            .store
            .fail(
                &a_job.fence(),
                &Failure {
                    reason: "A gives up".into(),
                    permanent: true,
                    retry_after: None,
                },
                &fixed_backoff(1),
            )
            .await
            .unwrap();
        assert_eq!(fail, FailOutcome::Stale);
        let rec = db
            .store
            .record_effect(
                &a_job.fence(),
                &format!("{id}/charge"),
                "fp",
                &serde_json::json!(1),
                LEASE,
            )
            .await
            .unwrap();
        assert_eq!(rec, RecordOutcome::Stale);
        assert!(db
            .store
            .release_many(&a, &[a_job.attempt()], "A")
            .await
            .unwrap()
            .is_empty());
        assert_running_under(&db, id, 8, &b).await;
        assert_eq!(
            db.effect_count(Some(&format!("{id}/write"))).await,
            0,
            "A's business write rolled back with its refused completion"
        );

        // B's completion applies.
        assert_eq!(
            run_in_one_transaction(&db, &b_job, serde_json::json!("from B")).await,
            CompleteOutcome::Completed
        );
        let rec = db.store.job(id).await.unwrap();
        assert_eq!(rec.state, JobState::Done);
        assert_eq!(rec.generation, Generation(8));
        assert_eq!(rec.result, Some(serde_json::json!("from B")));
        // ... and A still cannot touch the finished job.
        assert_eq!(
            db.store
                .complete(&a_job.fence(), Some(serde_json::json!("late")))
                .await
                .unwrap(),
            CompleteOutcome::Stale
        );
        assert_eq!(
            db.store.job(id).await.unwrap().result,
            Some(serde_json::json!("from B"))
        );
        assert_eq!(db.effect_generations(&format!("{id}/write")).await, vec![8]);
        db.assert_effect_once(id, 8, 8).await;
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_owner_stale_generation_is_refused_by_the_generation_check() {
    bounded(async {
        // One process: its handler for generation 7 stalls, the lease passes, and the
        // same process (same owner id) claims generation 8. Owner and state match the
        // row; only the generation tells the two attempts apart.
        let db = TestDb::new("fencing_same_owner").await;
        let h = TestHandler::new(&db).await;
        let id = db.store.enqueue(job("k")).await.unwrap();
        advance_generation_to(&db, id, 6).await;
        let me = owner("proc");
        let old = db.store.claim(&claim_req(&me, 1)).await.unwrap().remove(0);
        assert_eq!(old.generation, Generation(7));

        // Generation 7's handler finds nothing in the ledger and stalls inside its act,
        // just before the effect lands. The effect store has neither idempotency keys
        // nor fencing, so the handler reconciles (looks the key up before acting).
        let (entered_tx, entered_rx) = tokio::sync::oneshot::channel::<()>();
        let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
        let old_task = {
            let (h, store, old) = (h.clone(), db.store.clone(), old.clone());
            let pause = Box::pin(async move {
                let _ = entered_tx.send(());
                let _ = go_rx.await;
            });
            tokio::spawn(async move {
                let opts = Opts {
                    reconcile: true,
                    pause: Some(pause),
                };
                h.run_with(&store, &old, opts).await
            })
        };
        within(10, "generation 7 to enter its act", entered_rx)
            .await
            .unwrap();

        // The lease passes and the same process claims generation 8.
        let new = expire_and_reclaim(&db, &old, &me).await;
        assert_eq!(new.generation, Generation(8));

        // Generation 7's effect lands now, after its fence is gone: the ledger must
        // refuse its record (owner and state match; only the generation differs).
        go_tx.send(()).unwrap();
        let old_run = within(10, "generation 7's handler", old_task)
            .await
            .unwrap();
        assert_eq!(old_run.path, Path::Acted);
        assert_eq!(
            db.ledger(id).await,
            None,
            "stale generation 7 recorded an effect while generation 8 owned the job"
        );
        let err = old_run
            .result
            .clone()
            .expect_err("generation 7's record was refused, yet its step reported success");
        assert!(err.message().contains("lost the lease"), "{err}");

        // Generation 8 finds the effect by its key in the store, records it, and does
        // not act again.
        let new_run = h
            .run_with(
                &db.store,
                &new,
                Opts {
                    reconcile: true,
                    pause: None,
                },
            )
            .await;
        assert_eq!(
            (new_run.path, new_run.applied_by()),
            (Path::Reconciled, Some(7)),
            "{new_run:?}"
        );
        db.assert_effect_once(id, 7, 8).await;

        assert_eq!(
            run_in_one_transaction(&db, &old, serde_json::json!("old")).await,
            CompleteOutcome::Stale
        );
        assert_eq!(
            db.store
                .complete(&old.fence(), Some(serde_json::json!("old")))
                .await
                .unwrap(),
            CompleteOutcome::Stale
        );
        let outcomes = db
            .store
            .complete_many(&me, &[(old.attempt(), Some(serde_json::json!("old")))])
            .await
            .unwrap();
        assert_eq!(outcomes, vec![CompleteOutcome::Stale]);
        let fail = db
            .store
            .fail(
                &old.fence(),
                &Failure {
                    reason: "old".into(),
                    permanent: true,
                    retry_after: None,
                },
                &fixed_backoff(1),
            )
            .await
            .unwrap();
        assert_eq!(fail, FailOutcome::Stale);
        assert_eq!(
            db.store
                .renew(&me, &[old.attempt()], LEASE)
                .await
                .unwrap()
                .lost,
            vec![old.attempt()]
        );
        assert_eq!(
            db.store
                .record_effect(
                    &old.fence(),
                    &format!("{id}/charge"),
                    "fp",
                    &serde_json::json!(1),
                    LEASE
                )
                .await
                .unwrap(),
            RecordOutcome::Stale
        );
        assert!(db
            .store
            .release_many(&me, &[old.attempt()], "old")
            .await
            .unwrap()
            .is_empty());
        assert_running_under(&db, id, 8, &me).await;
        assert_eq!(
            db.effect_count(Some(&format!("{id}/write"))).await,
            0,
            "the old generation's business write rolled back with its refused completion"
        );

        assert_eq!(
            run_in_one_transaction(&db, &new, serde_json::json!("new")).await,
            CompleteOutcome::Completed
        );
        let rec = db.store.job(id).await.unwrap();
        assert_eq!((rec.state, rec.generation), (JobState::Done, Generation(8)));
        assert_eq!(rec.result, Some(serde_json::json!("new")));
        // The old generation asking again is not told it completed.
        assert_eq!(
            db.store.completion_status(&old.fence()).await.unwrap(),
            CompleteOutcome::Stale
        );
        assert_eq!(db.effect_generations(&format!("{id}/write")).await, vec![8]);
        db.assert_effect_once(id, 7, 8).await;
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_completion_applies_only_current_generations() {
    bounded(async {
        let db = TestDb::new("fencing_complete_many").await;
        let h = TestHandler::new(&db).await;
        let ids = db
            .store
            .enqueue_many(vec![job("k"), job("k")])
            .await
            .unwrap();
        let me = owner("proc");
        let jobs = db.store.claim(&claim_req(&me, 2)).await.unwrap();
        assert_eq!(jobs.len(), 2);
        // The first job's handler runs (generation 1) while its lease holds; its
        // completion waits for the batch. The second has not started.
        let first_g1 = jobs.iter().find(|j| j.id == ids[0]).unwrap();
        assert_eq!(h.run(&db.store, first_g1).await.path, Path::Acted);

        // Both leases are lost and re-claimed by the same owner; the batch still
        // carries the old generation for the first job.
        let at = secs_after(jobs[0].lease_until, 1);
        let rep = db
            .store
            .reap(&owner("r"), &fixed_backoff(1), 10, Some(at))
            .await
            .unwrap();
        assert_eq!(rep.retried.len(), 2);
        let again = db
            .store
            .claim(&claim_at(&me, 2, secs_after(at, 2)))
            .await
            .unwrap();
        assert_eq!(again.len(), 2);
        // Both new attempts run: the first gets generation 1's outcome from the
        // ledger, the second acts.
        let first_g2 = again.iter().find(|j| j.id == ids[0]).unwrap();
        let fresh = again.iter().find(|j| j.id == ids[1]).unwrap();
        let rerun = h.run(&db.store, first_g2).await;
        assert_eq!(
            (rerun.path, rerun.applied_by()),
            (Path::Ledger, Some(1)),
            "the re-claimed first job must get its recorded outcome, not act: {rerun:?}"
        );
        assert_eq!(h.run(&db.store, fresh).await.path, Path::Acted);

        let outcomes = db
            .store
            .complete_many(
                &me,
                &[
                    (first_g1.attempt(), None),
                    (fresh.attempt(), Some(serde_json::json!(2))),
                ],
            )
            .await
            .unwrap();
        assert_eq!(
            outcomes,
            vec![CompleteOutcome::Stale, CompleteOutcome::Completed]
        );
        assert_eq!(db.state_of(ids[0]).await, "running");
        assert_eq!(db.state_of(ids[1]).await, "done");
        db.assert_effect_once(ids[0], 1, 1).await;
        db.assert_effect_once(ids[1], 2, 2).await;
        assert_eq!(db.assert_done_jobs_have_their_effects().await, 1);
        assert_eq!(db.assert_no_duplicate_effects().await, 2);
        db.drop().await;
    })
    .await
}

/// The same fence with another job identity: what an attempt of a dropped schema's job
/// holds once the schema is created again under the same process (ids, owner and a
/// first generation repeat there; the identity does not).
fn of_another_incarnation(fence: &leasehold::Fence) -> leasehold::Fence {
    let mut other = fence.clone();
    other.identity =
        leasehold::EffectIdentity::parse("00000000-0000-4000-8000-000000000001").unwrap();
    assert_ne!(other.identity, fence.identity);
    other
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_of_another_job_identity_writes_nothing_on_any_fenced_path() {
    bounded(async {
        let db = TestDb::new("fencing_identity").await;
        let plain = db.store.enqueue(job("k")).await.unwrap();
        let in_key = db.store.enqueue(keyed("k", "acct", 1)).await.unwrap();
        let me = owner("proc");
        let claimed = db.store.claim(&claim_req(&me, 2)).await.unwrap();
        assert_eq!(claimed.len(), 2);
        let json = serde_json::json!("from the other incarnation");
        for j in &claimed {
            let other = of_another_incarnation(&j.fence());
            let wrong = other.attempt();
            let what = format!("job {} (keyed: {})", j.id, j.key.is_some());
            assert_eq!(
                db.store.complete(&other, Some(json.clone())).await.unwrap(),
                CompleteOutcome::Stale,
                "complete, {what}"
            );
            let mut conn = db.pool.acquire().await.unwrap();
            let mut tx = conn.begin().await.unwrap();
            assert_eq!(
                db.store
                    .complete_in(&mut tx, &other, Some(json.clone()))
                    .await
                    .unwrap(),
                CompleteOutcome::Stale,
                "complete_in, {what}"
            );
            tx.commit().await.unwrap();
            assert_eq!(
                db.store
                    .complete_many(&me, &[(wrong.clone(), Some(json.clone()))])
                    .await
                    .unwrap(),
                vec![CompleteOutcome::Stale],
                "complete_many, {what}"
            );
            assert_eq!(
                db.store.completion_status(&other).await.unwrap(),
                CompleteOutcome::Stale,
                "completion_status, {what}"
            );
            let failure = Failure {
                reason: "the other incarnation failed".into(),
                permanent: true,
                retry_after: None,
            };
            assert_eq!(
                db.store
                    .fail(&other, &failure, &fixed_backoff(1))
                    .await
                    .unwrap(),
                FailOutcome::Stale,
                "fail, {what}"
            );
            assert_eq!(
                db.store
                    .snooze(&other, std::time::Duration::from_secs(60), 5)
                    .await
                    .unwrap(),
                None,
                "snooze, {what}"
            );
            let renewal = db
                .store
                .renew(&me, std::slice::from_ref(&wrong), LEASE)
                .await
                .unwrap();
            assert!(renewal.renewed.is_empty(), "renew, {what}: {renewal:?}");
            assert_eq!(renewal.lost, vec![wrong.clone()], "renew, {what}");
            assert!(
                db.store
                    .release_many(&me, std::slice::from_ref(&wrong), "other")
                    .await
                    .unwrap()
                    .is_empty(),
                "release_many, {what}"
            );
            assert_eq!(
                db.store.record_progress(&other, &json).await.unwrap(),
                leasehold::FenceOutcome::Stale,
                "record_progress, {what}"
            );
            assert_eq!(
                db.store
                    .record_effect(
                        &other,
                        &format!("{}/{}/charge", other.identity, j.id),
                        "fp",
                        &json,
                        std::time::Duration::from_secs(3600),
                    )
                    .await
                    .unwrap(),
                RecordOutcome::Stale,
                "record_effect, {what}"
            );
            let rec = db.store.job(j.id).await.unwrap();
            assert_eq!(
                (
                    rec.state,
                    rec.generation,
                    rec.progress.clone(),
                    rec.last_error.clone()
                ),
                (JobState::Running, j.generation, None, None),
                "{what}: a write of the other incarnation landed"
            );
            assert!(
                db.store.job_effects(j.id).await.unwrap().is_empty(),
                "{what}: an effect landed"
            );
        }
        // The job's own fences still hold: both complete.
        for j in &claimed {
            assert_eq!(
                db.store.complete(&j.fence(), None).await.unwrap(),
                CompleteOutcome::Completed
            );
        }
        assert_eq!(db.state_of(plain).await, "done");
        assert_eq!(db.state_of(in_key).await, "done");
        db.drop().await;
    })
    .await
}
