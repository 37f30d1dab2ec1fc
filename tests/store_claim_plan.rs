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

/// Shared buffers one claim of `limit` jobs from `default` touched, whole function
/// included (nothing is claimed: the transaction is rolled back).
async fn claim_buffers(db: &TestDb, limit: i32) -> i64 {
    use sqlx::Connection;
    let mut conn = db.raw_conn("buffers").await;
    let mut tx = conn.begin().await.unwrap();
    let plan: serde_json::Value = sqlx::query_scalar(&format!(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM \"{}\".claim(ARRAY['default'], \
         NULL, $1, 9223372036854775807, true, 'buffers', NULL, 30, false)",
        db.schema
    ))
    .bind(limit)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    conn.close().await.unwrap();
    plan[0]["Plan"]["Shared Hit Blocks"].as_i64().unwrap()
        + plan[0]["Plan"]["Shared Read Blocks"].as_i64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_steps_over_the_entries_of_jobs_claimed_before_it_once() {
    bounded(async {
        let db = TestDb::with_options("claim_plan_walk_once", StoreOptions::default(), 2).await;
        let total = 60_000;
        load(&db, "default", total, None).await;
        // Warm: the first claim of a session also reads the catalog.
        claim_buffers(&db, 32).await;
        let before = claim_buffers(&db, 32).await;
        // Claim 40,000: their pending versions' index entries stay ahead of the queue's
        // first pending job until VACUUM (none runs here).
        let w = owner("w");
        for _ in 0..40 {
            assert_eq!(db.store.claim(&claim_req(&w, 1000)).await.unwrap().len(), 1000);
        }
        let index_pages: i64 = sqlx::query_scalar(&format!(
            "SELECT pg_relation_size('\"{}\".jobs_claimable_by_queue') / current_setting('block_size')::int8",
            db.schema
        ))
        .fetch_one(&db.pool)
        .await
        .unwrap();
        // The index holds one entry per job loaded (none was inserted since): the
        // claimed ones fill about 40/60 of its pages.
        let claimed_pages = index_pages * 40 / 60;
        // A transaction elsewhere in the database (another test's) can keep the claimed
        // entries from being marked dead, and then each is checked against its row:
        // the least of a few tries is the walk over marked entries.
        let mut after = i64::MAX;
        for _ in 0..10 {
            after = after.min(claim_buffers(&db, 32).await);
            if after - before <= claimed_pages * 13 / 10 + 20 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let walked = after - before;
        assert!(
            walked >= claimed_pages / 2,
            "the claim should have had to step over about {claimed_pages} pages of claimed \
             entries (walked {walked}: before {before}, after {after}); is VACUUM running?"
        );
        assert!(
            walked <= claimed_pages * 13 / 10 + 20,
            "a claim stepped over the claimed entries more than once: {walked} pages more \
             than on the fresh table, against {claimed_pages} pages of them"
        );
        db.drop().await;
    })
    .await
}
