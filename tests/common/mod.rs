//! Test support: a schema per test on a shared test database, small pools, a job
//! factory, and helpers to read the database directly.
#![allow(dead_code)]

use std::time::Duration;

use leasehold::{NewJob, OwnerId, Store, StoreOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

/// The database all tests share (each in its own schema). Override with LEASEHOLD_TEST_DB.
pub fn test_db_name() -> String {
    std::env::var("LEASEHOLD_TEST_DB").unwrap_or_else(|_| "leasehold_test".into())
}

pub fn base_options() -> PgConnectOptions {
    let host = std::env::var("PGHOST").unwrap_or_else(|_| "127.0.0.1".into());
    let port: u16 = std::env::var("PGPORT").ok().and_then(|p| p.parse().ok()).unwrap_or(5432);
    let user = std::env::var("PGUSER").unwrap_or_else(|_| "root".into());
    PgConnectOptions::new().host(&host).port(port).username(&user).log_statements(tracing::log::LevelFilter::Trace)
}

/// Create the shared test database if it does not exist (racing tests are fine).
pub async fn ensure_database() {
    let name = test_db_name();
    let mut admin = base_options().database("postgres").connect().await.expect("connect to postgres database");
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(&name)
        .fetch_one(&mut admin)
        .await
        .unwrap();
    if !exists {
        // Two tests may race here; the loser's "already exists" is harmless.
        let _ = sqlx::query(&format!("CREATE DATABASE \"{name}\"")).execute(&mut admin).await;
    }
}

/// One test's isolated world: its own schema, a small pool tagged with the test name.
pub struct TestDb {
    pub schema: String,
    pub pool: PgPool,
    pub store: Store,
    pub app_name: String,
}

impl TestDb {
    pub async fn new(test: &str) -> TestDb {
        Self::with_options(test, StoreOptions::default(), 4).await
    }

    pub async fn with_options(test: &str, options: StoreOptions, pool_size: u32) -> TestDb {
        ensure_database().await;
        let nonce: u32 = rand::random();
        let schema = format!("t_{}_{:08x}", test.chars().filter(|c| c.is_ascii_alphanumeric()).take(30).collect::<String>().to_lowercase(), nonce);
        let app_name = format!("lh-{schema}");
        let pool = pool_for(&app_name, pool_size).await;
        let store = Store::new(pool.clone(), &schema, options).unwrap();
        store.migrate().await.unwrap();
        TestDb { schema, pool, store, app_name }
    }

    /// A second pool on the same schema (another "worker"), tagged `suffix`.
    pub async fn other_pool(&self, suffix: &str, size: u32) -> PgPool {
        pool_for(&format!("{}-{suffix}", self.app_name), size).await
    }

    /// A second store handle over the same schema with its own pool.
    pub async fn other_store(&self, suffix: &str) -> Store {
        let pool = self.other_pool(suffix, 2).await;
        Store::new(pool, &self.schema, self.store.options().clone()).unwrap()
    }

    pub fn table(&self, name: &str) -> String {
        format!("\"{}\".{name}", self.schema)
    }

    pub async fn state_of(&self, id: leasehold::JobId) -> String {
        sqlx::query_scalar(&format!("SELECT state FROM {} WHERE id = $1", self.table("jobs")))
            .bind(id.0)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub async fn count_where(&self, table: &str, cond: &str) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM {} WHERE {cond}", self.table(table)))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// Terminate every backend whose application_name starts with `prefix`.
    pub async fn kill_backends(&self, prefix: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name LIKE $1 || '%' AND pid <> pg_backend_pid()",
        )
        .bind(prefix)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    pub async fn drop(self) {
        self.pool.close().await;
        let mut conn = base_options().database(&test_db_name()).connect().await.unwrap();
        let _ = sqlx::query(&format!("DROP SCHEMA \"{}\" CASCADE", self.schema)).execute(&mut conn).await;
    }
}

pub async fn pool_for(app_name: &str, size: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(base_options().database(&test_db_name()).application_name(app_name))
        .await
        .expect("connect to test database")
}

/// Job factory: a job of `kind` with a small JSON payload.
pub fn job(kind: &str) -> NewJob {
    NewJob::from_json(kind, serde_json::json!({ "n": 1 }))
}

pub fn keyed(kind: &str, key: &str, n: i64) -> NewJob {
    NewJob::from_json(kind, serde_json::json!({ "n": n })).with_key(key)
}

pub fn owner(name: &str) -> OwnerId {
    OwnerId::named(format!("{name}:{:08x}", rand::random::<u32>()))
}
