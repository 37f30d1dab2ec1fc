//! Claimer: runs the short claim statements and hands out the jobs.
//!
//! # Messages
//! - [`Wake`]: a NOTIFY arrived, slots were freed, or the listener reconnected.
//! - [`StopClaiming`]: shutdown has begun.
//!
//! # Lifecycle
//! Claims only into free slots (`take` reserves them first) and within the in-flight
//! byte budget. One claim statement at a time, covering every queue of the scheduler.
//! After a full batch it claims again at once; after an empty one the poll interval
//! doubles up to `poll_interval_max`; any work resets it to `poll_interval_min`. A wake
//! during a claim is remembered and served right after it.
//!
//! Unkeyed jobs run as tasks; keyed jobs go to their key's sequencer.
//!
//! # Failure
//! A failed claim gives its slots back, is counted, and is retried after the longest
//! poll interval.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;

use super::sequencer::{RunJob, SequencerHandle};
use crate::env::Env;
use crate::executor::{execute, hold};
use crate::job::ClaimedJob;
use crate::metrics::MailboxMeter;
use crate::store::ClaimRequest;

/// Look for work now.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Wake;

/// Stop claiming (shutdown). Replies whether a claim statement is still in flight (its
/// jobs are dispatched when it returns, so shutdown asks again until it is not).
#[derive(Message)]
#[rtype(result = "bool")]
pub(crate) struct StopClaiming;

pub(crate) struct Claimer {
    env: Arc<Env>,
    claiming: bool,
    wake_pending: bool,
    stopping: bool,
    poll: Duration,
    next_tick: Option<SpawnHandle>,
    meter: Arc<MailboxMeter>,
}

impl Claimer {
    pub fn new(env: Arc<Env>) -> Self {
        let meter = env.metrics.meter("claimer");
        let poll = env.config.poll_interval_min;
        Claimer {
            env,
            claiming: false,
            wake_pending: false,
            stopping: false,
            poll,
            next_tick: None,
            meter,
        }
    }

    fn schedule(&mut self, ctx: &mut Context<Self>, after: Duration) {
        if let Some(h) = self.next_tick.take() {
            ctx.cancel_future(h);
        }
        self.next_tick = Some(ctx.run_later(after, |act, ctx| {
            act.next_tick = None;
            act.claim(ctx);
        }));
    }

    fn claim(&mut self, ctx: &mut Context<Self>) {
        if self.stopping {
            return;
        }
        if self.claiming {
            self.wake_pending = true;
            return;
        }
        let cfg = &self.env.config;
        let want = self.env.slots.take(cfg.claim_batch_max);
        if want == 0 {
            // Every slot is busy; a finishing job wakes us.
            return;
        }
        self.claiming = true;
        let req = ClaimRequest {
            owner: self.env.owner.clone(),
            queues: cfg.queues.clone(),
            kinds: Some(self.env.kinds.clone()),
            limit: want as i64,
            byte_budget: self.env.slots.byte_room(),
            lease: cfg.lease,
            at: None,
        };
        let store = self.env.store.clone();
        let started = Instant::now();
        ctx.spawn(async move { store.claim(&req).await }.into_actor(self).map(
            move |res, act, ctx| {
                act.claiming = false;
                let env = act.env.clone();
                env.metrics.record_claim(started.elapsed());
                env.metrics.incr(|c| &c.claims);
                let cfg = &env.config;
                match res {
                    Ok(jobs) => {
                        let got = jobs.len();
                        env.slots.give_back(want - got);
                        env.metrics.add(|c| &c.claimed, got as u64);
                    hold(&env, got);
                        for job in jobs {
                            act.dispatch(job);
                        }
                        if got == 0 {
                            env.metrics.incr(|c| &c.empty_claims);
                            act.poll = (act.poll * 2).min(cfg.poll_interval_max);
                        } else {
                            act.poll = cfg.poll_interval_min;
                        }
                        if got == want || act.wake_pending {
                            act.wake_pending = false;
                            act.claim(ctx);
                        } else {
                            act.schedule(ctx, act.poll);
                        }
                    }
                    Err(e) => {
                        env.slots.give_back(want);
                        env.metrics.incr(|c| &c.db_errors);
                        tracing::warn!(error = %e, "leasehold claim failed; retrying");
                        act.wake_pending = false;
                        act.schedule(ctx, cfg.poll_interval_max);
                    }
                }
            },
        ));
    }

    /// Run an unkeyed job as a task; give a keyed one to its key's sequencer.
    fn dispatch(&mut self, job: ClaimedJob) {
        self.env.slots.hold_bytes(job.payload_bytes);
        match job.key.clone() {
            None => {
                let env = self.env.clone();
                actix::spawn(async move {
                    let bytes = job.payload_bytes;
                    execute(env.clone(), job).await;
                    env.slots.release_bytes(bytes);
                    env.slots.give_back(1);
                    env.wake_claimer();
                });
            }
            Some(key) => SequencerHandle::deliver(&self.env, (job.queue.clone(), key), RunJob(job)),
        }
    }
}

impl Actor for Claimer {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.env.config.mailbox_capacity);
        self.claim(ctx);
    }
}

impl Handler<Wake> for Claimer {
    type Result = ();
    fn handle(&mut self, _: Wake, ctx: &mut Self::Context) {
        let _m = self.meter.handling();
        self.poll = self.env.config.poll_interval_min;
        self.claim(ctx);
    }
}

impl Handler<StopClaiming> for Claimer {
    type Result = bool;
    fn handle(&mut self, _: StopClaiming, ctx: &mut Self::Context) -> bool {
        let _m = self.meter.handling();
        self.stopping = true;
        if let Some(h) = self.next_tick.take() {
            ctx.cancel_future(h);
        }
        self.claiming
    }
}

impl Handler<super::Stop> for Claimer {
    type Result = ();
    fn handle(&mut self, _: super::Stop, ctx: &mut Self::Context) {
        let _m = self.meter.handling();
        self.stopping = true;
        ctx.stop();
    }
}
