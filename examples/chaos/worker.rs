//! Worker mode (`chaos worker ...`): one real leasehold `Scheduler` in its own process,
//! connected to PostgreSQL through its fault proxy, running the chaos job kinds
//! ([`crate::kinds`]) and writing the history of real execution ([`crate::attempt`]),
//! and beside it one small scheduler per periodic episode ([`crate::periodic`]).
//!
//! The worker's database role has no server-side timeouts of its own
//! (`statement_timeout`, `idle_in_transaction_session_timeout`): a host gives the
//! library whatever its pool is, and the library must cope with a hung connection or a
//! held lock by itself.
//!
//! SIGTERM calls `Scheduler::shutdown` (drain within the grace period, release the
//! rest). Metrics are written every 500 ms so a killed worker leaves recent figures.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use leasehold::{Backoff, Config, RetryPolicy, Scheduler};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};

use crate::attempt::History;
use crate::kinds::{Charge, Flaky, Hang, Panicky, Poison, Shared, Slow, StrictKind, TxHold};
use crate::model::Jsonl;

/// The result size cap every worker runs with; the `poison` kind's `big` results exceed
/// it. Small, so a poisoned result stays cheap to produce.
pub const MAX_RESULT_BYTES: usize = 64 * 1024;

pub struct Options {
    pub id: usize,
    pub inc: u32,
    pub db_port: u16,
    pub effects: String,
    pub out: PathBuf,
    pub concurrency: usize,
    pub lease_ms: u64,
    pub renew_ms: u64,
    pub reaper_ms: u64,
    pub backoff_base_ms: u64,
    pub backoff_cap_ms: u64,
    pub jitter: f64,
    pub max_run_ms: u64,
}

impl Options {
    pub fn to_args(&self) -> Vec<String> {
        vec![
            "worker".into(),
            self.id.to_string(),
            self.inc.to_string(),
            self.db_port.to_string(),
            self.effects.clone(),
            self.out.display().to_string(),
            self.concurrency.to_string(),
            self.lease_ms.to_string(),
            self.renew_ms.to_string(),
            self.reaper_ms.to_string(),
            self.backoff_base_ms.to_string(),
            self.backoff_cap_ms.to_string(),
            self.jitter.to_string(),
            self.max_run_ms.to_string(),
        ]
    }

    fn parse(args: &[String]) -> Options {
        let n = |i: usize| -> u64 {
            args.get(i)
                .and_then(|a| a.parse().ok())
                .unwrap_or_else(|| panic!("worker: bad argument {i}: {:?}", args.get(i)))
        };
        Options {
            id: n(0) as usize,
            inc: n(1) as u32,
            db_port: n(2) as u16,
            effects: args[3].clone(),
            out: PathBuf::from(&args[4]),
            concurrency: n(5) as usize,
            lease_ms: n(6),
            renew_ms: n(7),
            reaper_ms: n(8),
            backoff_base_ms: n(9),
            backoff_cap_ms: n(10),
            jitter: args[11].parse().expect("jitter"),
            max_run_ms: n(12),
        }
    }

    pub fn config(&self) -> Config {
        let ms = Duration::from_millis;
        Config {
            concurrency: self.concurrency,
            lease: ms(self.lease_ms),
            renew_interval: ms(self.renew_ms),
            poll_interval_min: ms(20),
            poll_interval_max: ms(400),
            claim_batch_max: 16,
            retry: RetryPolicy {
                max_attempts: 12,
                backoff: Backoff {
                    base: ms(self.backoff_base_ms),
                    cap: ms(self.backoff_cap_ms),
                    jitter: self.jitter,
                },
            },
            max_run_time: ms(self.max_run_ms),
            reaper_interval: ms(self.reaper_ms),
            shutdown_grace: ms(1000),
            effect_keep: Duration::from_secs(24 * 3600),
            sequencer_idle: ms(2000),
            // An idle limited queue beside the busy one, limited to every slot: it never
            // has a job, and must never keep a slot from the queue that has them (the
            // `liveness` and `stuck` rules judge the rest).
            queues: vec!["default".into(), IDLE_LIMITED_QUEUE.into()],
            queue_concurrency: [(IDLE_LIMITED_QUEUE.to_string(), self.concurrency)].into(),
            store: leasehold::StoreOptions {
                max_result_bytes: MAX_RESULT_BYTES,
                ..leasehold::StoreOptions::default()
            },
            ..Config::default()
        }
    }
}

