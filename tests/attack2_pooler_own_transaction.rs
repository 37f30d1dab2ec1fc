//! Attack on "A `Store` that is never migrated ... makes the same check before its first
//! statement, and then refuses every call with the same error, having written nothing".
//!
//! The check needs server connections of its own. Many store calls begin a transaction
//! on the pool first (holds, cancels, listings, `queue_stats`, COPY, completions, ...)
//! and a call inside the caller's transaction comes with one open: behind PgBouncer in
//! transaction mode with one server connection (the setup the README's own pooler tests
//! use), that open transaction holds the only server connection while the check waits
//! for one. The check then gives up after 10 s and the store "goes on as configured"
//! (direct) for good: the verdict is kept, so the store is never refused.

mod common;
#[path = "common/pgbouncer.rs"]
mod pgbouncer;

use std::time::{Duration, Instant};

use common::*;
use leasehold::{Store, StoreOptions};
use pgbouncer::PgBouncer;
use sqlx::PgPool;

async fn through(bouncer: &PgBouncer, app: &str, size: u32) -> PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(
            bouncer
                .options()
                .database(&test_db_name())
                .application_name(app),
        )
        .await
        .expect("connect through pgbouncer")
}

fn is_pooler_refusal<T>(r: &leasehold::Result<T>) -> bool {
    matches!(r, Err(leasehold::Error::Config { field, .. }) if *field == "store.transaction_pooler")
}

fn show<T: std::fmt::Debug>(r: &leasehold::Result<T>) -> String {
    format!("{r:?}").chars().take(200).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_as_the_first_call_behind_a_one_connection_transaction_pooler_is_refused() {
    bounded(async {
        let db = TestDb::new("a2_pooler_own_tx_hold").await;
        let id = db.store.enqueue(job("k")).await.unwrap();
        let bouncer = PgBouncer::start(1);
        let pool = through(&bouncer, &db.app_name_of("untold"), 2).await;
        let store = Store::new(pool.clone(), &db.schema, StoreOptions::default()).unwrap();
        let t = Instant::now();
        let first = within(30, "hold", store.hold(id)).await;
        let took = t.elapsed();
        // The same store again: the verdict is kept for it.
        let second = within(30, "enqueue", store.enqueue(job("web"))).await;
        let third = within(30, "queue_stats", store.queue_stats()).await;
        pool.close().await;
        drop(bouncer);
        let state = db.state_of(id).await;
        let jobs = db.job_count().await;
        assert!(
            is_pooler_refusal(&first) && is_pooler_refusal(&second) && is_pooler_refusal(&third),
            "behind an untold transaction pooler (1 server connection): hold -> {} after {took:?}; \
             then enqueue -> {}; then queue_stats -> {}; the job is now {state}, {jobs} jobs in the table",
            show(&first),
            show(&second),
            show(&third)
        );
        assert_eq!((state.as_str(), jobs), ("pending", 1), "nothing written");
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_in_the_callers_transaction_behind_a_one_connection_transaction_pooler_is_refused(
) {
    bounded(async {
        let db = TestDb::new("a2_pooler_own_tx_in").await;
        let bouncer = PgBouncer::start(1);
        let pool = through(&bouncer, &db.app_name_of("untold"), 2).await;
        let store = Store::new(pool.clone(), &db.schema, StoreOptions::default()).unwrap();
        // The web service's request: its business transaction, then the job in it.
        let mut tx = pool.begin().await.unwrap();
        let t = Instant::now();
        let first = within(30, "enqueue_in", store.enqueue_in(&mut tx, job("web"))).await;
        let took = t.elapsed();
        let committed = tx.commit().await;
        // Later requests on the same store, each in its own transaction.
        let mut later = Vec::new();
        for _ in 0..3 {
            let mut tx = pool.begin().await.unwrap();
            let r = within(30, "enqueue_in", store.enqueue_in(&mut tx, job("web"))).await;
            let c = tx.commit().await;
            later.push(format!("{} (commit {:?})", show(&r), c.map(|_| ()).map_err(|e| e.to_string())));
        }
        pool.close().await;
        drop(bouncer);
        let jobs = db.job_count().await;
        assert!(
            is_pooler_refusal(&first) && later.iter().all(|l| l.contains("transaction_pooler")),
            "behind an untold transaction pooler (1 server connection): enqueue_in -> {} after \
             {took:?} (commit {:?}); later enqueue_in calls on the same store: {later:#?}; {jobs} jobs written",
            show(&first),
            committed.map(|_| ()).map_err(|e| e.to_string())
        );
        assert_eq!(jobs, 0, "nothing written");
        db.drop().await;
    })
    .await
}
