//! Claimer: runs the short claim statements and hands out the jobs.
//!
//! # Messages
//! - [`Wake`]: a NOTIFY arrived, the listener reconnected, or a place freed in a queue
//!   at its own limit with more of its jobs waiting (see `queue_limits`).
//! - [`SlotsFreed`]: a handler returned or a successor was parked.
//! - [`StopClaiming`]: shutdown has begun.
//! - [`PausesChanged`]: a queue was paused (look at the paused queues now).
//!
//! # Lifecycle
//! Claims run on the claimer's own connections, planned generically (see
//! `scheduler::claim_session`). Claims only into free slots (`take` reserves them first) and within the in-flight
//! byte budget, one statement covering every queue of the scheduler. After a full batch
//! it claims again at once; after an empty one the poll interval doubles up to
//! `poll_interval_max`; any work resets it to `poll_interval_min`. A wake during a claim
//! is remembered and served right after it.
//!
//! # Batching
//! An unkeyed job gives its slot back as soon as its handler returns (its completion is
//! then written by the completer while the next claim runs; see [`super::Slots`]).
//! Under load, a wake that finds fewer than half a batch of free slots waits up to
//! [`COALESCE`] for more, so one statement serves many freed slots; an idle scheduler
//! claims at once. While the latest claim came back full (a backlog), a second statement
//! may run alongside the first when half a batch or more is free
//! ([`MAX_CLAIMS_IN_FLIGHT`]); otherwise wakes during a claim are served by one claim
//! right after it, so a trickle of enqueues is claimed in batches, not one per NOTIFY.
//!
//! Unkeyed jobs run as tasks; keyed jobs go to their key's sequencer.
//!
//! # Failure
//! A failed claim gives its slots back, is counted, and is retried after the longest
//! poll interval.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;

use super::dispatch::{dispatch, release_ready, start_ready, wait_for_slot, GiveBack};
use super::pace::Pace;
use super::queue_limits::ClaimPlan;
use crate::env::Env;
use crate::executor::hold;
use crate::metrics::MailboxMeter;
use crate::store::ClaimRequest;

/// Look for work now: a NOTIFY arrived, the listener reconnected, or a place freed in a
/// queue at its own limit with more of its jobs waiting.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Wake;

/// Slots were freed (a handler returned, a key moved on) or a successor was parked.
/// Ignored once a claim found fewer jobs than it had slots for: new work then comes with
/// a NOTIFY (or the next poll), so a freed slot alone is no reason to ask again.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct SlotsFreed;

/// Look at the paused queues now: a pause was announced, or the listener reconnected
/// (announcements may have been missed).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct PausesChanged;

/// How often the claimer looks at the paused queues even without an announcement, so
/// a pause whose NOTIFY was lost still stops this scheduler's claimed-ahead jobs within
/// about a second (the claim statements themselves never take a paused queue's jobs).
pub(crate) const PAUSE_LOOK: Duration = Duration::from_secs(1);

/// Stop claiming (shutdown). Replies whether a claim statement is still in flight (its
/// jobs are dispatched when it returns, so shutdown asks again until it is not).
#[derive(Message)]
#[rtype(result = "bool")]
pub(crate) struct StopClaiming;

pub(crate) struct Claimer {
    env: Arc<Env>,
    /// Claim statements running now (at most [`MAX_CLAIMS_IN_FLIGHT`]).
    claiming: usize,
    wake_pending: bool,
    stopping: bool,
    poll: Duration,
    next_tick: Option<SpawnHandle>,
    /// `next_tick` is a coalescing wait (see [`COALESCE`]), not a poll.
    coalescing: bool,
    /// Work is probably waiting for slots: the latest claim came back full (or cut short
    /// by the byte budget), found no free slot, or a NOTIFY came since. Freed slots
    /// trigger a claim only then.
    more_waiting: bool,
    /// The latest claim came back full: more is probably waiting.
    backlog: bool,
    /// Jobs claimed ahead waited a lease without a free slot and were given back: claim
    /// none ahead until a slot is free again.
    ahead_paused: bool,
    /// When the oldest job claimed ahead will have waited a lease (see
    /// [`Claimer::schedule_give_back`]).
    give_back_tick: Option<SpawnHandle>,
    /// A look at the paused queues is in flight.
    looking_at_pauses: bool,
    /// Attempts ended per second lately: how far ahead to claim.
    pace: Pace,
    meter: Arc<MailboxMeter>,
}

