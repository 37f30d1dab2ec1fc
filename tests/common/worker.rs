//! Runtime-test support: a scheduler config with short durations, a handler that logs
//! every run into the test schema, a database of its own for tests that count or kill
//! the scheduler's connections by name, and a second scheduler process (this test
//! binary re-executed).
//!
//! Include it next to `common` with `#[path = "common/worker.rs"] mod worker;`.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use leasehold::{Backoff, Config, Handler, JobContext, JobError, Scheduler, Store, StoreOptions};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

use crate::common::{
    base_options, ensure_database, grant_runtime_role, pool_for, runtime_options, runtime_role,
    test_db_name, within, TestDb,
};

/// Set in a re-executed test binary: the schema its worker serves.
pub const SCHEMA_VAR: &str = "LEASEHOLD_WORKER_SCHEMA";
/// The worker's name in the run log.
pub const NAME_VAR: &str = "LEASEHOLD_WORKER_NAME";
/// The worker's lease, in milliseconds.
pub const LEASE_VAR: &str = "LEASEHOLD_WORKER_LEASE_MS";
/// The worker process's `Config::concurrency` (default: [`fast_config`]'s).
pub const CONCURRENCY_VAR: &str = "LEASEHOLD_WORKER_CONCURRENCY";

/// Pool size of every runtime test (the scheduler adds three connections of its own).
pub const POOL: u32 = 6;

/// Short durations: lease 2 s, renewal 500 ms, reaper 300 ms, polling 20..200 ms,
/// backoff from 50 ms, grace 2 s.
pub fn fast_config(schema: &str) -> Config {
    let mut c = Config {
        schema: schema.to_string(),
        ..Config::default()
    };
    c.concurrency = 8;
    c.lease = Duration::from_secs(2);
    c.renew_interval = Duration::from_millis(500);
    c.reaper_interval = Duration::from_millis(300);
    c.poll_interval_min = Duration::from_millis(20);
    c.poll_interval_max = Duration::from_millis(200);
    c.retry.backoff = Backoff {
        base: Duration::from_millis(50),
        cap: Duration::from_secs(1),
        jitter: 0.2,
    };
    c.shutdown_grace = Duration::from_secs(2);
    c.sequencer_idle = Duration::from_millis(500);
    c
}

/// [`fast_config`] with another lease (renewal at a quarter of it).
pub fn config_with_lease(schema: &str, lease: Duration) -> Config {
    let mut c = fast_config(schema);
    c.lease = lease;
    c.renew_interval = lease / 4;
    c
}

/// Run a test body in an actix System of its own, as `#[actix_rt::test]` does, but
/// contain a failure: the body runs as a task, so its panic is caught inside the
/// runtime, and the System is then leaked rather than dropped. Dropping it would drop
/// the scheduler's tasks (holding pool connections) outside any runtime; sqlx panics on
/// that, and a panic during the unwind aborts the whole test binary, taking the other
/// tests with it.
pub fn run_in_system<F>(body: F)
where
    F: std::future::Future<Output = ()> + 'static,
{
    // `RUST_LOG=leasehold=debug cargo test ...` shows what the scheduler did.
    if let Ok(filter) = std::env::var("RUST_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_test_writer()
            .try_init();
    }
    let system = actix::System::new();
    match system.block_on(async move { actix::spawn(body).await }) {
        Ok(()) => drop(system),
        Err(failed) => {
            std::mem::forget(system);
            match failed.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                Err(e) => panic!("test body did not finish: {e}"),
            }
        }
    }
}

