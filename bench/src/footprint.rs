//! Footprint: claim cost as the table grows (with its EXPLAIN), and memory.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::{ClaimRequest, OwnerId, Scheduler, Store};
use serde_json::json;

use super::handlers::{config, wait_until, Hold};
use super::report::percentile;
use super::setup::{self, QUEUE};
use super::throughput::load_keyed;

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
        let items: Vec<_> = jobs.iter().map(|j| (j.attempt(), None)).collect();
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
