//! Dispatch: start claimed jobs in free slots, and the queue of claimed jobs waiting for
//! one.
//!
//! A job waits here when it was claimed ahead of a free slot (`Config::claim_ahead`),
//! or when a key's successor was claimed by its predecessor's completion while every
//! slot was busy. Either way it is already tracked: its lease is renewed while it waits,
//! its payload bytes count against the budget, and shutdown releases it at once. A
//! handler that returns starts the next waiting job itself, in the slot it frees, with
//! no message and no round trip; the claimer only keeps the queue filled. A job that
//! waited longer than a lease is given back (released, its attempt not counted), so a
//! busy process does not hold work that others could run.
//!
//! Not an actor: functions over the scheduler's shared state, called from the claimer and
//! the sequencers on the scheduler's thread, and from handlers' tasks as they return, on
//! whichever thread runs handlers (so the queue and the slots are behind locks and
//! atomics, and whatever must run on the scheduler's thread is sent there).

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::sequencer::{RunJob, SequencerHandle};
use crate::context::JobContext;
use crate::env::Env;
use crate::executor::{begin, finish, unhold};
use crate::CancelReason;

/// Claimed jobs waiting for a slot, oldest first.
#[derive(Default)]
pub(crate) struct ReadyQueue {
    jobs: Mutex<VecDeque<(JobContext, Instant)>>,
}

impl ReadyQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(JobContext, Instant)>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Since when the oldest waiting job has waited.
    pub fn oldest_since(&self) -> Option<Instant> {
        self.lock().front().map(|(_, since)| *since)
    }
}

/// The queues this scheduler last saw paused (see `store::pause`): the claim statements
/// already skip them; this set only keeps jobs claimed before the pause from starting.
#[derive(Default)]
pub(crate) struct PausedSet {
    queues: std::sync::RwLock<HashSet<String>>,
}

impl PausedSet {
    /// Whether `queue` was paused when last looked at.
    pub fn contains(&self, queue: &str) -> bool {
        let set = self.queues.read().unwrap_or_else(|p| p.into_inner());
        !set.is_empty() && set.contains(queue)
    }

    /// Replace the set; returns whether any queue is paused now.
    pub fn replace(&self, queues: HashSet<String>) -> bool {
        let any = !queues.is_empty();
        *self.queues.write().unwrap_or_else(|p| p.into_inner()) = queues;
        any
    }
}

/// Which waiting jobs to give back.
pub(crate) enum GiveBack {
    /// Every one (shutdown).
    All,
    /// Those that waited longer than this for a slot.
    WaitedLongerThan(Duration),
    /// Those of queues paused now.
    OfPausedQueues,
}

/// Queue a claimed (tracked, byte-counted) job for the next free slot. The queue stays
/// in the order jobs joined it (and so of their waiting times): [`release_ready`] relies
/// on it.
pub(crate) fn wait_for_slot(env: &Env, ctx: JobContext) {
    env.ready.lock().push_back((ctx, Instant::now()));
    env.metrics.ready.fetch_add(1, SeqCst);
}

/// Start waiting jobs while slots are free (a job of a queue paused since its claim is
/// given back instead). Returns how many started.
pub(crate) fn start_ready(env: &Arc<Env>) -> usize {
    let mut started = 0;
    let mut paused = Vec::new();
    loop {
        let next = {
            let mut ready = env.ready.lock();
            if ready.is_empty() || env.slots.take(1) == 0 {
                break;
            }
            ready.pop_front()
        };
        let Some((ctx, _)) = next else { break };
        env.metrics.ready.fetch_sub(1, SeqCst);
        if env.paused.contains(&ctx.job().queue) {
            env.slots.give_back(1);
            paused.push(ctx);
            continue;
        }
        dispatch(env, ctx);
        started += 1;
    }
    if !paused.is_empty() {
        give_back(env, paused, "its queue was paused; given back");
    }
    started
}

/// Run a claimed job that holds a slot (and its bytes): an unkeyed one by starting its
/// handler here and watching it from the scheduler's thread, a keyed one through its
/// key's sequencer. Callable from any thread: a handler's task that returns starts the
/// next waiting job through it (see [`SlotHandOff`]).
pub(crate) fn dispatch(env: &Arc<Env>, ctx: JobContext) {
    let job = ctx.job();
    match job.key.clone() {
        None => {
            let slot = Arc::new(SlotHandOff {
                env: env.clone(),
                bytes: job.payload_bytes,
                done: AtomicBool::new(false),
            });
            let on_return = {
                let slot = slot.clone();
                Box::new(move || slot.hand_on())
            };
            let begun = begin(env.clone(), ctx, Some(on_return));
            let env = env.clone();
            env.clone().home.spawn(async move {
                finish(begun, move || slot.hand_on()).await;
                if env.slots.finished() {
                    env.wake_claimer();
                }
            });
        }
        Some(key) => {
            let queue = job.queue.clone();
            let env = env.clone();
            env.clone().home.call(move || {
                SequencerHandle::deliver(&env, (queue, key), RunJob(ctx));
            });
        }
    }
}

/// An unkeyed job's slot (and its payload's bytes), handed on exactly once when its
/// handler returns: by the handler's own task, the moment the handler's body returns,
/// or else (a panic, an abort, a handler that never started) by the execution watching
/// it.
///
/// Handed on from the handler's task, the next waiting job's handler starts right there,
/// on the handler's thread: with handlers on the host's runtime, a job then follows the
/// one before it with no hand-over between threads (the scheduler's thread learns of
/// both endings meanwhile, and writes them). At concurrency 1 those two hand-overs per
/// job (the handler's end to the scheduler's thread, the next start back) were most of
/// a no-op job's time.
pub(crate) struct SlotHandOff {
    env: Arc<Env>,
    bytes: i32,
    done: AtomicBool,
}

