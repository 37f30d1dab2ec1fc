//! Worker mode (`chaos worker ...`): one real leasehold `Scheduler` in its own process,
//! connected to PostgreSQL through its fault proxy, running the chaos job kinds and
//! writing a history line at every handler start and end.
//!
//! SIGTERM calls `Scheduler::shutdown` (drain within the grace period, release the
//! rest). Metrics are written every 500 ms so a killed worker leaves recent figures.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold::{Backoff, Config, Handler, JobContext, JobError, RetryPolicy, Scheduler};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};

use crate::effects::{self, ApplyRequest};
use crate::model::{now_us, HistoryLine, Jsonl};

/// Payload of the chaos kinds (`charge`, `flaky`, `slow`, `panicky`, `hang`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Work {
    pub cid: u64,
    /// External effects to apply (steps `s0`, `s1`, ...), each through `ctx.once`.
    #[serde(default)]
    pub steps: u8,
    /// Apply the effects after the sleep instead of before it.
    #[serde(default)]
    pub effects_last: bool,
    #[serde(default)]
    pub sleep_ms: u64,
    /// Attempts up to this one fail (after the effects), panic, or hang.
    #[serde(default)]
    pub fail_first: i32,
    #[serde(default)]
    pub permanent: bool,
    /// Sleep through a cancellation (a lost lease) instead of stopping.
    #[serde(default)]
    pub ignore_cancel: bool,
    #[serde(default)]
    pub pad: Option<String>,
}

/// The strictly typed payload of kind `strict`; the workload also sends ones that do
/// not decode.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Strict {
    pub cid: u64,
    pub amount: u32,
}

#[derive(Serialize)]
struct EffectRequest<'a> {
    cid: u64,
    step: &'a str,
}

#[derive(Serialize, Deserialize)]
struct Receipt {
    receipt: u64,
}

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
            ..Config::default()
        }
    }
}

struct Shared {
    w: usize,
    inc: u32,
    effects: String,
    max_run_ms: u64,
    hist: Mutex<Jsonl>,
}

impl Shared {
    fn line(&self, ctx: &JobContext, ev: &str, outcome: &str, ledger_hits: u32, detail: String) {
        let l = HistoryLine {
            t_us: now_us(),
            w: self.w,
            inc: self.inc,
            ev: ev.into(),
            owner: None,
            job: ctx.job_id().0,
            generation: ctx.generation().0,
            attempt: ctx.attempt(),
            kind: ctx.kind().to_string(),
            key: ctx.key().map(str::to_string),
            key_seq: ctx.job().key_seq,
            outcome: outcome.into(),
            ledger_hits,
            detail,
        };
        self.hist.lock().unwrap().write(&l);
    }

    fn result(&self, ctx: &JobContext) -> serde_json::Value {
        serde_json::json!({ "gen": ctx.generation().0, "w": self.w, "inc": self.inc })
    }

    /// Apply effect `step` at most once per effect key; true if the ledger answered.
    async fn effect(&self, ctx: &JobContext, cid: u64, step: &str) -> Result<bool, JobError> {
        let called = AtomicBool::new(false);
        let fingerprint = leasehold::context::fingerprint(&EffectRequest { cid, step })?;
        let req = EffectRequest { cid, step };
        let flag = &called;
        let _: Receipt = ctx
            .once(step, &req, |key| async move {
                flag.store(true, SeqCst);
                let r = effects::apply(
                    &self.effects,
                    &ApplyRequest {
                        effect_key: key.to_string(),
                        job: ctx.job_id().0,
                        step: step.to_string(),
                        generation: ctx.generation().0,
                        key: ctx.key().map(str::to_string),
                        key_seq: ctx.job().key_seq,
                        fingerprint,
                        worker: format!("w{}.{}", self.w, self.inc),
                    },
                )
                .await
                .map_err(|e| JobError::retry(format!("effect server: {e}")))?;
                match r.decision.as_str() {
                    "applied" | "already" => Ok(Receipt { receipt: r.receipt }),
                    "fenced" => Err(JobError::retry(
                        "effect refused: a newer generation was seen",
                    )),
                    other => Err(JobError::permanent(format!("effect refused: {other}"))),
                }
            })
            .await?;
        Ok(!called.load(SeqCst))
    }

