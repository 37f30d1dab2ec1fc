//! Forward-only migrations into the library's own schema, with its own version table.
//!
//! Several processes may start at once: a transaction-scoped advisory lock (keyed by
//! the schema name) serializes them, and each re-reads the applied versions under the
//! lock, so the second one finds nothing to do. The host's `_sqlx_migrations` table is
//! never touched.
//!
//! A schema that is current (or newer: a rolling deploy) is recognised by one read,
//! before any lock or DDL, so a scheduler can start as a runtime role that may not
//! create anything ([`runtime_grants`] is what that role needs). Only a missing
//! migration takes the lock and runs DDL; a role that may not is told to run the
//! migration as the schema's owner ([`Error::SchemaOutdated`]).

use sqlx::{Connection, PgConnection, PgPool};

use super::exec::On;
use super::pooler::CHECKED;
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
    (
        8,
        "unique jobs",
        include_str!("../../migrations/0008_unique_jobs.sql"),
    ),
    (
        9,
        "progress of running jobs",
        include_str!("../../migrations/0009_progress.sql"),
    ),
    (
        10,
        "periodic schedules and their fire times",
        include_str!("../../migrations/0010_periodic.sql"),
    ),
    (
        11,
        "the claim walks the entries ahead of a queue's first pending job once",
        include_str!("../../migrations/0011_claim_walks_once.sql"),
    ),
    (
        12,
        "the reaper's index keyed on the lease, not on the running state",
        include_str!("../../migrations/0012_leased_index.sql"),
    ),
    (
        13,
        "live schedulers and their heartbeats; parked jobs by id and jobs by key, for listings",
        include_str!("../../migrations/0013_schedulers.sql"),
    ),
    (
        14,
        "a key's history indexed once per job, not once per row version",
        include_str!("../../migrations/0014_ended_by_key.sql"),
    ),
    (
        15,
        "an expired lease counts as an attempt only when its start was recorded",
        include_str!("../../migrations/0015_recorded_starts.sql"),
    ),
    (
        16,
        "per-queue caps inside the one claim statement",
        include_str!("../../migrations/0016_claim_caps.sql"),
    ),
    (
        17,
        "results, progress and effect outcomes too deep to read back refused by the schema",
        include_str!("../../migrations/0017_readable_json.sql"),
    ),
    (
        18,
        "the schema's identity, the first part of every effect key",
        include_str!("../../migrations/0018_schema_identity.sql"),
    ),
    (
        19,
        "the versioned specs of periodic schedules, for builds whose specs differ",
        include_str!("../../migrations/0019_periodic_specs.sql"),
    ),
    (
        20,
        "retention bounded by what is due: done and cancelled jobs by when they may go, keys whose jobs retention deleted",
        include_str!("../../migrations/0020_bounded_retention.sql"),
    ),
    (
        21,
        "every job's own effect identity, the first part of its effect keys",
        include_str!("../../migrations/0021_job_effect_identity.sql"),
    ),
    (
        22,
        "retention's jobs scan resumes after the last job deleted: done and cancelled jobs by when they may go, then id",
        include_str!("../../migrations/0022_prune_resumes.sql"),
    ),
    (
        23,
        "a batch of keyed completions waits a bounded turn for a job row another session holds, or skips it as it skips a held key row",
        include_str!("../../migrations/0023_completions_skip_held_rows.sql"),
    ),
];

/// The newest schema version this build knows.
pub const SCHEMA_VERSION: i32 = 23;

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

/// The grants of the runtime role, run by the schema's owner; `{r}` is the role.
const RUNTIME_GRANTS: &str = "GRANT USAGE ON SCHEMA {s} TO {r};
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {s} TO {r};
REVOKE INSERT, UPDATE, DELETE ON {s}.leasehold_migrations FROM {r};
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {s} TO {r};
ALTER DEFAULT PRIVILEGES IN SCHEMA {s} GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {r};
ALTER DEFAULT PRIVILEGES IN SCHEMA {s} GRANT EXECUTE ON FUNCTIONS TO {r};
";

/// What a role needs to run a scheduler and the admin calls on `schema`, and nothing
/// more, as SQL for the schema's owner (the role that runs
/// [`Store::migrate`](crate::Store::migrate)) to run after migrating: usage on the
/// schema; read and write on its tables, read only on `leasehold_migrations`; execute on
/// its functions (PUBLIC has that by default, but not where it was revoked); and
/// default privileges, so the tables and functions a later migration by the same owner
/// creates are granted too. No sequence: every id is an identity column, whose sequence
/// needs no grant. Idempotent: run it again after a migration if the default privileges
/// were left out. The README ("Running with least privilege") quotes it for
/// `runtime_grants(&Schema::new("leasehold")?, "leasehold_app")` and says which
/// statement needs which grant.
///
/// `role` is quoted here as an identifier (so `"App"` keeps its case).
pub fn runtime_grants(schema: &Schema, role: &str) -> String {
    let role = format!("\"{}\"", role.replace('"', "\"\""));
    format!(
        "-- leasehold: the grants of runtime role {role} on schema {}; run as the schema's owner, after `leasehold migrate`.\n{}",
        schema.quoted(),
        schema.render(RUNTIME_GRANTS).replace("{r}", &role)
    )
}

/// The versions applied to `schema`; none when it (or its version table) does not
/// exist yet. A plain read: no lock, no DDL.
async fn applied_versions(
    conn: &mut PgConnection,
    schema: &Schema,
    pooled: bool,
) -> Result<Vec<i32>> {
    let fresh: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NULL")
        .bind(schema.render("{s}.leasehold_migrations"))
        .fetch_one(On {
            pooler: &CHECKED,
            conn: &mut *conn,
            pooled,
            lock_wait: None,
        })
        .await?;
    if fresh {
        return Ok(Vec::new());
    }
    Ok(
        sqlx::query_scalar(&schema.render("SELECT version FROM {s}.leasehold_migrations"))
            .fetch_all(On {
                pooler: &CHECKED,
                conn: &mut *conn,
                pooled,
                lock_wait: None,
            })
            .await?,
    )
}