/// Under load, a claim for fewer than half a batch of free slots waits this long for
/// more running jobs to end, so one statement serves them together instead of one
/// statement per freed slot. Never when the scheduler is idle (a NOTIFY on an idle
/// scheduler claims at once).
const COALESCE: Duration = Duration::from_millis(1);

/// How long after the oldest waiting job's lease age its give-back pass runs: late
/// enough that the job is past the age, and a give-back that failed is tried again at
/// this pace, not in a tight loop.
const GIVE_BACK_SLACK: Duration = Duration::from_millis(100);

/// Claim statements in flight at once: a second one, for half a batch or more, overlaps
/// the first (SKIP LOCKED keeps them apart), so claiming keeps up with fast handlers.
/// The claimer's own pool has this many connections.
pub(crate) const MAX_CLAIMS_IN_FLIGHT: usize = 2;

impl Claimer {
    pub fn new(env: Arc<Env>) -> Self {
        let meter = env.metrics.meter("claimer");
        let poll = env.config.poll_interval_min;
        Claimer {
            env,
            claiming: 0,
            wake_pending: false,
            stopping: false,
            poll,
            next_tick: None,
            coalescing: false,
            more_waiting: true,
            backlog: false,
            ahead_paused: false,
            give_back_tick: None,
            looking_at_pauses: false,
            pace: Pace::new(Instant::now(), 0),
            meter,
        }
    }

    /// Jobs to hold claimed ahead now: `claim_ahead`, or what the recent pace starts in
    /// `claim_ahead_window` if that is fewer.
    fn ahead_target(&mut self) -> usize {
        let cfg = &self.env.config;
        let Some(window) = cfg.claim_ahead_window else {
            return cfg.claim_ahead;
        };
        let c = &self.env.metrics.counters;
        let ended = [&c.completed, &c.failed, &c.dead, &c.snoozed, &c.cancelled]
            .iter()
            .map(|n| n.load(std::sync::atomic::Ordering::Relaxed))
            .sum();
        self.pace.update(Instant::now(), ended);
        self.pace.ahead(window, cfg.claim_ahead)
    }

    fn schedule(&mut self, ctx: &mut Context<Self>, after: Duration) {
        if let Some(h) = self.next_tick.take() {
            ctx.cancel_future(h);
        }
        self.coalescing = false;
        self.next_tick = Some(ctx.run_later(after, |act, ctx| {
            act.next_tick = None;
            act.claim(ctx);
        }));
    }

    fn claim(&mut self, ctx: &mut Context<Self>) {
        self.claim_after(ctx, false);
        self.schedule_give_back(ctx);
    }

    /// A job claimed ahead waits at most a lease for a slot, then goes back to the queue
    /// for other processes. With every slot busy no claim runs (nothing frees a slot, no
    /// wake-up need come), so a timer set for the oldest waiting job's lease age runs
    /// the claim pass that gives it back.
    fn schedule_give_back(&mut self, ctx: &mut Context<Self>) {
        if self.give_back_tick.is_some() || self.stopping {
            return;
        }
        let Some(since) = self.env.ready.oldest_since() else {
            return;
        };
        let due = (since + self.env.config.lease).saturating_duration_since(Instant::now());
        self.give_back_tick = Some(ctx.run_later(due + GIVE_BACK_SLACK, |act, ctx| {
            act.give_back_tick = None;
            act.claim(ctx);
        }));
    }

