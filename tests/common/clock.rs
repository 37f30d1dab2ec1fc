//! A database clock the test controls, with no seam in the library: a schema of the
//! test's own holds `now()`, `clock_timestamp()`, `statement_timestamp()` and
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
        let s = &schema;
        let mut sql = format!(
            "CREATE SCHEMA {s};
             CREATE TABLE {s}.shift (secs float8 NOT NULL);
             INSERT INTO {s}.shift VALUES (0);
             GRANT USAGE ON SCHEMA {s} TO PUBLIC;
             GRANT SELECT ON {s}.shift TO PUBLIC;"
        );
        for (f, volatility) in [
            ("now", "STABLE"),
            ("transaction_timestamp", "STABLE"),
            ("statement_timestamp", "STABLE"),
            ("clock_timestamp", "VOLATILE"),
        ] {
            sql.push_str(&format!(
                "CREATE FUNCTION {s}.{f}() RETURNS timestamptz LANGUAGE sql {volatility} AS
                 $$ SELECT pg_catalog.{f}()
                      + pg_catalog.make_interval(secs => (SELECT secs FROM {s}.shift)) $$;
                 GRANT EXECUTE ON FUNCTION {s}.{f}() TO PUBLIC;"
            ));
        }
        // Column defaults were bound to the built-in functions when the tables were
        // created: point them at the test's, so every time the schema writes is read
        // from one clock (retention, say, compares `enqueued_at` with `clock_timestamp()`).
        // The catalogs are read for this schema's tables only, and each default is
        // deparsed in the loop's body, never in a filter the planner may run first:
        // deparsing a default of another test's table while that test drops its schema
        // fails ("cache lookup failed for function"), which `information_schema.columns`
        // (deparsing every default in the database) ran into.
        sql.push_str(&format!(
            "DO $do$ DECLARE r record; def text; BEGIN
               FOR r IN SELECT c.relname, a.attname, d.adbin, d.adrelid
                        FROM pg_catalog.pg_attrdef d
                        JOIN pg_catalog.pg_class c ON c.oid = d.adrelid
                        JOIN pg_catalog.pg_attribute a
                          ON a.attrelid = d.adrelid AND a.attnum = d.adnum
                        WHERE c.relnamespace = '{t}'::regnamespace LOOP
                 def := pg_catalog.pg_get_expr(r.adbin, r.adrelid);
                 CONTINUE WHEN def !~ '(now|clock_timestamp)[(][)]';
                 EXECUTE format('ALTER TABLE %I.%I ALTER COLUMN %I SET DEFAULT %s',
                   '{t}', r.relname, r.attname,
                   replace(replace(def, 'clock_timestamp()', '{s}.clock_timestamp()'),
                           'now()', '{s}.now()'));
               END LOOP;
             END $do$;",
            t = db.schema
        ));
        sqlx::raw_sql(&sql).execute(&db.owner).await.unwrap();
        let pool = PgPoolOptions::new()
            .max_connections(6)
            .acquire_timeout(std::time::Duration::from_secs(10))
            .connect_with(
                runtime_options()
                    .database(&test_db_name())
                    .application_name(&format!("{}-clock", db.app_name))
                    .options([("search_path", format!("{s},pg_catalog"))]),
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
