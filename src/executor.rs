//! One attempt of one job: check its lease is live, run the handler under it, then
//! write the ending.
//!
//! The handler runs in its own task so a panic is caught and becomes a failed attempt.
//! The attempt ends with exactly one fenced write: complete (through the completion
//! batcher), fail (retry, dead, or cancelled), or release (shutdown). A write that fails
//! on a connection error is retried with backoff while the lease is still confirmed,
//! and otherwise left to the reaper: it never takes the scheduler down.
//!
//! A handler that completed its job in its own transaction (`JobContext::complete_in`)
//! has written its ending itself: once that transaction committed, the attempt ends
//! completed whatever the handler did next (returned an error, panicked, ran past its
//! run time or its lease, was cancelled or given back at shutdown), and that is logged
//! as after its completion, never counted as a stale completion.
//!
//! # Stopping a handler
//!
//! A handler is asked to stop through its context (lost lease, local lease deadline,
//! operator cancel, timeout, shutdown), given a short grace, then aborted. The ending
//! is written only after the handler's task has really ended (the abort awaited), so a
//! key never moves on while an attempt of its head may still run in this process.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::{JoinError, JoinHandle};
use tracing::Instrument;

use crate::actor::completer::{Complete, Completed};
use crate::context::{CancelReason, JobContext};
use crate::env::Env;
use crate::error::Result;
use crate::handler::{AttemptError, RetryDelay};
use crate::job::{ClaimedJob, CompleteOutcome, FailOutcome};
use crate::metrics::Outcome;
use crate::store::Failure;

/// How an attempt ended, as far as this scheduler knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    Completed,
    Retrying,
    Dead,
    /// The handler snoozed: pending again after its delay, no attempt spent.
    Snoozed,
    /// An operator cancelled the job while it ran.
    Cancelled,
    /// The fence was gone: another generation (or an operator) owns the job.
    Stale,
    /// Given back (shutdown, or a lease not confirmed before the handler could start).
    Released,
    /// The ending could not be written (database unreachable); the lease will tell.
    Unknown,
}

impl Ended {
    fn outcome(self) -> Outcome {
        match self {
            Ended::Completed => Outcome::Completed,
            Ended::Retrying => Outcome::Retried,
            Ended::Dead => Outcome::Dead,
            Ended::Snoozed => Outcome::Snoozed,
            Ended::Cancelled => Outcome::Cancelled,
            Ended::Stale => Outcome::Stale,
            Ended::Released => Outcome::Released,
            Ended::Unknown => Outcome::Unknown,
        }
    }
}

