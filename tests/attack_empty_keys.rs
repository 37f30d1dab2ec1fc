//! Attack: "an empty key is refused everywhere" — through the enqueue paths the suite's
//! empty_key test does not take (COPY, outcomes in a host transaction), and the unique
//! key. Each must be refused with `InvalidInput` and write nothing.

mod common;

use common::*;
use leasehold::{Error, NewJob};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_job_key_is_refused_by_copy_and_outcome_enqueues_and_writes_nothing() {
    bounded(async {
        let db = TestDb::new("empty_key_paths").await;
        let mut results = Vec::new();
        {
            let mut tx = db.pool.begin().await.unwrap();
            results.push((
                "enqueue_copy_in",
                db.store
                    .enqueue_copy_in(&mut tx, vec![keyed("k", "", 1)])
                    .await
                    .map(|_| ()),
            ));
            // The host's transaction is still usable.
            sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
            results.push((
                "enqueue_outcomes_in",
                db.store
                    .enqueue_outcomes_in(&mut tx, vec![keyed("k", "", 2)])
                    .await
                    .map(|_| ()),
            ));
            sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
            tx.commit().await.unwrap();
        }
        let written = db.count_where("jobs", "true").await;
        for (path, r) in &results {
            assert!(
                matches!(r, Err(Error::InvalidInput { .. })),
                "{path} with an empty key: {r:?}"
            );
        }
        assert_eq!(written, 0);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_unique_key_is_refused() {
    bounded(async {
        let db = TestDb::new("empty_unique").await;
        let r = db
            .store
            .enqueue(
                NewJob::new("k", &serde_json::json!({}))
                    .unwrap()
                    .unique("", leasehold::UniqueScope::WhileOpen),
            )
            .await;
        assert!(matches!(r, Err(Error::InvalidInput { .. })), "{r:?}");
        db.drop().await;
    })
    .await
}
