//! Lease renewer: extends the leases of this scheduler's running jobs, in batches.
//!
//! # What it renews
//! The attempts in the scheduler's running registry ([`Running`]), read at each tick.
//! A claim adds its attempts there (so an attempt is renewed from its claim, also while
//! it waits for a slot or for its key), and an attempt leaves once its ending is
//! written; they send the renewer nothing. Two
//! messages per attempt to another thread cost more than the rest of a no-op job's
//! client work (about a quarter of the throughput at concurrency 32, measured), and the
//! registry already holds what renewal needs. When one process holds two generations of
//! a job (its old attempt still running after its lease was taken back, and the job
//! claimed again here), only the newest is renewed, and the older is told its lease is
//! lost.
//!
//! # Never waiting
//! The renewal statement skips rows another transaction holds (reported *busy*, not
//! lost; see the store's lease module), and it is abandoned when it has no answer
//! within the renew interval (or half the lease, if longer); after two such misses in a
//! row the renewer replaces its connection (a hung connection would hang every renewal). Its sessions
//! also set `lock_timeout` and `statement_timeout` (see `scheduler::MAINTENANCE_SESSION`).
//! Whatever happens, each attempt's local deadline (see
//! [`JobContext::lease_deadline`]) stops its handler before its lease can expire.
//!
//! # Recording starts
//! Each renewal says, per attempt, whether its handler has started; the row keeps the
//! latest started generation, and the reaper counts an expired lease as an attempt only
//! when its start was recorded (a job claimed ahead and waiting for a slot in a process
//! that died has not run, and must not be dead-lettered for it). So that a handler that
//! kills its process is counted too, a start is recorded soon: every
//! [`START_RECORD_EVERY`] the renewer looks for attempts started since, and renews just
//! those (one statement for all of them, none when there are none). A process that dies
//! within that moment of a start leaves it unrecorded; the reaper bounds how often a job
//! is given back so (`store::UNSTARTED_EXPIRIES_MAX`).
//!
//! # Messages
//! - [`RenewNow`]: renew at once (tests; the listener, on a cancel notification for a job
//!   running here, since the renewal reads the row; the interval does the same).
//!
//! # Lifecycle
//! Runs on the maintenance arbiter (its own thread) with its own pool, every
//! `renew_interval` (at most lease/3, so two renewals can fail before a lease is lost).
//!
//! # Failure
//! A job whose fence no longer matches lost its lease (reaped, claimed by a newer
//! generation): its cancellation fires with `LeaseLost` — unless the attempt's ending is
//! being written, in which case the job leaving `running` is that ending. A job an
//! operator asked to cancel is told with `Cancelled`. A failed statement is counted and
//! retried at the next tick.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use dashmap::DashMap;
use sqlx::PgPool;

use crate::context::{CancelReason, JobContext};
use crate::job::{Attempt, EffectIdentity, Generation, JobId, OwnerId};
use crate::metrics::{MailboxMeter, Metrics};
use crate::store::Store;

/// Attempts this scheduler holds, by job, generation and identity (see `Env::running`):
/// the identity tells apart the same id and generation of two incarnations of a schema
/// (see [`Fence`](crate::Fence)).
pub(crate) type Running = Arc<DashMap<Attempt, JobContext>>;

/// Renew now; resolves with (renewed, lost) counts.
#[derive(Message)]
#[rtype(result = "(usize, usize)")]
pub(crate) struct RenewNow;

/// How often the renewer records the starts of attempts begun since its last look (see
/// the module docs): at most this long after a start, plus a statement, the row knows.
/// Under load that is five small statements a second; idle, none.
pub(crate) const START_RECORD_EVERY: Duration = Duration::from_millis(200);

/// Opens a fresh pool for the renewer (after a renewal hung).
pub(crate) type PoolMaker = Box<dyn Fn() -> PgPool + Send>;

pub(crate) struct LeaseRenewer {
    store: Store,
    fresh_pool: PoolMaker,
    owner: OwnerId,
    lease: Duration,
    interval: Duration,
    /// Local deadline of a lease confirmed by a renewal sent at `t`: `t + margin_after`.
    confirmed_for: Duration,
    running: Running,
    renewing: bool,
    /// A starts-only renewal (see [`START_RECORD_EVERY`]) is in flight.
    recording_starts: bool,
    /// Renewals abandoned in a row (see [`LeaseRenewer::answer_within`]).
    timeouts_in_a_row: u32,
    /// A tick came while a renewal was in flight.
    tick_missed: bool,
    meter: Arc<MailboxMeter>,
    metrics: Arc<Metrics>,
    capacity: usize,
}

