//! One attempt of one job: run the handler under its lease, then write the ending.
//!
//! The handler runs in its own task so a panic is caught and becomes a failed attempt.
//! The attempt ends with exactly one fenced write: complete (through the completion
//! batcher), fail (retry or dead), or release (shutdown). A write that fails on a
//! connection error is retried with backoff while the lease lasts, and otherwise left
//! to the reaper: it never takes the scheduler down.

use std::sync::Arc;
use std::time::Duration;

use crate::actor::completer::Complete;
use crate::context::{CancelReason, JobContext};
use crate::env::Env;
use crate::error::Result;
use crate::handler::AttemptError;
use crate::job::{ClaimedJob, CompleteOutcome, FailOutcome};
use crate::store::Failure;

/// How an attempt ended, as far as this scheduler knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    Completed,
    Retrying,
    Dead,
    /// The fence was gone: another generation (or an operator) owns the job.
    Stale,
    /// Given back at shutdown.
    Released,
    /// The ending could not be written (database unreachable); the lease will tell.
    Unknown,
}

enum Attempt {
    Succeeded(serde_json::Value),
    Failed(Failure),
    /// Cancelled by shutdown: release without counting the attempt.
    Interrupted,
    /// The lease was lost and the handler did not stop: nothing to write.
    Abandoned,
}

/// Count jobs this scheduler holds (claimed and not yet ended, running or queued in a
/// sequencer). Called synchronously when a claim returns, so shutdown never sees a
/// momentary zero between a job's claim and its start.
pub(crate) fn hold(env: &Env, n: usize) {
    env.metrics
        .in_flight
        .fetch_add(n as u64, std::sync::atomic::Ordering::SeqCst);
}

/// End the holds of jobs given back without running (parked successors released at
/// shutdown).
pub(crate) fn unhold(env: &Env, n: usize) {
    env.metrics
        .in_flight
        .fetch_sub(n as u64, std::sync::atomic::Ordering::SeqCst);
}

/// Ends a hold when the execution ends (or is dropped).
struct HeldJob<'a>(&'a Env);

