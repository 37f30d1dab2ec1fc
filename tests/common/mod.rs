//! Test support: a schema per test on a shared test database, small pools, a job
//! factory, and helpers to read the database directly.
//!
//! With `LEASEHOLD_TEST_RUNTIME_ROLE=1` (the README's test command runs the runtime
//! suites a second time so), each test's schema is migrated by the owner (the connecting
//! superuser) and everything else, the scheduler under test included, connects as
//! [`RUNTIME_ROLE`], holding exactly the grants of `leasehold::store::runtime_grants`:
//! the runtime suites prove the documented grants are enough for every path they take.
//! Fault injection that needs the owner (a trigger, a schema created at start) goes
//! through [`TestDb::owner`].
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
    let port: u16 = std::env::var("PGPORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(5432);
    let user = std::env::var("PGUSER").unwrap_or_else(|_| "root".into());
    PgConnectOptions::new()
        .host(&host)
        .port(port)
        .username(&user)
        .log_statements(tracing::log::LevelFilter::Trace)
}

/// The least-privileged role the tests connect as in runtime-role mode.
pub const RUNTIME_ROLE: &str = "leasehold_test_runtime";

/// The role tests connect as besides the owner: [`RUNTIME_ROLE`] when
/// `LEASEHOLD_TEST_RUNTIME_ROLE` is set (to anything but `0`), else none (the owner).
pub fn runtime_role() -> Option<&'static str> {
    match std::env::var("LEASEHOLD_TEST_RUNTIME_ROLE") {
        Ok(v) if !v.is_empty() && v != "0" => Some(RUNTIME_ROLE),
        _ => None,
    }
}

/// The options tests connect with: as [`runtime_role`] when set, else as the owner.
pub fn runtime_options() -> PgConnectOptions {
    match runtime_role() {
        Some(role) => base_options().username(role),
        None => base_options(),
    }
}

/// Create [`RUNTIME_ROLE`] if it does not exist (racing tests are fine). It holds no
/// grant of its own; each test's schema grants it `runtime_grants`.
async fn ensure_runtime_role(owner: &PgPool) {
    let created = sqlx::query(&format!("CREATE ROLE {RUNTIME_ROLE} LOGIN"))
        .execute(owner)
        .await;
    if let Err(e) = created {
        // 42710: it exists; 23505: another test created it at the same moment.
        let code = e
            .as_database_error()
            .and_then(|d| d.code())
            .unwrap_or_default();
        assert!(
            code == "42710" || code == "23505",
            "create role {RUNTIME_ROLE}: {e}"
        );
    }
}

/// Give [`RUNTIME_ROLE`] exactly the documented grants on `schema`: PUBLIC's default
/// EXECUTE on the schema's functions revoked, then `runtime_grants`.
pub async fn grant_runtime_role(owner: &PgPool, schema: &str) {
    ensure_runtime_role(owner).await;
    sqlx::query(&format!(
        "REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA \"{schema}\" FROM PUBLIC"
    ))
    .execute(owner)
    .await
    .unwrap();
    let grants = leasehold::store::runtime_grants(
        &leasehold::store::Schema::new(schema).unwrap(),
        RUNTIME_ROLE,
    );
    sqlx::raw_sql(&grants).execute(owner).await.unwrap();
}

/// Create the shared test database if it does not exist (racing tests are fine).
pub async fn ensure_database() {
    let name = test_db_name();
    let mut admin = base_options()
        .database("postgres")
        .connect()
        .await
        .expect("connect to postgres database");
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&name)
            .fetch_one(&mut admin)
            .await
            .unwrap();
    if !exists {
        // Two tests may race here; the loser's "already exists" is harmless.
        let _ = sqlx::query(&format!("CREATE DATABASE \"{name}\""))
            .execute(&mut admin)
            .await;
    }
}

/// One test's isolated world: its own schema, a small pool tagged with the test name.
pub struct TestDb {
    pub schema: String,
    /// Connected as the runtime role in runtime-role mode, else as the owner.
    pub pool: PgPool,
    pub store: Store,
    pub app_name: String,
    /// The schema owner's pool (the same pool as `pool` unless in runtime-role mode).
    pub owner: PgPool,
}

impl TestDb {
    pub async fn new(test: &str) -> TestDb {
        Self::with_options(test, StoreOptions::default(), 4).await
    }