enum Attempt {
    Succeeded(serde_json::Value),
    Failed(Failure),
    /// Run again after this long, without counting the attempt (`JobError::snooze`).
    Snoozed(Duration),
    /// Give the job back without counting the attempt, with this reason.
    Release(&'static str),
    /// The lease was lost: nothing to write.
    Abandoned,
}

impl Attempt {
    /// What the handler's ending was, for a log line.
    fn described(&self) -> String {
        match self {
            Attempt::Succeeded(_) => "returned Ok".into(),
            Attempt::Failed(f) => format!("failed: {}", f.reason),
            Attempt::Snoozed(d) => format!("snoozed for {}", humantime::format_duration(*d)),
            Attempt::Release(reason) => format!("was given back: {reason}"),
            Attempt::Abandoned => "was stopped: its lease was lost".into(),
        }
    }
}

type Joined = std::result::Result<std::result::Result<serde_json::Value, AttemptError>, JoinError>;

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
struct HeldJob(Arc<Env>);

impl Drop for HeldJob {
    fn drop(&mut self) {
        unhold(&self.0, 1);
    }
}

/// An attempt whose handler was started (or found not startable) by [`begin`], for
/// [`finish`] to watch and end. Dropped unfinished (only when the scheduler's thread has
/// already stopped, see `Home::spawn`), it ends its hold, and nothing renews its lease
/// any more: the job runs again after it expires, as after a crash.
pub(crate) struct Begun {
    env: Arc<Env>,
    ctx: JobContext,
    span: tracing::Span,
    /// The job's kind's meter, looked up once per attempt.
    meter: Arc<crate::metrics::JobMeter>,
    _held: HeldJob,
    start: Start,
}

enum Start {
    /// The handler's task, spawned at `started`.
    Running {
        task: JoinHandle<std::result::Result<serde_json::Value, AttemptError>>,
        started: Instant,
        max_run_time: Duration,
    },
    /// The handler may not start (no live lease, shutdown): the attempt's outcome instead.
    Not(Attempt),
    /// The job cannot run (its payload did not decode, its kind has no handler): a
    /// failed attempt that ran for no time.
    Refused(Attempt),
}

/// Begin one claimed (tracked and [`hold`]-counted) job's attempt: check it may start,
/// and spawn its handler where handlers run. Synchronous and callable from any thread,
/// so a handler's own task can start the next waiting job the moment it returns, with
/// no hand-over to the scheduler's thread between the two (see `actor::dispatch`).
/// `on_return` runs inside the handler's task right after the handler's body returns
/// (not after a panic or an abort).
pub(crate) fn begin(
    env: Arc<Env>,
    ctx: JobContext,
    on_return: Option<Box<dyn FnOnce() + Send>>,
) -> Begun {
    let span = attempt_span(&env, &ctx);
    let held = HeldJob(env.clone());
    let job = ctx.job();
    let meter = env.metrics.job(&job.queue, &job.kind);
    if job.attempt == 1 {
        if let Ok(waited) = (job.claimed_at - job.created_at).to_std() {
            env.metrics.record_start(&meter, waited);
        }
    }
    let start = match not_startable(&env, &ctx) {
        Some(instead) => {
            env.metrics.incr(|c| &c.not_started);
            Start::Not(instead)
        }
        None => {
            // Before the spawn: a renewal that sees the flag records the start in the
            // row, after which an expiry of this lease counts as an attempt.
            ctx.mark_started();
            span.in_scope(|| spawn_handler(&env, &ctx, on_return))
        }
    };
    Begun {
        env,
        ctx,
        span,
        meter,
        _held: held,
        start,
    }
}

/// Watch a [`begin`]-started attempt to its ending, calling `ran` once the handler has
/// returned (or was stopped), before the ending is written: the slot is freed there (if
/// the handler's task did not already), so the next claim overlaps the completion write.
pub(crate) async fn finish(begun: Begun, ran: impl FnOnce()) -> Ended {
    finish_attempt(begun, ran, false).await.0
}

/// What a completion through the batcher said about the key's next job.
#[derive(Default)]
pub(crate) enum Successor {
    /// No chained completion happened (not keyed, shutdown begun, no spare slot or
    /// bytes, completed in the handler's own transaction, a failure...).
    #[default]
    NotAsked,
    /// Asked: the key has no successor the owner can claim now (none, not yet due, or
    /// of a kind it does not run; a promoted one is pending and announced).
    NoneClaimable,
    /// Claimed in the completion's transaction: tracked (renewed) and counted as held.
    Claimed(Box<JobContext>),
}

/// [`begin`] and [`finish`] in one, for a key's sequencer (on the scheduler's thread): a
/// completion also claims the key's successor in its transaction (unless shutdown has
/// begun), for the sequencer to run with the slot it holds.
pub(crate) async fn execute_chained(
    env: Arc<Env>,
    ctx: JobContext,
    ran: impl FnOnce(),
) -> (Ended, Successor) {
    attempt_once(env, ctx, ran, true).await
}

/// The span of one attempt: everything the scheduler does for it, and the handler's own
/// logs and spans, carry the job's identity (so `tracing-opentelemetry` users get one
/// trace per attempt with no code of their own).
fn attempt_span(env: &Env, ctx: &JobContext) -> tracing::Span {
    let job = ctx.job();
    // A root span: an attempt may begin inside the previous one's handler task (whose
    // span is current there), and is not part of it.
    tracing::info_span!(
        parent: None,
        "leasehold.attempt",
        job.id = job.id.0,
        job.kind = %job.kind,
        job.queue = %job.queue,
        job.key = job.key.as_deref().unwrap_or(""),
        job.attempt = job.attempt,
        job.generation = job.generation.0,
        owner = %env.owner,
        outcome = tracing::field::Empty,
    )
}

async fn attempt_once(
    env: Arc<Env>,
    ctx: JobContext,
    ran: impl FnOnce(),
    chain: bool,
) -> (Ended, Successor) {
    finish_attempt(begin(env, ctx, None), ran, chain).await
}

async fn finish_attempt(begun: Begun, ran: impl FnOnce(), chain: bool) -> (Ended, Successor) {
    let span = begun.span.clone();
    let ended = finish_in_span(begun, ran, chain)
        .instrument(span.clone())
        .await;
    span.record("outcome", tracing::field::debug(&ended.0));
    ended
}

async fn finish_in_span(begun: Begun, ran: impl FnOnce(), chain: bool) -> (Ended, Successor) {
    let Begun {
        env,
        ctx,
        meter,
        _held,
        start,
        ..
    } = begun;
    let job = ctx.job();
    let attempt = match start {
        Start::Not(instead) => instead,
        Start::Refused(failed) => {
            meter.ran_for(Duration::ZERO);
            failed
        }
        Start::Running {
            task,
            started,
            max_run_time,
        } => {
            let attempt = watch_handler(&env, &ctx, task, started, max_run_time).await;
            meter.ran_for(started.elapsed());
            attempt
        }
    };
    ctx.set_ending();
    // Chain the key's successor while another slot is free, or, with every slot busy,
    // while the jobs waiting for a slot are fewer than the claimer's paced claim-ahead
    // target: parked, it is a job claimed ahead (leased and renewed, started by the next
    // free slot, given back after a lease, released at shutdown) and counts against that
    // target. Otherwise it is promoted to pending and claimed again later, which costs a
    // third version of its row and a claim (at saturation that was most successors:
    // keyed throughput rose by half when they were chained).
    // (Read before `ran()` hands this slot on; the ready queue's lock only for a keyed
    // job that found no spare slot.)
    let chain = chain && job.key.is_some();
    let spare = env.slots.free() > 0;
    let ahead_room = chain
        && !spare
        && env.ready.len() < env.ahead_target.load(std::sync::atomic::Ordering::Relaxed);
    ran();
    let bytes_ok = env.slots.byte_room() >= env.config.store.max_payload_bytes as i64
        || env.slots.bytes_in_use() == 0;
    let next = std::sync::Mutex::new(Successor::NotAsked);
    let chain = (chain && (spare || ahead_room) && bytes_ok && !env.stop_claiming.is_cancelled())
        .then_some(&next);
    let ended = write_ending(&env, &ctx, attempt, chain).await;
    meter.ended(ended.outcome());
    let next = next.into_inner().unwrap_or_else(|p| p.into_inner());
    if let Successor::Claimed(next) = &next {
        // Counted before this attempt's own hold ends, so shutdown never sees a gap.
        hold(&env, 1);
        env.slots.hold_bytes(next.job().payload_bytes);
        env.metrics.incr(|c| &c.claimed);
        if !spare {
            env.metrics.incr(|c| &c.chained_ahead);
        }
    }
    env.untrack(&ctx);
    (ended, next)
}

/// Why a claimed attempt must not start its handler, if it must not: nothing runs
/// without a live lease, and nothing new starts once shutdown's grace is over.
fn not_startable(env: &Env, ctx: &JobContext) -> Option<Attempt> {
    if env.hard_stop.is_cancelled() {
        return Some(Attempt::Release("released at shutdown"));
    }
    match ctx.cancel_reason() {
        Some(CancelReason::Shutdown) => Some(Attempt::Release("released at shutdown")),
        // Given back, not failed: the release cancels a job an operator asked to cancel
        // and, as for any release, does not count the attempt (its handler never ran).
        Some(CancelReason::Cancelled) => {
            Some(Attempt::Release("cancelled by operator before it started"))
        }
        Some(CancelReason::LeaseLost | CancelReason::Timeout) => Some(Attempt::Abandoned),
        None if !ctx.lease_live() => Some(Attempt::Release(
            "lease not confirmed before the handler could start",
        )),
        None => None,
    }
}

/// Spawn the handler's task where handlers run (or say why it cannot run).
fn spawn_handler(
    env: &Env,
    ctx: &JobContext,
    on_return: Option<Box<dyn FnOnce() + Send>>,
) -> Start {
    let job = ctx.job();
    if let Some(reason) = &job.payload_error {
        env.metrics.incr(|c| &c.decode_failures);
        return Start::Refused(Attempt::Failed(Failure {
            reason: reason.clone(),
            permanent: true,
            retry_after: None,
        }));
    }
    let Some(handler) = env.registry.get(&job.kind) else {
        // The claim filters on registered kinds, so this is a registry bug, not bad input.
        return Start::Refused(Attempt::Failed(Failure {
            reason: format!("no handler for kind {:?}", job.kind),
            permanent: true,
            retry_after: None,
        }));
    };
    // The task checks the lease again when it first runs: the process may have been
    // stopped (SIGSTOP, a paused VM) between the check before it and now.
    let gate = ctx.clone();
    let call = handler.call(ctx.clone(), job.payload.clone());
    let started = Instant::now();
    let task = env.handlers.spawn(
        async move {
            let returned = if gate.lease_live() {
                call.await
            } else {
                Err(AttemptError::NotStarted)
            };
            if let Some(on_return) = on_return {
                on_return();
            }
            returned
        }
        .in_current_span(),
    );
    let max_run_time = handler
        .policy()
        .max_run_time
        .unwrap_or(env.config.max_run_time);
    Start::Running {
        task,
        started,
        max_run_time,
    }
}

/// Wait for the handler's task (spawned at `started`), stopping it when its run time,
/// its lease, an operator or the shutdown says so.
async fn watch_handler(
    env: &Env,
    ctx: &JobContext,
    mut task: JoinHandle<std::result::Result<serde_json::Value, AttemptError>>,
    started: Instant,
    max_run_time: Duration,
) -> Attempt {
    let job = ctx.job();
    let token = ctx.token();
    let run_deadline = tokio::time::sleep_until((started + max_run_time).into());
    tokio::pin!(run_deadline);
    let lease = lease_watch(ctx);
    tokio::pin!(lease);
    let quick = env.config.renew_interval / 4;
    let joined = tokio::select! {
        biased;
        joined = &mut task => joined,
        _ = env.hard_stop.cancelled() => return interrupted(ctx, task).await,
        _ = &mut run_deadline => {
            ctx.cancel(CancelReason::Timeout);
            env.metrics.incr(|c| &c.timeouts);
            // A moment to notice the cancellation and clean up, then stop it.
            let _ = stop(task, Duration::from_millis(100)).await;
            return Attempt::Failed(Failure {
                reason: format!(
                    "attempt exceeded the maximum run time of {}",
                    humantime::format_duration(max_run_time)
                ),
                permanent: false,
                retry_after: None,
            });
        }
        _ = &mut lease => {
            // After a completion committed in the handler's own transaction, renewals
            // find the job done and confirm nothing more: the lease ended with the job,
            // it was not lost. The handler is stopped all the same (its job is done, and
            // the key's next job may be running), but that is not a lost lease. The row
            // says which, asked once the handler is stopped (the deadline is there to
            // stop it before its lease can expire, whether or not the database answers),
            // because a completion rolled back leaves the flag set.
            let unasked = ctx.cancel_reason().is_none();
            let may_be_done = ctx.completed_in_tx();
            let lost = || {
                env.metrics.incr(|c| &c.leases_lost);
                env.metrics.incr(|c| &c.lease_deadlines);
                tracing::warn!(job = %job.id, generation = %job.generation,
                    "leasehold lease not confirmed by its local deadline; stopping the attempt before it can expire");
            };
            if unasked && !may_be_done {
                lost();
            }
            ctx.cancel(CancelReason::LeaseLost);
            let stopped = stop(task, quick).await;
            let done = may_be_done
                && matches!(
                    env.store.completion_status(&job.fence()).await,
                    Ok(CompleteOutcome::AlreadyCompleted { .. })
                );
            if unasked && may_be_done && !done {
                lost();
            }
            match stopped {
                // Finished within the grace: its ending is still fenced.
                Some(joined) => joined,
                None => return Attempt::Failed(Failure {
                    reason: if done {
                        "the handler ran on for a lease after its completion in its own transaction; stopped".into()
                    } else {
                        "lease not confirmed in time (the database did not answer the renewals); stopped".into()
                    },
                    permanent: false,
                    retry_after: None,
                }),
            }
        }
        _ = token.cancelled() => match ctx.cancel_reason() {
            Some(CancelReason::Shutdown) => return interrupted(ctx, task).await,
            Some(CancelReason::Cancelled) => {
                // The key waits for this attempt's ending: give the handler a renew
                // interval to stop by itself, then stop it.
                match stop(task, env.config.renew_interval).await {
                    Some(joined) => joined,
                    None => return Attempt::Failed(Failure {
                        reason: "cancelled by operator; the handler was stopped".into(),
                        permanent: true,
                        retry_after: None,
                    }),
                }
            }
            // Lease lost: the job is someone else's now; its ending is refused anyway.
            _ => match stop(task, quick).await {
                Some(joined) => joined,
                None => return Attempt::Abandoned,
            },
        },
    };
    match (ctx.cancel_reason(), attempt_from(env, joined)) {
        // Told to stop for shutdown, the handler returned before the shutdown was seen
        // here: its error is the stop it was asked for (a handler that checks its
        // cancellation returns one), so the job is released as `interrupted` would,
        // not failed. Otherwise a deploy would spend an attempt (and a job on its last
        // one would go dead) whenever the handler won that race.
        (Some(CancelReason::Shutdown), Attempt::Failed(_)) => {
            Attempt::Release("released at shutdown")
        }
        (_, attempt) => attempt,
    }
}

/// Resolves once the attempt's local lease deadline has passed (renewals move it on).
async fn lease_watch(ctx: &JobContext) {
    loop {
        let deadline = ctx.lease_deadline();
        if Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep_until(deadline.into()).await;
    }
}

/// Wait up to `grace` for the handler's task to end by itself; otherwise abort it and
/// wait until it has really stopped. `None`: it was stopped.
async fn stop(
    mut task: JoinHandle<std::result::Result<serde_json::Value, AttemptError>>,
    grace: Duration,
) -> Option<Joined> {
    if let Ok(joined) = tokio::time::timeout(grace, &mut task).await {
        return Some(joined);
    }
    task.abort();
    let _ = task.await;
    None
}

fn attempt_from(env: &Env, joined: Joined) -> Attempt {
    match joined {
        Ok(Ok(value)) => Attempt::Succeeded(value),
        Ok(Err(AttemptError::Decode(reason))) => {
            env.metrics.incr(|c| &c.decode_failures);
            Attempt::Failed(Failure {
                reason,
                permanent: true,
                retry_after: None,
            })
        }
        Ok(Err(AttemptError::NotStarted)) => {
            env.metrics.incr(|c| &c.not_started);
            Attempt::Release("lease not confirmed before the handler could start")
        }
        Ok(Err(AttemptError::Job(e))) => match e.snooze_delay() {
            Some(delay) => Attempt::Snoozed(delay),
            None => Attempt::Failed(Failure {
                reason: e.message().to_string(),
                permanent: e.is_permanent(),
                retry_after: e.retry_delay(),
            }),
        },
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
                retry_after: None,
            })
        }
        // The runtime the handler ran on stopped under it (the host shutting down):
        // give the job back, as at shutdown.
        Err(_) => Attempt::Release("the handler's runtime stopped"),
    }
}