impl SlotHandOff {
    fn hand_on(&self) {
        if self.done.swap(true, SeqCst) {
            return;
        }
        // The handler returned: its slot serves the next waiting job at once, while this
        // one's ending is written.
        self.env.slots.release_bytes(self.bytes);
        self.env.slots.finishing();
        start_ready(&self.env);
        self.env.wake_claimer();
    }
}

/// RELEASE the given-back jobs, retrying while the database does not answer. They never
/// start here again: a release may commit with its reply lost (a cut connection, a
/// restart), and then the jobs are pending, perhaps already someone else's (the chaos
/// harness found a released job started when they went back to the ready queue). Until
/// a release is confirmed they stay tracked, so their leases are renewed and a
/// renewal that finds a job no longer ours (the release did land) ends the retries for
/// it; if the database stays away for a lease, they are dropped and their leases expire.
///
/// A job the statement answers as still held (a cancelled job whose key row another
/// session holds, or one an operator's cancel reached while the statement waited for
/// its row) is tried again for as long as renewals confirm its lease, however long the
/// key is held: taken as released, it was dropped while still running under this
/// attempt's lease, and its key waited for that lease to expire (the fault harness found
/// a cancel racing a give-back so; an attack, a key held for three leases).
async fn release_retrying(env: &Arc<Env>, jobs: &[JobContext], reason: &'static str) {
    // Errors (the database away) end the retries after a lease; a busy answer does not.
    let mut give_up = Instant::now() + env.config.lease;
    let mut pause = Duration::from_millis(50);
    // Jobs still to release: all of them, until a statement answers for some.
    let mut left: Vec<&JobContext> = jobs.iter().collect();
    loop {
        let before = left.len();
        left.retain(|j| {
            j.cancel_reason() != Some(CancelReason::LeaseLost)
                && Instant::now() < j.lease_deadline()
        });
        if left.len() < before {
            tracing::warn!(n = before - left.len(), "leasehold dropped jobs it could not give back before their local lease deadline; their leases will expire if no release landed");
        }
        if left.is_empty() {
            return;
        }
        let held: Vec<_> = left.iter().map(|j| j.job().attempt()).collect();
        let why = match env.store.release_reporting(&env.owner, &held, reason).await {
            Ok(answer) => {
                env.metrics
                    .add(|c| &c.released, answer.released.len() as u64);
                left.retain(|j| answer.busy.contains(&j.job().id));
                if left.is_empty() {
                    return;
                }
                // The database answers: only errors count towards giving up.
                give_up = Instant::now() + env.config.lease;
                tracing::debug!(n = left.len(), "leasehold waiting jobs still held (a key row another session holds, or a cancel meanwhile); trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(500));
                continue;
            }
            // Another session holds one of the rows (its lock outlasted the writer's
            // `lock_timeout`): release the others one by one, so only the held row
            // waits for its lock.
            Err(e) if e.is_lock_wait() && left.len() > 1 => {
                let mut still = Vec::new();
                for j in left {
                    let one = [j.job().attempt()];
                    match env.store.release_reporting(&env.owner, &one, reason).await {
                        Ok(answer) => {
                            env.metrics
                                .add(|c| &c.released, answer.released.len() as u64);
                            if !answer.busy.is_empty() {
                                still.push(j);
                            }
                        }
                        Err(_) => still.push(j),
                    }
                }
                left = still;
                if left.is_empty() {
                    return;
                }
                e.to_string()
            }
            Err(e) => e.to_string(),
        };
        if Instant::now() + pause < give_up {
            tracing::warn!(error = %why, n = left.len(), "leasehold could not give waiting jobs back; trying again (they will not start here)");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        } else {
            tracing::warn!(error = %why, n = left.len(), "leasehold could not release waiting jobs; dropping them here, their leases will expire if no release landed");
            return;
        }
    }
}

/// Give back the waiting jobs `which` selects. Released, not failed: the attempt is not
/// counted. Returns how many.
pub(crate) fn release_ready(env: &Arc<Env>, which: GiveBack, reason: &'static str) -> usize {
    let jobs: Vec<JobContext> = {
        let mut ready = env.ready.lock();
        // Jobs join at the back as they are queued, so the front has waited longest: the
        // claimer asks this on every pass (once per ended job under load), and the
        // answer is almost always "none", found without walking the queue.
        if let GiveBack::WaitedLongerThan(age) = &which {
            if ready
                .front()
                .is_none_or(|(_, since)| since.elapsed() <= *age)
            {
                return 0;
            }
        }
        let (out, keep): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut *ready)
            .into_iter()
            .partition(|(ctx, since): &(JobContext, Instant)| match &which {
                GiveBack::All => true,
                GiveBack::WaitedLongerThan(age) => since.elapsed() > *age,
                GiveBack::OfPausedQueues => env.paused.contains(&ctx.job().queue),
            });
        *ready = keep;
        out.into_iter().map(|(ctx, _)| ctx).collect()
    };
    let n = jobs.len();
    if n > 0 {
        env.metrics.ready.fetch_sub(n as u64, SeqCst);
        give_back(env, jobs, reason);
    }
    n
}

/// Release jobs taken off the ready queue (their slots are not held; their bytes and
/// tracking are), then let the claimer look again.
fn give_back(env: &Arc<Env>, jobs: Vec<JobContext>, reason: &'static str) {
    let env = env.clone();
    env.clone().home.spawn(async move {
        release_retrying(&env, &jobs, reason).await;
        for ctx in &jobs {
            env.slots.release_bytes(ctx.job().payload_bytes);
            env.untrack(ctx);
        }
        unhold(&env, jobs.len());
        env.wake_claimer();
    });
}
