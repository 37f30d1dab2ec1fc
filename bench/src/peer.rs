//! The peer: graphile_worker (the Rust crate) with its documented throughput recipe, on
//! the same database in the same run, each measurement right after leasehold's matching
//! one.
//!
//! The sections that measure leasehold's side (e2e at concurrency 1 and 32, keyed, the
//! idle latency) call [`Peer::drain`] and [`Peer::latency`] after each of their leasehold
//! runs and [`Peer::record`] the pair; [`Peer::rows`] turns the pairs into the table.
//!
//! Isolation: graphile_worker depends on sqlx 0.9 (leasehold on 0.8), so it gets its own
//! pool from the bench database's URL, as large as leasehold's, and its own multi-thread
//! tokio runtime, as its docs' `#[tokio::main]` gives it. It migrates its own schema,
//! [`SCHEMA`], dropped before every measurement; its migrations table is
//! `bench_graphile_worker.migrations`, so it never touches `public`, leasehold's schema
//! or a `_sqlx_migrations` table.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use graphile_worker::{
    IntoTaskHandlerResult, JobSpec, LocalQueueConfig, TaskHandler, Worker, WorkerContext,
    WorkerOptions,
};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection};

use super::handlers::wait_until;
use super::latency::Latency;
use super::report::{percentile, Row, Stat};
use super::sections::paired_ratio;

pub const SCHEMA: &str = "bench_graphile_worker";

/// The recipe: the "Throughput-oriented worker" of graphile_worker's docs
/// (docs/src/configuration/worker-options.md), all but its concurrency.
const LOCAL_QUEUE_SIZE: usize = 100;
const LOCAL_QUEUE_TTL: Duration = Duration::from_secs(60);
const BATCH_DELAY: Duration = Duration::from_millis(5);
const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// The unkeyed concurrencies compared.
pub const CONCURRENCIES: [usize; 2] = [1, 32];

/// Jobs per `add_jobs` call while loading.
const LOAD_CHUNK: u64 = 10_000;

/// The graphile_worker version this bench was built with, from the lockfile.
pub fn version() -> &'static str {
    let lock = include_str!("../../Cargo.lock");
    let at = lock
        .find("name = \"graphile_worker\"\nversion = \"")
        .expect("graphile_worker in Cargo.lock");
    let rest = &lock[at..];
    let start = rest.find("version = \"").unwrap() + "version = \"".len();
    let len = rest[start..].find('"').unwrap();
    &rest[start..start + len]
}

// ---------------------------------------------------------------------------------
// Handlers

#[derive(Clone, Debug)]
struct Done(Arc<AtomicU64>);

#[derive(Clone, Debug)]
struct Starts(Arc<Mutex<HashMap<u64, Instant>>>);

/// Does nothing; counts. Its payload is leasehold's no-op payload, `{"n": ..}`.
#[derive(Clone, Serialize, Deserialize)]
struct NoopTask {
    n: u64,
}

impl TaskHandler for NoopTask {
    const IDENTIFIER: &'static str = "noop";

    async fn run(self, ctx: WorkerContext) -> impl IntoTaskHandlerResult {
        if let Some(done) = ctx.get_ext::<Done>() {
            done.0.fetch_add(1, Relaxed);
        }
        Ok::<(), String>(())
    }
}

/// Records when each job started.
#[derive(Clone, Serialize, Deserialize)]
struct ProbeTask {
    n: u64,
}

impl TaskHandler for ProbeTask {
    const IDENTIFIER: &'static str = "probe";

    async fn run(self, ctx: WorkerContext) -> impl IntoTaskHandlerResult {
        let now = Instant::now();
        if let Some(starts) = ctx.get_ext::<Starts>() {
            starts.0.lock().unwrap().insert(self.n, now);
        }
        Ok::<(), String>(())
    }
}

// ---------------------------------------------------------------------------------
// The peer and its paired figures

