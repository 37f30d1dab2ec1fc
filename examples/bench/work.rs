//! The workloads: raw-SQL ceiling, leasehold end to end, enqueue, latency, keyed work,
//! table growth and memory. Each function is one run and returns its figures.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold::{
    ClaimRequest, Config, Handler, JobContext, JobError, NewJob, OwnerId, Scheduler, Store,
};
use serde_json::json;
use sqlx::postgres::PgConnectOptions;
use sqlx::Connection;

use super::report::percentile;
use super::setup::{self, QUEUE, SCHEMA};

// ---------------------------------------------------------------------------------
// Handlers

/// Does nothing; counts.
pub struct Noop {
    pub done: Arc<AtomicU64>,
}

impl Handler for Noop {
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "noop";

    async fn run(&self, _: JobContext, _: serde_json::Value) -> Result<(), JobError> {
        self.done.fetch_add(1, Relaxed);
        Ok(())
    }
}

/// Records when each job (payload `{"n": ..}`) started.
pub struct Probe {
    pub starts: Arc<Mutex<HashMap<u64, Instant>>>,
}

impl Handler for Probe {
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "probe";

    async fn run(&self, _: JobContext, p: serde_json::Value) -> Result<(), JobError> {
        let now = Instant::now();
        let n = p["n"].as_u64().unwrap_or(u64::MAX);
        self.starts.lock().unwrap().insert(n, now);
        Ok(())
    }
}

/// Waits until released, so its key's sequencer stays alive.
pub struct Hold {
    pub started: Arc<AtomicUsize>,
    pub release: tokio::sync::watch::Receiver<bool>,
}

impl Handler for Hold {
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "hold";

    async fn run(&self, _: JobContext, _: serde_json::Value) -> Result<(), JobError> {
        self.started.fetch_add(1, Relaxed);
        let mut rx = self.release.clone();
        let _ = rx.wait_for(|go| *go).await;
        Ok(())
    }
}

/// The scheduler configuration of every leasehold run: defaults, except the schema,
/// the concurrency and (by flag) the history detail.
pub fn config(concurrency: usize, history: bool) -> Config {
    let mut c = Config {
        schema: SCHEMA.into(),
        concurrency,
        ..Config::default()
    };
    c.store.full_history = history;
    c
}

fn noop_job(n: u64) -> NewJob {
    NewJob::from_json("noop", json!({ "n": n }))
}

async fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        if Instant::now() > deadline {
            panic!("bench: timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

// ---------------------------------------------------------------------------------
// Raw-SQL ceiling

const RAW_CLAIM: &str = "WITH cand AS (
    SELECT id FROM bench.jobs
    WHERE state = 'pending' AND available_at <= now() AND queue = ANY($1)
    ORDER BY priority, available_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE bench.jobs j
SET state = 'running', owner = $3, generation = j.generation + 1, attempts = j.attempts + 1,
    claimed_at = now(), lease_until = now() + interval '30 seconds'
FROM cand WHERE j.id = cand.id
RETURNING j.id, j.generation, j.payload";

const RAW_COMPLETE: &str = "UPDATE bench.jobs j
SET state = 'done', finished_at = now(), lease_until = NULL
FROM unnest($1::int8[], $2::int8[]) AS t(id, generation)
WHERE j.id = t.id AND j.generation = t.generation AND j.owner = $3 AND j.state = 'running'";

/// `conns` connections, each looping: claim 100 with one SKIP LOCKED statement, complete
/// them with one fenced UPDATE. Jobs/s over `n` preloaded jobs.
pub async fn ceiling(store: &Store, opts: &PgConnectOptions, conns: usize, n: u64) -> f64 {
    setup::reset(store).await;
    setup::raw_copy(store, "noop", n).await;
    setup::analyze(store).await;
    let mut connections = Vec::new();
    for _ in 0..conns {
        connections.push(setup::connect(opts).await);
    }
    let t0 = Instant::now();
    let workers: Vec<_> = connections
        .into_iter()
        .enumerate()
        .map(|(w, mut conn)| {
            tokio::spawn(async move {
                let owner = format!("raw:{w}");
                let queues = vec![QUEUE.to_string()];
                let mut done = 0u64;
                loop {
                    let rows: Vec<(i64, i64, serde_json::Value)> = sqlx::query_as(RAW_CLAIM)
                        .bind(&queues)
                        .bind(100i64)
                        .bind(&owner)
                        .fetch_all(&mut conn)
                        .await
                        .expect("raw claim");
                    if rows.is_empty() {
                        break;
                    }
                    let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
                    let gens: Vec<i64> = rows.iter().map(|r| r.1).collect();
                    let r = sqlx::query(RAW_COMPLETE)
                        .bind(&ids)
                        .bind(&gens)
                        .bind(&owner)
                        .execute(&mut conn)
                        .await
                        .expect("raw complete");
                    assert_eq!(r.rows_affected(), rows.len() as u64, "raw fence refused");
                    done += rows.len() as u64;
                }
                conn.close().await.ok();
                done
            })
        })
        .collect();
    let mut total = 0;
    for w in workers {
        total += w.await.expect("raw worker");
    }
    let took = t0.elapsed().as_secs_f64();
    assert_eq!(total, n, "the raw ceiling must process every job");
    n as f64 / took
}

// ---------------------------------------------------------------------------------
// Leasehold end to end

/// Jobs/s of a scheduler with no-op handlers draining `n` preloaded unkeyed jobs.
pub async fn throughput(store: &Store, concurrency: usize, n: u64, history: bool) -> f64 {
    setup::reset(store).await;
    setup::raw_copy(store, "noop", n).await;
    setup::analyze(store).await;
    let done = Arc::new(AtomicU64::new(0));
    let cpu0 = setup::cpu_secs();
    let t0 = Instant::now();
    let s = Scheduler::builder(store.pool().clone(), config(concurrency, history))
        .register(Noop { done: done.clone() })
        .start()
        .await
        .expect("start scheduler");
    let limit = Duration::from_secs(30 + n / 200);
    wait_until("the scheduler to drain", limit, || {
        s.metrics().counters.completed >= n
    })
    .await;
    let took = t0.elapsed().as_secs_f64();
    if std::env::var_os("BENCH_DEBUG").is_some() {
        eprintln!(
            "    process cpu {:.0}% of one core",
            (setup::cpu_secs() - cpu0) / took * 100.0
        );
    }
    debug_metrics(&s);
    s.shutdown().await.expect("shutdown");
    n as f64 / took
}

/// With BENCH_DEBUG set, what the scheduler did (claims, batch sizes, latencies).
pub fn debug_metrics(s: &Scheduler) {
    if std::env::var_os("BENCH_DEBUG").is_none() {
        return;
    }
    let m = s.metrics();
    let c = &m.counters;
    eprintln!(
        "    claims {} (empty {}), claimed {} ({:.1}/claim), completed {} ({:.1}/batch), notifications {}, claim p50 {:?} p99 {:?}",
        c.claims,
        c.empty_claims,
        c.claimed,
        c.claimed as f64 / c.claims.max(1) as f64,
        c.completed,
        c.completed as f64 / c.completion_batches.max(1) as f64,
        c.notifications,
        m.claim_latency.p50,
        m.claim_latency.p99
    );
    for mb in &m.mailboxes {
        eprintln!(
            "    mailbox {:<14} handled {:>7} high-water {:>5} mean {:?}",
            mb.actor, mb.handled, mb.high_water, mb.mean_handling
        );
    }
}

// ---------------------------------------------------------------------------------
// Enqueue

#[derive(Clone, Copy, Debug)]
pub enum EnqueueWay {
    One,
    Many,
    Copy,
    RawCopy,
}

/// Rows/s of enqueueing `n` unkeyed jobs one way, from building the jobs to commit.
pub async fn enqueue(store: &Store, way: EnqueueWay, n: u64) -> f64 {
    setup::reset(store).await;
    let t0 = Instant::now();
    match way {
        EnqueueWay::One => {
            for i in 0..n {
                store.enqueue(noop_job(i)).await.expect("enqueue");
            }
        }
        EnqueueWay::Many => {
            let mut i = 0;
            while i < n {
                let batch: Vec<NewJob> = (i..(i + 1000).min(n)).map(noop_job).collect();
                i += batch.len() as u64;
                store.enqueue_many(batch).await.expect("enqueue_many");
            }
        }
        EnqueueWay::Copy => {
            let jobs: Vec<NewJob> = (0..n).map(noop_job).collect();
            if std::env::var_os("BENCH_DEBUG").is_some() {
                eprintln!(
                    "    built {n} jobs in {:.1} ms",
                    t0.elapsed().as_secs_f64() * 1e3
                );
            }
            let written = store.enqueue_copy(jobs).await.expect("enqueue_copy");
            assert_eq!(written, n);
        }
        EnqueueWay::RawCopy => {
            assert_eq!(setup::raw_copy(store, "noop", n).await, n);
        }
    }
    let took = t0.elapsed().as_secs_f64();
    assert_eq!(setup::count_state(store, "pending").await, n as i64);
    n as f64 / took
}

// ---------------------------------------------------------------------------------
// Enqueue-to-start latency

/// What one latency run saw.
pub struct Latency {
    /// Enqueue call to handler start, ms.
    pub p50: f64,
    pub p99: f64,
    /// `created_at` to `claimed_at` (database clock), ms.
    pub db_p50: f64,
    pub offered: f64,
    pub samples: usize,
}

/// Offer `rate` probe jobs/s (keyed `key_prefix-n` when given) for `secs`, open loop:
/// one `enqueue` per job up to 200/s, else an `enqueue_many` every 5 ms. Measures from
/// the call to the handler's start.
pub async fn offer(
    store: &Store,
    starts: &Arc<Mutex<HashMap<u64, Instant>>>,
    first: u64,
    rate: f64,
    secs: f64,
    key_prefix: Option<&str>,
) -> Latency {
    let job = |n: u64| {
        let j = NewJob::from_json("probe", json!({ "n": n }));
        match key_prefix {
            Some(p) => j.with_key(format!("{p}-{n}")),
            None => j,
        }
    };
    let mut sent: Vec<(u64, Instant)> = Vec::new();
    let mut tasks = Vec::new();
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs_f64(secs);
    let mut n = first;
    if rate <= 200.0 {
        let every = Duration::from_secs_f64(1.0 / rate);
        let mut at = t0;
        while at < end {
            tokio::time::sleep_until(at.into()).await;
            let store = store.clone();
            let j = job(n);
            sent.push((n, Instant::now()));
            tasks.push(tokio::spawn(
                async move { store.enqueue(j).await.map(|_| ()) },
            ));
            n += 1;
            at += every;
        }
    } else {
        let tick = Duration::from_millis(5);
        let per_tick = (rate * tick.as_secs_f64()).round().max(1.0) as u64;
        let mut at = t0;
        while at < end {
            tokio::time::sleep_until(at.into()).await;
            let store = store.clone();
            let batch: Vec<NewJob> = (n..n + per_tick).map(job).collect();
            let now = Instant::now();
            sent.extend((n..n + per_tick).map(|i| (i, now)));
            tasks.push(tokio::spawn(async move {
                store.enqueue_many(batch).await.map(|_| ())
            }));
            n += per_tick;
            at += tick;
        }
    }
    let offered = sent.len() as f64 / t0.elapsed().as_secs_f64();
    for t in tasks {
        t.await.expect("enqueue task").expect("enqueue");
    }
    let want = sent.len();
    let s2 = starts.clone();
    wait_until("probe jobs to start", Duration::from_secs(60), || {
        let m = s2.lock().unwrap();
        sent.iter().filter(|(i, _)| m.contains_key(i)).count() == want
    })
    .await;
    let lat: Vec<f64> = {
        let m = starts.lock().unwrap();
        sent.iter()
            .map(|(i, at)| m[i].saturating_duration_since(*at).as_secs_f64() * 1e3)
            .collect()
    };
    let db: Vec<f64> = sqlx::query_scalar(&format!(
        "SELECT (extract(epoch FROM claimed_at - created_at) * 1000)::float8
         FROM {SCHEMA}.jobs WHERE kind = 'probe' AND (payload->>'n')::int8 >= $1 AND (payload->>'n')::int8 < $2"
    ))
    .bind(first as i64)
    .bind(n as i64)
    .fetch_all(store.pool())
    .await
    .expect("db latency");
    Latency {
        p50: percentile(&lat, 0.5),
        p99: percentile(&lat, 0.99),
        db_p50: percentile(&db, 0.5),
        offered,
        samples: lat.len(),
    }
}

/// One latency run on a fresh, idle scheduler.
pub async fn latency(
    store: &Store,
    concurrency: usize,
    rate: f64,
    secs: f64,
    history: bool,
) -> Latency {
    setup::reset(store).await;
    let starts = Arc::new(Mutex::new(HashMap::new()));
    let s = Scheduler::builder(store.pool().clone(), config(concurrency, history))
        .register(Probe {
            starts: starts.clone(),
        })
        .start()
        .await
        .expect("start scheduler");
    // Let it go idle: the first empty claims back the poll interval off.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let l = offer(store, &starts, 0, rate, secs, None).await;
    debug_metrics(&s);
    s.shutdown().await.expect("shutdown");
    l
}

// ---------------------------------------------------------------------------------
// Keyed work

/// Enqueue `keys` x `per_key` keyed no-op jobs, round robin over the keys.
pub async fn load_keyed(store: &Store, keys: u64, per_key: u64, kind: &str, prefix: &str) {
    let mut batch = Vec::with_capacity(5000);
    for j in 0..per_key {
        for k in 0..keys {
            batch.push(
                NewJob::from_json(kind, json!({ "n": j * keys + k }))
                    .with_key(format!("{prefix}{k}")),
            );
            if batch.len() == 5000 {
                store
                    .enqueue_many(std::mem::take(&mut batch))
                    .await
                    .expect("enqueue keyed");
            }
        }
    }
    if !batch.is_empty() {
        store.enqueue_many(batch).await.expect("enqueue keyed");
    }
}

/// Jobs/s draining `keys` x `per_key` keyed jobs.
pub async fn keyed(
    store: &Store,
    keys: u64,
    per_key: u64,
    concurrency: usize,
    history: bool,
) -> f64 {
    setup::reset(store).await;
    load_keyed(store, keys, per_key, "noop", "k").await;
    setup::analyze(store).await;
    let n = keys * per_key;
    let done = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let s = Scheduler::builder(store.pool().clone(), config(concurrency, history))
        .register(Noop { done: done.clone() })
        .start()
        .await
        .expect("start scheduler");
    wait_until(
        "keyed jobs to drain",
        Duration::from_secs(30 + n / 100),
        || s.metrics().counters.completed >= n,
    )
    .await;
    let took = t0.elapsed().as_secs_f64();
    s.shutdown().await.expect("shutdown");
    n as f64 / took
}

/// One hot key with `backlog` jobs: its jobs/s in each window, and the enqueue-to-start
/// latency of jobs of other keys offered at `other_rate` meanwhile.
pub async fn hot_key(
    store: &Store,
    backlog: u64,
    windows: usize,
    window: f64,
    other_rate: f64,
    concurrency: usize,
    history: bool,
) -> Vec<(f64, Latency)> {
    setup::reset(store).await;
    let mut i = 0;
    while i < backlog {
        let batch: Vec<NewJob> = (i..(i + 10_000).min(backlog))
            .map(|n| noop_job(n).with_key("hot"))
            .collect();
        i += batch.len() as u64;
        store.enqueue_many(batch).await.expect("enqueue hot key");
    }
    setup::analyze(store).await;
    setup::checkpoint(store).await;
    let done = Arc::new(AtomicU64::new(0));
    let starts = Arc::new(Mutex::new(HashMap::new()));
    let s = Scheduler::builder(store.pool().clone(), config(concurrency, history))
        .register(Noop { done: done.clone() })
        .register(Probe {
            starts: starts.clone(),
        })
        .start()
        .await
        .expect("start scheduler");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut out = Vec::new();
    let mut first = 0;
    for _ in 0..windows {
        let c0 = done.load(Relaxed);
        let t0 = Instant::now();
        let others = offer(store, &starts, first, other_rate, window, Some("other")).await;
        let rate = (done.load(Relaxed) - c0) as f64 / t0.elapsed().as_secs_f64();
        first += others.samples as u64 + 1;
        out.push((rate, others));
    }
    debug_metrics(&s);
    s.shutdown().await.expect("shutdown");
    out
}

// ---------------------------------------------------------------------------------
// Claim cost as the table grows

/// Median time of `iterations` claims of `limit` jobs (each batch then completed), over
/// a fresh working set of pending jobs added on top of whatever the table holds.
pub async fn claim_latency(store: &Store, iterations: usize, limit: i64) -> f64 {
    setup::raw_copy(store, "noop", iterations as u64 * limit as u64).await;
    setup::vacuum_analyze(store).await;
    let owner = OwnerId::named(format!("bench:claim:{}", rand_suffix()));
    let mut req = ClaimRequest::new(
        owner.clone(),
        vec![QUEUE.into()],
        limit,
        Duration::from_secs(30),
    );
    req.kinds = Some(vec!["noop".into()]);
    let mut took = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let t = Instant::now();
        let jobs = store.claim(&req).await.expect("claim");
        took.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(jobs.len() as i64, limit, "claim found too few jobs");
        let items: Vec<_> = jobs.iter().map(|j| (j.id, j.generation, None)).collect();
        store.complete_many(&owner, &items).await.expect("complete");
    }
    percentile(&took, 0.5)
}

pub async fn explain_claim(store: &Store, limit: i64) -> String {
    let mut req = ClaimRequest::new(
        OwnerId::named("bench:explain"),
        vec![QUEUE.into()],
        limit,
        Duration::from_secs(30),
    );
    req.kinds = Some(vec!["noop".into()]);
    store.explain_claim(&req).await.expect("explain")
}

fn rand_suffix() -> u64 {
    Instant::now().elapsed().as_nanos() as u64
        ^ std::process::id() as u64
        ^ (std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64)
}

// ---------------------------------------------------------------------------------
// Memory: a child process holding `keys` active keys

/// Runs in a child process (`--memory-child N`), so the figure is that of a process
/// holding only the scheduler. Prints one JSON line.
pub async fn memory_child(keys: usize) {
    let opts = setup::bench_database().await;
    let pool = setup::pool(&opts, 8).await;
    let before = setup::rss_mb();
    let started = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = tokio::sync::watch::channel(false);
    let mut cfg = config(keys + 16, false);
    cfg.sequencer_idle = Duration::from_secs(60);
    let s = Scheduler::builder(pool.clone(), cfg)
        .register(Hold {
            started: started.clone(),
            release: rx,
        })
        .start()
        .await
        .expect("start scheduler");
    let t0 = Instant::now();
    wait_until("every key to be active", Duration::from_secs(120), || {
        started.load(Relaxed) >= keys
    })
    .await;
    let ramp = t0.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let m = s.metrics();
    let during = setup::rss_mb();
    tx.send(true).expect("release");
    wait_until("held jobs to complete", Duration::from_secs(120), || {
        s.metrics().counters.completed >= keys as u64
    })
    .await;
    s.shutdown().await.expect("shutdown");
    println!(
        "{}",
        json!({
            "rss_before_mb": before,
            "rss_mb": during,
            "sequencers": m.sequencers,
            "in_flight": m.in_flight,
            "ramp_secs": ramp,
        })
    );
}

/// Load `keys` held jobs (one per key) and measure a child process holding them all.
pub async fn memory(store: &Store, keys: u64) -> serde_json::Value {
    setup::reset(store).await;
    load_keyed(store, keys, 1, "hold", "m").await;
    setup::analyze(store).await;
    let exe = std::env::current_exe().expect("current exe");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(exe)
            .arg("--memory-child")
            .arg(keys.to_string())
            .stderr(std::process::Stdio::inherit())
            .output()
    })
    .await
    .expect("join")
    .expect("run the memory child");
    assert!(out.status.success(), "memory child failed");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or("{}");
    serde_json::from_str(line).expect("memory child JSON")
}

