//! Handlers and helpers shared by the workloads.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold::{Config, Handler, JobContext, JobError, NewJob, Scheduler};
use serde_json::json;

use super::setup::SCHEMA;

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

/// Burns about `CPU_WORK` of one core (SHA-256 rounds, sized once at start), then
/// counts: a CPU-bound handler, to see handlers use the threads they are given.
pub struct Cpu {
    pub done: Arc<AtomicU64>,
    pub rounds: u64,
}

/// What one [`Cpu`] job costs on one core.
pub const CPU_WORK: Duration = Duration::from_millis(2);

impl Cpu {
    /// Rounds of hashing that take [`CPU_WORK`] on this machine (measured on the calling
    /// thread).
    pub fn calibrate() -> u64 {
        let t = Instant::now();
        let n = 20_000;
        std::hint::black_box(hash_rounds(n));
        let per = t.elapsed().as_secs_f64() / n as f64;
        (CPU_WORK.as_secs_f64() / per).max(1.0) as u64
    }
}

fn hash_rounds(n: u64) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut h = [0u8; 32];
    for _ in 0..n {
        h = Sha256::digest(h).into();
    }
    h
}

impl Handler for Cpu {
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "noop";

    async fn run(&self, _: JobContext, _: serde_json::Value) -> Result<(), JobError> {
        std::hint::black_box(hash_rounds(self.rounds));
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
    // Experiments' knobs, not recommendations: the defaults are what users get.
    // `LEASEHOLD_BENCH_HANDLER_THREADS=0` runs handlers on the scheduler's own thread
    // (see `Config::handler_threads`).
    if let Some(n) = knob("LEASEHOLD_BENCH_CLAIM_AHEAD") {
        c.claim_ahead = n;
    }
    if let Some(n) = knob("LEASEHOLD_BENCH_HANDLER_THREADS") {
        c.handler_threads = Some(n);
    }
    if let Some(n) = knob("LEASEHOLD_BENCH_CLAIM_BATCH_MAX") {
        c.claim_batch_max = n;
    }
    if let Some(n) = knob("LEASEHOLD_BENCH_COMPLETION_BATCH") {
        c.completion_batch = n;
    }
    if let Some(us) = knob("LEASEHOLD_BENCH_COMPLETION_FLUSH_US") {
        c.completion_flush = Duration::from_micros(us as u64);
    }
    c
}

/// A number from the environment variable `name`, if it is set to one.
fn knob(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

pub fn noop_job(n: u64) -> NewJob {
    NewJob::from_json("noop", json!({ "n": n }))
}

pub async fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        if Instant::now() > deadline {
            panic!("bench: timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
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