/// Shutdown after the grace period: a handler that finishes within a moment keeps its
/// result; otherwise it is stopped and the job released (the attempt not counted).
async fn interrupted(
    ctx: &JobContext,
    task: JoinHandle<std::result::Result<serde_json::Value, AttemptError>>,
) -> Attempt {
    ctx.cancel(CancelReason::Shutdown);
    match stop(task, Duration::from_millis(100)).await {
        Some(Ok(Ok(value))) => Attempt::Succeeded(value),
        _ => Attempt::Release("released at shutdown"),
    }
}

/// Why a handler's result cannot be stored, if it cannot: checked before it joins a
/// completion batch, so it fails its own attempt and never the batch.
fn unstorable_result(env: &Env, value: &serde_json::Value) -> Option<String> {
    if value.is_null() {
        return None;
    }
    if let Some(reason) = crate::store::unstorable_json(value, crate::store::MAX_PAYLOAD_DEPTH) {
        return Some(format!("result cannot be stored: {reason}"));
    }
    let mut size = ByteCount(0);
    if let Err(e) = serde_json::to_writer(&mut size, value) {
        return Some(format!("result cannot be encoded: {e}"));
    }
    let limit = env.config.store.max_result_bytes;
    (size.0 > limit).then(|| {
        format!(
            "result of {} bytes exceeds the limit of {limit} bytes (store.max_result_bytes)",
            size.0
        )
    })
}