    /// Claim into the free slots; `waited`: the coalescing wait is over.
    fn claim_after(&mut self, ctx: &mut Context<Self>, waited: bool) {
        if self.stopping || self.env.stop_claiming.is_cancelled() {
            release_ready(&self.env, GiveBack::All, "released at shutdown");
            return;
        }
        // Jobs that waited a lease for a slot go back to the queue for others; and this
        // scheduler claims nothing ahead until a slot frees, or it would take them again.
        let given_back = release_ready(
            &self.env,
            GiveBack::WaitedLongerThan(self.env.config.lease),
            "waited a lease for a slot; given back",
        );
        if given_back > 0 {
            self.ahead_paused = true;
        }
        start_ready(&self.env);
        let ahead_target = self.ahead_target();
        self.env.ahead_target.store(
            if self.ahead_paused { 0 } else { ahead_target },
            std::sync::atomic::Ordering::Relaxed,
        );
        let cfg = &self.env.config;
        let free = self.env.slots.free();
        let ahead_room = ahead_target.saturating_sub(self.env.ready.len());
        let half_batch = cfg.claim_batch_max.min(cfg.concurrency).div_ceil(2);
        // A second statement alongside the first only while there is a backlog (the last
        // claim came back full) and for half a batch or more; otherwise what arrives
        // meanwhile waits for the first to return, and is claimed together.
        if self.claiming >= MAX_CLAIMS_IN_FLIGHT
            || (self.claiming > 0 && (!self.backlog || free < half_batch))
        {
            self.wake_pending = true;
            return;
        }
        if cfg.claim_ahead == 0
            && !waited
            && self.claiming == 0
            && free > 0
            && free < half_batch
            && free < cfg.concurrency
        {
            if !self.coalescing {
                if let Some(h) = self.next_tick.take() {
                    ctx.cancel_future(h);
                }
                self.coalescing = true;
                self.next_tick = Some(ctx.run_later(COALESCE, |act, ctx| {
                    act.next_tick = None;
                    act.coalescing = false;
                    act.claim_after(ctx, true);
                }));
            }
            return;
        }
        if self.coalescing {
            if let Some(h) = self.next_tick.take() {
                ctx.cancel_future(h);
            }
            self.coalescing = false;
        }
        // The byte budget is spent while jobs hold it: a finishing job wakes us. (With
        // nothing held, the first job is taken whatever its size.)
        let byte_room = self.env.slots.byte_room();
        let nothing_held = self.env.slots.bytes_in_use() == 0;
        if byte_room == 0 && !nothing_held {
            self.more_waiting = true;
            return;
        }
        // Free slots first; then jobs to wait here for the next ones, topped up in
        // half-queue steps so a busy scheduler claims in batches.
        let slots = self.env.slots.take(cfg.claim_batch_max);
        if slots > 0 {
            self.ahead_paused = false;
        }
        let ahead = if self.ahead_paused {
            0
        } else if slots > 0 || ahead_room * 2 >= ahead_target.max(1) {
            ahead_room.min(cfg.claim_batch_max - slots)
        } else {
            0
        };
        let want = slots + ahead;
        if want == 0 {
            self.more_waiting = true;
            // Every slot is busy and the queue full; a finishing job wakes us.
            return;
        }
        // Queues at their own limit (`Config::queue_concurrency`) take no part; the
        // others with a limit are capped at their room in the same statement.
        let ClaimPlan {
            queues,
            limit: planned,
            caps: reserved,
        } = self.env.queue_limits.plan(&cfg.queues, want);
        let (slots, want) = if planned < want {
            self.env.slots.give_back(slots.saturating_sub(planned));
            (slots.min(planned), planned)
        } else {
            (slots, want)
        };
        if want == 0 {
            self.env.queue_limits.settle(&reserved, None);
            self.more_waiting = true;
            return;
        }
        self.claiming += 1;
        let budget_binds =
            byte_room < (want as i64).saturating_mul(cfg.store.max_payload_bytes as i64);
        let req = ClaimRequest {
            owner: self.env.owner.clone(),
            queues,
            kinds: Some(self.env.kinds.clone()),
            limit: want as i64,
            byte_budget: byte_room,
            first_over_budget: nothing_held,
            caps: reserved
                .iter()
                .map(|(q, &n)| (q.clone(), n as i64))
                .collect(),
            lease: cfg.lease,
            at: None,
        };
        let store = self.env.claim_store.clone();
        let started = Instant::now();
        ctx.spawn(
            async move { store.claim_sent(&req).await }
                .into_actor(self)
                .map(move |res, act, ctx| {
                    act.claiming -= 1;
                    let claimed = res.as_ref().ok().map(|(jobs, _)| &jobs[..]);
                    act.env.queue_limits.settle(&reserved, claimed);
                    let env = act.env.clone();
                    let took = started.elapsed();
                    env.metrics.record_claim(took);
                    if took > env.config.lease / 4 {
                        tracing::warn!(
                            took_ms = took.as_millis() as u64,
                            "leasehold claim statement was slow; its leases started when it did"
                        );
                    }
                    env.metrics.incr(|c| &c.claims);
                    let cfg = &env.config;
                    match res {
                        Ok((jobs, sent)) => {
                            let got = jobs.len();
                            env.slots.give_back(slots.saturating_sub(got));
                            env.metrics.add(|c| &c.claimed, got as u64);
                            env.metrics
                                .add(|c| &c.claimed_ahead, got.saturating_sub(slots) as u64);
                            hold(&env, got);
                            for (n, job) in jobs.into_iter().enumerate() {
                                env.slots.hold_bytes(job.payload_bytes);
                                // Renewed from this moment, whatever waits before it runs.
                                let ctx = env.track(job, sent);
                                if n < slots {
                                    dispatch(&env, ctx);
                                } else {
                                    wait_for_slot(&env, ctx);
                                }
                            }
                            // A slot freed while the claim ran takes a waiting job now.
                            start_ready(&env);
                            act.more_waiting = got == want || (budget_binds && got > 0);
                            act.backlog = got == want;
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
                                act.schedule_give_back(ctx);
                            }
                        }
                        Err(e) => {
                            env.slots.give_back(slots);
                            env.metrics.incr(|c| &c.db_errors);
                            tracing::warn!(error = %e, "leasehold claim failed; retrying");
                            act.wake_pending = false;
                            act.schedule(ctx, cfg.poll_interval_max);
                        }
                    }
                }),
        );
    }
}

