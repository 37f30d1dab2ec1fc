//! The bench database, its resets and bulk loaders, and what the run ran under.

use std::time::Duration;

use leasehold::{Store, StoreOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

/// The bench database: `leasehold_bench`, or `LEASEHOLD_BENCH_DB` (letters, digits and
/// `_`). Two benches at once must not share one: each drops and recreates its schema.
pub fn db() -> String {
    let name = std::env::var("LEASEHOLD_BENCH_DB").unwrap_or_else(|_| "leasehold_bench".into());
    assert!(
        !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
        "LEASEHOLD_BENCH_DB must be letters, digits and _: {name:?}"
    );
    name
}
pub const SCHEMA: &str = "bench";
pub const QUEUE: &str = "default";

pub fn server_options() -> PgConnectOptions {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/postgres".into());
    url.parse().expect("DATABASE_URL is not a PostgreSQL URL")
}

/// Connect to the server's `postgres` database, create `leasehold_bench` if needed, and
/// return options for it.
pub async fn bench_database() -> PgConnectOptions {
    let opts = server_options();
    let db = db();
    let mut admin = opts
        .clone()
        .database("postgres")
        .connect()
        .await
        .expect("connect to PostgreSQL (database postgres)");
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&db)
            .fetch_one(&mut admin)
            .await
            .expect("read pg_database");
    if !exists {
        // Two benches starting at once: the loser's error is harmless.
        let _ = sqlx::query(&format!("CREATE DATABASE {db}"))
            .execute(&mut admin)
            .await;
    }
    admin.close().await.ok();
    opts.database(&db)
}

pub async fn pool(opts: &PgConnectOptions, size: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .min_connections(0)
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(opts.clone().application_name("leasehold-bench"))
        .await
        .expect("connect to the bench database")
}

pub async fn connect(opts: &PgConnectOptions) -> PgConnection {
    opts.clone()
        .application_name("leasehold-bench-raw")
        .connect()
        .await
        .expect("connect to the bench database")
}

/// A fresh schema with leasehold's tables; the store writes full history or not, as the
/// schedulers of the run do.
pub async fn fresh_schema(pool: &PgPool, schema: &str, full_history: bool) -> Store {
    sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .execute(pool)
        .await
        .expect("drop the bench schema");
    let options = StoreOptions {
        full_history,
        ..StoreOptions::default()
    };
    let store = Store::new(pool.clone(), schema, options).expect("store");
    store.migrate().await.expect("migrate the bench schema");
    store
}

/// Empty every table, so each run starts from the same state.
pub async fn reset(store: &Store) {
    let s = store.schema().quoted();
    // Unprepared (simple protocol), as the other setup statements here: the pooler row
    // runs them through a transaction-mode PgBouncer, where a named statement collides.
    sqlx::raw_sql(&format!(
        "TRUNCATE {s}.jobs, {s}.job_events, {s}.job_keys, {s}.lease_expiries, {s}.effects \
         RESTART IDENTITY"
    ))
    .execute(store.pool())
    .await
    .expect("truncate");
}

/// Flush dirty pages now, so a checkpoint forced by the WAL of an earlier section does
/// not land in the middle of the next one (a no-op without the privilege).
pub async fn checkpoint(store: &Store) {
    let _ = sqlx::raw_sql("CHECKPOINT").execute(store.pool()).await;
}

/// Fresh statistics (this server runs with autovacuum off, so nothing else makes them).
pub async fn analyze(store: &Store) {
    sqlx::raw_sql(&format!("ANALYZE {}.jobs", store.schema().quoted()))
        .execute(store.pool())
        .await
        .expect("analyze");
}

pub async fn vacuum_analyze(store: &Store) {
    for t in ["jobs", "job_keys", "job_events"] {
        sqlx::raw_sql(&format!("VACUUM (ANALYZE) {}.{t}", store.schema().quoted()))
            .execute(store.pool())
            .await
            .expect("vacuum");
    }
}

/// The columns a raw COPY and `enqueue_copy` both write.
pub const COPY_COLUMNS: &str =
    "queue, kind, priority, state, payload, payload_bytes, max_attempts, dead_blocks_key";

/// The COPY text of `n` unkeyed pending jobs of `kind`, payloads `{"n":from..}`.
pub fn copy_text(kind: &str, from: u64, n: u64) -> Vec<u8> {
    let mut buf = Vec::with_capacity(n as usize * 56);
    for i in from..from + n {
        let payload = format!("{{\"n\":{i}}}");
        buf.extend_from_slice(
            format!(
                "{QUEUE}\t{kind}\t0\tpending\t{payload}\t{}\t25\tt\n",
                payload.len()
            )
            .as_bytes(),
        );
    }
    buf
}