// ---------------------------------------------------------------------------------
// Statement costs (diagnostic, `--only micro`)

/// Median ms of (leasehold claim, leasehold complete_many, raw claim, raw complete) for
/// batches of `batch`, one at a time on an otherwise idle database.
pub async fn micro(store: &Store, opts: &PgConnectOptions, batch: i64, rounds: usize) -> [f64; 4] {
    setup::reset(store).await;
    setup::raw_copy(store, "noop", 2 * rounds as u64 * batch as u64).await;
    setup::vacuum_analyze(store).await;
    let owner = OwnerId::named("bench:micro");
    let mut req = ClaimRequest::new(
        owner.clone(),
        vec![QUEUE.into()],
        batch,
        Duration::from_secs(30),
    );
    req.kinds = Some(vec!["noop".into()]);
    let (mut lc, mut lw, mut rc, mut rw) = (vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        let t = Instant::now();
        let jobs = store.claim(&req).await.expect("claim");
        lc.push(t.elapsed().as_secs_f64() * 1e3);
        let items: Vec<_> = jobs.iter().map(|j| (j.id, j.generation, None)).collect();
        let t = Instant::now();
        store.complete_many(&owner, &items).await.expect("complete");
        lw.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let mut conn = setup::connect(opts).await;
    let queues = vec![QUEUE.to_string()];
    for _ in 0..rounds {
        let t = Instant::now();
        let rows: Vec<(i64, i64, serde_json::Value)> = sqlx::query_as(RAW_CLAIM)
            .bind(&queues)
            .bind(batch)
            .bind("raw")
            .fetch_all(&mut conn)
            .await
            .expect("raw claim");
        rc.push(t.elapsed().as_secs_f64() * 1e3);
        let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
        let gens: Vec<i64> = rows.iter().map(|r| r.1).collect();
        let t = Instant::now();
        sqlx::query(RAW_COMPLETE)
            .bind(&ids)
            .bind(&gens)
            .bind("raw")
            .execute(&mut conn)
            .await
            .expect("raw complete");
        rw.push(t.elapsed().as_secs_f64() * 1e3);
    }
    conn.close().await.ok();
    [
        percentile(&lc, 0.5),
        percentile(&lw, 0.5),
        percentile(&rc, 0.5),
        percentile(&rw, 0.5),
    ]
}