/// A queue the workers claim from, with a limit of its own, that no job is ever
/// enqueued into.
pub const IDLE_LIMITED_QUEUE: &str = "idle_limited";

pub fn main(args: &[String]) -> ! {
    let o = Options::parse(args);
    // Deliberate panics are part of the workload: one line each, no backtrace.
    std::panic::set_hook(Box::new(|info| eprintln!("panic: {info}")));
    tracing_subscriber::fmt()
        .with_env_filter(
            std::env::var("CHAOS_WORKER_LOG").unwrap_or_else(|_| "leasehold=warn".into()),
        )
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .init();
    let code = actix::System::new().block_on(run(o));
    std::process::exit(code)
}

fn write_metrics(path: &std::path::Path, s: &Scheduler) {
    let m = s.metrics();
    let map: std::collections::BTreeMap<&str, u64> = m.counters.pairs().into_iter().collect();
    let _ = crate::model::write_json(path, &map);
}

async fn run(o: Options) -> i32 {
    let workers = o.out.join("workers");
    let _ = std::fs::create_dir_all(&workers);
    let hist_path = workers.join(format!("w{}.{}.jsonl", o.id, o.inc));
    let metrics_path = workers.join(format!("w{}.{}.metrics.json", o.id, o.inc));
    let history = Arc::new(History::new(
        o.id,
        o.inc,
        Jsonl::create(&hist_path).expect("history file"),
    ));
    let connect = PgConnectOptions::new()
        .host("127.0.0.1")
        .port(o.db_port)
        .username("chaos_worker")
        .database("chaos")
        .ssl_mode(PgSslMode::Disable)
        .application_name(&format!("chaos-w{}", o.id));
    let pool = PgPoolOptions::new()
        .max_connections(o.concurrency as u32 + 4)
        .acquire_timeout(Duration::from_secs(3))
        .connect_lazy_with(connect);
    let shared = Arc::new(Shared {
        effects: o.effects.clone(),
        max_run_ms: o.max_run_ms,
        max_result_bytes: MAX_RESULT_BYTES,
        history: history.clone(),
        pool: pool.clone(),
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let scheduler = loop {
        let s = Arc::clone(&shared);
        let started = Scheduler::builder(pool.clone(), o.config())
            .register(Charge(s.clone()))
            .register(Flaky(s.clone()))
            .register(Slow(s.clone()))
            .register(Panicky(s.clone()))
            .register(Hang(s.clone()))
            .register(TxHold(s.clone()))
            .register(Poison(s.clone()))
            .register(StrictKind(s))
            .start()
            .await;
        match started {
            Ok(s) => break s,
            Err(e) if tokio::time::Instant::now() < deadline => {
                eprintln!("w{}: start failed ({e}); retrying", o.id);
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Err(e) => {
                eprintln!("w{}: could not start: {e}", o.id);
                return 2;
            }
        }
    };
    history.mark("up", Some(scheduler.owner().to_string()), String::new());
    let periodic = match crate::periodic::start(o.id, o.db_port, deadline).await {
        Ok(p) => p,
        Err(e) => {
            eprintln!("w{}: could not start the periodic schedulers: {e}", o.id);
            return 2;
        }
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = tick.tick() => write_metrics(&metrics_path, &scheduler),
        }
    }
    history.mark("term", None, String::new());
    write_metrics(&metrics_path, &scheduler);
    // Releases during the shutdown are counted from the database (`released` events).
    let detail = format!("{:?}", scheduler.shutdown().await);
    for (s, p) in periodic {
        let _ = s.shutdown().await;
        p.close().await;
    }
    history.mark("down", None, detail);
    pool.close().await;
    0
}
