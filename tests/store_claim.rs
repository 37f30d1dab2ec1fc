//! Claim: `FOR UPDATE SKIP LOCKED` hands a second worker the next candidate instead of
//! blocking on (or double-claiming) a row another worker is locking, and a claim that
//! never commits leaves the job exactly as it was.

mod common;
#[path = "common/handler.rs"]
mod handler;

use std::collections::HashMap;

use common::*;
use handler::{Path, TestHandler};
use leasehold::{CompleteOutcome, Generation, JobId, StoreOptions};
use sqlx::Connection;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_skips_a_row_locked_by_another_worker_without_blocking() {
    bounded(async {
        let db = TestDb::with_options("claim_skips_locked", StoreOptions::default(), 3).await;
        let ids = db
            .store
            .enqueue_many(vec![job("k"), job("k"), job("k")])
            .await
            .unwrap();
        let (first, second, third) = (ids[0], ids[1], ids[2]);

        // Worker A locks the first candidate inside an open transaction, as its claim
        // statement would between picking and committing.
        let mut a = db.raw_conn("a").await;
        let mut a_tx = a.begin().await.unwrap();
        sqlx::query(&format!(
            "SELECT id FROM {} WHERE id = $1 FOR UPDATE",
            db.table("jobs")
        ))
        .bind(first.0)
        .execute(&mut *a_tx)
        .await
        .unwrap();

        // Worker B gets the next candidate at once: not A's row, and not stuck behind it.
        let b = owner("b");
        let got = within(
            2,
            "B's claim while A holds a row lock",
            db.store.claim(&claim_req(&b, 1)),
        )
        .await
        .unwrap();
        assert_eq!(got.len(), 1, "B must get a job");
        assert_eq!(
            got[0].id, second,
            "B must get the next candidate, not A's locked row"
        );
        assert_eq!(got[0].generation, Generation(1));

        // A larger claim also passes A's row by.
        let more = within(2, "B's second claim", db.store.claim(&claim_req(&b, 10)))
            .await
            .unwrap();
        assert_eq!(more.iter().map(|j| j.id).collect::<Vec<_>>(), vec![third]);

        // B runs its jobs.
        for j in got.iter().chain(more.iter()) {
            assert_eq!(
                db.store.complete(&j.fence(), None).await.unwrap(),
                CompleteOutcome::Completed
            );
        }

        // A lets go without claiming: its row is untouched and claimable.
        a_tx.rollback().await.unwrap();
        let rec = db.store.job(first).await.unwrap();
        assert_eq!(db.state_of(first).await, "pending");
        assert_eq!(rec.generation, Generation(0));
        assert_eq!(rec.attempts, 0);
        assert_eq!(db.state_of(second).await, "done");
        assert_eq!(db.state_of(third).await, "done");
        a.close().await.unwrap();
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_never_hand_out_one_job_twice() {
    bounded(async {
        let db = TestDb::with_options("claim_no_dupes", StoreOptions::default(), 2).await;
        let h = TestHandler::new(&db).await;
        let n = 200;
        let ids = db
            .store
            .enqueue_many((0..n).map(|_| job("k")).collect())
            .await
            .unwrap();
        let other = db.other_store_sized("w", 2).await;

        let mut tasks = Vec::new();
        for w in 0..4 {
            let store = if w % 2 == 0 {
                db.store.clone()
            } else {
                other.clone()
            };
            let h = h.clone();
            // Each worker runs the handler of every job it claimed, as it claims them.
            tasks.push(tokio::spawn(async move {
                let me = owner(&format!("w{w}"));
                let mut mine = Vec::new();
                loop {
                    let got = store.claim(&claim_req(&me, 7)).await.unwrap();
                    if got.is_empty() {
                        break;
                    }
                    for j in &got {
                        h.run(&store, j).await;
                    }
                    mine.extend(got);
                }
                mine
            }));
        }
        let mut claimed = Vec::new();
        for t in tasks {
            claimed.extend(within(60, "claim workers", t).await.unwrap());
        }
        let mut seen: Vec<JobId> = claimed.iter().map(|j| j.id).collect();
        seen.sort();
        let mut expected = ids.clone();
        expected.sort();
        assert_eq!(seen, expected, "every job claimed exactly once");

        for j in &claimed {
            assert_eq!(j.generation, Generation(1));
        }
        // By the handler's own log, every job ran exactly once, and acted.
        let mut runs: HashMap<JobId, usize> = HashMap::new();
        for run in h.runs() {
            assert_eq!(run.path, Path::Acted, "{run:?}");
            *runs.entry(run.job).or_default() += 1;
        }
        let twice: Vec<_> = runs.iter().filter(|(_, n)| **n > 1).collect();
        assert!(twice.is_empty(), "jobs run more than once: {twice:?}");
        assert_eq!(runs.len(), n as usize);
        assert_eq!(db.assert_no_duplicate_effects().await, n as usize);
        for id in &ids {
            let rec = db
                .ledger(*id)
                .await
                .expect("each job's effect is in the ledger");
            assert_eq!(rec.generation, Generation(1));
        }
        assert_eq!(
            db.count_where(
                "jobs",
                "state = 'running' AND generation = 1 AND attempts = 1"
            )
            .await,
            n
        );
        other.pool().close().await;
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_killed_before_commit_leaves_job_pending_for_another_worker() {
    bounded(async {
        let db = TestDb::with_options("claim_killed_uncommitted", StoreOptions::default(), 3).await;
        let id = db.store.enqueue(job("k")).await.unwrap();

        // A claims by hand on its own session: lock the candidate and write the lease,
        // exactly as the claim statement does, but do not commit yet.
        let a_owner = owner("a");
        let mut a = db.raw_conn("a").await;
        sqlx::query("BEGIN").execute(&mut a).await.unwrap();
        let picked: i64 = sqlx::query_scalar(&format!(
            "SELECT id FROM {} WHERE state = 'pending' ORDER BY priority, available_at, id LIMIT 1 FOR UPDATE SKIP LOCKED",
            db.table("jobs")
        ))
        .fetch_one(&mut a)
        .await
        .unwrap();
        assert_eq!(picked, id.0);
        sqlx::query(&format!(
            "UPDATE {} SET state = 'running', owner = $2, generation = generation + 1, attempts = attempts + 1, \
             claimed_at = now(), lease_until = now() + interval '30 seconds' WHERE id = $1",
            db.table("jobs")
        ))
        .bind(id.0)
        .bind(a_owner.as_str())
        .execute(&mut a)
        .await
        .unwrap();

        // While A's claim is open, nobody else gets the job (and nobody blocks).
        let b = owner("b");
        let none = within(2, "B's claim during A's open claim", db.store.claim(&claim_req(&b, 10))).await.unwrap();
        assert!(none.is_empty());

        // A dies before COMMIT.
        assert_eq!(db.kill_and_wait("a").await, 1);
        assert!(sqlx::query("COMMIT").execute(&mut a).await.is_err(), "A's session is gone");

        let rec = db.store.job(id).await.unwrap();
        assert_eq!(db.state_of(id).await, "pending");
        assert_eq!(rec.generation, Generation(0), "an uncommitted claim must not consume a generation");
        assert_eq!(rec.attempts, 0);
        assert_eq!(rec.owner, None);

        // B claims it and runs it.
        let got = within(5, "B's claim after A died", db.store.claim(&claim_req(&b, 10))).await.unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].id, id);
        assert_eq!(got[0].generation, Generation(1));
        assert_eq!(db.store.complete(&got[0].fence(), None).await.unwrap(), CompleteOutcome::Completed);

        assert_eq!(db.state_of(id).await, "done");
        db.drop().await;
    })
    .await
}
