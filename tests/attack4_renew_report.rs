//! Attack (fresh context): the batched renewal's report names attempts, (job, generation,
//! identity), so one batch may name two attempts of the same job id: an attempt of a
//! dropped schema's job 1 beside the new schema's job 1 (same id, owner and first
//! generation; another identity), as the scheduler's own renewer sends them, or an older
//! generation beside the current one. Each must be reported for itself: the attempt that
//! no longer holds its job in `lost`, never in `renewed` or `cancel_requested`.

mod common;

use common::*;
use leasehold::store::CancelOutcome;
use leasehold::{Attempt, ClaimedJob, JobId, OwnerId};

/// Job 1 claimed by `me`, then the schema created again and its new job 1 claimed by
/// `me` too: (the dropped schema's attempt, the new job's attempt).
async fn two_job_1s(db: &TestDb, me: &OwnerId) -> (ClaimedJob, ClaimedJob) {
    let first = db.store.enqueue(job("k")).await.unwrap();
    assert_eq!(first, JobId(1));
    let old = db.store.claim(&claim_req(me, 1)).await.unwrap().remove(0);
    create_schema_again(db).await;
    let again = db.store.enqueue(job("k")).await.unwrap();
    assert_eq!(again, JobId(1), "ids restart at 1");
    let new = db.store.claim(&claim_req(me, 1)).await.unwrap().remove(0);
    assert_eq!((old.id, old.generation), (new.id, new.generation));
    assert_ne!(old.effect_identity, new.effect_identity);
    (old, new)
}

fn renewed_attempts(report: &leasehold::store::RenewReport) -> Vec<Attempt> {
    report.renewed.iter().map(|(a, _)| a.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_naming_the_dropped_schemas_attempt_beside_the_new_job_1_reports_it_lost_not_renewed(
) {
    bounded(async {
        let db = TestDb::new("a4_renew_two_job_1s").await;
        let me = owner("proc");
        let (old, new) = two_job_1s(&db, &me).await;
        // The order the scheduler's renewer happens to send them in must not matter.
        let mut reports = Vec::new();
        for batch in [
            vec![old.attempt(), new.attempt()],
            vec![new.attempt(), old.attempt()],
        ] {
            reports.push(db.store.renew(&me, &batch, LEASE).await.unwrap());
        }
        db.drop().await;
        for report in reports {
            assert_eq!(
                (renewed_attempts(&report), report.lost.clone()),
                (vec![new.attempt()], vec![old.attempt()]),
                "the dropped schema's attempt of job 1 (identity {}) holds no job, yet the \
                 renewal reported it renewed beside the new job 1 (identity {}): {report:?}",
                old.effect_identity,
                new.effect_identity
            );
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_of_the_new_job_1_is_reported_for_its_own_attempt_only() {
    bounded(async {
        let db = TestDb::new("a4_renew_cancel").await;
        let me = owner("proc");
        let (old, new) = two_job_1s(&db, &me).await;
        assert_eq!(
            db.store
                .cancel(new.id, "customer closed the account")
                .await
                .unwrap(),
            CancelOutcome::Requested
        );
        let report = db
            .store
            .renew(&me, &[old.attempt(), new.attempt()], LEASE)
            .await
            .unwrap();
        db.drop().await;
        assert_eq!(
            report.cancel_requested,
            vec![new.attempt()],
            "an operator cancelled the new job 1; the renewal told the dropped schema's \
             attempt of job 1 to stop for that cancel too: {report:?}"
        );
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_naming_a_stale_generation_beside_the_current_one_reports_the_stale_one_lost() {
    bounded(async {
        let db = TestDb::new("a4_renew_two_gens").await;
        let me = owner("proc");
        let id = db.store.enqueue(job("k")).await.unwrap();
        let first = db.store.claim(&claim_req(&me, 1)).await.unwrap().remove(0);
        // Given back and claimed again by the same owner: generation 2 holds the job.
        assert_eq!(
            db.store
                .release_many(&me, &[first.attempt()], "given back")
                .await
                .unwrap(),
            vec![id]
        );
        let second = db.store.claim(&claim_req(&me, 1)).await.unwrap().remove(0);
        assert_eq!(second.generation.0, first.generation.0 + 1);
        // Alone, the stale generation is lost (as store_fencing checks).
        let alone = db
            .store
            .renew(&me, &[first.attempt()], LEASE)
            .await
            .unwrap();
        assert_eq!(alone.lost, vec![first.attempt()]);
        // Beside the current generation it must still be.
        let report = db
            .store
            .renew(&me, &[first.attempt(), second.attempt()], LEASE)
            .await
            .unwrap();
        db.drop().await;
        assert_eq!(
            (renewed_attempts(&report), report.lost.clone()),
            (vec![second.attempt()], vec![first.attempt()]),
            "generation {} no longer holds the job, yet it was reported renewed beside \
             generation {}: {report:?}",
            first.generation,
            second.generation
        );
    })
    .await
}