/// Tell an attempt its lease is gone, counting it once. An attempt whose ending is
/// being written is not told: the job left `running` by that ending.
fn lost(metrics: &Metrics, job: JobId, generation: Generation, ctx: &JobContext) -> bool {
    if ctx.cancel_reason().is_some() || ctx.is_ending() {
        return false;
    }
    metrics.incr(|c| &c.leases_lost);
    tracing::warn!(job = %job, generation = %generation, "leasehold lease lost; cancelling the attempt");
    ctx.cancel(CancelReason::LeaseLost);
    true
}

impl LeaseRenewer {
    pub fn new(
        store: Store,
        fresh_pool: PoolMaker,
        owner: OwnerId,
        running: Running,
        config: &crate::Config,
        metrics: Arc<Metrics>,
    ) -> Self {
        LeaseRenewer {
            store,
            fresh_pool,
            owner,
            lease: config.lease,
            interval: config.renew_interval,
            confirmed_for: config.lease - config.renew_interval / 2,
            running,
            renewing: false,
            recording_starts: false,
            timeouts_in_a_row: 0,
            tick_missed: false,
            meter: metrics.meter("lease_renewer"),
            metrics,
            capacity: config.mailbox_capacity,
        }
    }

    /// The newest running generation of each job; older ones are told they lost. A job
    /// is its id and identity: the same id of another incarnation of the schema is
    /// another job (its renewal finds it lost).
    fn newest(&self) -> Vec<Attempt> {
        let mut newest: HashMap<(JobId, EffectIdentity), Generation> = HashMap::new();
        for entry in self.running.iter() {
            let a = entry.key();
            let g = newest
                .entry((a.job, a.identity.clone()))
                .or_insert(a.generation);
            *g = (*g).max(a.generation);
        }
        for entry in self.running.iter() {
            let a = entry.key();
            if newest
                .get(&(a.job, a.identity.clone()))
                .is_some_and(|g| *g > a.generation)
            {
                lost(&self.metrics, a.job, a.generation, entry.value());
            }
        }
        newest
            .into_iter()
            .map(|((job, identity), generation)| Attempt {
                job,
                generation,
                identity,
            })
            .collect()
    }

    fn renew_once(&mut self) -> Option<impl ActorFuture<Self, Output = (usize, usize)>> {
        self.renew(false)
    }

    /// Renew the leases of every attempt held here or, with `starts_only`, of those whose
    /// start is not recorded yet (nothing to send when there are none).
    fn renew(
        &mut self,
        starts_only: bool,
    ) -> Option<impl ActorFuture<Self, Output = (usize, usize)>> {
        if starts_only && self.recording_starts {
            // The last look's statement is still out: the next look takes its place.
            return None;
        }
        if !starts_only && self.renewing {
            // A tick while a renewal is in flight: renew again as soon as it returns, so
            // one slow statement does not also cost the next interval.
            self.tick_missed = true;
            return None;
        }
        if self.running.is_empty() {
            return None;
        }
        let jobs: Vec<(Attempt, bool)> = self
            .newest()
            .into_iter()
            .filter_map(|attempt| {
                let ctx = self.running.get(&attempt)?;
                let ctx = ctx.value();
                if starts_only && (!ctx.start_unrecorded() || ctx.is_ending()) {
                    return None;
                }
                let started = ctx.has_started();
                Some((attempt, started))
            })
            .collect();
        if jobs.is_empty() {
            return None;
        }
        let sent_jobs: HashMap<Attempt, bool> = jobs.iter().cloned().collect();
        // Separate flags: a starts-only pass in flight never makes a full renewal (or a
        // `RenewNow`) wait or skip.
        if starts_only {
            self.recording_starts = true;
        } else {
            self.renewing = true;
        }
        let store = self.store.clone();
        let owner = self.owner.clone();
        let lease = self.lease;
        let limit = self.answer_within();
        let asked = Instant::now();
        let renewal = async move {
            tokio::time::timeout(limit, store.renew_recording(&owner, &jobs, lease)).await
        };
        Some(renewal.into_actor(self).map(move |res, act, ctx| {
            if starts_only {
                act.recording_starts = false;
            } else {
                act.renewing = false;
            }
            if !starts_only && std::mem::take(&mut act.tick_missed) {
                if let Some(f) = act.renew_once() {
                    ctx.spawn(f.map(|_, _, _| ()));
                }
            }
            match res {
                Ok(Ok(report)) => {
                    act.timeouts_in_a_row = 0;
                    let sent = report.sent_at.unwrap_or(asked);
                    act.apply(report, sent, &sent_jobs)
                }
                Ok(Err(e)) => {
                    act.metrics.incr(|c| &c.db_errors);
                    tracing::warn!(error = %e, "leasehold lease renewal failed; retrying next tick");
                    (0, 0)
                }
                Err(_) => {
                    act.metrics.incr(|c| &c.renew_timeouts);
                    act.timeouts_in_a_row += 1;
                    tracing::warn!(
                        "leasehold lease renewal got no answer within {}",
                        humantime::format_duration(limit)
                    );
                    // A slow statement's answer is drained on the connection's next use;
                    // a hung connection would hang that too, so after a second miss in
                    // a row the renewer opens a fresh one.
                    if act.timeouts_in_a_row >= 2 {
                        tracing::warn!("leasehold lease renewer reconnecting");
                        let fresh = act.store.with_pool((act.fresh_pool)());
                        let old = std::mem::replace(&mut act.store, fresh);
                        // The hung connection is dropped with the old pool, in the background.
                        actix::spawn(async move { drop(old) });
                        act.timeouts_in_a_row = 0;
                    }
                    (0, 0)
                }
            }
        }))
    }