/// Counts what is written to it, so a result's size is known without a copy.
struct ByteCount(usize);

impl std::io::Write for ByteCount {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `chain`: where to put the key's successor if the completion claims it.
async fn write_ending(
    env: &Env,
    ctx: &JobContext,
    attempt: Attempt,
    chain: Option<&std::sync::Mutex<Successor>>,
) -> Ended {
    let job = ctx.job();
    // Claimed again by this process at the same fence: whatever this older attempt
    // wrote would land on the newer one's row (see `JobContext::supersede`).
    if ctx.is_superseded() {
        return stale(env, job, "ending of an attempt claimed again");
    }
    let fence = job.fence();
    let attempt = match attempt {
        // The handler completed inside its own transaction but that transaction did not
        // commit (it returned Ok regardless): the business write is gone, so the attempt
        // must not count as done. Fail it; the fence decides whether it is still ours.
        Attempt::Succeeded(v) if ctx.completed_in_tx() => match committed_in_tx(env, ctx).await {
            Ok(true) => {
                env.metrics.incr(|c| &c.completed);
                return Ended::Completed;
            }
            Ok(false) => Attempt::Failed(Failure {
                reason: "the handler's transaction that completed the job did not commit".into(),
                permanent: false,
                retry_after: None,
            }),
            Err(_) => Attempt::Succeeded(v),
        },
        Attempt::Succeeded(v) => match unstorable_result(env, &v) {
            Some(reason) => {
                env.metrics.incr(|c| &c.results_refused);
                Attempt::Failed(Failure {
                    reason,
                    permanent: true,
                    retry_after: None,
                })
            }
            None => Attempt::Succeeded(v),
        },
        // The handler completed the job in its own transaction, then erred, panicked, was
        // stopped (timeout, lease deadline, cancel, shutdown) or snoozed. If that
        // transaction committed, the job is done by this attempt, and nothing is left to
        // write; if not, the attempt's own ending is written under its fence below.
        other if ctx.completed_in_tx() => {
            match completed_before(env, ctx, &other.described()).await {
                Some(ended) => return ended,
                None => other,
            }
        }
        other => other,
    };
    match attempt {
        Attempt::Succeeded(value) => {
            let outcome = if ctx.completed_in_tx() {
                with_retries(ctx, env, || env.store.completion_status(&fence)).await
            } else {
                let result = if value.is_null() { None } else { Some(value) };
                with_retries(ctx, env, || {
                    complete_via_batcher(env, job, chain, result.clone())
                })
                .await
            };
            match outcome {
                Ok(CompleteOutcome::Completed) => {
                    env.metrics.incr(|c| &c.completed);
                    Ended::Completed
                }
                Ok(CompleteOutcome::AlreadyCompleted { .. }) => {
                    env.metrics.incr(|c| &c.completed);
                    if !ctx.completed_in_tx() {
                        env.metrics.incr(|c| &c.completion_replays);
                    }
                    Ended::Completed
                }
                Ok(CompleteOutcome::Stale) => stale(env, job, "completion"),
                // The database refused to store the completion itself: fail the attempt
                // for good with the reason, rather than leave it to expire and run again.
                Err(e) if !e.is_transient() => {
                    let failure = Failure {
                        reason: format!("the completion could not be written: {e}"),
                        permanent: true,
                        retry_after: None,
                    };
                    Box::pin(write_ending(env, ctx, Attempt::Failed(failure), None)).await
                }
                Err(_) => Ended::Unknown,
            }
        }
        Attempt::Failed(mut failure) => {
            tracing::warn!(job = %job.id, kind = %job.kind, attempt = job.attempt, reason = %failure.reason, "leasehold attempt failed");
            // The kind's retry delay, unless the error brought its own.
            let mut backoff = env.config.retry.backoff;
            if let Some(delay) = env
                .registry
                .get(&job.kind)
                .and_then(|h| h.policy().retry_delay.clone())
            {
                match delay {
                    RetryDelay::Exponential(b) => backoff = b,
                    fixed if failure.retry_after.is_none() => {
                        failure.retry_after = fixed.fixed_wait(job.attempt);
                    }
                    _ => {}
                }
            }
            match with_turns(ctx, env, || {
                env.ending_store.fail(&fence, &failure, &backoff)
            })
            .await
            {
                Ok(FailOutcome::Retrying { .. }) => {
                    env.metrics.incr(|c| &c.failed);
                    Ended::Retrying
                }
                Ok(FailOutcome::Dead) => {
                    env.metrics.incr(|c| &c.dead);
                    Ended::Dead
                }
                Ok(FailOutcome::Cancelled) => {
                    env.metrics.incr(|c| &c.cancelled);
                    Ended::Cancelled
                }
                // The handler's commit may have landed between the check above and this
                // write (a handler stopped while its COMMIT was on the way).
                Ok(FailOutcome::Stale) => {
                    match completed_before(env, ctx, &format!("failed: {}", failure.reason)).await {
                        Some(ended) => ended,
                        None => stale(env, job, "failure"),
                    }
                }
                Err(_) => Ended::Unknown,
            }
        }
        Attempt::Snoozed(delay) => {
            let max = env.registry.get(&job.kind).map_or(0, |h| h.max_snoozes());
            match with_turns(ctx, env, || env.ending_store.snooze(&fence, delay, max)).await {
                Ok(Some(_)) => {
                    env.metrics.incr(|c| &c.snoozed);
                    Ended::Snoozed
                }
                // Over the kind's limit, cancelled meanwhile, or no longer ours: a
                // failed attempt, which tells those apart.
                Ok(None) => {
                    let failure = Failure {
                        reason: format!(
                            "snoozed for {}, but the snooze was refused: kind {:?} allows {max} \
                             snoozes per job (Handler::MAX_SNOOZES), or the job was cancelled",
                            humantime::format_duration(delay),
                            job.kind
                        ),
                        permanent: false,
                        retry_after: None,
                    };
                    Box::pin(write_ending(env, ctx, Attempt::Failed(failure), None)).await
                }
                Err(_) => Ended::Unknown,
            }
        }
        Attempt::Release(reason) => {
            let held = [job.attempt()];
            loop {
                let released = with_turns(ctx, env, || {
                    env.ending_store
                        .release_reporting(&env.owner, &held, reason)
                })
                .await;
                match released {
                    Ok(r) if !r.cancelled.is_empty() => {
                        env.metrics.incr(|c| &c.cancelled);
                        break Ended::Cancelled;
                    }
                    Ok(r) if !r.released.is_empty() => {
                        env.metrics.incr(|c| &c.released);
                        break Ended::Released;
                    }
                    // Still this attempt's (its key row held, or a cancel committed
                    // while the statement waited): not stale; try again while the
                    // lease is confirmed, else its expiry gives it back.
                    Ok(r)
                        if !r.busy.is_empty()
                            && Instant::now() < ctx.lease_deadline()
                            && ctx.cancel_reason() != Some(CancelReason::LeaseLost) =>
                    {
                        tokio::time::sleep(LOCK_RETRY_MAX).await;
                    }
                    Ok(_) => {
                        break completed_before(env, ctx, &format!("was given back: {reason}"))
                            .await
                            .unwrap_or(Ended::Stale)
                    }
                    Err(_) => break Ended::Unknown,
                }
            }
        }
        Attempt::Abandoned => {
            match completed_before(env, ctx, &Attempt::Abandoned.described()).await {
                Some(ended) => ended,
                None => stale(env, job, "abandoned attempt"),
            }
        }
    }
}

/// Whether this attempt completed its job in the handler's own transaction and that
/// transaction committed; then its ending is `Completed`, counted as such, and what the
/// handler did after (`after`: an error, a panic, a stop) is logged as after the
/// completion. `None` when it did not (no such completion, rolled back, or the job is
/// another attempt's now): the fence decides the ending as for any attempt.
///
/// Why not stale: the job is done, by this very attempt. Counted as a stale completion,
/// a healthy worker would fire the stale-completion alert.
async fn completed_before(env: &Env, ctx: &JobContext, after: &str) -> Option<Ended> {
    if !ctx.completed_in_tx() {
        return None;
    }
    let job = ctx.job();
    match committed_in_tx(env, ctx).await {
        Ok(true) => {
            env.metrics.incr(|c| &c.completed);
            tracing::warn!(job = %job.id, kind = %job.kind, attempt = job.attempt, after,
                "leasehold handler went on after completing its job in its own transaction, which committed: the job is done");
            Some(Ended::Completed)
        }
        _ => None,
    }
}

/// Whether the handler's own transaction, in which it completed its job
/// ([`JobContext::complete_in`]), committed: the completion reads back as this attempt's,
/// or the row is gone while this attempt's lease still runs. A rolled-back completion
/// leaves the row running under this attempt's lease, and retention deletes only
/// finished jobs, so a row gone meanwhile was completed by this attempt and then pruned
/// (a pass with its floor lowered, before the read-back): not a lost fence. Past the
/// lease a row gone says nothing; retention's floor
/// ([`DEFAULT_PRUNE_FLOOR`](crate::store::DEFAULT_PRUNE_FLOOR)) keeps it for the
/// read-back.
async fn committed_in_tx(env: &Env, ctx: &JobContext) -> Result<bool> {
    let job = ctx.job();
    let fence = job.fence();
    match with_retries(ctx, env, || env.store.completion_status(&fence)).await? {
        CompleteOutcome::Completed | CompleteOutcome::AlreadyCompleted { .. } => Ok(true),
        CompleteOutcome::Stale => {
            if Instant::now() >= ctx.lease_deadline() {
                return Ok(false);
            }
            let exists = with_retries(ctx, env, || env.store.attempt_row_exists(&fence)).await?;
            Ok(!exists)
        }
    }
}

fn stale(env: &Env, job: &ClaimedJob, what: &str) -> Ended {
    env.metrics.incr(|c| &c.stale_completions);
    tracing::warn!(job = %job.id, generation = %job.generation, "leasehold {what} refused: this worker no longer owns the job");
    Ended::Stale
}

async fn complete_via_batcher(
    env: &Env,
    job: &ClaimedJob,
    chain: Option<&std::sync::Mutex<Successor>>,
    result: Option<serde_json::Value>,
) -> Result<CompleteOutcome> {
    let fence = job.fence();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let msg = Complete {
        fence: fence.clone(),
        key: job.key.clone().map(|k| (job.queue.clone(), k)),
        chain: chain.is_some(),
        result: result.clone(),
        reply: tx,
    };
    if env.completer.tell(msg).is_err() {
        return env.store.complete(&fence, result).await;
    }
    match rx.await {
        Ok(Ok(Completed { outcome, successor })) => {
            if let (Some(slot), CompleteOutcome::Completed) = (chain, &outcome) {
                *slot.lock().unwrap_or_else(|p| p.into_inner()) = match successor {
                    Some((job, sent)) => Successor::Claimed(Box::new(env.track(job, sent))),
                    None => Successor::NoneClaimable,
                };
            }
            Ok(outcome)
        }
        Ok(Err(e)) => Err(e),
        // The batcher went away (shutdown): write it directly.
        Err(_) => env.store.complete(&fence, result).await,
    }
}

/// Retry a fenced write with backoff for as long as this process may still hold the
/// lease: until its local deadline, plus one lease (past that, no renewal confirmed it
/// for a whole lease, and it has surely expired; the write would be refused anyway).
/// While the renewer confirms the lease the deadline keeps moving, however long a busy
/// pool makes the write wait. The handler has returned by now, so writing late is only
/// a question of wasted work, never of safety: every write is fenced. Errors that may
/// pass (a lost connection, a busy pool, a deadlock, a timeout) are retried for that
/// long; an error the database gives for the statement itself is tried
/// [`REFUSED_TRIES`] times. `Err`: gave up; the reaper takes the job back.
async fn with_retries<T, F, Fut>(ctx: &JobContext, env: &Env, mut write: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let job = ctx.job();
    let mut pause = Duration::from_millis(20);
    let mut refused = 0;
    loop {
        match write().await {
            Ok(v) => return Ok(v),
            Err(e) => {
                env.metrics.incr(|c| &c.db_errors);
                if !e.is_transient() {
                    refused += 1;
                }
                let give_up_at = ctx.lease_deadline() + env.config.lease;
                let left = give_up_at.saturating_duration_since(Instant::now());
                if refused >= REFUSED_TRIES || left.is_zero() {
                    tracing::error!(job = %job.id, error = %e, "leasehold could not write the job's ending; leaving it to the lease");
                    return Err(e);
                }
                env.metrics.incr(|c| &c.completion_retries);
                // A lock a host holds (its transaction has the job's key) is waited out in
                // short tries, so the ending lands soon after the host commits.
                let cap = if e.is_lock_wait() {
                    tracing::debug!(job = %job.id, error = %e, "leasehold ending waits for a lock another session holds; retrying");
                    LOCK_RETRY_MAX
                } else {
                    tracing::warn!(job = %job.id, error = %e, "leasehold ending write failed; retrying");
                    Duration::from_secs(2)
                };
                pause = pause.min(cap);
                tokio::time::sleep(pause.min(left)).await;
                pause = (pause * 2).min(cap);
            }
        }
    }
}

/// [`with_retries`] for an ending the executor writes itself (a failure, a snooze, a
/// release) on [`Env::ending_store`], whose every try waits at most one turn for a lock.
/// After a try that waited a turn out (another session holds the job's row or its key),
/// each further try takes one of the writer's waiting permits (`Env::row_waits`, shared
/// with the completer), so however many such endings wait, one writer connection stays
/// free for every other job's ending (found by an attack: twelve held rows of failing
/// jobs, each try waiting the session's whole 250 ms, delayed other endings 1.5 s).
/// Completions do not come here: the completer takes those permits itself.
async fn with_turns<T, F, Fut>(ctx: &JobContext, env: &Env, mut write: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let waited = std::sync::atomic::AtomicBool::new(false);
    with_retries(ctx, env, || {
        let attempt = write();
        let waited = &waited;
        async move {
            let _turn = match waited.load(std::sync::atomic::Ordering::Relaxed) {
                true => Some(env.row_waits.acquire().await.expect("never closed")),
                false => None,
            };
            let written = attempt.await;
            let lock = matches!(&written, Err(e) if e.is_lock_wait());
            waited.store(lock, std::sync::atomic::Ordering::Relaxed);
            written
        }
    })
    .await
}

/// The longest pause between tries of an ending that waits for a lock another session
/// holds (each try waits `Config::writer_lock_wait` itself).
const LOCK_RETRY_MAX: Duration = Duration::from_millis(100);

/// Tries of an ending write the database refuses for a reason other than a passing one.
const REFUSED_TRIES: u32 = 3;
