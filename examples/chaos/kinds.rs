//! The chaos job kinds, as a worker runs them. Every handler opens an [`Attempt`]
//! first, so its start, its calls to the effect server and its end (even an abort) are
//! in the worker's history.
//!
//! - `charge`, `flaky`, `slow`: effects through `ctx.once`, sleeps, deliberate failures
//!   ([`Work`]).
//! - `panicky`, `hang` (ignores cancellation; only the max run time stops it), `strict`
//!   (a typed payload the workload also sends undecodable).
//! - `txhold`: completes inside its own transaction (`ctx.complete_in`) and keeps that
//!   transaction open for `hold_ms` on its first attempt, holding its job row (and, if
//!   keyed, its key row) locked, as a host's slow business transaction would.
//!   With `err_after_commit`, the handler returns an error after that commit: the job is
//!   done, and the attempt must not be counted (or logged) as stale.
//! - `poison`: a value the database cannot store or read back (a NUL in a string, over
//!   the result size cap, nested deeper than 128), on one of three write paths: the
//!   returned result, a result completed in the handler's own transaction
//!   (`complete_in`), or the outcome of an effect through `ctx.once` (after the effect
//!   happened). The job must die with a reason naming the result (or the outcome), and
//!   the effect must not be applied again.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use leasehold::{CompleteOutcome, Handler, JobContext, JobError};
use serde::{Deserialize, Serialize};

use crate::attempt::{Attempt, History};
use crate::effects::{self, ApplyRequest};

/// Payload of the chaos kinds (`charge`, `flaky`, `slow`, `panicky`, `hang`, `txhold`,
/// `poison`).
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
    /// `txhold`: how long the first attempt keeps its completing transaction open.
    #[serde(default)]
    pub hold_ms: u64,
    /// `poison`: what (`nul`, `big`, `deep`), prefixed by the path: none (the returned
    /// result), `tx_` (through `complete_in`) or `effect_` (an effect's outcome).
    #[serde(default)]
    pub poison: Option<String>,
    /// `txhold`: return an error after the completing transaction committed.
    #[serde(default)]
    pub err_after_commit: bool,
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
    /// A poisoned outcome's payload (`poison` kind, `effect_` path); null otherwise.
    #[serde(default)]
    note: serde_json::Value,
}

/// Nesting of a `deep` poison: past the 128 levels the library stores and reads back.
const POISON_DEPTH: usize = 200;

/// A value the database cannot store (`nul`), over the result cap (`big`), or nested
/// too deep to read back (`deep`).
fn poisoned(what: &str, max_result_bytes: usize) -> serde_json::Value {
    match what {
        "nul" => serde_json::json!("before\u{0}after"),
        "deep" => {
            let mut v = serde_json::json!(1);
            for _ in 0..POISON_DEPTH {
                v = serde_json::json!([v]);
            }
            v
        }
        _ => serde_json::json!("r".repeat(max_result_bytes + 4096)),
    }
}

/// What every handler of one worker process shares.
pub struct Shared {
    pub effects: String,
    pub max_run_ms: u64,
    /// Result size cap configured for this worker (`poison` kind `big` exceeds it).
    pub max_result_bytes: usize,
    pub history: Arc<History>,
    /// The worker's pool (through its fault proxy), for `txhold`'s transaction.
    pub pool: sqlx::PgPool,
}

impl Shared {
    fn result(&self, ctx: &JobContext) -> serde_json::Value {
        let h = &self.history;
        serde_json::json!({ "gen": ctx.generation().0, "w": h.w, "inc": h.inc })
    }

