//! A database clock the test controls, with no seam in the library
//! ([`leasehold::testkit::clock`]): a schema of the test's own holds `now()`, `clock_timestamp()`, `statement_timestamp()` and
//! `transaction_timestamp()` functions that return PostgreSQL's own plus a shift the
//! test sets, and a pool whose sessions put that schema before `pg_catalog` in their
//! `search_path` calls those instead of the built-in ones. The library's SQL names its
//! tables by schema and calls the clock functions unqualified, so everything that pool
//! runs (and every connection a scheduler opens from the pool's options) reads the
//! shifted clock (the schema's column defaults are pointed at it too), while the host's
//! clock stays what it is: the database is "ahead" or
//! "behind", or in a daylight-saving night of the test's choosing, without sleeping.
//!
//! Include it next to `common` with `#[path = "common/clock.rs"] mod clock;`.
#![allow(dead_code)]

use chrono::{DateTime, Utc};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

use crate::common::{runtime_options, test_db_name, TestDb};

pub struct DbClock {
    schema: String,
    owner: PgPool,
    /// Sessions reading the shifted clock: give it to the scheduler under test.
    pub pool: PgPool,
}

impl DbClock {
    /// Install the clock beside `db`'s schema, unshifted.
    pub async fn install(db: &TestDb) -> DbClock {
        let schema = format!("{}_clock", db.schema);
        let sql = leasehold::testkit::clock::install_sql(&schema, &db.schema, "0");
        sqlx::raw_sql(&sql).execute(&db.owner).await.unwrap();
        let pool = PgPoolOptions::new()
            .max_connections(6)
            .acquire_timeout(std::time::Duration::from_secs(10))
            .connect_with(
                runtime_options()
                    .database(&test_db_name())
                    .application_name(&format!("{}-clock", db.app_name))
                    .options([("search_path", format!("{schema},pg_catalog"))]),
            )
            .await
            .unwrap();
        DbClock {
            schema,
            owner: db.owner.clone(),
            pool,
        }
    }

    /// Make the database's clock read `at` now (and run on from there).
    pub async fn set(&self, at: DateTime<Utc>) {
        sqlx::query(&format!(
            "UPDATE {}.shift SET secs = extract(epoch FROM $1 - pg_catalog.clock_timestamp())",
            self.schema
        ))
        .bind(at)
        .execute(&self.owner)
        .await
        .unwrap();
    }

    /// Make the database's clock run `secs` ahead of the real one (behind if negative).
    pub async fn shift(&self, secs: f64) {
        sqlx::query(&format!("UPDATE {}.shift SET secs = $1", self.schema))
            .bind(secs)
            .execute(&self.owner)
            .await
            .unwrap();
    }

    /// What the shifted clock reads.
    pub async fn now(&self) -> DateTime<Utc> {
        sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub async fn drop(self) {
        self.pool.close().await;
        let _ = sqlx::query(&format!("DROP SCHEMA {} CASCADE", self.schema))
            .execute(&self.owner)
            .await;
    }
}