    pub async fn with_options(test: &str, options: StoreOptions, pool_size: u32) -> TestDb {
        let mut db = Self::unmigrated(test, options, pool_size).await;
        db.store.migrate().await.unwrap();
        if let Some(role) = runtime_role() {
            grant_runtime_role(&db.owner, &db.schema).await;
            db.pool = pool_for(&db.app_name, pool_size).await;
            let connected_as: String = sqlx::query_scalar("SELECT current_user::text")
                .fetch_one(&db.pool)
                .await
                .unwrap();
            assert_eq!(
                connected_as, role,
                "the test pool connects as the runtime role"
            );
            db.store = Store::new(db.pool.clone(), &db.schema, db.store.options().clone()).unwrap();
        }
        db
    }

    /// Like [`TestDb::with_options`] but the schema does not exist yet (migration tests);
    /// connected as the owner in every mode.
    pub async fn unmigrated(test: &str, options: StoreOptions, pool_size: u32) -> TestDb {
        ensure_database().await;
        let nonce: u32 = rand::random();
        let schema = format!(
            "t_{}_{:08x}",
            test.chars()
                .filter(|c| c.is_ascii_alphanumeric())
                .take(30)
                .collect::<String>()
                .to_lowercase(),
            nonce
        );
        let app_name = format!("lh-{schema}");
        let pool = owner_pool_for(&app_name, pool_size).await;
        let store = Store::new(pool.clone(), &schema, options).unwrap();
        TestDb {
            schema,
            owner: pool.clone(),
            pool,
            store,
            app_name,
        }
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
        sqlx::query_scalar(&format!(
            "SELECT state FROM {} WHERE id = $1",
            self.table("jobs")
        ))
        .bind(id.0)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    pub async fn count_where(&self, table: &str, cond: &str) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {} WHERE {cond}",
            self.table(table)
        ))
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
        .fetch_one(&self.owner)
        .await
        .unwrap()
    }

    pub async fn drop(self) {
        self.pool.close().await;
        self.owner.close().await;
        let mut conn = base_options()
            .database(&test_db_name())
            .connect()
            .await
            .unwrap();
        let _ = sqlx::query(&format!("DROP SCHEMA \"{}\" CASCADE", self.schema))
            .execute(&mut conn)
            .await;
    }
}

/// A pool on the test database as [`runtime_role`] (the owner when none is set).
pub async fn pool_for(app_name: &str, size: u32) -> PgPool {
    connect_pool(runtime_options(), app_name, size).await
}

/// A pool on the test database as the owner, in every mode.
pub async fn owner_pool_for(app_name: &str, size: u32) -> PgPool {
    connect_pool(base_options(), app_name, size).await
}

async fn connect_pool(options: PgConnectOptions, app_name: &str, size: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options.database(&test_db_name()).application_name(app_name))
        .await
        .expect("connect to test database")
}

/// The schema versions this build ships, from the migrations' file names (`0020_name.sql`
/// is version 20), ascending. They need not be contiguous: each line of the schema's
/// history takes its own number.
pub fn shipped_versions() -> Vec<i32> {
    let mut shipped: Vec<i32> =
        std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "sql"))
            .map(|p| {
                p.file_name().unwrap().to_str().unwrap()[..4]
                    .parse()
                    .unwrap()
            })
            .collect();
    shipped.sort();
    shipped
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

// ---------------------------------------------------------------------------
// Store-test helpers: test clock, bounded waits, raw connections, a test effect
// store (no unique constraint, so a duplicate apply is countable), plan inspection.
// ---------------------------------------------------------------------------

use std::future::Future;

use chrono::{DateTime, Utc};
use leasehold::{Backoff, ClaimRequest, Generation, JobId};
use sqlx::PgConnection;

/// The lease the store tests claim with. Long: leases end by the `at` test clock, never
/// by waiting.
pub const LEASE: Duration = Duration::from_secs(30);

/// Upper bound on a whole test: every test stops by itself, even if a lock is never
/// released.
pub const TEST_DEADLINE: Duration = Duration::from_secs(180);

/// Run a test body with [`TEST_DEADLINE`].
pub async fn bounded<T>(body: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_DEADLINE, body)
        .await
        .expect("test exceeded its deadline (a lock or wait never ended)")
}

/// Await `fut` for at most `secs` seconds; panic naming `what` otherwise.
pub async fn within<T>(secs: u64, what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {secs}s"))
}

/// A claim request on the default queue with [`LEASE`].
pub fn claim_req(owner: &OwnerId, limit: i64) -> ClaimRequest {
    ClaimRequest::new(
        owner.clone(),
        vec![leasehold::config::DEFAULT_QUEUE.to_string()],
        limit,
        LEASE,
    )
}

