//! A primary fails over to its standby under two running schedulers.
//!
//! Each test starts its own primary and streaming standby (tests/common/replica.rs;
//! never the shared server), and two schedulers in this process that reach the database
//! through a loopback proxy, as services reach a primary through a virtual IP or a DNS
//! name. Keyed payment jobs charge an in-process gateway through `JobContext::once`
//! (the effect ledger) with the effect key as the idempotency key; the gateway keeps
//! books of every request and every charge. Mid-run the primary's postmaster is
//! SIGKILLed (a crash, not a shutdown), the standby is promoted and the proxy moved to it.
//!
//! * Synchronous standby: no acknowledged enqueue or completion is lost, every job is
//!   charged exactly once, a key's jobs ran in order and never overlapped, and the same
//!   two schedulers finish the work (reconnect, re-LISTEN, reclaim the leases the dead
//!   primary granted, by the new primary's clock).
//! * Asynchronous standby: what the standby had not received is gone — shown
//!   deterministically by stopping the standby first, so every enqueue and completion
//!   acknowledged after that is on the old primary only. The lost enqueues are missing;
//!   the jobs completed in the gap run again, and the gateway's idempotency key (the
//!   effect key) is what keeps their charges single. A job this process had claimed in
//!   the gap may start under that lost lease; the new primary refuses its writes, so it
//!   ends failed without reaching the gateway, and the runs that completed keep each
//!   key's order on each primary.

mod common;
#[path = "../examples/chaos/pgbin.rs"]
#[allow(dead_code)]
mod pgbin;
#[path = "common/replica.rs"]
mod replica;
#[path = "common/worker.rs"]
mod worker;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::within;
use leasehold::{Config, JobContext, JobError, JobId, NewJob, Scheduler};
use replica::{Pair, Proxy};
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::Connection;

const SCHEMA: &str = "failover";

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Charge {
    key: String,
    seq: u64,
}

/// The payment gateway: charges once per idempotency key, and keeps books of every
/// request it got.
#[derive(Default)]
struct Gateway {
    /// Requests per idempotency key.
    requests: HashMap<String, u32>,
    /// The receipt of each key's one charge.
    charges: HashMap<String, u64>,
}

/// One handler run, as the handler saw it.
#[derive(Clone, Debug)]
struct Run {
    job: i64,
    key: String,
    seq: u64,
    start: Instant,
    end: Instant,
    ok: bool,
    by: &'static str,
}

#[derive(Clone)]
struct Pay {
    by: &'static str,
    gateway: Arc<Mutex<Gateway>>,
    runs: Arc<Mutex<Vec<Run>>>,
}

impl leasehold::Handler for Pay {
    type Payload = Charge;
    type Output = u64;
    const KIND: &'static str = "pay";

    async fn run(&self, ctx: JobContext, charge: Charge) -> Result<u64, JobError> {
        let start = Instant::now();
        tokio::time::sleep(Duration::from_millis(20)).await;
        let gateway = self.gateway.clone();
        let outcome = ctx
            .once("charge", &charge, |key| async move {
                let mut g = gateway.lock().unwrap();
                *g.requests.entry(key.as_str().to_string()).or_default() += 1;
                let next = g.charges.len() as u64 + 1;
                Ok(*g.charges.entry(key.as_str().to_string()).or_insert(next))
            })
            .await;
        tokio::time::sleep(Duration::from_millis(10)).await;
        self.runs.lock().unwrap().push(Run {
            job: ctx.job_id().0,
            key: charge.key.clone(),
            seq: charge.seq,
            start,
            end: Instant::now(),
            ok: outcome.is_ok(),
            by: self.by,
        });
        outcome
    }
}

/// The runtime tests' short durations (lease 2 s, renewal 500 ms, reaper 300 ms), four
/// slots per scheduler.
fn config() -> Config {
    let mut c = worker::fast_config(SCHEMA);
    c.concurrency = 4;
    c
}

