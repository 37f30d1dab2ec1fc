//! Unique jobs: concurrent enqueuers of one unique key get one job and its id; each
//! scope (while open, per period, for ever) frees or keeps the key as it says; a batch
//! with duplicates inside it and against the table, through `enqueue_many` and COPY,
//! writes each key once without failing; a keyed duplicate leaves its key's counters
//! alone; a unique key held by an open transaction is decided by its commit. Asserted on
//! the rows, never on the lock.

mod common;

use std::time::Duration;

use common::*;
use leasehold::{CompleteOutcome, Enqueued, Error, JobState, NewJob, UniqueScope};

fn charge(order: u32, scope: UniqueScope) -> NewJob {
    NewJob::from_json("charge", serde_json::json!({ "order": order }))
        .unique(format!("order-{order}"), scope)
}

async fn finish(db: &TestDb) {
    let w = owner("w");
    for j in db.store.claim(&claim_req(&w, 100)).await.unwrap() {
        let done = db.store.complete(&j.fence(), None).await.unwrap();
        assert_eq!(done, CompleteOutcome::Completed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_concurrent_enqueuers_of_one_unique_key_get_one_job() {
    bounded(async {
        let db = TestDb::with_options("uniq_race", Default::default(), 8).await;
        let mut tasks = Vec::new();
        for _ in 0..16 {
            let store = db.store.clone();
            tasks.push(tokio::spawn(async move {
                store
                    .enqueue_outcome(charge(1, UniqueScope::WhileOpen))
                    .await
                    .unwrap()
            }));
        }
        let mut outs: Vec<Enqueued> = Vec::new();
        for t in tasks {
            outs.push(t.await.unwrap());
        }
        assert_eq!(db.job_count().await, 1);
        assert_eq!(outs.iter().filter(|e| !e.duplicate).count(), 1, "{outs:?}");
        assert!(outs.iter().all(|e| e.id == outs[0].id), "{outs:?}");
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_open_frees_the_key_when_the_job_ends_and_forever_never_does() {
    bounded(async {
        let db = TestDb::new("uniq_scopes").await;
        let open = db
            .store
            .enqueue_outcome(charge(1, UniqueScope::WhileOpen))
            .await
            .unwrap();
        let ever = db
            .store
            .enqueue_outcome(charge(2, UniqueScope::Forever))
            .await
            .unwrap();
        assert!(!open.duplicate && !ever.duplicate);
        // While they are open, both keys are taken (a held job is open too).
        db.store.hold(open.id).await.unwrap();
        let again = db
            .store
            .enqueue_outcome(charge(1, UniqueScope::WhileOpen))
            .await
            .unwrap();
        assert_eq!((again.id, again.duplicate), (open.id, true));
        db.store.release_hold(open.id).await.unwrap();
        finish(&db).await;
        // Done: the while-open key is free again, the forever key is not.
        let next = db
            .store
            .enqueue_outcome(charge(1, UniqueScope::WhileOpen))
            .await
            .unwrap();
        assert!(!next.duplicate && next.id != open.id, "{next:?}");
        let still = db
            .store
            .enqueue_outcome(charge(2, UniqueScope::Forever))
            .await
            .unwrap();
        assert_eq!((still.id, still.duplicate), (ever.id, true));
        // Retention does not prune a job whose unique key holds for ever.
        let pruned = common::prune_now(&db.store, 100).await.unwrap();
        assert_eq!(pruned.jobs, 1, "the done while-open job is pruned");
        assert_eq!(db.state_of(ever.id).await, "done");
        let after = db
            .store
            .enqueue_outcome(charge(2, UniqueScope::Forever))
            .await
            .unwrap();
        assert_eq!((after.id, after.duplicate), (ever.id, true));
        // The same key of another kind is another key.
        let other = NewJob::from_json("refund", serde_json::json!({}))
            .unique("order-2", UniqueScope::Forever);
        assert!(!db.store.enqueue_outcome(other).await.unwrap().duplicate);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_period_scope_allows_one_job_per_window_whatever_its_state() {
    bounded(async {
        let db = TestDb::new("uniq_period").await;
        let scope = UniqueScope::Period(Duration::from_secs(2));
        // Start right after a window opens, so the first two land in one window.
        let now: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let into = 2000 - (now.timestamp_millis().rem_euclid(2000));
        tokio::time::sleep(Duration::from_millis(into as u64 + 50)).await;
        let first = db.store.enqueue_outcome(charge(7, scope)).await.unwrap();
        finish(&db).await;
        let same = db.store.enqueue_outcome(charge(7, scope)).await.unwrap();
        assert_eq!(
            (same.id, same.duplicate),
            (first.id, true),
            "done, same window"
        );
        tokio::time::sleep(Duration::from_millis(2100)).await;
        let next = db.store.enqueue_outcome(charge(7, scope)).await.unwrap();
        assert!(!next.duplicate, "a new window takes a new job");
        assert_eq!(db.job_count().await, 2);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_duplicates_inside_and_against_the_table_writes_each_key_once() {
    bounded(async {
        let db = TestDb::new("uniq_batch").await;
        let existing = db
            .store
            .enqueue(charge(3, UniqueScope::WhileOpen))
            .await
            .unwrap();
        let outs = db
            .store
            .enqueue_many_outcomes(vec![
                charge(1, UniqueScope::WhileOpen),
                charge(1, UniqueScope::WhileOpen),
                job("plain"),
                charge(2, UniqueScope::WhileOpen),
                charge(3, UniqueScope::WhileOpen),
            ])
            .await
            .unwrap();
        assert!(!outs[0].duplicate);
        assert_eq!((outs[1].id, outs[1].duplicate), (outs[0].id, true));
        assert!(!outs[2].duplicate && !outs[3].duplicate);
        assert_eq!((outs[4].id, outs[4].duplicate), (existing, true));
        assert_eq!(db.job_count().await, 4);

        // COPY: the same resolution, duplicates left out of the load.
        let written = db
            .store
            .enqueue_copy(vec![
                charge(2, UniqueScope::WhileOpen),
                charge(4, UniqueScope::WhileOpen),
                charge(4, UniqueScope::WhileOpen),
                charge(5, UniqueScope::Forever),
                job("plain"),
            ])
            .await
            .unwrap();
        assert_eq!(written, 3);
        assert_eq!(db.job_count().await, 7);
        assert_eq!(
            db.count_where(
                "jobs",
                "unique_key = 'order-5' AND unique_until = 'infinity'"
            )
            .await,
            1
        );
        let again = db
            .store
            .enqueue_outcome(charge(5, UniqueScope::Forever))
            .await
            .unwrap();
        assert!(again.duplicate, "the COPY's forever key holds");
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_duplicate_leaves_its_keys_counters_alone() {
    bounded(async {
        let db = TestDb::new("uniq_keyed").await;
        let a = db
            .store
            .enqueue_outcome(charge(1, UniqueScope::WhileOpen).with_key("acct"))
            .await
            .unwrap();
        let b = db
            .store
            .enqueue_outcome(charge(1, UniqueScope::WhileOpen).with_key("acct"))
            .await
            .unwrap();
        assert_eq!((b.id, b.duplicate), (a.id, true));
        assert_eq!(db.count_where("job_keys", "open_jobs = 1").await, 1);
        finish(&db).await;
        assert_eq!(db.count_where("job_keys", "open_jobs = 0").await, 1);
        assert_eq!(db.store.job(a.id).await.unwrap().state, JobState::Done);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unique_key_in_an_open_transaction_is_decided_by_its_commit() {
    bounded(async {
        let db = TestDb::new("uniq_tx").await;
        let other = db.other_store("second").await;
        // Rolled back: the waiting enqueuer writes its own job.
        let mut tx = db.pool.begin().await.unwrap();
        db.store
            .enqueue_in(&mut tx, charge(1, UniqueScope::WhileOpen))
            .await
            .unwrap();
        let waiting = {
            let other = other.clone();
            tokio::spawn(async move {
                other
                    .enqueue_outcome(charge(1, UniqueScope::WhileOpen))
                    .await
                    .unwrap()
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !waiting.is_finished(),
            "the second enqueuer waits for the first's commit"
        );
        tx.rollback().await.unwrap();
        let second = waiting.await.unwrap();
        assert!(!second.duplicate);
        // Committed: the waiting enqueuer gets that job.
        let mut tx = db.pool.begin().await.unwrap();
        let id = db
            .store
            .enqueue_in(&mut tx, charge(2, UniqueScope::WhileOpen))
            .await
            .unwrap();
        let waiting = tokio::spawn(async move {
            other
                .enqueue_outcome(charge(2, UniqueScope::WhileOpen))
                .await
                .unwrap()
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        tx.commit().await.unwrap();
        let third = waiting.await.unwrap();
        assert_eq!((third.id, third.duplicate), (id, true));
        assert_eq!(db.job_count().await, 2);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_unique_key_or_period_is_refused_and_writes_nothing() {
    bounded(async {
        let db = TestDb::new("uniq_bad").await;
        for bad in [
            job("x").unique("", UniqueScope::WhileOpen),
            job("x").unique("a\0b", UniqueScope::Forever),
            job("x").unique("k", UniqueScope::Period(Duration::from_millis(10))),
        ] {
            let err = db
                .store
                .enqueue_many(vec![job("fine"), bad.clone()])
                .await
                .unwrap_err();
            assert!(matches!(err, Error::InvalidInput { .. }), "{bad:?}: {err}");
            assert!(db.store.enqueue_copy(vec![bad]).await.is_err());
        }
        // A unique batch is checked as it is written, after its locks: a payload over
        // the limit still refuses the whole batch and writes nothing.
        let huge = NewJob::from_json("charge", serde_json::json!("x".repeat(300 * 1024)))
            .unique("order-9", UniqueScope::WhileOpen);
        let err = db
            .store
            .enqueue_many(vec![charge(8, UniqueScope::WhileOpen), huge.clone()])
            .await
            .unwrap_err();
        assert!(matches!(err, Error::PayloadTooLarge { .. }), "{err}");
        assert!(db
            .store
            .enqueue_copy(vec![charge(8, UniqueScope::Forever), huge])
            .await
            .is_err());
        assert_eq!(db.job_count().await, 0);
        // And the unique key taken by the refused batch is free.
        assert!(
            !db.store
                .enqueue_outcome(charge(8, UniqueScope::WhileOpen))
                .await
                .unwrap()
                .duplicate
        );
        db.drop().await;
    })
    .await
}
