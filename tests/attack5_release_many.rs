//! Attack: `Store::release_many(owner, attempts, reason)` at the Store level.
//!
//! Promise: it returns the ids actually released or cancelled (a job missing from its
//! answer is no longer the caller's, or still held: call again); a job an operator
//! cancelled is cancelled and its key moves on; keyed jobs run one at a time in enqueue
//! order; nothing of another owner or generation is touched.

mod common;

use common::*;
use leasehold::{CancelOutcome, ClaimedJob, JobId, JobState, OwnerId};

async fn claim_n(db: &TestDb, w: &OwnerId, n: i64) -> Vec<ClaimedJob> {
    db.store.claim(&claim_req(w, n)).await.unwrap()
}

async fn state(db: &TestDb, id: JobId) -> JobState {
    db.store.job(id).await.unwrap().state
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_many_naming_a_cancelled_keyed_attempt_twice_keeps_the_key_to_one_job_at_a_time() {
    bounded(async {
        let db = TestDb::new("a5_rm_dup").await;
        let ids = db
            .store
            .enqueue_many((1..=3).map(|n| keyed("k", "acct", n)).collect())
            .await
            .unwrap();
        let w = owner("w");
        let got = claim_n(&db, &w, 10).await;
        assert_eq!(got.iter().map(|j| j.id).collect::<Vec<_>>(), vec![ids[0]]);
        let head = &got[0];
        assert_eq!(
            db.store.cancel(head.id, "not needed").await.unwrap(),
            CancelOutcome::Requested
        );
        // The same attempt twice in one call (a caller's list built from two sources).
        let released = db
            .store
            .release_many(&w, &[head.attempt(), head.attempt()], "give back")
            .await
            .unwrap();
        let open_jobs: i64 = sqlx::query_scalar(&format!(
            "SELECT open_jobs FROM {} WHERE job_key = 'acct'",
            db.table("job_keys")
        ))
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(state(&db, ids[0]).await, JobState::Cancelled);
        assert_eq!(state(&db, ids[1]).await, JobState::Pending);
        assert_eq!(state(&db, ids[2]).await, JobState::Waiting);

        // The key's second job runs and completes; its third is the head now.
        let second = claim_n(&db, &w, 10).await;
        assert_eq!(
            second.iter().map(|j| j.id).collect::<Vec<_>>(),
            vec![ids[1]]
        );
        db.store.complete(&second[0].fence(), None).await.unwrap();
        assert_eq!(state(&db, ids[2]).await, JobState::Pending);

        // A new job of the key must wait behind the third.
        let fourth = db.store.enqueue(keyed("k", "acct", 4)).await.unwrap();
        let fourth_state = state(&db, fourth).await;
        let together = claim_n(&db, &w, 10).await;
        let running: Vec<JobId> = together.iter().map(|j| j.id).collect();
        assert!(
            fourth_state == JobState::Waiting && running == vec![ids[2]],
            "release_many answered {released:?} and left the key's open_jobs at {open_jobs} \
             for 2 open jobs; a later enqueue of the key was {fourth_state:?} and one claim took \
             {running:?}: two jobs of one key running at once"
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_many_answers_each_released_job_once() {
    bounded(async {
        let db = TestDb::new("a5_rm_dup_answer").await;
        let id = db.store.enqueue(job("k")).await.unwrap();
        let w = owner("w");
        let got = claim_n(&db, &w, 10).await;
        let released = db
            .store
            .release_many(&w, &[got[0].attempt(), got[0].attempt()], "give back")
            .await
            .unwrap();
        let rec = db.store.job(id).await.unwrap();
        assert_eq!((rec.state, rec.attempts), (JobState::Pending, 0));
        assert_eq!(
            released,
            vec![id],
            "the ids actually released: one job was released, once"
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_many_touches_nothing_of_another_owner_or_an_older_generation() {
    bounded(async {
        let db = TestDb::new("a5_rm_fence").await;
        let ids = db
            .store
            .enqueue_many(vec![job("k"), keyed("k", "acct", 1), keyed("k", "acct", 2)])
            .await
            .unwrap();
        let w = owner("w");
        let other = owner("other");
        let got = claim_n(&db, &w, 10).await;
        assert_eq!(got.len(), 2);
        for j in &got {
            db.store.cancel(j.id, "stop").await.unwrap();
        }
        let attempts: Vec<_> = got.iter().map(|j| j.attempt()).collect();
        assert!(db
            .store
            .release_many(&other, &attempts, "not mine")
            .await
            .unwrap()
            .is_empty());
        // An older generation of the same job, same owner.
        let mut stale: Vec<_> = attempts.clone();
        for a in &mut stale {
            a.generation = leasehold::Generation(a.generation.0 - 1);
        }
        assert!(db
            .store
            .release_many(&w, &stale, "old generation")
            .await
            .unwrap()
            .is_empty());
        for j in &got {
            assert_eq!(state(&db, j.id).await, JobState::Running);
        }
        let mut released = db.store.release_many(&w, &attempts, "mine").await.unwrap();
        released.sort();
        let mut want: Vec<JobId> = got.iter().map(|j| j.id).collect();
        want.sort();
        assert_eq!(released, want);
        for j in &got {
            assert_eq!(state(&db, j.id).await, JobState::Cancelled);
        }
        assert_eq!(
            state(&db, ids[2]).await,
            JobState::Pending,
            "the key moved on"
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_many_leaves_out_a_cancelled_job_whose_key_is_held_and_cancels_it_when_called_again(
) {
    bounded(async {
        let db = TestDb::new("a5_rm_held").await;
        let ids = db
            .store
            .enqueue_many(vec![keyed("k", "acct", 1), keyed("k", "acct", 2)])
            .await
            .unwrap();
        let w = owner("w");
        let got = claim_n(&db, &w, 10).await;
        db.store.cancel(got[0].id, "stop").await.unwrap();
        let mut producer = db.owner.begin().await.unwrap();
        sqlx::query(&format!(
            "SELECT 1 FROM {} WHERE job_key = 'acct' FOR UPDATE",
            db.table("job_keys")
        ))
        .execute(&mut *producer)
        .await
        .unwrap();
        let first = within(5, "release with the key held", async {
            db.store
                .release_many(&w, &[got[0].attempt()], "give back")
                .await
                .unwrap()
        })
        .await;
        assert!(first.is_empty(), "{first:?}");
        assert_eq!(state(&db, ids[0]).await, JobState::Running);
        producer.rollback().await.unwrap();
        let second = db
            .store
            .release_many(&w, &[got[0].attempt()], "give back")
            .await
            .unwrap();
        assert_eq!(second, vec![ids[0]]);
        assert_eq!(state(&db, ids[0]).await, JobState::Cancelled);
        assert_eq!(state(&db, ids[1]).await, JobState::Pending);
        let rec = db.store.job(ids[0]).await.unwrap();
        assert_eq!(rec.attempts, 0);
        db.drop().await;
    })
    .await
}

/// The sibling of the release's duplicate: a batch completion naming one keyed attempt
/// twice completes it once and leaves its key once (the key's next job alone runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_many_naming_a_keyed_attempt_twice_keeps_the_key_to_one_job_at_a_time() {
    bounded(async {
        let db = TestDb::new("a5_cm_dup").await;
        let ids = db
            .store
            .enqueue_many((1..=3).map(|n| keyed("k", "acct", n)).collect())
            .await
            .unwrap();
        let w = owner("w");
        let got = claim_n(&db, &w, 10).await;
        assert_eq!(got.iter().map(|j| j.id).collect::<Vec<_>>(), vec![ids[0]]);
        let a = got[0].attempt();
        let outcomes = db
            .store
            .complete_many(&w, &[(a.clone(), None), (a, None)])
            .await
            .unwrap();
        assert_eq!(outcomes.len(), 2, "one outcome per item: {outcomes:?}");
        assert_eq!(state(&db, ids[0]).await, JobState::Done);
        assert_eq!(state(&db, ids[1]).await, JobState::Pending);
        assert_eq!(state(&db, ids[2]).await, JobState::Waiting);
        let fourth = db.store.enqueue(keyed("k", "acct", 4)).await.unwrap();
        let together = claim_n(&db, &w, 10).await;
        assert_eq!(
            (
                state(&db, fourth).await,
                together.iter().map(|j| j.id).collect::<Vec<_>>()
            ),
            (JobState::Waiting, vec![ids[1]]),
            "one job of the key at a time"
        );
        db.drop().await;
    })
    .await
}
