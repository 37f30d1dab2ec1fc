//! One run: a gateway, three schedulers, 200 payments, and the books afterwards.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::testkit::gateway::{Decision, Gateway, GatewayConfig, Receipt};
use leasehold::{Backoff, Config, Handler, JobId, NewJob, OwnerId, Scheduler, Store, StoreOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use crate::handler::{
    account, fault_plan, gateway_faults, reference, worker_faults, Injector, KeyScheme, Payment,
    PaymentHandler,
};
use crate::{
    ACCOUNTS, CLIENT_TIMEOUT, GATEWAY_STALL, LEASE, PAYMENTS_PER_ACCOUNT, REAPER_INTERVAL,
    RENEW_INTERVAL, RUN_DEADLINE, WORKERS,
};

/// What one run left behind, from the database, the schedulers and the gateway.
pub(crate) struct RunReport {
    pub(crate) elapsed: Duration,
    pub(crate) payments: usize,
    pub(crate) by_state: BTreeMap<String, i64>,
    pub(crate) requested: u64,
    pub(crate) applied: u64,
    pub(crate) applied_in_log: usize,
    pub(crate) duplicates_suppressed: u64,
    pub(crate) fenced: u64,
    pub(crate) receipts_held: usize,
    pub(crate) duplicate_charges: u64,
    pub(crate) never_charged: usize,
    pub(crate) accounts_in_order: usize,
    pub(crate) stale_refused: u64,
    pub(crate) leases_expired: i64,
    pub(crate) attempts: i64,
    pub(crate) claimed_per_worker: Vec<u64>,
    /// Gateway requests still undecided when the books were read.
    pub(crate) undecided_left: bool,
    pub(crate) trace: Vec<String>,
}

/// The demo's timings, with the store settings the environment gives
/// (`shared/store_env.rs`).
fn scheduler_config(schema: &str) -> leasehold::Result<Config> {
    let mut config = Config {
        schema: schema.to_string(),
        concurrency: 8,
        lease: LEASE,
        renew_interval: RENEW_INTERVAL,
        reaper_interval: REAPER_INTERVAL,
        poll_interval_min: Duration::from_millis(20),
        poll_interval_max: Duration::from_millis(250),
        max_run_time: Duration::from_secs(10),
        shutdown_grace: Duration::from_secs(2),
        ..Config::default()
    };
    config.retry.max_attempts = 10;
    config.retry.backoff = backoff();
    crate::store_env::store_settings(&mut config)?;
    Ok(config)
}

fn backoff() -> Backoff {
    Backoff {
        base: Duration::from_millis(100),
        cap: Duration::from_secs(1),
        jitter: 0.25,
    }
}

async fn small_pool(
    options: &PgConnectOptions,
    name: &str,
    size: u32,
) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options.clone().application_name(name))
        .await
}

fn payments() -> Vec<Payment> {
    // Enqueue order: round by round over the accounts, so each account's payments are
    // interleaved with everyone else's; per account, `seq` is the enqueue order.
    let mut out = Vec::new();
    for seq in 1..=PAYMENTS_PER_ACCOUNT {
        for a in 1..=ACCOUNTS {
            out.push(Payment {
                account: account(a),
                seq,
                amount_cents: 100 + i64::from((a * 37 + seq * 11) % 900),
            });
        }
    }
    out
}

pub(crate) async fn run(
    options: &PgConnectOptions,
    keys: KeyScheme,
) -> Result<RunReport, Box<dyn Error>> {
    let schema = format!("payments_{}_{}", std::process::id(), keys.label());
    let admin = small_pool(options, "leasehold-demo-injector", 2).await?;
    let result = run_in(options, &admin, &schema, keys).await;
    let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
        .execute(&admin)
        .await;
    admin.close().await;
    result
}