/// One figure measured on both sides, run by run (index r of each is a pair).
struct Paired {
    name: String,
    unit: &'static str,
    leasehold: Vec<f64>,
    peer: Vec<f64>,
    /// Also show graphile_worker against the raw-SQL ceiling.
    vs_ceiling: bool,
}

pub struct Peer {
    rt: Option<tokio::runtime::Runtime>,
    url: String,
    opts: PgConnectOptions,
    pool_conns: u32,
    paired: Vec<Paired>,
    /// The raw ceiling at the pool's size, run by run, when the ceiling ran.
    pub ceiling: Option<(usize, Vec<f64>)>,
}

impl Peer {
    pub fn new(opts: &PgConnectOptions, pool_conns: u32) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("graphile-worker")
            .build()
            .expect("graphile_worker's runtime");
        Peer {
            rt: Some(rt),
            url: opts.to_url_lossy().to_string(),
            opts: opts.clone(),
            pool_conns,
            paired: Vec::new(),
            ceiling: None,
        }
    }

    /// Run `f` on graphile_worker's runtime and wait for it.
    async fn on<F>(&self, f: F) -> F::Output
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let rt = self.rt.as_ref().expect("runtime");
        rt.spawn(f).await.expect("graphile_worker bench task")
    }

    /// Jobs/s draining `n` preloaded no-op jobs; keyed as `(queues, per_queue)`: job i in
    /// the named queue `k{i % queues}`, as leasehold's keyed load orders its keys.
    pub async fn drain(&self, concurrency: usize, n: u64, keyed: Option<(u64, u64)>) -> f64 {
        let (url, opts, pool) = (self.url.clone(), self.opts.clone(), self.pool_conns);
        self.on(drain(url, opts, pool, concurrency, n, keyed)).await
    }

    /// Enqueue-to-start latency on an idle worker, `rate` jobs/s for `secs`.
    pub async fn latency(&self, concurrency: usize, rate: f64, secs: f64) -> Latency {
        let (url, opts, pool) = (self.url.clone(), self.opts.clone(), self.pool_conns);
        self.on(latency(url, opts, pool, concurrency, rate, secs))
            .await
    }

    /// Add one run's pair to the figure `name`.
    pub fn record(
        &mut self,
        name: String,
        unit: &'static str,
        vs_ceiling: bool,
        ours: f64,
        theirs: f64,
    ) {
        let i = match self.paired.iter().position(|p| p.name == name) {
            Some(i) => i,
            None => {
                self.paired.push(Paired {
                    name,
                    unit,
                    leasehold: Vec::new(),
                    peer: Vec::new(),
                    vs_ceiling,
                });
                self.paired.len() - 1
            }
        };
        self.paired[i].leasehold.push(ours);
        self.paired[i].peer.push(theirs);
    }

    /// The table's rows: per figure graphile_worker (against the ceiling where it ran),
    /// then leasehold with the ratio leasehold / graphile_worker of each pair.
    pub fn rows(&self) -> Vec<Row> {
        let section: &'static str = Box::leak(
            format!(
                "graphile_worker {} (the peer), same database, run by run after leasehold; \
                 ratio = leasehold / graphile_worker",
                version()
            )
            .into_boxed_str(),
        );
        let mut rows = Vec::new();
        for p in &self.paired {
            let mut theirs = Row::new(
                section,
                format!("{}: graphile_worker", p.name),
                Stat::of(p.peer.clone()),
                p.unit,
            );
            if let (true, Some((c, den))) = (p.vs_ceiling, &self.ceiling) {
                theirs = theirs.ratio(paired_ratio(&p.peer, den), format!("ceiling@{c}"));
            }
            rows.push(theirs);
            rows.push(
                Row::new(
                    section,
                    format!("{}: leasehold", p.name),
                    Stat::of(p.leasehold.clone()),
                    p.unit,
                )
                .ratio(paired_ratio(&p.leasehold, &p.peer), "graphile_worker"),
            );
        }
        rows
    }

    /// What the peer ran with, for the report.
    pub fn describe(&self) -> Value {
        json!({
            "crate": "graphile_worker",
            "version": version(),
            "schema": SCHEMA,
            "pool_connections": self.pool_conns,
            "runtime": "its own tokio multi-thread runtime (one worker per core)",
            "local_queue": {"size": LOCAL_QUEUE_SIZE, "ttl_ms": LOCAL_QUEUE_TTL.as_millis() as u64},
            "complete_job_batch_delay_ms": BATCH_DELAY.as_millis() as u64,
            "fail_job_batch_delay_ms": BATCH_DELAY.as_millis() as u64,
            "poll_interval_ms": POLL_INTERVAL.as_millis() as u64,
            "load": format!("WorkerUtils::add_jobs, {LOAD_CHUNK} per call"),
        })
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Dropping a runtime blocks, which an async context forbids.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

// ---------------------------------------------------------------------------------
// Measurements (on graphile_worker's runtime)

/// The recipe, at `concurrency`, on a pool of `pool` connections.
fn recipe(url: &str, pool: u32, concurrency: usize) -> WorkerOptions {
    WorkerOptions::default()
        .database_url(url)
        .max_pg_conn(pool)
        .schema(SCHEMA)
        .concurrency(concurrency)
        .poll_interval(POLL_INTERVAL)
        .complete_job_batch_delay(BATCH_DELAY)
        .fail_job_batch_delay(BATCH_DELAY)
        .local_queue(
            LocalQueueConfig::default()
                .with_size(LOCAL_QUEUE_SIZE)
                .with_ttl(LOCAL_QUEUE_TTL),
        )
        .listen_os_shutdown_signals(false)
}

/// Drop the peer's schema (the worker's `init` migrates it afresh); a connection of the
/// peer's runtime for the bench's own queries.
async fn fresh_schema(opts: &PgConnectOptions) -> PgConnection {
    let mut conn = opts
        .clone()
        .application_name("leasehold-bench-peer")
        .connect()
        .await
        .expect("connect to the bench database");
    sqlx::query(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        .execute(&mut conn)
        .await
        .expect("drop the peer's schema");
    conn
}

async fn start(worker: Worker) -> (Arc<Worker>, tokio::task::JoinHandle<()>) {
    let worker = Arc::new(worker);
    let w = worker.clone();
    let running = tokio::spawn(async move { w.run().await.expect("graphile_worker run") });
    (worker, running)
}

async fn stop(worker: Arc<Worker>, running: tokio::task::JoinHandle<()>) {
    worker.request_shutdown();
    running.await.expect("graphile_worker run task");
    worker.pg_pool().close().await;
}

async fn drain(
    url: String,
    opts: PgConnectOptions,
    pool: u32,
    concurrency: usize,
    n: u64,
    keyed: Option<(u64, u64)>,
) -> f64 {
    let mut conn = fresh_schema(&opts).await;
    let done = Arc::new(AtomicU64::new(0));
    let worker = recipe(&url, pool, concurrency)
        .add_extension(Done(done.clone()))
        .define_job::<NoopTask>()
        .init()
        .await
        .expect("init graphile_worker");
    load(&worker, n, keyed).await;
    for t in ["_private_jobs", "_private_job_queues"] {
        sqlx::query(&format!("ANALYZE {SCHEMA}.{t}"))
            .execute(&mut conn)
            .await
            .expect("analyze");
    }
    let limit = Duration::from_secs(30 + n / 200);
    let t0 = Instant::now();
    let (worker, running) = start(worker).await;
    wait_until("graphile_worker's handlers", limit, || {
        done.load(Relaxed) >= n
    })
    .await;
    // Done as leasehold's drain means it (its `completed` counts written completions):
    // graphile_worker deletes a job when its batched completion commits.
    let count = format!("SELECT count(*) FROM {SCHEMA}._private_jobs");
    loop {
        let left: i64 = sqlx::query_scalar(&count)
            .fetch_one(&mut conn)
            .await
            .expect("count the peer's jobs");
        if left == 0 {
            break;
        }
        assert!(
            t0.elapsed() < limit,
            "bench: graphile_worker left {left} jobs"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let took = t0.elapsed().as_secs_f64();
    stop(worker, running).await;
    conn.close().await.ok();
    n as f64 / took
}

/// Bulk-enqueue with `add_jobs`, graphile_worker's documented batch insert.
async fn load(worker: &Worker, n: u64, keyed: Option<(u64, u64)>) {
    if let Some((queues, per_queue)) = keyed {
        assert_eq!(queues * per_queue, n);
    }
    let utils = worker.create_utils();
    let plain = JobSpec::default();
    let named: Vec<JobSpec> = match keyed {
        Some((queues, _)) => (0..queues)
            .map(|k| JobSpec {
                queue_name: Some(format!("k{k}")),
                ..JobSpec::default()
            })
            .collect(),
        None => Vec::new(),
    };
    let mut i = 0;
    while i < n {
        let chunk: Vec<(NoopTask, &JobSpec)> = (i..(i + LOAD_CHUNK).min(n))
            .map(|j| {
                let spec = match keyed {
                    Some((queues, _)) => &named[(j % queues) as usize],
                    None => &plain,
                };
                (NoopTask { n: j }, spec)
            })
            .collect();
        i += chunk.len() as u64;
        utils.add_jobs(&chunk).await.expect("add_jobs");
    }
}

/// As leasehold's idle latency: a worker left idle 700 ms, then one `add_job` per job at
/// `rate`, open loop, each from the call to the handler's start.
async fn latency(
    url: String,
    opts: PgConnectOptions,
    pool: u32,
    concurrency: usize,
    rate: f64,
    secs: f64,
) -> Latency {
    assert!(rate <= 200.0, "the peer's latency offers one job per call");
    let conn = fresh_schema(&opts).await;
    conn.close().await.ok();
    let starts = Arc::new(Mutex::new(HashMap::new()));
    let worker = recipe(&url, pool, concurrency)
        .add_extension(Starts(starts.clone()))
        .define_job::<ProbeTask>()
        .init()
        .await
        .expect("init graphile_worker");
    let (worker, running) = start(worker).await;
    tokio::time::sleep(Duration::from_millis(700)).await;

    let utils = worker.create_utils();
    let mut sent: Vec<(u64, Instant)> = Vec::new();
    let mut tasks = Vec::new();
    let every = Duration::from_secs_f64(1.0 / rate);
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs_f64(secs);
    let (mut at, mut n) = (t0, 0u64);
    while at < end {
        tokio::time::sleep_until(at.into()).await;
        let utils = utils.clone();
        sent.push((n, Instant::now()));
        tasks.push(tokio::spawn(async move {
            utils
                .add_job(ProbeTask { n }, JobSpec::default())
                .await
                .map(|_| ())
        }));
        n += 1;
        at += every;
    }
    let offered = sent.len() as f64 / t0.elapsed().as_secs_f64();
    for t in tasks {
        t.await.expect("add_job task").expect("add_job");
    }
    let want = sent.len();
    let s2 = starts.clone();
    wait_until(
        "graphile_worker's probe jobs to start",
        Duration::from_secs(60),
        || {
            let m = s2.lock().unwrap();
            sent.iter().filter(|(i, _)| m.contains_key(i)).count() == want
        },
    )
    .await;
    let lat: Vec<f64> = {
        let m = starts.lock().unwrap();
        sent.iter()
            .map(|(i, at)| m[i].saturating_duration_since(*at).as_secs_f64() * 1e3)
            .collect()
    };
    stop(worker, running).await;
    Latency {
        p50: percentile(&lat, 0.5),
        p99: percentile(&lat, 0.99),
        // graphile_worker deletes a job when it completes: no row left to read it from.
        db_p50: f64::NAN,
        offered,
        samples: lat.len(),
    }
}
