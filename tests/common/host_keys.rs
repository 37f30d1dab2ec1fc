//! A scenario shared by the direct and the pooled runtime tests: hosts' open
//! transactions hold three keys while those keys' heads finish, and unkeyed jobs run
//! meanwhile. Each head's completion must wait for its key; no other job's ending may
//! wait with it. Asserted on the handlers' log (when each returned) and the jobs'
//! states (when each was seen done).
//!
//! Include it next to `common`, `worker` and `scripted` with
//! `#[path = "common/host_keys.rs"] mod host_keys;`.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use leasehold::{JobId, JobState, Scheduler};
use sqlx::PgPool;

use crate::common::TestDb;
use crate::scripted::{scripted, work, Script, Scripted};
use crate::worker::wait_until;

/// Wait until every job of `ids` is in a terminal state.
pub async fn wait_done(db: &TestDb, ids: &[JobId], secs: u64) {
    wait_until(secs, "the jobs to end", || async {
        for id in ids {
            if !db.store.job(*id).await.unwrap().state.is_terminal() {
                return false;
            }
        }
        true
    })
    .await;
}

/// Run the scenario on `scheduler` (whose handler is `h`, its jobs in `db`), the hosts'
/// transactions on `host_pool`; shuts the scheduler down at the end. Each unkeyed job
/// must be done within half a `lease` of its handler's return.
pub async fn endings_while_hosts_hold_keys(
    scheduler: Scheduler,
    h: &Scripted,
    db: &TestDb,
    host_pool: &PgPool,
    lease: Duration,
) {
    let keys = ["K1", "K2", "K3"];
    let mut heads = Vec::new();
    for k in keys {
        heads.push(
            scheduler
                .enqueue_job(
                    scripted(Script {
                        gate: Some(format!("finish-{k}")),
                        ..work(&format!("head-{k}"), 0)
                    })
                    .with_key(k),
                )
                .await
                .unwrap(),
        );
    }
    for k in keys {
        h.started(&format!("head-{k}"), 10).await;
    }
    // Each host enqueues its key's next job and stays open: the key row is locked.
    let mut hosts = Vec::new();
    let mut nexts = Vec::new();
    for k in keys {
        let mut host = host_pool.begin().await.unwrap();
        nexts.push(
            scheduler
                .enqueue_in(
                    &mut host,
                    scripted(work(&format!("next-{k}"), 0)).with_key(k),
                )
                .await
                .unwrap(),
        );
        hosts.push(host);
    }
    // The heads finish one after another, so their completions are separate
    // batches, each left waiting for its key.
    for k in keys {
        h.open(&format!("finish-{k}"));
        h.ended(&format!("head-{k}"), 10).await;
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    // Unkeyed jobs now, one every 100 ms: each must be done soon after its handler
    // returns.
    let (quick, waits) = quick_endings(&scheduler, h, db, 12, |_| None).await;
    let slowest = waits.iter().max().copied().unwrap();
    // The heads are still waiting for their keys.
    for id in &heads {
        assert_eq!(db.store.job(*id).await.unwrap().state, JobState::Running);
    }
    // The hosts let go one at a time, the last key first: each head must complete soon
    // after its own key is free, however long the keys before it stay held (a
    // completion waiting for K1 must not keep K3's waiting behind it).
    let mut hosts = hosts;
    let mut after_commit = Vec::new();
    while let Some(host) = hosts.pop() {
        host.commit().await.unwrap();
        let committed = Instant::now();
        let head = heads[hosts.len()];
        loop {
            if db.store.job(head).await.unwrap().state == JobState::Done {
                break;
            }
            assert!(
                committed.elapsed() < Duration::from_secs(10),
                "head {head} not done 10 s after its key was let go ({} keys still held)",
                hosts.len()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        after_commit.push(committed.elapsed());
    }
    assert!(
        after_commit.iter().all(|d| *d < lease / 2),
        "a head completed long after its key was let go: {after_commit:?} (K3, K2, K1)"
    );
    let all: Vec<_> = heads.iter().chain(&nexts).chain(&quick).copied().collect();
    wait_done(db, &all, 20).await;
    let m = scheduler.metrics();
    scheduler.shutdown().await.unwrap();
    assert!(
        slowest < lease / 2,
        "an unkeyed job waited {slowest:?} from its handler's return to done while the \
         hosts held three keys (a completion waiting on a key held a connection every \
         ending needs); all: {waits:?}"
    );
    for id in &all {
        let job = db.store.job(*id).await.unwrap();
        assert_eq!(
            (job.state, job.generation.0),
            (JobState::Done, 1),
            "{job:?}"
        );
    }
    assert_eq!(db.count_where("lease_expiries", "true").await, 0);
    assert_eq!(m.counters.leases_lost, 0, "{:?}", m.counters);
    h.assert_keys_serial();
}

/// Enqueue `n` jobs that return at once, one every 100 ms (job `i` with key `key_of(i)`),
/// and measure for each the time from its handler's return to the first moment it is
/// seen done. Returns their ids and those waits; panics when one is not done in 20 s.
pub async fn quick_endings(
    scheduler: &Scheduler,
    h: &Scripted,
    db: &TestDb,
    n: usize,
    key_of: impl Fn(usize) -> Option<String>,
) -> (Vec<JobId>, Vec<Duration>) {
    // Enqueued by a task while this one watches their states.
    let enqueued = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let jobs: Vec<_> = (0..n)
        .map(|i| {
            let job = scripted(work(&format!("quick-{i}"), 0));
            match key_of(i) {
                Some(k) => job.with_key(k),
                None => job,
            }
        })
        .collect();
    let enqueuer = {
        let scheduler = scheduler.clone();
        let enqueued = enqueued.clone();
        tokio::spawn(async move {
            for job in jobs {
                let id = scheduler.enqueue_job(job).await.unwrap();
                enqueued.lock().unwrap().push(id);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    // The first moment each is seen done, against its handler's return.
    let mut done_at: Vec<Option<Instant>> = vec![None; n];
    let deadline = Instant::now() + Duration::from_secs(20);
    while done_at.iter().any(Option::is_none) {
        let quick: Vec<JobId> = enqueued.lock().unwrap().clone();
        if Instant::now() > deadline {
            let mut seen = Vec::new();
            for (i, id) in quick.iter().enumerate() {
                let job = db.store.job(*id).await.unwrap();
                let ran = h.runs_tagged(&format!("quick-{i}"));
                seen.push(format!(
                    "{id}: {:?} gen {} ran {} ended {}",
                    job.state,
                    job.generation.0,
                    ran.len(),
                    ran.iter().filter(|e| e.end.is_some()).count()
                ));
            }
            panic!("quick jobs not done within 20 s: {seen:#?}");
        }
        for (i, id) in quick.iter().enumerate() {
            if done_at[i].is_none() && db.store.job(*id).await.unwrap().state == JobState::Done {
                done_at[i] = Some(Instant::now());
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    enqueuer.await.unwrap();
    let quick: Vec<JobId> = enqueued.lock().unwrap().clone();
    let waits = (0..n)
        .map(|i| {
            let returned = h.runs_tagged(&format!("quick-{i}"))[0].end.unwrap();
            done_at[i].unwrap().saturating_duration_since(returned)
        })
        .collect();
    (quick, waits)
}