async fn run_in(
    options: &PgConnectOptions,
    admin: &PgPool,
    schema: &str,
    keys: KeyScheme,
) -> Result<RunReport, Box<dyn Error>> {
    let gateway = Gateway::start(GatewayConfig {
        faults: gateway_faults(),
        ..GatewayConfig::default()
    })?;
    let store_options = StoreOptions {
        transaction_pooler: scheduler_config(schema)?.store.transaction_pooler,
        ..StoreOptions::default()
    };
    let store = Store::new(admin.clone(), schema, store_options)?;
    let handler = PaymentHandler {
        gateway: gateway.client().with_timeout(CLIENT_TIMEOUT),
        keys,
        worker_faults: Arc::new(worker_faults()),
        injector: Injector {
            store: store.clone(),
            owner: OwnerId::named("fault-injector"),
            backoff: backoff(),
        },
        wake_ups: Arc::default(),
    };
    let started = Instant::now();
    let mut workers = Vec::new();
    for w in 1..=WORKERS {
        let pool = small_pool(options, &format!("leasehold-demo-w{w}"), 3).await?;
        let scheduler = Scheduler::builder(pool, scheduler_config(schema)?)
            .register(handler.clone())
            .start()
            .await?;
        workers.push(scheduler);
    }
    let payments = payments();
    let jobs = payments
        .iter()
        .map(|p| Ok(NewJob::new(PaymentHandler::KIND, p)?.with_key(p.account.clone())))
        .collect::<leasehold::Result<Vec<_>>>()?;
    let ids = workers[0].enqueue_many(jobs).await?;
    let job_of: HashMap<String, JobId> = payments
        .iter()
        .map(Payment::reference)
        .zip(ids.iter().copied())
        .collect();

    let by_state = wait_until_settled(&store, payments.len()).await?;
    let elapsed = started.elapsed();
    let owners: Vec<(OwnerId, String)> = workers
        .iter()
        .enumerate()
        .map(|(i, w)| (w.owner().clone(), format!("w{}", i + 1)))
        .collect();
    let mut claimed_per_worker = Vec::new();
    let mut stale_refused = 0;
    for w in workers {
        let m = w.metrics();
        claimed_per_worker.push(m.counters.claimed);
        stale_refused += m.counters.stale_completions;
        w.shutdown().await?;
    }
    // A request stalled at the gateway may still be deciding; the books wait for it.
    let undecided_left = !gateway.wait_decided(GATEWAY_STALL * 2).await;
    let mut report = RunReport {
        elapsed,
        payments: payments.len(),
        by_state,
        requested: 0,
        applied: 0,
        applied_in_log: 0,
        duplicates_suppressed: 0,
        fenced: 0,
        receipts_held: 0,
        duplicate_charges: 0,
        never_charged: 0,
        accounts_in_order: 0,
        stale_refused,
        leases_expired: 0,
        attempts: 0,
        claimed_per_worker,
        undecided_left,
        trace: Vec::new(),
    };
    read_books(&mut report, &gateway, &store, &payments).await?;
    let (a, s, _) = fault_plan()[0];
    let traced = reference(&account(a), s);
    report.trace = trace(&store, &gateway, &traced, job_of[&traced], &owners).await?;
    let wake_ups = handler.wake_ups.lock().unwrap();
    for w in wake_ups.iter().filter(|w| w.reference == traced) {
        let name = owners
            .iter()
            .find(|(o, _)| *o == w.owner)
            .map_or("?", |(_, n)| n);
        report.trace.push(format!(
            "worker {name} (g{}) woke up: {}; its ending was refused as stale",
            w.generation, w.error
        ));
    }
    drop(wake_ups);
    gateway.shutdown();
    Ok(report)
}