/// Like [`claim_req`], as if the database time were `at`.
pub fn claim_at(owner: &OwnerId, limit: i64, at: DateTime<Utc>) -> ClaimRequest {
    let mut req = claim_req(owner, limit);
    req.at = Some(at);
    req
}

/// A handler-like loop: claim whatever is claimable (as if at [`far_future`]), one at a
/// time, complete it, until nothing is left. Returns what ran, in order.
pub async fn run_all(db: &TestDb, w: &OwnerId) -> Vec<leasehold::ClaimedJob> {
    let mut ran = Vec::new();
    loop {
        let mut got = db.store.claim(&claim_at(w, 1, far_future())).await.unwrap();
        let Some(j) = got.pop() else { break };
        assert_eq!(
            db.store.complete(&j.fence(), None).await.unwrap(),
            leasehold::CompleteOutcome::Completed
        );
        ran.push(j);
    }
    ran
}

/// Backoff without jitter: a retry is due exactly `secs` after the failure.
pub fn fixed_backoff(secs: u64) -> Backoff {
    Backoff {
        base: Duration::from_secs(secs),
        cap: Duration::from_secs(secs),
        jitter: 0.0,
    }
}

/// A test-clock instant far beyond any lease or backoff a test uses.
pub fn far_future() -> DateTime<Utc> {
    Utc::now() + chrono::Duration::days(3650)
}

pub fn secs_after(t: DateTime<Utc>, secs: i64) -> DateTime<Utc> {
    t + chrono::Duration::seconds(secs)
}

impl TestDb {
    /// A store over this schema with its own pool of `size` connections, tagged `suffix`.
    pub async fn other_store_sized(&self, suffix: &str, size: u32) -> Store {
        let pool = self.other_pool(suffix, size).await;
        Store::new(pool, &self.schema, self.store.options().clone()).unwrap()
    }

    /// The application_name of connections opened with `suffix` (for `kill_backends`).
    pub fn app_name_of(&self, suffix: &str) -> String {
        format!("{}-{suffix}", self.app_name)
    }

    /// A raw connection to the test database tagged `suffix` (a worker's own session).
    pub async fn raw_conn(&self, suffix: &str) -> PgConnection {
        runtime_options()
            .database(&test_db_name())
            .application_name(&self.app_name_of(suffix))
            .connect()
            .await
            .expect("raw connection")
    }