impl Drop for HeldJob<'_> {
    fn drop(&mut self) {
        self.0
            .metrics
            .in_flight
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Run one claimed (and [`hold`]-counted) job to its ending, calling `ran` once the
/// handler has returned, before the ending is
/// written: the claimer frees the job's slot there, so the next claim overlaps the
/// completion write.
pub(crate) async fn execute_then(env: Arc<Env>, job: ClaimedJob, ran: impl FnOnce()) -> Ended {
    attempt_once(env, job, ran, false).await.0
}

/// What a completion through the batcher said about the key's next job.
#[derive(Debug, Default)]
pub(crate) enum Successor {
    /// No chained completion happened (not keyed, shutdown begun, completed in the
    /// handler's own transaction, a replayed completion, a failure...).
    #[default]
    NotAsked,
    /// Asked: the key has no successor the owner can claim now (none, not yet due, or
    /// of a kind it does not run; a promoted one is pending and announced).
    NoneClaimable,
    /// Claimed in the completion's transaction, and counted as held.
    Claimed(Box<ClaimedJob>),
}

/// [`execute_then`] for a key's sequencer: a completion also claims the key's successor in
/// its transaction (unless shutdown has begun), for the sequencer to run with the slot
/// it holds.
pub(crate) async fn execute_chained(
    env: Arc<Env>,
    job: ClaimedJob,
    ran: impl FnOnce(),
) -> (Ended, Successor) {
    attempt_once(env, job, ran, true).await
}

async fn attempt_once(
    env: Arc<Env>,
    job: ClaimedJob,
    ran: impl FnOnce(),
    chain: bool,
) -> (Ended, Successor) {
    let _held = HeldJob(&env);
    let ctx = JobContext::new(job.clone(), env.store.clone(), env.config.effect_keep);
    // The lease renewer reads this registry at each tick.
    env.running.insert((job.id, job.generation), ctx.clone());
    if job.attempt == 1 {
        if let Ok(waited) = (job.claimed_at - job.created_at).to_std() {
            env.metrics.record_start(waited);
        }
    }
    let attempt = run_handler(&env, &ctx, &job).await;
    // Chain the key's successor only while another slot is free: under saturation it
    // waits its turn in the claimer's queue instead of holding a lease while parked.
    let spare = env.slots.free() > 0;
    ran();
    let next = std::sync::Mutex::new(Successor::NotAsked);
    let chain =
        (chain && spare && job.key.is_some() && !env.stop_claiming.is_cancelled()).then_some(&next);
    let ended = write_ending(&env, &ctx, &job, attempt, chain).await;
    let next = next.into_inner().unwrap_or_else(|p| p.into_inner());
    if matches!(next, Successor::Claimed(_)) {
        // Counted before this attempt's own hold ends, so shutdown never sees a gap.
        hold(&env, 1);
        env.metrics.incr(|c| &c.claimed);
    }

    env.running.remove(&(job.id, job.generation));
    (ended, next)
}

async fn run_handler(env: &Env, ctx: &JobContext, job: &ClaimedJob) -> Attempt {
    let Some(handler) = env.registry.get(&job.kind) else {
        // The claim filters on registered kinds, so this is a registry bug, not bad input.
        return Attempt::Failed(Failure {
            reason: format!("no handler for kind {:?}", job.kind),
            permanent: true,
        });
    };
    let mut task = tokio::spawn(handler.call(ctx.clone(), job.payload.clone()));
    let token = ctx.token();
    let deadline = tokio::time::sleep(env.config.max_run_time);
    tokio::pin!(deadline);
    let joined = tokio::select! {
        biased;
        joined = &mut task => joined,
        _ = env.hard_stop.cancelled() => return interrupted(ctx, task).await,
        _ = &mut deadline => {
            ctx.cancel(CancelReason::Timeout);
            env.metrics.incr(|c| &c.timeouts);
            // A moment to notice the cancellation and clean up, then stop it.
            let _ = tokio::time::timeout(Duration::from_millis(100), &mut task).await;
            task.abort();
            return Attempt::Failed(Failure {
                reason: format!(
                    "attempt exceeded the maximum run time of {}",
                    humantime::format_duration(env.config.max_run_time)
                ),
                permanent: false,
            });
        }
        _ = token.cancelled() => {
            if ctx.cancel_reason() == Some(CancelReason::Shutdown) {
                return interrupted(ctx, task).await;
            }
            // Lease lost: give the handler one renew interval to stop by itself; its
            // ending is then written, and refused by the fence.
            match tokio::time::timeout(env.config.renew_interval, &mut task).await {
                Ok(joined) => joined,
                Err(_) => {
                    task.abort();
                    return Attempt::Abandoned;
                }
            }
        }
    };
    match joined {
        Ok(Ok(value)) => Attempt::Succeeded(value),
        Ok(Err(AttemptError::Decode(reason))) => {
            env.metrics.incr(|c| &c.decode_failures);
            Attempt::Failed(Failure {
                reason,
                permanent: true,
            })
        }
        Ok(Err(AttemptError::Job(e))) => Attempt::Failed(Failure {
            reason: e.message().to_string(),
            permanent: e.is_permanent(),
        }),
        Err(join) if join.is_panic() => {
            env.metrics.incr(|c| &c.panics);
            let panic = join.into_panic();
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".into());
            Attempt::Failed(Failure {
                reason: format!("handler panicked: {msg}"),
                permanent: false,
            })
        }
        Err(_) => Attempt::Failed(Failure {
            reason: "handler task was cancelled".into(),
            permanent: false,
        }),
    }
}

/// Shutdown after the grace period: a handler that finishes within a moment keeps its
/// result; otherwise it is stopped and the job released (the attempt not counted).
async fn interrupted(
    ctx: &JobContext,
    mut task: tokio::task::JoinHandle<std::result::Result<serde_json::Value, AttemptError>>,
) -> Attempt {
    ctx.cancel(CancelReason::Shutdown);
    match tokio::time::timeout(Duration::from_millis(100), &mut task).await {
        Ok(Ok(Ok(value))) => Attempt::Succeeded(value),
        _ => {
            task.abort();
            Attempt::Interrupted
        }
    }
}

/// `chain`: where to put the key's successor if the completion claims it.
async fn write_ending(
    env: &Env,
    ctx: &JobContext,
    job: &ClaimedJob,
    attempt: Attempt,
    chain: Option<&std::sync::Mutex<Successor>>,
) -> Ended {
    let fence = job.fence();
    // The handler completed inside its own transaction but that transaction did not
    // commit (it returned Ok regardless): the business write is gone, so the attempt
    // must not count as done. Fail it; the fence decides whether it is still ours.
    let attempt = match attempt {
        Attempt::Succeeded(v) if ctx.completed_in_tx() => {
            match with_retries(env, job, || env.store.completion_status(&fence)).await {
                Some(CompleteOutcome::Stale) => Attempt::Failed(Failure {
                    reason: "the handler's transaction that completed the job did not commit"
                        .into(),
                    permanent: false,
                }),
                _ => Attempt::Succeeded(v),
            }
        }
        other => other,
    };
    match attempt {
        Attempt::Succeeded(value) => {
            let outcome = if ctx.completed_in_tx() {
                // The handler completed inside its own transaction; confirm it committed.
                with_retries(env, job, || env.store.completion_status(&fence)).await
            } else {
                let result = if value.is_null() { None } else { Some(value) };
                with_retries(env, job, || {
                    complete_via_batcher(env, &fence, job.key.is_some(), chain, result.clone())
                })
                .await
            };
            match outcome {
                Some(CompleteOutcome::Completed) => {
                    env.metrics.incr(|c| &c.completed);
                    Ended::Completed
                }
                Some(CompleteOutcome::AlreadyCompleted { .. }) => {
                    env.metrics.incr(|c| &c.completed);
                    if !ctx.completed_in_tx() {
                        env.metrics.incr(|c| &c.completion_replays);
                    }
                    Ended::Completed
                }
                Some(CompleteOutcome::Stale) => stale(env, job, "completion"),
                None => Ended::Unknown,
            }
        }
        Attempt::Failed(failure) => {
            tracing::warn!(job = %job.id, kind = %job.kind, attempt = job.attempt, reason = %failure.reason, "leasehold attempt failed");
            let backoff = env.config.retry.backoff;
            match with_retries(env, job, || env.store.fail(&fence, &failure, &backoff)).await {
                Some(FailOutcome::Retrying { .. }) => {
                    env.metrics.incr(|c| &c.failed);
                    Ended::Retrying
                }
                Some(FailOutcome::Dead) => {
                    env.metrics.incr(|c| &c.dead);
                    Ended::Dead
                }
                Some(FailOutcome::Stale) => stale(env, job, "failure"),
                None => Ended::Unknown,
            }
        }
        Attempt::Interrupted => {
            let held = [(job.id, job.generation)];
            let released = with_retries(env, job, || {
                env.store
                    .release_many(&env.owner, &held, "released at shutdown")
            })
            .await;
            match released {
                Some(ids) if !ids.is_empty() => {
                    env.metrics.incr(|c| &c.released);
                    Ended::Released
                }
                Some(_) => Ended::Stale,
                None => Ended::Unknown,
            }
        }
        Attempt::Abandoned => stale(env, job, "abandoned attempt"),
    }
}

fn stale(env: &Env, job: &ClaimedJob, what: &str) -> Ended {
    env.metrics.incr(|c| &c.stale_completions);
    tracing::warn!(job = %job.id, generation = %job.generation, "leasehold {what} refused: this worker no longer owns the job");
    Ended::Stale
}

async fn complete_via_batcher(
    env: &Env,
    fence: &crate::job::Fence,
    keyed: bool,
    chain: Option<&std::sync::Mutex<Successor>>,
    result: Option<serde_json::Value>,
) -> Result<CompleteOutcome> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let msg = Complete {
        fence: fence.clone(),
        keyed,
        chain: chain.is_some(),
        result: result.clone(),
        reply: tx,
    };
    if env.completer.tell(msg).is_err() {
        return env.store.complete(fence, result).await;
    }
    match rx.await {
        Ok(Ok((outcome, next))) => {
            if let (Some(slot), CompleteOutcome::Completed) = (chain, &outcome) {
                *slot.lock().unwrap_or_else(|p| p.into_inner()) = match next {
                    Some(job) => Successor::Claimed(Box::new(job)),
                    None => Successor::NoneClaimable,
                };
            }
            Ok(outcome)
        }
        Ok(Err(e)) => Err(e),
        // The batcher went away (shutdown): write it directly.
        Err(_) => env.store.complete(fence, result).await,
    }
}

/// Retry a fenced write on connection errors, with backoff, while the lease may still
/// hold. `None`: gave up; the reaper will take the job back when its lease passes.
async fn with_retries<T, F, Fut>(env: &Env, job: &ClaimedJob, mut write: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let give_up = tokio::time::Instant::now() + env.config.lease;
    let mut pause = Duration::from_millis(20);
    loop {
        match write().await {
            Ok(v) => return Some(v),
            Err(e) => {
                env.metrics.incr(|c| &c.db_errors);
                if tokio::time::Instant::now() + pause >= give_up {
                    tracing::error!(job = %job.id, error = %e, "leasehold could not write the job's ending; leaving it to the lease");
                    return None;
                }
                env.metrics.incr(|c| &c.completion_retries);
                tracing::warn!(job = %job.id, error = %e, "leasehold ending write failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        }
    }
}
