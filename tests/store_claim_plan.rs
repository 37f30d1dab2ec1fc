//! The claim reads a handful of index entries whatever the table holds and whatever the
//! planner knows: on a table that was never analyzed, with 10^5 delayed jobs in the
//! claimed queue and 10^5 due jobs in another, whether the claim fills its limit or not.
//! Asserted on what the claim really read (the transaction's own statistics), not on
//! time. Also: claim order across priorities and queues, and the byte budget.

mod common;

use std::time::Duration;

use common::*;
use leasehold::{NewJob, StoreOptions};

async fn load(db: &TestDb, queue: &str, n: usize, delay: Option<Duration>) {
    let jobs: Vec<NewJob> = (0..n)
        .map(|i| {
            let j = NewJob::from_json("k", serde_json::json!({ "n": i })).with_queue(queue);
            match delay {
                Some(d) => j.with_delay(d),
                None => j,
            }
        })
        .collect();
    db.store.enqueue_copy(jobs).await.unwrap();
}

async fn never_analyzed(db: &TestDb) -> bool {
    sqlx::query_scalar::<_, bool>(
        "SELECT reltuples < 0 AND coalesce(last_analyze, last_autoanalyze) IS NULL
         FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid WHERE c.oid = to_regclass($1)",
    )
    .bind(db.table("jobs"))
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_reads_only_what_it_takes_on_a_never_analyzed_table() {
    bounded(async {
        let db = TestDb::with_options("claim_plan_fresh", StoreOptions::default(), 2).await;
        let hour = Some(Duration::from_secs(3600));
        load(&db, "default", 100_000, None).await;
        load(&db, "default", 100_000, hour).await;
        load(&db, "other", 100_000, None).await;
        assert!(
            never_analyzed(&db).await,
            "the table must be fresh for this test"
        );
        let fresh = claim_footprint(&db, &["default"], 32).await;
        assert_eq!(fresh.claimed, 32);
        assert_eq!(fresh.seq_scans, 0, "{fresh:?}");
        assert!(fresh.index_tuples <= 80, "the claim read {fresh:?}");
        assert!(fresh.heap_fetches <= 80, "the claim read {fresh:?}");

        sqlx::query(&format!("ANALYZE {}", db.table("jobs")))
            .execute(&db.pool)
            .await
            .unwrap();
        let analyzed = claim_footprint(&db, &["default"], 32).await;
        assert_eq!(analyzed.claimed, 32);
        assert!(
            fresh.index_tuples <= analyzed.index_tuples + 8,
            "fresh {fresh:?} vs analyzed {analyzed:?}"
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_cannot_fill_its_limit_walks_no_delayed_job_and_no_other_queue() {
    bounded(async {
        let db = TestDb::with_options("claim_plan_unfilled", StoreOptions::default(), 2).await;
        load(&db, "default", 5, None).await;
        load(&db, "default", 100_000, Some(Duration::from_secs(3600))).await;
        load(&db, "other", 100_000, None).await;
        for analyzed in [false, true] {
            if analyzed {
                sqlx::query(&format!("ANALYZE {}", db.table("jobs")))
                    .execute(&db.pool)
                    .await
                    .unwrap();
            }
            let f = claim_footprint(&db, &["default"], 100).await;
            assert_eq!(f.claimed, 5, "analyzed={analyzed}");
            assert_eq!(f.seq_scans, 0, "analyzed={analyzed}: {f:?}");
            assert!(
                f.index_tuples <= 30,
                "analyzed={analyzed}: the claim read {f:?}"
            );
            assert!(
                f.heap_fetches <= 30,
                "analyzed={analyzed}: the claim read {f:?}"
            );
        }
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_take_lower_priorities_first_and_merge_queues_by_age() {
    bounded(async {
        let db = TestDb::with_options("claim_plan_order", StoreOptions::default(), 2).await;
        // Enqueued in this order: b0 (queue b), a0, a-pri-1, b1, a-delayed.
        let mut ids = Vec::new();
        for (queue, priority, delay) in [
            ("b", 0, None),
            ("a", 0, None),
            ("a", -1, None),
            ("b", 0, None),
            ("a", -5, Some(Duration::from_secs(3600))),
        ] {
            let mut j = NewJob::from_json("k", serde_json::json!({}))
                .with_queue(queue)
                .with_priority(priority);
            if let Some(d) = delay {
                j = j.with_delay(d);
            }
            ids.push(db.store.enqueue(j).await.unwrap());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let w = owner("w");
        let mut req = claim_req(&w, 3);
        req.queues = vec!["a".into(), "b".into()];
        let got: Vec<_> = db
            .store
            .claim(&req)
            .await
            .unwrap()
            .into_iter()
            .map(|j| j.id)
            .collect();
        // Priority -1 first; then priority 0 of both queues by age (b0 before a0); the
        // delayed job is not due whatever its priority.
        assert_eq!(got, vec![ids[2], ids[0], ids[1]]);
        let next: Vec<_> = db
            .store
            .claim(&req)
            .await
            .unwrap()
            .into_iter()
            .map(|j| j.id)
            .collect();
        assert_eq!(next, vec![ids[3]]);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_byte_budget_claims_nothing_unless_nothing_is_held() {
    bounded(async {
        let db = TestDb::with_options("claim_plan_budget", StoreOptions::default(), 2).await;
        for _ in 0..3 {
            db.store
                .enqueue(NewJob::from_json(
                    "k",
                    serde_json::json!({ "pad": "x".repeat(100) }),
                ))
                .await
                .unwrap();
        }
        let w = owner("w");
        let mut req = claim_req(&w, 3);
        req.byte_budget = 50;
        req.first_over_budget = false;
        assert!(db.store.claim(&req).await.unwrap().is_empty());
        req.first_over_budget = true;
        assert_eq!(
            db.store.claim(&req).await.unwrap().len(),
            1,
            "the first one only"
        );
        req.byte_budget = 250;
        assert_eq!(
            db.store.claim(&req).await.unwrap().len(),
            2,
            "as many as fit"
        );
        db.drop().await;
    })
    .await
}