/// Two schedulers through the proxy, with their handlers' shared books.
struct Cluster {
    a: Scheduler,
    b: Scheduler,
    gateway: Arc<Mutex<Gateway>>,
    runs: Arc<Mutex<Vec<Run>>>,
}

async fn schedulers(proxy: &Proxy) -> Cluster {
    let gateway: Arc<Mutex<Gateway>> = Default::default();
    let runs: Arc<Mutex<Vec<Run>>> = Default::default();
    let mut started = Vec::new();
    for by in ["a", "b"] {
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(proxy.options());
        let handler = Pay {
            by,
            gateway: gateway.clone(),
            runs: runs.clone(),
        };
        started.push(
            Scheduler::builder(pool, config())
                .register(handler)
                .start()
                .await
                .expect("start a scheduler"),
        );
    }
    let b = started.pop().unwrap();
    let a = started.pop().unwrap();
    Cluster {
        a,
        b,
        gateway,
        runs,
    }
}

/// Keyed jobs enqueued one by one through `scheduler`; returns those acknowledged.
/// Each key's `seq` counts every attempt to enqueue, acknowledged or not.
async fn enqueue(
    scheduler: &Scheduler,
    keys: usize,
    n: usize,
    seqs: &mut BTreeMap<String, u64>,
) -> Vec<JobId> {
    let mut acked = Vec::new();
    for i in 0..n {
        let key = format!("acct-{}", i % keys);
        let seq = seqs.entry(key.clone()).or_default();
        *seq += 1;
        let job = NewJob::new(
            "pay",
            &Charge {
                key: key.clone(),
                seq: *seq,
            },
        )
        .unwrap()
        .with_key(key);
        if let Ok(id) = scheduler.enqueue_job(job).await {
            acked.push(id);
        }
    }
    acked
}

fn ok_runs(runs: &Arc<Mutex<Vec<Run>>>) -> usize {
    runs.lock().unwrap().iter().filter(|r| r.ok).count()
}

/// A key's runs, by start: their sequence numbers never go back, and no two overlap.
fn assert_keys_serial(runs: &[Run]) {
    let mut by_key: BTreeMap<&str, Vec<&Run>> = BTreeMap::new();
    for r in runs {
        by_key.entry(&r.key).or_default().push(r);
    }
    let t0 = runs.iter().map(|r| r.start).min();
    for (key, mut rs) in by_key {
        rs.sort_by_key(|r| r.start);
        let t0 = t0.unwrap();
        let story: Vec<String> = rs
            .iter()
            .map(|r| {
                format!(
                    "job {} seq {} on {} {}..{} ms{}",
                    r.job,
                    r.seq,
                    r.by,
                    (r.start - t0).as_millis(),
                    (r.end - t0).as_millis(),
                    if r.ok { "" } else { " (failed)" }
                )
            })
            .collect();
        for w in rs.windows(2) {
            assert!(
                w[1].start >= w[0].end,
                "{key}: job {} (on {}) started before job {} (on {}) ended: {story:#?}",
                w[1].job,
                w[1].by,
                w[0].job,
                w[0].by
            );
            assert!(
                w[1].seq >= w[0].seq,
                "{key}: seq {} ran after seq {}: {story:#?}",
                w[1].seq,
                w[0].seq
            );
        }
    }
}

