//! Forward-only migrations into the library's own schema, with its own version table.
//!
//! Several processes may start at once: a transaction-scoped advisory lock (keyed by
//! the schema name) serializes them, and each re-reads the applied versions under the
//! lock, so the second one finds nothing to do. The host's `_sqlx_migrations` table is
//! never touched.

use sqlx::{Connection, PgPool};

use super::schema::Schema;
use crate::error::{Error, Result};

/// (version, description, SQL template). Append only; never edit an applied entry.
const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "jobs, keys, lease expiries, history, effect ledger",
        include_str!("../../migrations/0001_jobs.sql"),
    ),
    (
        2,
        "cancel requests for running jobs, key-sequence floors",
        include_str!("../../migrations/0002_hardening.sql"),
    ),
    (
        3,
        "a claim function whose plan needs no statistics; the claim index by queue",
        include_str!("../../migrations/0003_claim.sql"),
    ),
    (
        4,
        "held and dead jobs by queue, for the metrics' gauges",
        include_str!("../../migrations/0004_parked.sql"),
    ),
];

/// The newest schema version this build knows.
pub const SCHEMA_VERSION: i32 = 4;

/// Apply every missing migration to `schema`. A no-op when already applied.
pub async fn migrate(pool: &PgPool, schema: &Schema) -> Result<()> {
    let mut conn = pool.acquire().await?;
    let mut tx = conn.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('leasehold.migrate'), hashtext($1))")
        .bind(schema.name())
        .execute(&mut *tx)
        .await?;
    sqlx::query(&schema.render("CREATE SCHEMA IF NOT EXISTS {s}"))
        .execute(&mut *tx)
        .await?;
    let fresh: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NULL")
        .bind(schema.render("{s}.leasehold_migrations"))
        .fetch_one(&mut *tx)
        .await?;
    sqlx::query(&schema.render(
        "CREATE TABLE IF NOT EXISTS {s}.leasehold_migrations (
             version     integer PRIMARY KEY,
             description text NOT NULL,
             applied_at  timestamptz NOT NULL DEFAULT now())",
    ))
    .execute(&mut *tx)
    .await?;
    if fresh {
        // Every column of the schema is documented, this table's too.
        sqlx::Executor::execute(
            &mut *tx,
            sqlx::raw_sql(&schema.render(
                "COMMENT ON TABLE {s}.leasehold_migrations IS 'Schema versions applied by leasehold (its own table; the host''s _sqlx_migrations is never used).';
                 COMMENT ON COLUMN {s}.leasehold_migrations.version IS 'Migration version, applied in ascending order, each once.';
                 COMMENT ON COLUMN {s}.leasehold_migrations.description IS 'What the migration created or changed.';
                 COMMENT ON COLUMN {s}.leasehold_migrations.applied_at IS 'Database time the migration was applied.';",
            )),
        )
        .await?;
    }
    let applied: Vec<i32> =
        sqlx::query_scalar(&schema.render("SELECT version FROM {s}.leasehold_migrations"))
            .fetch_all(&mut *tx)
            .await?;
    for &(version, description, template) in MIGRATIONS {
        if applied.contains(&version) {
            continue;
        }
        let sql = template.replace("__SCHEMA__", schema.quoted());
        // Through the trait: `raw_sql(..).execute(&mut *tx)` makes this future !Send
        // (a rustc higher-ranked lifetime limitation), and callers spawn `migrate()`.
        sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(&sql))
            .await
            .map_err(|source| Error::Migration { version, source })?;
        sqlx::query(
            &schema.render(
                "INSERT INTO {s}.leasehold_migrations (version, description) VALUES ($1, $2)",
            ),
        )
        .bind(version)
        .bind(description)
        .execute(&mut *tx)
        .await?;
        tracing::info!(
            schema = schema.name(),
            version,
            description,
            "leasehold migration applied"
        );
    }
    tx.commit().await?;
    Ok(())
}
