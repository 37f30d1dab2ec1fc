//! A hot key with a 100,000-job backlog does not make the claim scan the backlog: the
//! backlog is `waiting`, outside the claim's partial index, so the claim reads a
//! handful of index entries whatever the backlog's size. Asserted on what the claim
//! really read (the transaction's own table and index statistics), never on wall-clock
//! time.

mod common;

use common::*;
use leasehold::{CompleteOutcome, JobState};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_key_backlog_of_100k_does_not_widen_the_claim_of_other_keys() {
    bounded(async {
        let db = TestDb::with_options("hot_key_backlog", Default::default(), 2).await;
        let mut others = Vec::new();
        for n in 0..10 {
            others.push(keyed("k", &format!("k{n}"), n));
            others.push(job("k"));
        }
        // The hot key's head comes first, so a claim takes it and then the others.
        let hot_head = db.store.enqueue(keyed("k", "hot", 0)).await.unwrap();
        let other_ids = db.store.enqueue_many(others).await.unwrap();
        let small = claim_footprint(&db, &["default"], 10).await;

        for chunk in 0..10 {
            let ids = db
                .store
                .enqueue_many((0..10_000).map(|n| keyed("k", "hot", chunk * 10_000 + n + 1)).collect())
                .await
                .unwrap();
            assert_eq!(ids.len(), 10_000);
        }
        assert_eq!(db.count_where("jobs", "job_key = 'hot' AND state = 'waiting'").await, 100_000);
        // Right after the bulk enqueue (planner statistics still from the small table)
        // and after ANALYZE (as autovacuum would), the claim reads only pending rows.
        for analyzed in [false, true] {
            if analyzed {
                sqlx::query(&format!("ANALYZE {}", db.table("jobs"))).execute(&db.pool).await.unwrap();
            }
            let f = claim_footprint(&db, &["default"], 10).await;
            assert_eq!(f.claimed, 10);
            assert_eq!(f.seq_scans, 0, "analyzed={analyzed}: {f:?}");
            assert!(f.index_tuples <= 40, "analyzed={analyzed}: the claim read {f:?} (without the backlog: {small:?})");
            assert!(f.heap_fetches <= 40, "analyzed={analyzed}: {f:?}");
            eprintln!("analyzed={analyzed}: without backlog {small:?}; with {f:?}");
        }

        // And the claim itself: ten jobs, one of them the hot head, none of its backlog.
        let w = owner("w");
        let got = db.store.claim(&claim_req(&w, 10)).await.unwrap();
        assert_eq!(got.len(), 10);
        assert_eq!(got.iter().filter(|j| j.key.as_deref() == Some("hot")).count(), 1);
        assert!(got.iter().any(|j| j.id == hot_head));
        assert!(got.iter().filter(|j| j.id != hot_head).all(|j| other_ids.contains(&j.id)));
        for j in &got {
            assert_eq!(db.store.complete(&j.fence(), None).await.unwrap(), CompleteOutcome::Completed);
        }
        // The hot key moved on by exactly one.
        let next: (i64, String) = sqlx::query_as(&format!(
            "SELECT key_seq, state FROM {} WHERE job_key = 'hot' AND state IN ('pending', 'running')",
            db.table("jobs")
        ))
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(next, (2, JobState::Pending.as_str().to_string()));
        assert_eq!(db.count_where("jobs", "state = 'done'").await, 10);
        assert_eq!(db.count_where("jobs", "job_key = 'hot' AND state = 'waiting'").await, 99_999);
        db.drop().await;
    })
    .await
}