    /// How long a renewal may take before it is abandoned: the renew interval, or half
    /// the lease when that is longer. Safety never rests on it (the local deadlines do);
    /// it keeps one stuck statement from stopping renewal for good.
    fn answer_within(&self) -> Duration {
        self.interval.max(self.lease / 2)
    }

    /// Act on a renewal's answer: move the local deadlines of the renewed attempts,
    /// tell those an operator cancelled, cancel those that lost their lease.
    fn apply(
        &mut self,
        report: crate::store::RenewReport,
        sent: Instant,
        started: &HashMap<Attempt, bool>,
    ) -> (usize, usize) {
        let attempt = |a: &Attempt| self.running.get(a).map(|e| e.value().clone());
        self.metrics
            .add(|c| &c.leases_renewed, report.renewed.len() as u64);
        self.metrics
            .add(|c| &c.leases_busy, report.busy.len() as u64);
        let deadline = sent + self.confirmed_for;
        for (a, _) in &report.renewed {
            if let Some(ctx) = attempt(a) {
                ctx.confirm_lease(deadline);
                if started.get(a).is_some_and(|s| *s) {
                    ctx.start_recorded();
                }
            }
        }
        for a in &report.cancel_requested {
            if let Some(ctx) = attempt(a) {
                if ctx.cancel_reason().is_none() {
                    self.metrics.incr(|c| &c.cancels_requested);
                    ctx.cancel(CancelReason::Cancelled);
                }
            }
        }
        let mut n_lost = 0;
        for a in &report.lost {
            // Ended meanwhile (no longer in the registry): not a loss.
            if let Some(ctx) = attempt(a) {
                n_lost += usize::from(lost(&self.metrics, a.job, a.generation, &ctx));
            }
        }
        (report.renewed.len(), n_lost)
    }
}

impl Actor for LeaseRenewer {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.capacity);
        ctx.run_interval(self.interval, |act, ctx| {
            if let Some(f) = act.renew_once() {
                ctx.spawn(f.map(|_, _, _| ()));
            }
        });
        ctx.run_interval(START_RECORD_EVERY.min(self.interval), |act, ctx| {
            if let Some(f) = act.renew(true) {
                ctx.spawn(f.map(|_, _, _| ()));
            }
        });
    }
}

impl Handler<RenewNow> for LeaseRenewer {
    type Result = ResponseActFuture<Self, (usize, usize)>;
    fn handle(&mut self, _: RenewNow, _: &mut Self::Context) -> Self::Result {
        let _m = self.meter.handling();
        match self.renew_once() {
            Some(f) => Box::pin(f),
            None => Box::pin(async { (0, 0) }.into_actor(self)),
        }
    }
}

impl Handler<super::Stop> for LeaseRenewer {
    type Result = ResponseActFuture<Self, ()>;
    fn handle(&mut self, _: super::Stop, _: &mut Self::Context) -> Self::Result {
        let _m = self.meter.handling();
        let pool = self.store.pool().clone();
        Box::pin(
            async move { pool.close().await }
                .into_actor(self)
                .map(|_, _, ctx| ctx.stop()),
        )
    }
}
