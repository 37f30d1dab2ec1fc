//! Sequencer: one actor per active key; runs that key's jobs one at a time, in order.
//!
//! # Messages
//! - [`RunJob`]: a claimed job of this key (from the claimer).
//!
//! # Lifecycle
//! Created on demand in the scheduler's registry (a dashmap keyed by queue and key).
//! The database already guarantees only the key's head is claimable; the sequencer adds
//! the in-process part: a job's completion promotes the key's successor and claims it
//! for this sequencer in the same transaction (see [`crate::store`]'s key succession),
//! so the key's next job starts without a claim statement or a poll. The handler's slot
//! is free while that completion is written; the successor takes a free slot, or waits
//! parked for the claimer to hand it the next one. After `sequencer_idle` without work
//! the sequencer removes itself from the registry and stops.
//!
//! # Backpressure
//! A job delivered while another runs waits in the sequencer (rare: only after a
//! release or a reap). Each queued job already holds its slot. A chained successor is
//! only asked for when another slot was free as the handler returned, or when fewer
//! jobs wait for a slot than the claimer's paced claim-ahead target: parked successors
//! are jobs claimed ahead, bounded and given back like them.
//!
//! # Shutdown
//! Once shutdown begins it fetches nothing more. On [`super::Stop`] it stops at once
//! when idle; with a fetch in flight it first runs what the fetch claimed (the executor
//! releases it), so no job is left claimed and unrun.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

use actix::prelude::*;

use super::Metered;
use crate::context::JobContext;
use crate::env::Env;
use crate::executor::{execute_chained, hold, Ended, Successor};
use crate::metrics::MailboxMeter;

/// Run this claimed (and tracked: its lease is renewed while it waits) job after the
/// ones before it.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct RunJob(pub JobContext);

/// A registry entry: the address and how many `RunJob`s are on their way to it.
#[derive(Clone)]
pub(crate) struct SequencerHandle {
    addr: Metered<Sequencer>,
    inbox: Arc<AtomicUsize>,
}

impl SequencerHandle {
    /// Ask the sequencer to stop (shutdown, after every attempt has ended).
    pub fn stop(&self) -> Result<(), super::Stop> {
        self.addr.tell(super::Stop)
    }

    /// Deliver to the key's sequencer, creating it if needed. Runs under the registry
    /// entry's lock, so a sequencer that is retiring either sees the message counted
    /// in its inbox (and stays) or is already gone from the registry (and a new one is
    /// made).
    pub fn deliver(env: &Arc<Env>, key: (String, String), msg: RunJob) {
        let mut msg = msg;
        loop {
            let entry = env
                .sequencers
                .entry(key.clone())
                .or_insert_with(|| Sequencer::spawn(env.clone(), key.clone()));
            entry.inbox.fetch_add(1, SeqCst);
            match entry.addr.tell(msg) {
                Ok(()) => return,
                Err(back) => {
                    // Stopped without leaving the registry (should not happen): replace it.
                    msg = back;
                    drop(entry);
                    env.sequencers.remove(&key);
                }
            }
        }
    }
}

pub(crate) struct Sequencer {
    env: Arc<Env>,
    key: (String, String),
    inbox: Arc<AtomicUsize>,
    running: bool,
    fetching: bool,
    /// Shutdown asked this sequencer to stop; it does once nothing runs or is fetched.
    stopping: bool,
    backlog: VecDeque<JobContext>,
    idle_timer: Option<SpawnHandle>,
    meter: Arc<MailboxMeter>,
}

impl Sequencer {
    fn spawn(env: Arc<Env>, key: (String, String)) -> SequencerHandle {
        let inbox = Arc::new(AtomicUsize::new(0));
        let meter = env.metrics.meter("sequencer");
        let seq = Sequencer {
            env: env.clone(),
            key,
            inbox: inbox.clone(),
            running: false,
            fetching: false,
            stopping: false,
            backlog: VecDeque::new(),
            idle_timer: None,
            meter: meter.clone(),
        };
        SequencerHandle {
            addr: Metered::new(seq.start(), meter),
            inbox,
        }
    }

    /// Run a job that holds a slot (its bytes already counted).
    fn run(&mut self, job: JobContext, ctx: &mut Context<Self>) {
        if let Some(t) = self.idle_timer.take() {
            ctx.cancel_future(t);
        }
        self.running = true;
        let env = self.env.clone();
        let freed = self.env.clone();
        let bytes = job.job().payload_bytes;
        ctx.spawn(
            execute_chained(env, job, move || {
                // The handler returned: its slot serves other keys while the completion
                // (which promotes this key's successor) is written.
                freed.slots.release_bytes(bytes);
                freed.slots.finishing();
                super::dispatch::start_ready(&freed);
                freed.wake_claimer();
            })
            .into_actor(self)
            .map(move |(ended, next), act, ctx| {
                act.running = false;
                if act.env.slots.finished() {
                    act.env.wake_claimer();
                }
                act.after(ended, next, ctx);
            }),
        );
    }

