//! Forward-only migrations into the library's own schema, with its own version table.
//!
//! Several processes may start at once: a transaction-scoped advisory lock (keyed by
//! the schema name) serializes them, and each re-reads the applied versions under the
//! lock, so the second one finds nothing to do. The host's `_sqlx_migrations` table is
//! never touched.

use sqlx::{Connection, PgConnection, PgPool};

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
    (
        5,
        "lease expiries by time, for the recent expiries in queue statistics",
        include_str!("../../migrations/0005_recent_expiries.sql"),
    ),
    (
        6,
        "paused queues",
        include_str!("../../migrations/0006_paused_queues.sql"),
    ),
    (
        7,
        "snoozes",
        include_str!("../../migrations/0007_snoozes.sql"),
    ),
];

/// The newest schema version this build knows.
pub const SCHEMA_VERSION: i32 = 7;

/// Serializes migrations of one schema across processes, and a printed script with them.
const LOCK: &str = "SELECT pg_advisory_xact_lock(hashtext('leasehold.migrate'), hashtext($1))";

const VERSION_TABLE: &str = "CREATE TABLE IF NOT EXISTS {s}.leasehold_migrations (
    version     integer PRIMARY KEY,
    description text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now())";

// Every column of the schema is documented, this table's too.
const VERSION_TABLE_COMMENTS: &str = "COMMENT ON TABLE {s}.leasehold_migrations IS 'Schema versions applied by leasehold (its own table; the host''s _sqlx_migrations is never used).';
COMMENT ON COLUMN {s}.leasehold_migrations.version IS 'Migration version, applied in ascending order, each once.';
COMMENT ON COLUMN {s}.leasehold_migrations.description IS 'What the migration created or changed.';
COMMENT ON COLUMN {s}.leasehold_migrations.applied_at IS 'Database time the migration was applied.';";

const RECORD_VERSION: &str =
    "INSERT INTO {s}.leasehold_migrations (version, description) VALUES ($1, $2)";

/// The versions applied to `schema`; none when it has no version table yet.
async fn applied_versions(conn: &mut PgConnection, schema: &Schema) -> Result<Vec<i32>> {
    let fresh: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NULL")
        .bind(schema.render("{s}.leasehold_migrations"))
        .fetch_one(&mut *conn)
        .await?;
    if fresh {
        return Ok(Vec::new());
    }
    Ok(
        sqlx::query_scalar(&schema.render("SELECT version FROM {s}.leasehold_migrations"))
            .fetch_all(&mut *conn)
            .await?,
    )
}

/// Apply every missing migration to `schema`. A no-op when already applied.
pub async fn migrate(pool: &PgPool, schema: &Schema) -> Result<()> {
    let mut conn = pool.acquire().await?;
    let mut tx = conn.begin().await?;
    sqlx::query(LOCK)
        .bind(schema.name())
        .execute(&mut *tx)
        .await?;
    sqlx::query(&schema.render("CREATE SCHEMA IF NOT EXISTS {s}"))
        .execute(&mut *tx)
        .await?;
    let applied = applied_versions(&mut tx, schema).await?;
    if applied.is_empty() {
        sqlx::query(&schema.render(VERSION_TABLE))
            .execute(&mut *tx)
            .await?;
        sqlx::Executor::execute(
            &mut *tx,
            sqlx::raw_sql(&schema.render(VERSION_TABLE_COMMENTS)),
        )
        .await?;
    }
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
        sqlx::query(&schema.render(RECORD_VERSION))
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

/// The SQL [`migrate`] would run on `schema` now, as one script for teams that apply
/// migrations themselves (`psql -1 -f`, or their own migration tool): one transaction
/// that takes the same advisory lock, creates the schema and the version table if
/// missing, applies the missing migrations and records them, so a later [`migrate`]
/// finds nothing to do. Reads the applied versions; writes nothing. Empty of
/// migrations (but still valid) when the schema is current.
pub async fn script(pool: &PgPool, schema: &Schema) -> Result<String> {
    let mut conn = pool.acquire().await?;
    let applied = applied_versions(&mut conn, schema).await?;
    let mut out = format!(
        "-- leasehold schema {}: the migrations not yet applied (version {SCHEMA_VERSION} is the newest).\nBEGIN;\n",
        schema.quoted()
    );
    // Schema names are validated identifiers (a-z, 0-9, _), safe inside a literal.
    out += &LOCK.replace("$1", &format!("'{}'", schema.name()));
    out += ";\n";
    out += &schema.render("CREATE SCHEMA IF NOT EXISTS {s};\n");
    if applied.is_empty() {
        out += &schema.render(VERSION_TABLE);
        out += ";\n";
        out += &schema.render(VERSION_TABLE_COMMENTS);
        out += "\n";
    }
    for &(version, description, template) in MIGRATIONS {
        if applied.contains(&version) {
            continue;
        }
        out += &format!("\n-- migration {version}: {description}\n");
        out += template.replace("__SCHEMA__", schema.quoted()).trim_end();
        out += "\n";
        out += &schema
            .render(RECORD_VERSION)
            .replace("$1", &version.to_string())
            .replace("$2", &format!("'{}'", description.replace('\'', "''")));
        out += ";\n";
    }
    out += "COMMIT;\n";
    Ok(out)
}
