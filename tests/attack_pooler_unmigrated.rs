//! Attack: "the store refuses a transaction-mode pooler unless told". The check runs in
//! `Store::migrate`. A web service that only enqueues (its schema migrated by a deploy
//! step, as the least-privilege setup suggests) builds a `Store` over a pool through
//! PgBouncer in transaction mode and never calls `migrate`. Every call must either
//! work or be refused with the one clear error naming `store.transaction_pooler`.

mod common;
#[path = "common/pgbouncer.rs"]
mod pgbouncer;

use common::*;
use leasehold::{NewJob, Store, StoreOptions};
use sqlx::postgres::PgPoolOptions;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_never_migrates_behind_a_transaction_pooler_is_refused_with_the_pooler_error()
{
    bounded(async {
        let db = TestDb::new("pooler_unmigrated").await;
        let bouncer = pgbouncer::PgBouncer::start(1);
        let pool = PgPoolOptions::new()
            .max_connections(3)
            .connect_with(bouncer.options().database(&test_db_name()))
            .await
            .unwrap();
        let store = Store::new(pool.clone(), &db.schema, StoreOptions::default()).unwrap();
        let mut errors = Vec::new();
        let mut ok = 0;
        for round in 0..6 {
            let calls = (0..3).map(|i| {
                let s = store.clone();
                async move {
                    s.enqueue(NewJob::new("web", &serde_json::json!({"r": round, "i": i})).unwrap())
                        .await
                }
            });
            for r in futures_util::future::join_all(calls).await {
                match r {
                    Ok(_) => ok += 1,
                    Err(e) => errors.push(e.to_string()),
                }
            }
        }
        pool.close().await;
        drop(bouncer);
        let unclear: Vec<&String> = errors
            .iter()
            .filter(|e| !e.contains("transaction_pooler"))
            .collect();
        assert!(
            unclear.is_empty(),
            "{ok} enqueues went in; {} failed without naming the pooler switch, e.g. {:?}",
            unclear.len(),
            unclear.first()
        );
        db.drop().await;
    })
    .await
}