/// The gateway's books against the new primary's rows: every job in `ids` is done with
/// the receipt of its own key's one charge (a re-run got the first charge back by its
/// idempotency key; a second charge under another key would show as a mismatch).
async fn assert_books(pair: &Pair, ids: &[JobId], gateway: &Arc<Mutex<Gateway>>) {
    let list = ids
        .iter()
        .map(|i| i.0.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut conn = sqlx::PgConnection::connect_with(&pair.standby.options())
        .await
        .unwrap();
    let rows: Vec<(i64, Option<serde_json::Value>, String)> = sqlx::query_as(&format!(
        "SELECT id, result, effect_identity::text FROM {SCHEMA}.jobs WHERE id IN ({list}) AND state = 'done'"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(rows.len(), ids.len());
    // The standby holds each job's effect identity as the primary had it: the keys the
    // gateway saw are found.
    let g = gateway.lock().unwrap();
    let mut receipts = HashSet::new();
    for (id, result, identity) in rows {
        let identity = leasehold::EffectIdentity::parse(&identity).unwrap();
        let key = leasehold::EffectKey::new(&identity, JobId(id), "charge");
        let charged = g.charges.get(key.as_str()).copied();
        assert_eq!(
            result.and_then(|r| r.as_u64()),
            charged,
            "job {id}: its result is its own charge's receipt"
        );
        assert!(receipts.insert(charged), "job {id} shares a receipt");
    }
}

async fn done_among(pair: &Pair, ids: &[JobId]) -> i64 {
    let list = ids
        .iter()
        .map(|i| i.0.to_string())
        .collect::<Vec<_>>()
        .join(",");
    if list.is_empty() {
        return 0;
    }
    pair.standby
        .scalar(&format!(
            "SELECT count(*) FROM {SCHEMA}.jobs WHERE id IN ({list}) AND state = 'done'"
        ))
        .await
}

async fn present_among(pair: &Pair, ids: &[JobId]) -> i64 {
    let list = ids
        .iter()
        .map(|i| i.0.to_string())
        .collect::<Vec<_>>()
        .join(",");
    pair.standby
        .scalar(&format!(
            "SELECT count(*) FROM {SCHEMA}.jobs WHERE id IN ({list})"
        ))
        .await
}

async fn wait_for(secs: u64, what: &str, mut cond: impl FnMut() -> bool) {
    within(secs, what, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

#[test]
fn a_failover_to_a_synchronous_standby_loses_nothing_acknowledged_and_charges_once() {
    let system = actix::System::new();
    system.block_on(within(150, "synchronous failover", async {
        let mut pair = Pair::start("failover-sync", true);
        pair.wait_streaming(true).await;
        let proxy = Proxy::start(pair.primary.port).await;
        let c = schedulers(&proxy).await;
        let mut seqs = BTreeMap::new();
        let mut acked = enqueue(&c.a, 30, 600, &mut seqs).await;
        assert_eq!(acked.len(), 600);
        wait_for(60, "a third of the jobs to run", || ok_runs(&c.runs) >= 200).await;

        // Enqueues keep coming through the crash; only the acknowledged count.
        let enqueuer = {
            let a = c.a.clone();
            let mut seqs = seqs.clone();
            actix::spawn(async move {
                let mut acked = Vec::new();
                let until = Instant::now() + Duration::from_secs(4);
                while Instant::now() < until {
                    acked.extend(enqueue(&a, 20, 5, &mut seqs).await);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                acked
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let killed = Instant::now();
        let before_kill = c.runs.lock().unwrap().len();
        pair.primary.kill();
        pair.promote().await;
        proxy.repoint(pair.standby.port);
        let promoted = Instant::now();
        acked.extend(enqueuer.await.unwrap());

        // The same two schedulers finish every acknowledged job on the new primary.
        let total = acked.len() as i64;
        let mut finished = 0;
        for _ in 0..900 {
            finished = done_among(&pair, &acked).await;
            if finished == total {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            finished, total,
            "every acknowledged job is done on the new primary"
        );
        // An enqueue whose commit reached the standby while its reply was lost in the
        // crash is a job too (acknowledged implies committed, not the converse): it
        // runs like the others, so the books count every job the new primary holds.
        let mut jobs: i64 = 0;
        for _ in 0..300 {
            let open: i64 = pair
                .standby
                .scalar(&format!(
                    "SELECT count(*) FROM {SCHEMA}.jobs WHERE state <> 'done'"
                ))
                .await;
            jobs = pair
                .standby
                .scalar(&format!("SELECT count(*) FROM {SCHEMA}.jobs"))
                .await;
            if open == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            jobs >= total && jobs <= total + 2,
            "{jobs} jobs on the new primary for {total} acknowledged (at most the enqueues \
             in flight at the crash, one per enqueuer, may be there unacknowledged)"
        );
        let runs = c.runs.lock().unwrap().clone();
        let first_after = runs
            .iter()
            .filter(|r| r.ok && r.start > promoted)
            .map(|r| r.end)
            .min()
            .expect("jobs ran after the failover");
        println!(
            "failover: kill to promoted {:?}, kill to first job done on the new primary {:?}; \
             {} acknowledged jobs, {} runs ({} before the kill)",
            promoted - killed,
            first_after - killed,
            total,
            runs.len(),
            before_kill
        );
        for by in ["a", "b"] {
            assert!(
                runs.iter()
                    .any(|r| r.ok && r.by == by && r.start > promoted),
                "scheduler {by} ran jobs after the failover, without a restart"
            );
        }

        // The gateway's books: one charge per job; a request repeated only by a run the
        // crash cut before its ledger row committed, and deduplicated by its key.
        let (charges, repeated) = {
            let g = c.gateway.lock().unwrap();
            let repeated: u32 = g.requests.values().map(|n| n - 1).sum();
            (g.charges.len() as i64, repeated)
        };
        assert_eq!(charges, jobs, "one charge per job");
        assert!(
            repeated <= 8,
            "at most one repeated request per slot in flight at the crash: {repeated}"
        );
        assert_books(&pair, &acked, &c.gateway).await;
        let ledger: i64 = pair
            .standby
            .scalar(&format!("SELECT count(*) FROM {SCHEMA}.effects"))
            .await;
        assert_eq!(ledger, jobs, "the effect ledger survived the failover");
        assert_keys_serial(&runs);

        c.a.shutdown().await.unwrap();
        c.b.shutdown().await.unwrap();
        drop(pair);
    }));
}

#[test]
fn a_failover_to_an_asynchronous_standby_loses_what_it_had_not_received() {
    let system = actix::System::new();
    system.block_on(within(150, "asynchronous failover", async {
        let mut pair = Pair::start("failover-async", false);
        pair.wait_streaming(false).await;
        let proxy = Proxy::start(pair.primary.port).await;
        let c = schedulers(&proxy).await;
        let mut seqs = BTreeMap::new();
        // Enough that some are still running when the standby stops receiving: their
        // completions are the ones the failover loses.
        let replicated = enqueue(&c.a, 10, 200, &mut seqs).await;
        assert_eq!(replicated.len(), 200);
        wait_for(60, "the first jobs to run", || ok_runs(&c.runs) >= 20).await;

        // The standby stops receiving: from here on, what the primary acknowledges is
        // on the primary alone (an asynchronous standby falling behind, made exact).
        pair.wait_caught_up().await;
        pair.standby.stop();
        let gap_started = Instant::now();
        let done_at_gap = ok_runs(&c.runs);
        let in_gap = enqueue(&c.a, 10, 30, &mut seqs).await;
        assert_eq!(in_gap.len(), 30, "acknowledged: the primary waits for no standby");
        wait_for(60, "jobs to complete in the gap", || {
            ok_runs(&c.runs) >= done_at_gap + 25
        })
        .await;
        let completed_in_gap: HashSet<i64> = c
            .runs
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.ok && r.end > gap_started && replicated.contains(&JobId(r.job)))
            .map(|r| r.job)
            .collect();

        let killed = Instant::now();
        pair.primary.kill();
        pair.standby.start();
        pair.promote().await;
        proxy.repoint(pair.standby.port);
        let promoted = Instant::now();

        // Lost: every enqueue acknowledged in the gap.
        assert_eq!(
            present_among(&pair, &in_gap).await,
            0,
            "the enqueues the standby never received are gone"
        );
        // Not lost: the jobs replicated before the gap; those completed in the gap run
        // again (their completions are gone), and the gateway charges each once.
        let mut finished = 0;
        for _ in 0..900 {
            finished = done_among(&pair, &replicated).await;
            if finished == replicated.len() as i64 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if finished != replicated.len() as i64 {
            let list = replicated.iter().map(|i| i.0.to_string()).collect::<Vec<_>>().join(",");
            let mut conn = sqlx::PgConnection::connect_with(&pair.standby.options()).await.unwrap();
            let rows: Vec<String> = sqlx::query_scalar(&format!(
                "SELECT row_to_json(j)::text FROM (SELECT id, state, job_key, key_seq, attempts,
                 last_error FROM {SCHEMA}.jobs WHERE id IN ({list}) AND state <> 'done') j"
            ))
            .fetch_all(&mut conn)
            .await
            .unwrap();
            let keys: Vec<(String, String)> = sqlx::query_as(&format!(
                "SELECT job_key, row_to_json(k)::text FROM {SCHEMA}.job_keys k"
            ))
            .fetch_all(&mut conn)
            .await
            .unwrap();
            panic!(
                "{finished} of {} replicated jobs done on the new primary; not done: \
                 {rows:#?}\nkeys: {keys:#?}",
                replicated.len()
            );
        }
        let runs = c.runs.lock().unwrap().clone();
        let ran_again: HashSet<i64> = runs
            .iter()
            .filter(|r| r.ok && r.start > promoted && completed_in_gap.contains(&r.job))
            .map(|r| r.job)
            .collect();
        println!(
            "async failover: kill to promoted {:?}; {} enqueues acknowledged in the gap lost; \
             {} jobs completed in the gap, {} of them ran again after the promotion",
            promoted - killed,
            in_gap.len(),
            completed_in_gap.len(),
            ran_again.len()
        );
        assert!(!completed_in_gap.is_empty());
        assert_eq!(
            ran_again, completed_in_gap,
            "every completion the standby never received runs again"
        );
        let repeated = {
            let g = c.gateway.lock().unwrap();
            g.requests.values().filter(|n| **n > 1).count()
        };
        println!(
            "async failover: {repeated} effect keys asked twice (a re-run whose ledger row was lost)"
        );
        assert_books(&pair, &replicated, &c.gateway).await;
        // What fencing still guarantees. A job this process claimed (ahead, or as a
        // key's successor) on the old primary in the gap may start after the failover
        // under that lost lease: its writes are refused by the new primary (the ledger
        // write fails, so it never reaches the gateway) and it ends failed. The runs that
        // completed keep a key's order and never overlap on each primary; across the
        // failover the jobs whose completions were lost run again, in order.
        let (before, after): (Vec<Run>, Vec<Run>) = runs
            .iter()
            .filter(|r| r.ok)
            .cloned()
            .partition(|r| r.start < promoted);
        assert_keys_serial(&before);
        assert_keys_serial(&after);
        let stale: Vec<&Run> = runs
            .iter()
            .filter(|r| !r.ok && r.end > promoted)
            .collect();
        // A run under a lease the standby had received may go on across the failover
        // and complete on the new primary: it still never overlaps its key's next run.
        let mut completed: Vec<Run> = runs.iter().filter(|r| r.ok).cloned().collect();
        completed.sort_by_key(|r| (r.key.clone(), r.start));
        for w in completed.windows(2).filter(|w| w[0].key == w[1].key) {
            assert!(
                w[1].start >= w[0].end,
                "{}: job {} overlapped job {} across the failover",
                w[0].key,
                w[1].job,
                w[0].job
            );
        }
        println!(
            "async failover: {} runs under a lost lease after the promotion, all refused",
            stale.len()
        );

        c.a.shutdown().await.unwrap();
        c.b.shutdown().await.unwrap();
        drop(pair);
    }));
}