    /// The running job ended; its slot went back when its handler returned.
    fn after(&mut self, ended: Ended, next: Successor, ctx: &mut Context<Self>) {
        if let Successor::Claimed(job) = next {
            let job = *job;
            // Claimed by the completion's own transaction (and renewed since). It runs
            // now if a slot is free; otherwise the claimer gives it the next one, before
            // claiming anything new. Anything delivered meanwhile waits behind it.
            if self.env.slots.take(1) == 1 {
                self.run(job, ctx);
            } else {
                super::dispatch::wait_for_slot(&self.env, job);
                self.env.wake_claimer();
                self.next_or_idle(ctx);
            }
            return;
        }
        // NoneClaimable: the completion already looked; a fetch would find nothing.
        let key_moved_on = matches!(ended, Ended::Completed)
            && !matches!(next, Successor::NoneClaimable)
            && !self.env.stop_claiming.is_cancelled();
        // Within the byte budget: a successor's payload is at most the payload cap.
        let bytes_ok = self.env.slots.byte_room() >= self.env.config.store.max_payload_bytes as i64
            || self.env.slots.bytes_in_use() == 0;
        if !key_moved_on || !bytes_ok || !self.backlog.is_empty() || self.env.slots.take(1) == 0 {
            self.next_or_idle(ctx);
            return;
        }
        // Within the queue's own limit (`Config::queue_concurrency`).
        if !self.env.queue_limits.reserve_one(&self.key.0) {
            self.env.slots.give_back(1);
            self.next_or_idle(ctx);
            return;
        }
        // Fetch the key's next job with the slot just taken.
        self.fetching = true;
        let env = self.env.clone();
        let (queue, key) = self.key.clone();
        ctx.spawn(
            async move {
                env.store
                    .claim_key_sent(&env.owner, &queue, &key, Some(&env.kinds), env.config.lease, None)
                    .await
            }
            .into_actor(self)
            .map(move |res, act, ctx| {
                act.fetching = false;
                act.env.queue_limits.settle_one(&act.key.0);
                match res {
                    Ok(Some((job, sent))) => {
                        act.env.metrics.incr(|c| &c.claimed);
                        hold(&act.env, 1);
                        act.env.slots.hold_bytes(job.payload_bytes);
                        let job = act.env.track(job, sent);
                        // It takes the slot; anything delivered meanwhile waits behind.
                        act.run(job, ctx);
                    }
                    Ok(None) => {
                        act.env.slots.give_back(1);
                        act.env.wake_claimer();
                        act.next_or_idle(ctx);
                    }
                    Err(e) => {
                        act.env.metrics.incr(|c| &c.db_errors);
                        tracing::warn!(error = %e, "leasehold sequencer fetch-next failed; the claimer will find the job");
                        act.env.slots.give_back(1);
                        act.env.wake_claimer();
                        act.next_or_idle(ctx);
                    }
                }
            }),
        );
    }

    /// Run what the claimer delivered meanwhile (it holds its own slot) or start the
    /// idle countdown.
    fn next_or_idle(&mut self, ctx: &mut Context<Self>) {
        match self.backlog.pop_front() {
            Some(next) => self.run(next, ctx),
            None => self.arm_idle(ctx),
        }
    }

    fn arm_idle(&mut self, ctx: &mut Context<Self>) {
        if self.stopping {
            ctx.stop();
            return;
        }
        if self.idle_timer.is_some() {
            return;
        }
        self.idle_timer = Some(ctx.run_later(self.env.config.sequencer_idle, |act, ctx| {
            act.idle_timer = None;
            if act.running || act.fetching || !act.backlog.is_empty() {
                return;
            }
            let me = ctx.address();
            let inbox = act.inbox.clone();
            let removed = act
                .env
                .sequencers
                .remove_if(&act.key, |_, h| {
                    h.addr.addr() == &me && inbox.load(SeqCst) == 0
                })
                .is_some();
            if removed {
                ctx.stop();
            }
        }));
    }
}

impl Actor for Sequencer {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.env.config.mailbox_capacity);
        self.env.metrics.sequencers.fetch_add(1, SeqCst);
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        self.env.metrics.sequencers.fetch_sub(1, SeqCst);
    }
}

impl Handler<RunJob> for Sequencer {
    type Result = ();
    fn handle(&mut self, RunJob(job): RunJob, ctx: &mut Self::Context) {
        let _m = self.meter.handling();
        self.inbox.fetch_sub(1, SeqCst);
        if self.running || self.fetching {
            self.backlog.push_back(job);
        } else {
            self.run(job, ctx);
        }
    }
}

impl Handler<super::Stop> for Sequencer {
    type Result = ();
    fn handle(&mut self, _: super::Stop, ctx: &mut Self::Context) {
        let _m = self.meter.handling();
        // A fetch in flight may have claimed the key's next job: stopping now would drop
        // it claimed and unrun until its lease expires. Stop once it has run (released,
        // since the grace period is over) and the slot is back.
        self.stopping = true;
        if !self.running && !self.fetching {
            ctx.stop();
        }
    }
}