    /// Terminate the backends tagged `suffix` and wait until they are gone, so their
    /// locks are released before the test goes on.
    pub async fn kill_and_wait(&self, suffix: &str) -> i64 {
        let name = self.app_name_of(suffix);
        let killed = self.kill_backends(&name).await;
        within(10, "terminated backends to exit", async {
            loop {
                let left: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                )
                .bind(&name)
                .fetch_one(&self.pool)
                .await
                .unwrap();
                if left == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        killed
    }

    /// Wait until a backend tagged `suffix` is waiting for a lock.
    pub async fn wait_until_lock_waiting(&self, suffix: &str) {
        let name = self.app_name_of(suffix);
        within(10, "backend to wait for a lock", async {
            loop {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'",
                )
                .bind(&name)
                .fetch_one(&self.pool)
                .await
                .unwrap();
                if waiting > 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
    }

    /// Create the test effect store: deliberately no unique constraint, so a duplicate
    /// apply shows up as a second row.
    pub async fn create_effects_table(&self) {
        sqlx::query(&format!(
            "CREATE TABLE {} (effect_key text NOT NULL, job_id bigint NOT NULL, generation bigint NOT NULL, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())",
            self.table("test_effects")
        ))
        .execute(&self.owner)
        .await
        .unwrap();
    }

    /// Apply an effect inside the caller's transaction (a business write in the same
    /// database as the job, committed only if the job's completion in that transaction
    /// is accepted). An external effect goes through the library instead: see
    /// `common/handler.rs`.
    pub async fn apply_effect_in(
        &self,
        conn: &mut PgConnection,
        effect_key: &str,
        job: JobId,
        generation: Generation,
    ) {
        sqlx::query(&format!(
            "INSERT INTO {} (effect_key, job_id, generation) VALUES ($1, $2, $3)",
            self.table("test_effects")
        ))
        .bind(effect_key)
        .bind(job.0)
        .bind(generation.0)
        .execute(conn)
        .await
        .unwrap();
    }

    /// Rows in `test_effects`, all or for one effect key.
    pub async fn effect_count(&self, effect_key: Option<&str>) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {} WHERE $1::text IS NULL OR effect_key = $1",
            self.table("test_effects")
        ))
        .bind(effect_key)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    /// Generations that applied `effect_key`, in apply order.
    pub async fn effect_generations(&self, effect_key: &str) -> Vec<i64> {
        sqlx::query_scalar(&format!(
            "SELECT generation FROM {} WHERE effect_key = $1 ORDER BY applied_at",
            self.table("test_effects")
        ))
        .bind(effect_key)
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }

    /// The effect key `JobContext` makes for `job`'s `step`: with the job's own effect
    /// identity, read from its row.
    pub async fn effect_key(&self, job: JobId, step: &str) -> String {
        let identity: String = sqlx::query_scalar(&format!(
            "SELECT effect_identity::text FROM {} WHERE id = $1",
            self.table("jobs")
        ))
        .bind(job.0)
        .fetch_one(&self.pool)
        .await
        .unwrap();
        let identity = leasehold::EffectIdentity::parse(&identity).unwrap();
        leasehold::EffectKey::new(&identity, job, step).to_string()
    }

    /// Rows of `jobs` (and `job_keys`) — "nothing was written" checks.
    pub async fn job_count(&self) -> i64 {
        self.count_where("jobs", "true").await
    }
}

/// What one claim really read, from the transaction's own statistics
/// (`pg_stat_xact_user_tables`, and the per-index transaction counters): planner-independent evidence of the
/// claim's cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    pub claimed: i64,
    pub seq_scans: i64,
    /// Index entries read, over every index of `jobs`.
    pub index_tuples: i64,
    /// Heap rows fetched through indexes.
    pub heap_fetches: i64,
}

/// Claim up to `limit` jobs of `queues` through the schema's claim function in a
/// transaction that is rolled back, and report what it read.
pub async fn claim_footprint(db: &TestDb, queues: &[&str], limit: i32) -> Footprint {
    use sqlx::Connection;
    let mut conn = db.raw_conn("footprint").await;
    let mut tx = conn.begin().await.unwrap();
    let queues: Vec<String> = queues.iter().map(|q| q.to_string()).collect();
    let claimed: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".claim($1, NULL, $2, 9223372036854775807, true, 'footprint', NULL, 30, false)",
        db.schema
    ))
    .bind(&queues)
    .bind(limit)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    let (seq_scans, heap_fetches): (i64, i64) = sqlx::query_as(
        "SELECT coalesce(seq_scan, 0), coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables
         WHERE relid = to_regclass($1)",
    )
    .bind(db.table("jobs"))
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    let index_tuples: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(pg_stat_get_xact_tuples_returned(indexrelid)), 0)::int8
         FROM pg_index WHERE indrelid = to_regclass($1)",
    )
    .bind(db.table("jobs"))
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    conn.close().await.unwrap();
    Footprint {
        claimed,
        seq_scans,
        index_tuples,
        heap_fetches,
    }
}

/// Drop `db`'s schema and create it again under the same name (its owner migrates it;
/// the runtime role gets its grants again): ids restart at 1.
pub async fn create_schema_again(db: &TestDb) {
    sqlx::query(&format!("DROP SCHEMA \"{}\" CASCADE", db.schema))
        .execute(&db.owner)
        .await
        .unwrap();
    leasehold::Store::new(
        db.owner.clone(),
        &db.schema,
        leasehold::StoreOptions::default(),
    )
    .unwrap()
    .migrate()
    .await
    .unwrap();
    if runtime_role().is_some() {
        grant_runtime_role(&db.owner, &db.schema).await;
    }
}

/// `pg_dump` of `db`'s schema, as a plain SQL script (what an operator keeps as a backup).
pub fn dump_schema(db: &TestDb) -> String {
    let o = base_options();
    let out = std::process::Command::new("pg_dump")
        .args(["--no-owner", "--no-privileges", "--schema", &db.schema])
        .args(["--host", o.get_host(), "--port", &o.get_port().to_string()])
        .args(["--username", o.get_username(), "--dbname", &test_db_name()])
        .output()
        .expect("pg_dump runs");
    assert!(
        out.status.success(),
        "pg_dump: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A retention pass that deletes every done and cancelled job, however recently it
/// finished: `keep` and the floor both zero. Only for a test's own schema, where no
/// worker can still be reading an ending back (the floor's reason:
/// `leasehold::store::DEFAULT_PRUNE_FLOOR`).
pub async fn prune_now(
    store: &Store,
    batch: i64,
) -> leasehold::Result<leasehold::store::PruneReport> {
    let mut options = leasehold::store::PruneOptions::new(Duration::ZERO);
    options.floor = Duration::ZERO;
    options.batch = batch;
    store.prune_with(&options).await
}