/// Wait until every job is done or dead (or the deadline passes); jobs by state.
async fn wait_until_settled(
    store: &Store,
    total: usize,
) -> Result<BTreeMap<String, i64>, Box<dyn Error>> {
    let deadline = Instant::now() + RUN_DEADLINE;
    loop {
        let mut by_state = BTreeMap::new();
        for (_queue, states) in store.job_counts().await? {
            for (state, n) in states {
                *by_state.entry(state).or_insert(0) += n;
            }
        }
        let settled = ["done", "dead"]
            .iter()
            .map(|s| by_state.get(*s).copied().unwrap_or(0))
            .sum::<i64>();
        if settled as usize >= total || Instant::now() >= deadline {
            return Ok(by_state);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Fill in the figures from the gateway's books and the database.
async fn read_books(
    r: &mut RunReport,
    gateway: &Gateway,
    store: &Store,
    payments: &[Payment],
) -> Result<(), Box<dyn Error>> {
    let counts = gateway.counts();
    r.requested = counts.requested;
    r.applied = counts.applied;
    r.duplicates_suppressed = counts.duplicates;
    r.fenced = counts.fenced;
    let log = gateway.log();
    r.applied_in_log = log
        .iter()
        .filter(|e| e.decision == Decision::Applied)
        .count();
    let per_ref = gateway.applied_by_reference();
    r.duplicate_charges = per_ref.values().map(|n| n.saturating_sub(1)).sum();
    r.never_charged = payments
        .iter()
        .filter(|p| !per_ref.contains_key(&p.reference()))
        .count();
    let by_account = gateway.applied_by_account();
    r.accounts_in_order = (1..=ACCOUNTS)
        .filter(|&a| {
            let expected: Vec<String> = (1..=PAYMENTS_PER_ACCOUNT)
                .map(|s| reference(&account(a), s))
                .collect();
            let mut applied = by_account.get(&account(a)).cloned().unwrap_or_default();
            applied.dedup();
            applied == expected
        })
        .count();

    let s = store.schema().quoted();
    let results: Vec<Option<serde_json::Value>> =
        sqlx::query_scalar(&format!("SELECT result FROM {s}.jobs WHERE state = 'done'"))
            .fetch_all(store.pool())
            .await?;
    let charge_ids: HashSet<u64> = results
        .into_iter()
        .flatten()
        .filter_map(|v| serde_json::from_value::<Receipt>(v).ok())
        .map(|receipt| receipt.charge_id)
        .collect();
    r.receipts_held = charge_ids.len();
    r.leases_expired = sqlx::query_scalar(&format!("SELECT count(*) FROM {s}.lease_expiries"))
        .fetch_one(store.pool())
        .await?;
    r.attempts = sqlx::query_scalar(&format!(
        "SELECT coalesce(sum(attempts), 0)::int8 FROM {s}.jobs"
    ))
    .fetch_one(store.pool())
    .await?;
    Ok(())
}

/// One payment's story, as the database and the gateway saw it.
async fn trace(
    store: &Store,
    gateway: &Gateway,
    reference: &str,
    job: JobId,
    owners: &[(OwnerId, String)],
) -> Result<Vec<String>, Box<dyn Error>> {
    let who = |owner: &Option<String>| -> String {
        let owner = owner.as_deref().unwrap_or("?");
        owners
            .iter()
            .find(|(o, _)| o.as_str() == owner)
            .map(|(_, name)| name.clone())
            .unwrap_or_else(|| owner.to_string())
    };
    let mut lines = Vec::new();
    for e in store.history(job).await? {
        if e.event == "enqueued" {
            continue;
        }
        let detail = match e.event.as_str() {
            "failed" | "dead" => format!(": {}", e.detail.unwrap_or_default()),
            _ => String::new(),
        };
        let by = match &e.owner {
            Some(_) => format!(" by {}", who(&e.owner)),
            None => String::new(),
        };
        lines.push(format!(
            "job     {:<9} g{}{by}{detail}",
            e.event, e.generation
        ));
    }
    for e in gateway
        .log()
        .iter()
        .filter(|e| e.request.reference == reference)
    {
        lines.push(format!(
            "gateway #{:<3} key {:<16} token g{} -> {:?}{}",
            e.n,
            e.idempotency_key,
            e.fencing_token.map(|t| t & 0xffff_ffff).unwrap_or(0),
            e.decision,
            e.charge_id
                .map(|c| format!(" (charge #{c})"))
                .unwrap_or_default()
        ));
    }
    Ok(lines)
}
