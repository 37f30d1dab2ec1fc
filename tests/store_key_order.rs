//! Per-key order: jobs of one key run one at a time in the order their enqueues
//! committed (the key row lock fixes the sequence), only the head is claimable, and the
//! successor is promoted in the transaction that ends the head. Order and one-at-a-time
//! are asserted on the handler's own execution log (start and end), not on leases.

mod common;
#[path = "common/handler.rs"]
mod handler;

use std::sync::Arc;

use common::*;
use handler::{Path, TestHandler};
use leasehold::{ClaimedJob, CompleteOutcome, JobId, JobState, OwnerId, StoreOptions};
use sqlx::Connection;

/// Run the key to the end one job at a time, through the handler, asserting each time
/// that a wide claim returns only the head. The order the jobs ran in is the handler's
/// log.
async fn drain_one_at_a_time(db: &TestDb, h: &TestHandler, w: &OwnerId, expected_open: usize) {
    for _ in 0..expected_open {
        let got = db.store.claim(&claim_req(w, 10)).await.unwrap();
        assert_eq!(
            got.len(),
            1,
            "only the key's head may be claimable, got {:?}",
            ids(&got)
        );
        let j = &got[0];
        // While the head runs, nothing else of the key is claimable.
        assert!(db.store.claim(&claim_req(w, 10)).await.unwrap().is_empty());
        assert_eq!(h.run(&db.store, j).await.path, Path::Acted);
        assert_eq!(
            db.store.complete(&j.fence(), None).await.unwrap(),
            CompleteOutcome::Completed
        );
    }
    assert!(db.store.claim(&claim_req(w, 10)).await.unwrap().is_empty());
}