/// Raw COPY of `n` unkeyed jobs (the loader, and the raw-COPY baseline).
pub async fn raw_copy(store: &Store, kind: &str, n: u64) -> u64 {
    let mut conn = store.pool().acquire().await.expect("acquire");
    let s = store.schema().quoted();
    let mut copy = conn
        .copy_in_raw(&format!("COPY {s}.jobs ({COPY_COLUMNS}) FROM STDIN"))
        .await
        .expect("copy in");
    let mut from = 0;
    while from < n {
        let chunk = (n - from).min(20_000);
        copy.send(copy_text(kind, from, chunk))
            .await
            .expect("copy send");
        from += chunk;
    }
    copy.finish().await.expect("copy finish")
}

/// Rows in a state (for checks).
pub async fn count_state(store: &Store, state: &str) -> i64 {
    let s = store.schema().quoted();
    sqlx::query_scalar(&format!("SELECT count(*) FROM {s}.jobs WHERE state = $1"))
        .bind(state)
        .fetch_one(store.pool())
        .await
        .expect("count")
}

/// Insert `n` jobs straight in one state with generate_series (table-growth phases).
/// Terminal rows look like completed jobs: claimed once, finished, with an owner.
pub async fn insert_rows(store: &Store, state: &str, n: i64) {
    let s = store.schema().quoted();
    let finished = if state == "done" { "now()" } else { "NULL" };
    let (attempts, owner) = if state == "done" {
        (1, "'bench:old'")
    } else {
        (0, "NULL")
    };
    sqlx::query(&format!(
        "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts,
                                    attempts, generation, owner, finished_at, available_at)
         SELECT '{QUEUE}', 'noop', $1, jsonb_build_object('n', g), 10, 25,
                {attempts}, {attempts}, {owner}, {finished}, now() - interval '1 hour'
         FROM generate_series(1, $2) g"
    ))
    .bind(state)
    .bind(n)
    .execute(store.pool())
    .await
    .expect("insert rows");
}

/// `n` delayed jobs (due tomorrow) and `n` jobs of another queue, which a claim of
/// [`QUEUE`] must not walk.
pub async fn insert_beside(store: &Store, n: i64) {
    let s = store.schema().quoted();
    sqlx::query(&format!(
        "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, available_at)
         SELECT q, 'noop', 'pending', jsonb_build_object('n', g), 10, 25,
                CASE WHEN q = '{QUEUE}' THEN now() + interval '1 day' ELSE now() - interval '1 hour' END
         FROM generate_series(1, $1) g, (VALUES ('{QUEUE}'), ('bench_other')) AS v(q)"
    ))
    .bind(n)
    .execute(store.pool())
    .await
    .expect("insert delayed and other-queue rows");
}

pub async fn drop_schema(pool: &PgPool, schema: &str) {
    sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .execute(pool)
        .await
        .expect("drop schema");
}

/// The machine the run ran on.
pub fn machine() -> Vec<(String, String)> {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kb: u64 = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    vec![
        ("nproc".into(), cores.to_string()),
        ("cpu".into(), cpu),
        (
            "memory".into(),
            format!("{:.1} GiB", mem_kb as f64 / 1024.0 / 1024.0),
        ),
        ("kernel".into(), kernel),
    ]
}

/// The PostgreSQL settings that matter for these figures.
pub async fn settings(pool: &PgPool) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(pool)
        .await
        .unwrap_or_default();
    out.push(("server_version".into(), version));
    for name in [
        "shared_buffers",
        "synchronous_commit",
        "fsync",
        "wal_level",
        "full_page_writes",
        "commit_delay",
        "max_connections",
        "work_mem",
        "effective_cache_size",
        "random_page_cost",
        "jit",
        "autovacuum",
        "max_wal_size",
        "checkpoint_timeout",
    ] {
        let v: String = sqlx::query_scalar(&format!("SHOW {name}"))
            .fetch_one(pool)
            .await
            .unwrap_or_else(|_| "?".into());
        out.push((name.into(), v));
    }
    out
}

/// VmRSS of this process, in MB (10^6 bytes).
pub fn rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .map(|kb| kb * 1024.0 / 1e6)
        .unwrap_or(f64::NAN)
}

/// CPU time (user + system) this process has used, in seconds.
pub fn cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of the full line: 11 and 12 here.
    (ticks(11) + ticks(12)) / 100.0
}