    /// Apply effect `step` at most once per effect key; true if the ledger answered.
    /// With `poison`, the effect's outcome carries a poisoned value (see [`poisoned`]).
    async fn effect(
        &self,
        ctx: &JobContext,
        at: &Attempt,
        cid: u64,
        step: &str,
        poison: Option<&str>,
    ) -> Result<bool, JobError> {
        let note = poison
            .map(|p| poisoned(p, self.max_result_bytes))
            .unwrap_or(serde_json::Value::Null);
        let note = &note;
        let called = AtomicBool::new(false);
        let fingerprint = leasehold::context::fingerprint(&EffectRequest { cid, step })?;
        let req = EffectRequest { cid, step };
        let flag = &called;
        let h = &self.history;
        let _: Receipt = ctx
            .once(step, &req, |key| async move {
                flag.store(true, SeqCst);
                at.effect(step);
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
                        worker: format!("w{}.{}", h.w, h.inc),
                    },
                )
                .await
                .map_err(|e| JobError::retry(format!("effect server: {e}")))?;
                match r.decision.as_str() {
                    "applied" | "already" => Ok(Receipt {
                        receipt: r.receipt,
                        note: note.clone(),
                    }),
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
        let at = self.history.start(&ctx, String::new());
        let mut hits = 0;
        let outcome = async {
            if !w.effects_last {
                for s in 0..w.steps {
                    hits += self.effect(&ctx, &at, w.cid, &format!("s{s}"), None).await? as u32;
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
                    hits += self.effect(&ctx, &at, w.cid, &format!("s{s}"), None).await? as u32;
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
            Ok(_) => at.finish("ok", hits, String::new()),
            Err(e) => at.finish("err", hits, e.message().chars().take(200).collect()),
        }
        outcome
    }

    /// `txhold`: complete in the handler's own transaction, then keep it open.
    async fn txhold(&self, ctx: JobContext, w: Work) -> Result<serde_json::Value, JobError> {
        let hold = if ctx.attempt() == 1 { w.hold_ms } else { 50 };
        let at = self.history.start(&ctx, format!("hold_ms={hold}"));
        let failed = |e: String| {
            at.finish("err", 0, e.clone());
            Err(JobError::retry(format!("txhold: {e}")))
        };
        let mut tx = match self.pool.begin().await {
            Ok(tx) => tx,
            Err(e) => return failed(e.to_string()),
        };
        let result = self.result(&ctx);
        match ctx.complete_in(&mut tx, Some(result.clone())).await {
            Ok(CompleteOutcome::Completed) => {}
            Ok(other) => {
                let _ = tx.rollback().await;
                at.finish("stale", 0, format!("complete_in: {other:?}"));
                return Err(JobError::retry(
                    "txhold: this attempt no longer owns the job",
                ));
            }
            Err(e) => return failed(e.message().to_string()),
        }
        // A cooperative handler: told to stop (lease lost, operator cancel), it rolls
        // its business transaction back rather than commit work it may no longer own.
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(hold)) => {
                match tx.commit().await {
                    Ok(()) if w.err_after_commit => {
                        at.finish("ok", 0, "error after a committed complete_in".into());
                        Err(JobError::retry("chaos: an error after a committed complete_in"))
                    }
                    Ok(()) => {
                        at.finish("ok", 0, String::new());
                        Ok(result)
                    }
                    Err(e) => failed(format!("commit: {e}")),
                }
            }
            _ = ctx.cancelled() => {
                let _ = tx.rollback().await;
                let msg = format!("cancelled while holding its transaction: {:?}", ctx.cancel_reason());
                at.finish("err", 0, msg.clone());
                Err(JobError::retry(msg))
            }
        }
    }

    /// `poison`: a value that cannot be stored or read back, on one write path (see the
    /// module docs).
    async fn poison(&self, ctx: JobContext, w: Work) -> Result<serde_json::Value, JobError> {
        let at = self.history.start(&ctx, format!("poison={:?}", w.poison));
        let spec = w.poison.clone().unwrap_or_default();
        let (path, what) = match spec.split_once('_') {
            Some((path, what)) => (path, what),
            None => ("return", spec.as_str()),
        };
        let mut result = self.result(&ctx);
        match path {
            "effect" => {
                let got = self.effect(&ctx, &at, w.cid, "s0", Some(what)).await;
                let hits = got.as_ref().map(|h| *h as u32).unwrap_or(0);
                match &got {
                    Ok(_) => at.finish("ok", hits, "a poisoned outcome was accepted".into()),
                    Err(e) => at.finish("err", hits, e.message().chars().take(200).collect()),
                }
                got.map(|_| result)
            }
            "tx" => {
                result["poison"] = poisoned(what, self.max_result_bytes);
                let mut tx = match self.pool.begin().await {
                    Ok(tx) => tx,
                    Err(e) => {
                        at.finish("err", 0, e.to_string());
                        return Err(JobError::retry(format!("poison: {e}")));
                    }
                };
                let done = ctx.complete_in(&mut tx, Some(result.clone())).await;
                let _ = tx.rollback().await;
                match done {
                    Ok(outcome) => {
                        at.finish(
                            "ok",
                            0,
                            format!("complete_in took a poisoned result: {outcome:?}"),
                        );
                        Ok(result)
                    }
                    Err(e) => {
                        at.finish("err", 0, e.message().chars().take(200).collect());
                        Err(e)
                    }
                }
            }
            _ => {
                result["poison"] = poisoned(what, self.max_result_bytes);
                at.finish("ok", 0, format!("returned a poisoned result ({spec})"));
                Ok(result)
            }
        }
    }
}

macro_rules! kind {
    ($name:ident, $kind:literal, $payload:ty, |$s:ident, $ctx:ident, $p:ident| $body:expr) => {
        pub struct $name(pub Arc<Shared>);
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
kind!(TxHold, "txhold", Work, |s, ctx, p| s.txhold(ctx, p).await);
kind!(Poison, "poison", Work, |s, ctx, p| s.poison(ctx, p).await);
kind!(Panicky, "panicky", Work, |s, ctx, p| {
    let at = s.history.start(&ctx, String::new());
    if ctx.attempt() <= p.fail_first {
        at.finish("panic", 0, String::new());
        panic!(
            "chaos: deliberate panic in job {} attempt {}",
            ctx.job_id(),
            ctx.attempt()
        );
    }
    at.finish("ok", 0, String::new());
    Ok(s.result(&ctx))
});
kind!(Hang, "hang", Work, |s, ctx, p| {
    let at = s.history.start(&ctx, String::new());
    if ctx.attempt() <= p.fail_first {
        // Ignores cancellation on purpose: only the executor's max run time stops it
        // (its abort drops this future, and the guard writes the end).
        tokio::time::sleep(Duration::from_millis(s.max_run_ms + 3000)).await;
        at.finish("ok", 0, "outlived the max run time".into());
    } else {
        at.finish("ok", 0, String::new());
    }
    Ok(s.result(&ctx))
});
kind!(StrictKind, "strict", Strict, |s, ctx, _p| {
    let at = s.history.start(&ctx, String::new());
    at.finish("ok", 0, String::new());
    Ok(s.result(&ctx))
});

pub const KINDS: [&str; 8] = [
    "charge", "flaky", "slow", "panicky", "hang", "strict", "txhold", "poison",
];
