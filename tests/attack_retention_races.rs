//! Attack on retention's races with producers: "a key enqueued again while its row is
//! deleted keeps growing key_seq and its order", with two pruners at once (zero
//! retention, every few milliseconds, as the chaos operator does), producers enqueueing
//! the same few keys one at a time, in batches and inside host transactions, and a
//! worker draining. Every key row is deleted and made again many times over.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use leasehold::Store;

const KEYS: u64 = 60;

async fn produce(store: Store, stop: Arc<AtomicBool>, style: u8) -> u64 {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let key = format!("acct-{}", rand::random::<u64>() % KEYS);
        match style {
            0 => {
                store.enqueue(keyed("k", &key, n as i64)).await.unwrap();
                n += 1;
            }
            1 => {
                let other = format!("acct-{}", rand::random::<u64>() % KEYS);
                store
                    .enqueue_many(vec![
                        keyed("k", &key, n as i64),
                        keyed("k", &other, n as i64 + 1),
                        keyed("k", &key, n as i64 + 2),
                    ])
                    .await
                    .unwrap();
                n += 3;
            }
            _ => {
                let mut tx = store.pool().begin().await.unwrap();
                store
                    .enqueue_in(&mut tx, keyed("k", &key, n as i64))
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(15)).await;
                tx.commit().await.unwrap();
                n += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(80)).await;
    }
    n
}

async fn prune_loop(store: Store, stop: Arc<AtomicBool>) -> (u64, u64, u64) {
    let (mut passes, mut skipped, mut keys) = (0, 0, 0);
    while !stop.load(Ordering::Relaxed) {
        let r = common::prune_now(&store, 20).await.unwrap();
        passes += 1;
        skipped += r.skipped as u64;
        keys += r.keys;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    (passes, skipped, keys)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_keeps_its_order_and_key_seq_while_two_pruners_race_its_producers() {
    bounded(async {
        let db = TestDb::new("atk_ret_races").await;
        let stop = Arc::new(AtomicBool::new(false));
        let mut producers = Vec::new();
        for style in 0..3u8 {
            let store = db.other_store(&format!("producer{style}")).await;
            producers.push(tokio::spawn(produce(store, stop.clone(), style)));
        }
        let mut pruners = Vec::new();
        for p in 0..2 {
            let store = db.other_store(&format!("pruner{p}")).await;
            pruners.push(tokio::spawn(prune_loop(store, stop.clone())));
        }
        // The worker: one job at a time, as a key's handler would run it.
        let w = owner("w");
        let mut ran: Vec<(String, i64, i64)> = Vec::new();
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(12) {
            let got = db.store.claim(&claim_at(&w, 1, far_future())).await.unwrap();
            match got.into_iter().next() {
                Some(j) => {
                    db.store.complete(&j.fence(), None).await.unwrap();
                    ran.push((j.key.clone().unwrap(), j.key_seq.unwrap(), j.id.0));
                }
                None => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        }
        stop.store(true, Ordering::Relaxed);
        let mut enqueued = 0;
        for p in producers {
            enqueued += within(20, "a producer", p).await.unwrap();
        }
        let mut prune_figures = Vec::new();
        for p in pruners {
            prune_figures.push(within(20, "a pruner", p).await.unwrap());
        }
        // Drain what is left.
        let open_at_stop = db
            .count_where("jobs", "state IN ('pending', 'waiting', 'running')")
            .await;
        let drain_started = Instant::now();
        let mut odd = Vec::new();
        while drain_started.elapsed() < Duration::from_secs(40) {
            let got = db.store.claim(&claim_at(&w, 1, far_future())).await.unwrap();
            match got.into_iter().next() {
                Some(j) => {
                    let outcome = db.store.complete(&j.fence(), None).await.unwrap();
                    if outcome != leasehold::CompleteOutcome::Completed && odd.len() < 5 {
                        odd.push(format!("{j:?}: {outcome:?}"));
                    }
                    ran.push((j.key.clone().unwrap(), j.key_seq.unwrap(), j.id.0));
                }
                None => break,
            }
        }
        eprintln!("{open_at_stop} open when the producers stopped; drained in {:?}; odd completions {odd:?}", drain_started.elapsed());
        let stuck = db
            .count_where("jobs", "state IN ('pending', 'waiting', 'running')")
            .await;
        eprintln!(
            "{enqueued} enqueued, {} ran; pruners (passes, skipped, key rows deleted): \
             {prune_figures:?}; {stuck} left open",
            ran.len()
        );
        assert_eq!(stuck, 0, "jobs left without a head to run them");
        assert_eq!(ran.len() as u64, enqueued, "every job ran once");
        assert!(
            prune_figures.iter().map(|f| f.2).sum::<u64>() > 20,
            "the key rows were not deleted often enough to test anything: {prune_figures:?}"
        );
        let mut last: HashMap<&str, (i64, i64)> = HashMap::new();
        for (key, seq, id) in &ran {
            if let Some(&(prev_seq, prev_id)) = last.get(key.as_str()) {
                assert!(
                    *seq > prev_seq,
                    "key {key}: job {id} (key_seq {seq}) ran after job {prev_id} (key_seq {prev_seq})"
                );
            }
            last.insert(key, (*seq, *id));
        }
        db.drop().await;
    })
    .await
}