/// The migrations of this build that `applied` lacks, in order. Versions newer than the
/// build (a rolling deploy's) are not its business.
fn missing(
    applied: &[i32],
) -> impl Iterator<Item = &'static (i32, &'static str, &'static str)> + '_ {
    MIGRATIONS.iter().filter(|m| !applied.contains(&m.0))
}

async fn schema_exists(conn: &mut PgConnection, schema: &Schema, pooled: bool) -> Result<bool> {
    Ok(
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
            .bind(schema.name())
            .fetch_one(On {
                pooler: &CHECKED,
                conn: &mut *conn,
                pooled,
                lock_wait: None,
            })
            .await?,
    )
}

/// Apply every missing migration to `schema`. When none is missing (the schema is
/// current, or newer than this build), one read and no lock, no DDL: a runtime role
/// without CREATE starts. Otherwise the missing ones are applied in one transaction;
/// a role that may not is refused with [`Error::SchemaOutdated`].
pub async fn migrate(pool: &PgPool, schema: &Schema, pooled: bool) -> Result<()> {
    let mut conn = pool.acquire().await?;
    let applied = applied_versions(&mut conn, schema, pooled).await?;
    if missing(&applied).next().is_none() {
        return Ok(());
    }
    let found = applied.iter().copied().max().unwrap_or(0);
    apply(&mut conn, schema, pooled).await.map_err(|e| match e {
        Error::Database(source) | Error::Migration { source, .. } if is_denied(&source) => {
            Error::SchemaOutdated {
                schema: schema.name().to_string(),
                found,
                needed: SCHEMA_VERSION,
                source,
            }
        }
        e => e,
    })
}

/// `insufficient_privilege`: the role may not create the schema, a table or a function.
fn is_denied(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("42501"))
}

/// The locked half of [`migrate`]: re-read under the lock, create what is missing.
async fn apply(conn: &mut PgConnection, schema: &Schema, pooled: bool) -> Result<()> {
    let mut tx = conn.begin().await?;
    sqlx::query(LOCK)
        .bind(schema.name())
        .execute(On {
            pooler: &CHECKED,
            conn: &mut tx,
            pooled,
            lock_wait: None,
        })
        .await?;
    // Only when missing: CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even
    // when the schema exists, which an owner given its schema by a DBA may not have.
    if !schema_exists(&mut tx, schema, pooled).await? {
        sqlx::query(&schema.render("CREATE SCHEMA IF NOT EXISTS {s}"))
            .execute(On {
                pooler: &CHECKED,
                conn: &mut tx,
                pooled,
                lock_wait: None,
            })
            .await?;
    }
    let applied = applied_versions(&mut tx, schema, pooled).await?;
    if applied.is_empty() {
        sqlx::query(&schema.render(VERSION_TABLE))
            .execute(On {
                pooler: &CHECKED,
                conn: &mut tx,
                pooled,
                lock_wait: None,
            })
            .await?;
        sqlx::Executor::execute(
            On {
                pooler: &CHECKED,
                conn: &mut tx,
                pooled,
                lock_wait: None,
            },
            sqlx::raw_sql(&schema.render(VERSION_TABLE_COMMENTS)),
        )
        .await?;
    }
    for &(version, description, template) in missing(&applied) {
        let sql = template.replace("__SCHEMA__", schema.quoted());
        // Through the trait: `raw_sql(..).execute(On { conn: &mut *tx, pooled })` makes this future !Send
        // (a rustc higher-ranked lifetime limitation), and callers spawn `migrate()`.
        sqlx::Executor::execute(
            On {
                pooler: &CHECKED,
                conn: &mut tx,
                pooled,
                lock_wait: None,
            },
            sqlx::raw_sql(&sql),
        )
        .await
        .map_err(|source| Error::Migration { version, source })?;
        sqlx::query(&schema.render(RECORD_VERSION))
            .bind(version)
            .bind(description)
            .execute(On {
                pooler: &CHECKED,
                conn: &mut tx,
                pooled,
                lock_wait: None,
            })
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
/// that takes the same advisory lock, creates the schema (if it does not exist) and the
/// version table (if missing), applies the missing migrations and records them, so a
/// later [`migrate`] finds nothing to do. Reads the applied versions; writes nothing.
/// When nothing is missing, as [`migrate`] then runs nothing, only a comment saying so.
pub async fn script(pool: &PgPool, schema: &Schema, pooled: bool) -> Result<String> {
    let mut conn = pool.acquire().await?;
    let applied = applied_versions(&mut conn, schema, pooled).await?;
    let mut out = format!(
        "-- leasehold schema {}: the migrations not yet applied (version {SCHEMA_VERSION} is the newest).\n",
        schema.quoted()
    );
    if missing(&applied).next().is_none() {
        out += "-- none: the schema is current.\n";
        return Ok(out);
    }
    out += "BEGIN;\n";
    // Schema names are validated identifiers (a-z, 0-9, _), safe inside a literal.
    out += &LOCK.replace("$1", &format!("'{}'", schema.name()));
    out += ";\n";
    if !schema_exists(&mut conn, schema, pooled).await? {
        out += &schema.render("CREATE SCHEMA IF NOT EXISTS {s};\n");
    }
    if applied.is_empty() {
        out += &schema.render(VERSION_TABLE);
        out += ";\n";
        out += &schema.render(VERSION_TABLE_COMMENTS);
        out += "\n";
    }
    for &(version, description, template) in missing(&applied) {
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
