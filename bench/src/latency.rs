//! Latency: enqueue-to-start at a fixed offered rate, and one hot key.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold::{NewJob, Scheduler, Store};
use serde_json::json;

use super::handlers::{config, debug_metrics, noop_job, wait_until, Noop, Probe};
use super::report::percentile;
use super::setup::{self, SCHEMA};

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
