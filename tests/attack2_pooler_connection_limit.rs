//! Attack on "A direct or session-mode connection is never refused": the check opens
//! two connections of its own, outside the pool. A service whose role may open exactly
//! as many connections as its pool holds (`ALTER ROLE … CONNECTION LIMIT`, as managed
//! databases and careful DBAs set) connects straight to PostgreSQL, with nothing
//! between; and a session-mode PgBouncer whose pool is as large as the service's.

mod common;
#[path = "common/pgbouncer.rs"]
mod pgbouncer;

use std::time::{Duration, Instant};

use common::*;
use leasehold::{Store, StoreOptions};
use sqlx::postgres::PgPoolOptions;

fn show<T: std::fmt::Debug>(r: &leasehold::Result<T>) -> String {
    format!("{r:?}").chars().take(240).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_pool_as_large_as_the_roles_connection_limit_is_not_refused() {
    bounded(async {
        let db = TestDb::new("a2_conn_limit").await;
        let role = format!("lh_a2_limited_{:08x}", rand::random::<u32>());
        sqlx::raw_sql(&format!(
            "CREATE ROLE {role} LOGIN CONNECTION LIMIT 2; {}",
            leasehold::store::runtime_grants(
                &leasehold::store::Schema::new(&db.schema).unwrap(),
                &role
            )
        ))
        .execute(&db.owner)
        .await
        .unwrap();
        // A pool of 2 for a role allowed 2 connections, both open (a service that has
        // served requests).
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .min_connections(2)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(base_options().username(&role).database(&test_db_name()))
            .await
            .unwrap();
        {
            let a = pool.acquire().await.unwrap();
            let b = pool.acquire().await.unwrap();
            drop((a, b));
        }
        // The pool itself works.
        let one: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(one, 1);
        let store = Store::new(pool.clone(), &db.schema, StoreOptions::default()).unwrap();
        let mut results = Vec::new();
        for _ in 0..3 {
            let r = within(30, "enqueue", store.enqueue(job("k"))).await;
            results.push(show(&r));
        }
        let listed = within(30, "queue_stats", store.queue_stats()).await;
        pool.close().await;
        let jobs = db.job_count().await;
        let _ = sqlx::raw_sql(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
            .execute(&db.owner)
            .await;
        assert!(
            results.iter().all(|r| r.starts_with("Ok")) && listed.is_ok(),
            "a direct pool that works, for a role with CONNECTION LIMIT = pool size: enqueue x3 -> \
             {results:#?}; queue_stats -> {}; {jobs} jobs written",
            show(&listed)
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_pooler_as_large_as_the_services_pool_is_not_refused() {
    bounded(async {
        let db = TestDb::new("a2_session_full").await;
        let bouncer = pgbouncer::PgBouncer::start_session(1);
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(bouncer.options().database(&test_db_name()))
            .await
            .unwrap();
        let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&pool).await.unwrap();
        assert_eq!(one, 1);
        let store = Store::new(pool.clone(), &db.schema, StoreOptions::default()).unwrap();
        let t = Instant::now();
        let first = within(40, "first enqueue", store.enqueue(job("k"))).await;
        let first_took = t.elapsed();
        let t = Instant::now();
        let second = within(40, "second enqueue", store.enqueue(job("k"))).await;
        let second_took = t.elapsed();
        pool.close().await;
        drop(bouncer);
        assert!(
            first.is_ok() && second.is_ok(),
            "session pooler, 1 server connection, pool of 1: first enqueue {} after {first_took:?}, \
             second {} after {second_took:?}",
            show(&first),
            show(&second)
        );
        // The README's bound: the check gives up after 10 s, asked once per store.
        assert!(
            first_took < Duration::from_secs(12) && second_took < Duration::from_secs(2),
            "first enqueue took {first_took:?}, second {second_took:?}"
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_pool_of_one_is_not_stalled_by_the_check_inside_the_callers_transaction() {
    bounded(async {
        let db = TestDb::new("a2_direct_one").await;
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(runtime_options().database(&test_db_name()))
            .await
            .unwrap();
        let store = Store::new(pool.clone(), &db.schema, StoreOptions::default()).unwrap();
        // The first call of the store, inside the caller's transaction, which holds the
        // pool's only connection.
        let mut tx = pool.begin().await.unwrap();
        let t = Instant::now();
        let first = within(40, "enqueue_in", store.enqueue_in(&mut tx, job("k"))).await;
        let took = t.elapsed();
        tx.commit().await.unwrap();
        let second = within(40, "enqueue", store.enqueue(job("k"))).await;
        pool.close().await;
        assert!(
            first.is_ok() && second.is_ok() && took < Duration::from_secs(2),
            "direct pool of 1: enqueue_in {} after {took:?}, then enqueue {}",
            show(&first),
            show(&second)
        );
        assert_eq!(db.job_count().await, 2);
        db.drop().await;
    })
    .await
}