impl Claimer {
    /// Read the paused queues; give back the claimed-ahead jobs of any paused one.
    fn look_at_pauses(&mut self, ctx: &mut Context<Self>) {
        if self.looking_at_pauses || self.stopping {
            return;
        }
        self.looking_at_pauses = true;
        let store = self.env.claim_store.clone();
        ctx.spawn(async move { store.paused_queues().await }.into_actor(self).map(
            |res, act, _| {
                act.looking_at_pauses = false;
                match res {
                    Ok(paused) => {
                        let queues = paused.into_iter().map(|p| p.queue).collect();
                        if act.env.paused.replace(queues) {
                            release_ready(
                                &act.env,
                                GiveBack::OfPausedQueues,
                                "its queue was paused; given back",
                            );
                        }
                    }
                    Err(e) => {
                        act.env.metrics.incr(|c| &c.db_errors);
                        tracing::debug!(error = %e, "leasehold could not read the paused queues; trying again");
                    }
                }
            },
        ));
    }
}

impl Actor for Claimer {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.env.config.mailbox_capacity);
        self.look_at_pauses(ctx);
        ctx.run_interval(PAUSE_LOOK, |act, ctx| act.look_at_pauses(ctx));
        if !self.env.config.queue_concurrency.is_empty() {
            // A place freed in a limited queue with more waiting: look now (see
            // `queue_limits` for why freed slots alone do not tell).
            let env = self.env.clone();
            ctx.spawn(actix::fut::wrap_future(async move {
                loop {
                    env.queue_limits.place_freed().await;
                    if let Some(claimer) = env.claimer.get() {
                        let _ = claimer.tell(Wake);
                    }
                }
            }));
        }
        self.claim(ctx);
    }
}

impl Handler<PausesChanged> for Claimer {
    type Result = ();
    fn handle(&mut self, _: PausesChanged, ctx: &mut Self::Context) {
        let _m = self.meter.handling();
        self.look_at_pauses(ctx);
    }
}

impl Handler<Wake> for Claimer {
    type Result = ();
    fn handle(&mut self, _: Wake, ctx: &mut Self::Context) {
        let _m = self.meter.handling();
        self.more_waiting = true;
        self.poll = self.env.config.poll_interval_min;
        self.claim(ctx);
    }
}

impl Handler<SlotsFreed> for Claimer {
    type Result = ();
    fn handle(&mut self, _: SlotsFreed, ctx: &mut Self::Context) {
        let _m = self.meter.handling();
        // Before looking: an ending from now on sends another message (see
        // `Env::wake_claimer`).
        self.env
            .claimer_woken
            .store(false, std::sync::atomic::Ordering::SeqCst);
        if !self.more_waiting && self.env.ready.is_empty() {
            return;
        }
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
        release_ready(&self.env, GiveBack::All, "released at shutdown");
        self.claiming > 0
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
