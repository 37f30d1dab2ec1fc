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
//! lost; see the store's lease module), and it is abandoned after `renew_interval`
//! without an answer: the renewer then replaces its connection (a hung connection
//! would hang the next renewal too) and tries again at the next tick. Its sessions
//! also set `lock_timeout` and `statement_timeout` (see `scheduler::MAINTENANCE_SESSION`).
//! Whatever happens, each attempt's local deadline (see
//! [`JobContext::lease_deadline`]) stops its handler before its lease can expire.
//!
//! # Messages
//! - [`RenewNow`]: renew at once (tests; the interval does the same).
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
use crate::job::{Generation, JobId, OwnerId};
use crate::metrics::{MailboxMeter, Metrics};
use crate::store::Store;

/// Attempts this scheduler holds, by job and generation (see `Env::running`).
pub(crate) type Running = Arc<DashMap<(JobId, Generation), JobContext>>;

/// Renew now; resolves with (renewed, lost) counts.
#[derive(Message)]
#[rtype(result = "(usize, usize)")]
pub(crate) struct RenewNow;

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
            meter: metrics.meter("lease_renewer"),
            metrics,
            capacity: config.mailbox_capacity,
        }
    }

    /// The newest running generation of each job; older ones are told they lost.
    fn newest(&self) -> Vec<(JobId, Generation)> {
        let mut newest: HashMap<JobId, Generation> = HashMap::new();
        for entry in self.running.iter() {
            let (job, generation) = *entry.key();
            let g = newest.entry(job).or_insert(generation);
            *g = (*g).max(generation);
        }
        for entry in self.running.iter() {
            let (job, generation) = *entry.key();
            if newest.get(&job).is_some_and(|g| *g > generation) {
                lost(&self.metrics, job, generation, entry.value());
            }
        }
        newest.into_iter().collect()
    }

    fn renew_once(&mut self) -> Option<impl ActorFuture<Self, Output = (usize, usize)>> {
        if self.renewing || self.running.is_empty() {
            return None;
        }
        let jobs = self.newest();
        let sent_jobs: HashMap<JobId, Generation> = jobs.iter().copied().collect();
        self.renewing = true;
        let store = self.store.clone();
        let owner = self.owner.clone();
        let lease = self.lease;
        let limit = self.interval;
        let sent = Instant::now();
        let renewal =
            async move { tokio::time::timeout(limit, store.renew(&owner, &jobs, lease)).await };
        Some(renewal.into_actor(self).map(move |res, act, _| {
            act.renewing = false;
            match res {
                Ok(Ok(report)) => act.apply(report, sent, &sent_jobs),
                Ok(Err(e)) => {
                    act.metrics.incr(|c| &c.db_errors);
                    tracing::warn!(error = %e, "leasehold lease renewal failed; retrying next tick");
                    (0, 0)
                }
                Err(_) => {
                    act.metrics.incr(|c| &c.renew_timeouts);
                    tracing::warn!(
                        "leasehold lease renewal got no answer within {}; reconnecting",
                        humantime::format_duration(act.interval)
                    );
                    let fresh = act.store.with_pool((act.fresh_pool)());
                    let old = std::mem::replace(&mut act.store, fresh);
                    // The hung connection is dropped with the old pool, in the background.
                    actix::spawn(async move { drop(old) });
                    (0, 0)
                }
            }
        }))
    }

    /// Act on a renewal's answer: move the local deadlines of the renewed attempts,
    /// tell those an operator cancelled, cancel those that lost their lease.
    fn apply(
        &mut self,
        report: crate::store::RenewReport,
        sent: Instant,
        generation_of: &HashMap<JobId, Generation>,
    ) -> (usize, usize) {
        let attempt = |id: &JobId| {
            generation_of.get(id).and_then(|g| {
                self.running
                    .get(&(*id, *g))
                    .map(|e| (*g, e.value().clone()))
            })
        };
        self.metrics
            .add(|c| &c.leases_renewed, report.renewed.len() as u64);
        self.metrics
            .add(|c| &c.leases_busy, report.busy.len() as u64);
        let deadline = sent + self.confirmed_for;
        for (id, _) in &report.renewed {
            if let Some((_, ctx)) = attempt(id) {
                ctx.confirm_lease(deadline);
            }
        }
        for id in &report.cancel_requested {
            if let Some((_, ctx)) = attempt(id) {
                if ctx.cancel_reason().is_none() {
                    self.metrics.incr(|c| &c.cancels_requested);
                    ctx.cancel(CancelReason::Cancelled);
                }
            }
        }
        let mut n_lost = 0;
        for id in &report.lost {
            // Ended meanwhile (no longer in the registry): not a loss.
            if let Some((generation, ctx)) = attempt(id) {
                n_lost += usize::from(lost(&self.metrics, *id, generation, &ctx));
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