fn ids(jobs: &[ClaimedJob]) -> Vec<JobId> {
    jobs.iter().map(|j| j.id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueues_of_one_key_run_in_commit_order_not_start_order() {
    bounded(async {
        let db = TestDb::with_options("key_commit_order", StoreOptions::default(), 2).await;
        let h = TestHandler::new(&db).await;
        let mut c1 = db.raw_conn("tx1").await;
        let mut c2 = db.raw_conn("tx2").await;

        // tx1 starts first (it has a transaction id), tx2 second.
        let mut tx1 = c1.begin().await.unwrap();
        let _: i64 = sqlx::query_scalar("SELECT txid_current()")
            .fetch_one(&mut *tx1)
            .await
            .unwrap();
        let mut tx2 = c2.begin().await.unwrap();
        let _: i64 = sqlx::query_scalar("SELECT txid_current()")
            .fetch_one(&mut *tx2)
            .await
            .unwrap();

        // tx2 enqueues and commits first; then tx1.
        let second_started = db
            .store
            .enqueue_in(&mut tx2, keyed("k", "acct", 2))
            .await
            .unwrap();
        tx2.commit().await.unwrap();
        let first_started = within(
            5,
            "tx1's enqueue after tx2 committed",
            db.store.enqueue_in(&mut tx1, keyed("k", "acct", 1)),
        )
        .await
        .unwrap();
        tx1.commit().await.unwrap();
        let third = db.store.enqueue(keyed("k", "acct", 3)).await.unwrap();

        let rec2 = db.store.job(second_started).await.unwrap();
        let rec1 = db.store.job(first_started).await.unwrap();
        assert_eq!((rec2.state, rec2.key_seq), (JobState::Pending, Some(1)));
        assert_eq!((rec1.state, rec1.key_seq), (JobState::Waiting, Some(2)));

        drain_one_at_a_time(&db, &h, &owner("w"), 3).await;
        let order = h.assert_key_order();
        assert_eq!(
            order["acct"],
            vec![second_started, first_started, third],
            "the handler must have run the key in commit order"
        );
        assert_eq!(db.count_where("jobs", "state = 'done'").await, 3);
        assert_eq!(db.assert_done_jobs_have_their_effects().await, 3);
        c1.close().await.unwrap();
        c2.close().await.unwrap();
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_enqueue_of_a_key_waits_for_the_first_to_commit() {
    bounded(async {
        let db = TestDb::with_options("key_enqueue_blocks", StoreOptions::default(), 2).await;
        let h = TestHandler::new(&db).await;
        let mut c1 = db.raw_conn("tx1").await;
        let mut tx1 = c1.begin().await.unwrap();
        let first = db
            .store
            .enqueue_in(&mut tx1, keyed("k", "acct", 1))
            .await
            .unwrap();

        // tx2's enqueue of the same key blocks on the key row lock held by tx1.
        let store = db.store.clone();
        let mut c2 = db.raw_conn("tx2").await;
        let tx2 = tokio::spawn(async move {
            let mut tx = c2.begin().await.unwrap();
            let id = store
                .enqueue_in(&mut tx, keyed("k", "acct", 2))
                .await
                .unwrap();
            tx.commit().await.unwrap();
            c2.close().await.unwrap();
            id
        });
        db.wait_until_lock_waiting("tx2").await;
        assert!(!tx2.is_finished(), "tx2's enqueue must wait for tx1");
        // Another key is not held up.
        let other = within(
            5,
            "enqueue of another key",
            db.store.enqueue(keyed("k", "other", 1)),
        )
        .await
        .unwrap();

        tx1.commit().await.unwrap();
        let second = within(10, "tx2 after tx1 committed", tx2).await.unwrap();
        assert_eq!(db.store.job(first).await.unwrap().key_seq, Some(1));
        assert_eq!(db.store.job(second).await.unwrap().key_seq, Some(2));
        assert_eq!(db.state_of(second).await, "waiting");

        // Complete the other key's job first, then run "acct" in order.
        let w = owner("w");
        let got = db.store.claim(&claim_req(&w, 10)).await.unwrap();
        assert_eq!(ids(&got), vec![first, other], "one job per key");
        let o = got.iter().find(|j| j.id == other).unwrap();
        h.run(&db.store, o).await;
        db.store.complete(&o.fence(), None).await.unwrap();
        let f = got.iter().find(|j| j.id == first).unwrap();
        h.run(&db.store, f).await;
        assert_eq!(
            db.state_of(second).await,
            "waiting",
            "not before the head ends"
        );
        db.store.complete(&f.fence(), None).await.unwrap();
        drain_one_at_a_time(&db, &h, &w, 1).await;

        let order = h.assert_key_order();
        assert_eq!(order["acct"], vec![first, second]);
        assert_eq!(order["other"], vec![other]);
        assert_eq!(db.count_where("jobs", "state = 'done'").await, 3);
        assert_eq!(db.assert_done_jobs_have_their_effects().await, 3);
        c1.close().await.unwrap();
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_claim_never_returns_two_jobs_of_one_key() {
    bounded(async {
        let db = TestDb::new("key_batch_claim").await;
        let h = TestHandler::new(&db).await;
        let mut batch = Vec::new();
        for n in 0..5 {
            for key in ["a", "b", "c"] {
                batch.push(keyed("k", key, n));
            }
            batch.push(job("k"));
        }
        db.store.enqueue_many(batch).await.unwrap();
        let w = owner("w");
        let mut rounds = 0;
        let mut ran = 0;
        loop {
            let got = db.store.claim(&claim_req(&w, 100)).await.unwrap();
            if got.is_empty() {
                break;
            }
            rounds += 1;
            // The round's handlers run concurrently, and all of them are running at
            // once (a barrier inside the act): two jobs of one key in a round would
            // overlap in the handler's log.
            let barrier = Arc::new(tokio::sync::Barrier::new(got.len()));
            let mut running = Vec::new();
            for j in &got {
                let (h, store, barrier, j) =
                    (h.clone(), db.store.clone(), barrier.clone(), j.clone());
                running.push(tokio::spawn(async move {
                    let pause = Box::pin(async move {
                        barrier.wait().await;
                    });
                    let opts = handler::Opts {
                        reconcile: false,
                        pause: Some(pause),
                    };
                    h.run_with(&store, &j, opts).await
                }));
            }
            for r in running {
                let run = within(30, "a round of handlers", r).await.unwrap();
                assert_eq!(run.path, Path::Acted);
            }
            h.assert_key_order();
            let mut keys: Vec<&str> = got.iter().filter_map(|j| j.key.as_deref()).collect();
            let n = keys.len();
            keys.sort();
            keys.dedup();
            assert_eq!(keys.len(), n, "two jobs of one key in one claim: {keys:?}");
            for j in &got {
                assert_eq!(
                    db.store.complete(&j.fence(), None).await.unwrap(),
                    CompleteOutcome::Completed
                );
                ran += 1;
            }
        }
        assert_eq!(rounds, 5, "each round runs one job of each key");
        assert_eq!(ran, 20);
        let order = h.assert_key_order();
        assert_eq!(order.len(), 3);
        assert!(order.values().all(|jobs| jobs.len() == 5), "{order:?}");
        assert_eq!(db.count_where("jobs", "state = 'done'").await, 20);
        assert_eq!(db.assert_done_jobs_have_their_effects().await, 20);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn successor_is_promoted_by_the_completion_and_claimable_by_key() {
    bounded(async {
        let db = TestDb::new("key_promotion").await;
        let h = TestHandler::new(&db).await;
        let ids = db
            .store
            .enqueue_many((1..=3).map(|n| keyed("k", "acct", n)).collect())
            .await
            .unwrap();
        let w = owner("w");
        // claim_key: the sequencer's fast path for the next job of its key.
        let head = db
            .store
            .claim_key(&w, "default", "acct", None, LEASE, None)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(head.id, ids[0]);
        assert!(db
            .store
            .claim_key(&w, "default", "acct", None, LEASE, None)
            .await
            .unwrap()
            .is_none());
        h.run(&db.store, &head).await;
        assert_eq!(
            db.store.complete(&head.fence(), None).await.unwrap(),
            CompleteOutcome::Completed
        );
        // Promotion happened in the completion's transaction: the next is pending now.
        assert_eq!(db.state_of(ids[1]).await, "pending");
        assert_eq!(db.state_of(ids[2]).await, "waiting");
        let next = db
            .store
            .claim_key(&w, "default", "acct", None, LEASE, None)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(next.id, ids[1]);
        h.run(&db.store, &next).await;
        db.store.complete(&next.fence(), None).await.unwrap();
        drain_one_at_a_time(&db, &h, &w, 1).await;
        assert_eq!(h.assert_key_order()["acct"], ids);
        let events: Vec<String> = db
            .store
            .history(ids[2])
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.event)
            .collect();
        assert_eq!(events, vec!["promoted", "claimed", "completed"]);
        assert_eq!(db.count_where("job_keys", "open_jobs = 0").await, 1);
        assert_eq!(db.count_where("jobs", "state = 'done'").await, 3);
        assert_eq!(db.assert_done_jobs_have_their_effects().await, 3);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn successor_enqueued_while_the_head_completes_is_not_stranded() {
    bounded(async {
        // The completion takes the key row lock while a concurrent enqueue of the key
        // holds it: once the enqueue commits, the completion must see the new waiting
        // job and promote it (a stale snapshot would leave it waiting forever).
        let db = TestDb::with_options("key_promotion_race", StoreOptions::default(), 3).await;
        let handler = TestHandler::new(&db).await;
        let head = db.store.enqueue(keyed("k", "acct", 1)).await.unwrap();
        let w = owner("w");
        let h = db.store.claim(&claim_req(&w, 1)).await.unwrap().remove(0);
        // The head's handler runs; then its completion races the successor's enqueue.
        assert_eq!(handler.run(&db.store, &h).await.path, Path::Acted);

        let mut c1 = db.raw_conn("tx1").await;
        let mut tx1 = c1.begin().await.unwrap();
        let succ = db.store.enqueue_in(&mut tx1, keyed("k", "acct", 2)).await.unwrap();

        let store = db.store.clone();
        let fence = h.fence();
        let completing = tokio::spawn(async move { store.complete(&fence, None).await.unwrap() });
        // The completion blocks on the key row held by the open enqueue; then commit it.
        within(10, "completion to wait for the key lock", async {
            loop {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'",
                )
                .bind(&db.app_name)
                .fetch_one(&db.pool)
                .await
                .unwrap();
                if waiting > 0 {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        })
        .await;
        tx1.commit().await.unwrap();
        assert_eq!(within(10, "completion", completing).await.unwrap(), CompleteOutcome::Completed);

        assert_eq!(db.state_of(succ).await, "pending", "the successor must be promoted");
        drain_one_at_a_time(&db, &handler, &w, 1).await;
        assert_eq!(handler.assert_key_order()["acct"], vec![head, succ]);
        assert_eq!(db.count_where("jobs", "state = 'done'").await, 2);
        assert_eq!(db.assert_done_jobs_have_their_effects().await, 2);
        c1.close().await.unwrap();
        db.drop().await;
    })
    .await
}