/// Poll `cond` every 20 ms until it holds; panic naming `what` after `secs` seconds.
pub async fn wait_until<F, Fut>(secs: u64, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    within(secs, what, async {
        while !cond().await {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

// ---------------------------------------------------------------------------
// The logging handler.
// ---------------------------------------------------------------------------

/// Tables the logging handler and the worker processes use, in the test schema:
/// `run_log` (one row per run: started at its start, ended at its end, both by the
/// database clock), `workers` (each scheduler announces its owner id) and `control`
/// (a row tells worker processes to stop).
pub async fn create_run_tables(db: &TestDb) {
    for ddl in [
        "CREATE TABLE {s}.run_log (
            run_id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            job_id     bigint      NOT NULL,
            job_key    text,
            key_seq    bigint,
            n          bigint      NOT NULL,
            generation bigint      NOT NULL,
            worker     text        NOT NULL,
            started    timestamptz NOT NULL DEFAULT clock_timestamp(),
            ended      timestamptz)",
        "CREATE TABLE {s}.workers (name text PRIMARY KEY, owner text NOT NULL, pid int NOT NULL)",
        "CREATE TABLE {s}.control (stop boolean NOT NULL)",
    ] {
        // The application's tables are its owner's; the runtime role reaches them
        // through the schema's default privileges (see `runtime_grants`).
        sqlx::query(&ddl.replace("{s}", &format!("\"{}\"", db.schema)))
            .execute(&db.owner)
            .await
            .unwrap();
    }
}

/// A logged job's payload: its position within its key (or among unkeyed jobs) in
/// enqueue order, and how long it works.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Step {
    pub n: i64,
    pub sleep_ms: u64,
    /// Kill the whole process (abort) right after logging the run: a handler that takes
    /// its process down with it.
    #[serde(default)]
    pub abort: bool,
}

/// Logs each run into `run_log`: a row at the start, `ended` set at the end.
pub struct Logged {
    pool: PgPool,
    schema: String,
    worker: String,
}

impl Logged {
    pub fn new(pool: PgPool, schema: &str, worker: &str) -> Self {
        Logged {
            pool,
            schema: format!("\"{schema}\""),
            worker: worker.to_string(),
        }
    }
}

impl Handler for Logged {
    type Payload = Step;
    type Output = ();
    const KIND: &'static str = "logged";

    async fn run(&self, ctx: JobContext, step: Step) -> Result<(), JobError> {
        let run_id: i64 = sqlx::query_scalar(&format!(
            "INSERT INTO {}.run_log (job_id, job_key, key_seq, n, generation, worker)
             VALUES ($1, $2, $3, $4, $5, $6) RETURNING run_id",
            self.schema
        ))
        .bind(ctx.job_id().0)
        .bind(ctx.key())
        .bind(ctx.job().key_seq)
        .bind(step.n)
        .bind(ctx.generation().0)
        .bind(&self.worker)
        .fetch_one(&self.pool)
        .await?;
        if step.abort {
            std::process::abort();
        }
        if step.sleep_ms > 0 {
            tokio::time::sleep(Duration::from_millis(step.sleep_ms)).await;
        }
        sqlx::query(&format!(
            "UPDATE {}.run_log SET ended = clock_timestamp() WHERE run_id = $1",
            self.schema
        ))
        .bind(run_id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}

/// Start a scheduler running [`Logged`] as `worker`, and announce it in `workers`.
pub async fn start_logged(pool: &PgPool, config: Config, worker: &str) -> Scheduler {
    let schema = config.schema.clone();
    let scheduler = Scheduler::builder(pool.clone(), config)
        .register(Logged::new(pool.clone(), &schema, worker))
        .start()
        .await
        .expect("start scheduler");
    sqlx::query(&format!(
        "INSERT INTO \"{schema}\".workers (name, owner, pid) VALUES ($1, $2, $3)"
    ))
    .bind(worker)
    .bind(scheduler.owner().as_str())
    .bind(std::process::id() as i32)
    .execute(pool)
    .await
    .unwrap();
    scheduler
}

// ---------------------------------------------------------------------------
// A second scheduler process.
// ---------------------------------------------------------------------------

/// Body of the worker entry test. Without [`SCHEMA_VAR`] it does nothing (the entry
/// passes in a normal test run). With it, it runs a [`Logged`] scheduler on that schema
/// until a row appears in `control`, the parent process goes away, or 170 s pass.
pub fn worker_main() {
    let Ok(schema) = std::env::var(SCHEMA_VAR) else {
        return;
    };
    let name = std::env::var(NAME_VAR).unwrap_or_else(|_| "child".into());
    let lease = std::env::var(LEASE_VAR)
        .ok()
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis)
        .unwrap_or(Duration::from_secs(2));
    let _ = tracing_subscriber::fmt()
        .with_env_filter("leasehold=info")
        .try_init();
    actix::System::new().block_on(async move {
        let pool = pool_for(&format!("lh-{schema}-{name}"), POOL).await;
        let parent = unsafe { libc::getppid() };
        let mut config = config_with_lease(&schema, lease);
        if let Some(n) = std::env::var(CONCURRENCY_VAR)
            .ok()
            .and_then(|v| v.parse().ok())
        {
            config.concurrency = n;
        }
        let scheduler = start_logged(&pool, config, &name).await;
        eprintln!("worker {name}: scheduler {} started", scheduler.owner());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(170);
        loop {
            let stop: bool = sqlx::query_scalar(&format!(
                "SELECT EXISTS (SELECT 1 FROM \"{schema}\".control WHERE stop)"
            ))
            .fetch_one(&pool)
            .await
            .unwrap_or(true);
            if stop
                || tokio::time::Instant::now() > deadline
                || unsafe { libc::getppid() } != parent
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let report = scheduler.shutdown().await.expect("worker shutdown");
        eprintln!(
            "worker {name}: stopped ({} drained, {} cancelled)",
            report.drained, report.cancelled
        );
        pool.close().await;
    });
}

/// A worker process: this test binary re-executed with `--exact <entry>`. Killed when
/// dropped.
pub struct ChildWorker {
    pub name: String,
    child: Child,
    log: PathBuf,
}

impl ChildWorker {
    /// Start the worker entry test `entry` (its full name in this test binary) on `schema`.
    pub fn spawn(entry: &str, schema: &str, name: &str, lease: Duration) -> ChildWorker {
        Self::spawn_with(entry, schema, name, lease, None)
    }

    /// [`ChildWorker::spawn`] with the worker's concurrency (`None`: the default).
    pub fn spawn_with(
        entry: &str,
        schema: &str,
        name: &str,
        lease: Duration,
        concurrency: Option<usize>,
    ) -> ChildWorker {
        let exe = std::env::current_exe().expect("current test binary");
        let log = std::env::temp_dir().join(format!("leasehold-{schema}-{name}.log"));
        let out = std::fs::File::create(&log).expect("worker log file");
        let child = Command::new(exe)
            .args([entry, "--exact", "--nocapture", "--test-threads", "1"])
            .env(SCHEMA_VAR, schema)
            .env(NAME_VAR, name)
            .env(LEASE_VAR, lease.as_millis().to_string())
            .env(
                CONCURRENCY_VAR,
                concurrency.map(|n| n.to_string()).unwrap_or_default(),
            )
            .env("LEASEHOLD_TEST_DB", test_db_name())
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("spawn worker process");
        ChildWorker {
            name: name.to_string(),
            child,
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the worker printed so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Wait until the worker's scheduler announced itself; returns its owner id.
    pub async fn ready(&mut self, db: &TestDb) -> String {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let owner: Option<String> = sqlx::query_scalar(&format!(
                "SELECT owner FROM {} WHERE name = $1",
                db.table("workers")
            ))
            .bind(&self.name)
            .fetch_optional(&db.pool)
            .await
            .unwrap();
            if let Some(owner) = owner {
                return owner;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "worker {} exited before starting ({status}):\n{}",
                    self.name,
                    self.output()
                );
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "worker {} did not start within 60s:\n{}",
                self.name,
                self.output()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL, then reap the process.
    pub fn kill(&mut self) -> ExitStatus {
        self.child.kill().expect("kill worker");
        self.child.wait().expect("wait for killed worker")
    }

    /// Wait for the process to exit by itself, at most `limit`.
    pub async fn exited(&mut self, limit: Duration) -> ExitStatus {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "worker {} did not exit within {limit:?}:\n{}",
                self.name,
                self.output()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for ChildWorker {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Tell every worker process of the schema to stop.
pub async fn stop_workers(db: &TestDb) {
    sqlx::query(&format!(
        "INSERT INTO {} (stop) VALUES (true)",
        db.table("control")
    ))
    .execute(&db.pool)
    .await
    .unwrap();
}

// ---------------------------------------------------------------------------
// A database of its own: the scheduler names its own connections
// (`leasehold-listener <pid>:<nonce>`, `leasehold-renewer …`, `leasehold-reaper …`),
// and a test that counts or kills them by role needs a database no other test uses.
// ---------------------------------------------------------------------------

pub struct OwnDb {
    pub database: String,
    pub db: TestDb,
}

/// A pool of [`POOL`] connections on the test's own `database`, made with `options`.
async fn own_pool(options: PgConnectOptions, database: &str, app_name: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(POOL)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options.database(database).application_name(app_name))
        .await
        .expect("connect to the test's own database")
}

impl OwnDb {
    pub async fn new(test: &str) -> OwnDb {
        ensure_database().await;
        let nonce: u32 = rand::random();
        let database = format!("lh_rt_{test}_{nonce:08x}");
        let mut admin = base_options()
            .database("postgres")
            .connect()
            .await
            .expect("connect to postgres database");
        // Databases a failed earlier run of this test left behind. One in use (this
        // test running elsewhere right now) refuses the drop, which is fine.
        let stale: Vec<String> =
            sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE $1")
                .bind(format!("lh\\_rt\\_{test}\\_%"))
                .fetch_all(&mut admin)
                .await
                .unwrap();
        for name in stale {
            let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\""))
                .execute(&mut admin)
                .await;
        }
        sqlx::query(&format!("CREATE DATABASE \"{database}\""))
            .execute(&mut admin)
            .await
            .expect("create test database");
        let schema = format!("t_{test}");
        let app_name = format!("lh-{database}");
        let pool = own_pool(base_options(), &database, &app_name).await;
        let store = Store::new(pool.clone(), &schema, StoreOptions::default()).unwrap();
        store.migrate().await.unwrap();
        let owner = pool.clone();
        let (pool, store) = match runtime_role() {
            None => (pool, store),
            Some(_) => {
                grant_runtime_role(&owner, &schema).await;
                let pool = own_pool(runtime_options(), &database, &app_name).await;
                let store = Store::new(pool.clone(), &schema, StoreOptions::default()).unwrap();
                (pool, store)
            }
        };
        OwnDb {
            database,
            db: TestDb {
                schema,
                pool,
                store,
                app_name,
                owner,
            },
        }
    }

    /// Backends of this database whose application_name starts with `name` (the
    /// scheduler names its own `leasehold-<role> <pid>:<nonce>`).
    pub async fn backends_named(&self, name: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name LIKE $2 || '%'",
        )
        .bind(&self.database)
        .bind(name)
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }

    /// Backends named `name…` whose LISTEN has run (idle after it). A listener that is
    /// only connected may not listen yet: a NOTIFY sent then is missed, and a kill then
    /// fails its first connection, whose retry is not counted as a reconnect.
    pub async fn listening_backends_named(&self, name: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 \
             AND application_name LIKE $2 || '%' AND state = 'idle' \
             AND position('LISTEN' in query) > 0",
        )
        .bind(&self.database)
        .bind(name)
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }

    /// Backends of this database that a scheduler opened itself (`leasehold-*`).
    pub async fn scheduler_backends(&self) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name LIKE 'leasehold-%'",
        )
        .bind(&self.database)
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }

    /// Terminate this database's backends whose name starts with `name`; returns how
    /// many.
    pub async fn terminate(&self, name: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1 AND application_name LIKE $2 || '%'",
        )
        .bind(&self.database)
        .bind(name)
        .fetch_one(&self.db.owner)
        .await
        .unwrap()
    }

    pub async fn drop(self) {
        self.db.pool.close().await;
        self.db.owner.close().await;
        let mut admin = base_options()
            .database("postgres")
            .connect()
            .await
            .expect("connect to postgres database");
        let _ = sqlx::query(&format!(
            "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
            self.database
        ))
        .execute(&mut admin)
        .await;
    }
}