    async fn work(&self, ctx: JobContext, w: Work) -> Result<serde_json::Value, JobError> {
        self.line(&ctx, "start", "", 0, String::new());
        let mut hits = 0;
        let outcome = async {
            if !w.effects_last {
                for s in 0..w.steps {
                    hits += self.effect(&ctx, w.cid, &format!("s{s}")).await? as u32;
                }
            }
            if w.sleep_ms > 0 && w.ignore_cancel {
                tokio::time::sleep(Duration::from_millis(w.sleep_ms)).await;
            } else if w.sleep_ms > 0 {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(w.sleep_ms)) => {}
                    _ = ctx.cancelled() => {
                        return Err(JobError::retry(format!("cancelled: {:?}", ctx.cancel_reason())));
                    }
                }
            }
            if w.effects_last {
                for s in 0..w.steps {
                    hits += self.effect(&ctx, w.cid, &format!("s{s}")).await? as u32;
                }
            }
            if ctx.attempt() <= w.fail_first {
                let msg = format!("chaos: deliberate failure of attempt {}", ctx.attempt());
                return Err(if w.permanent {
                    JobError::permanent(msg)
                } else {
                    JobError::retry(msg)
                });
            }
            Ok(self.result(&ctx))
        }
        .await;
        match &outcome {
            Ok(_) => self.line(&ctx, "end", "ok", hits, String::new()),
            Err(e) => self.line(
                &ctx,
                "end",
                "err",
                hits,
                e.message().chars().take(200).collect(),
            ),
        }
        outcome
    }
}

macro_rules! kind {
    ($name:ident, $kind:literal, $payload:ty, |$s:ident, $ctx:ident, $p:ident| $body:expr) => {
        struct $name(Arc<Shared>);
        impl Handler for $name {
            type Payload = $payload;
            type Output = serde_json::Value;
            const KIND: &'static str = $kind;
            async fn run(
                &self,
                $ctx: JobContext,
                $p: $payload,
            ) -> Result<serde_json::Value, JobError> {
                let $s = &self.0;
                $body
            }
        }
    };
}

kind!(Charge, "charge", Work, |s, ctx, p| s.work(ctx, p).await);
kind!(Flaky, "flaky", Work, |s, ctx, p| s.work(ctx, p).await);
kind!(Slow, "slow", Work, |s, ctx, p| s.work(ctx, p).await);
kind!(Panicky, "panicky", Work, |s, ctx, p| {
    s.line(&ctx, "start", "", 0, String::new());
    if ctx.attempt() <= p.fail_first {
        s.line(&ctx, "end", "panic", 0, String::new());
        panic!(
            "chaos: deliberate panic in job {} attempt {}",
            ctx.job_id(),
            ctx.attempt()
        );
    }
    s.line(&ctx, "end", "ok", 0, String::new());
    Ok(s.result(&ctx))
});
kind!(Hang, "hang", Work, |s, ctx, p| {
    s.line(&ctx, "start", "", 0, String::new());
    if ctx.attempt() <= p.fail_first {
        // Ignores cancellation on purpose: only the executor's max run time stops it.
        tokio::time::sleep(Duration::from_millis(s.max_run_ms + 3000)).await;
        s.line(&ctx, "end", "ok", 0, "outlived the max run time".into());
    } else {
        s.line(&ctx, "end", "ok", 0, String::new());
    }
    Ok(s.result(&ctx))
});
kind!(StrictKind, "strict", Strict, |s, ctx, _p| {
    s.line(&ctx, "start", "", 0, String::new());
    s.line(&ctx, "end", "ok", 0, String::new());
    Ok(s.result(&ctx))
});

pub const KINDS: [&str; 6] = ["charge", "flaky", "slow", "panicky", "hang", "strict"];

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
    let shared = Arc::new(Shared {
        w: o.id,
        inc: o.inc,
        effects: o.effects.clone(),
        max_run_ms: o.max_run_ms,
        hist: Mutex::new(Jsonl::create(&hist_path).expect("history file")),
    });
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
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let scheduler = loop {
        let s = Arc::clone(&shared);
        let started = Scheduler::builder(pool.clone(), o.config())
            .register(Charge(s.clone()))
            .register(Flaky(s.clone()))
            .register(Slow(s.clone()))
            .register(Panicky(s.clone()))
            .register(Hang(s.clone()))
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
    let mark = |ev: &str, owner: Option<String>| {
        shared.hist.lock().unwrap().write(&HistoryLine {
            t_us: now_us(),
            w: o.id,
            inc: o.inc,
            ev: ev.into(),
            owner,
            ..Default::default()
        });
    };
    mark("up", Some(scheduler.owner().to_string()));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = tick.tick() => write_metrics(&metrics_path, &scheduler),
        }
    }
    mark("term", None);
    write_metrics(&metrics_path, &scheduler);
    // Releases during the shutdown are counted from the database (`released` events).
    let detail = format!("{:?}", scheduler.shutdown().await);
    shared.hist.lock().unwrap().write(&HistoryLine {
        t_us: now_us(),
        w: o.id,
        inc: o.inc,
        ev: "down".into(),
        detail,
        ..Default::default()
    });
    pool.close().await;
    0
}
