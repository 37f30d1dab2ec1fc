//! Lease renewer: extends the leases of this scheduler's running jobs, in batches.
//!
//! # What it renews
//! The attempts in the scheduler's running registry ([`Running`]), read at each tick.
//! Executions add and remove themselves there; they send the renewer nothing. Two
//! messages per attempt to another thread cost more than the rest of a no-op job's
//! client work (about a quarter of the throughput at concurrency 32, measured), and the
//! registry already holds what renewal needs. When one process holds two generations of
//! a job (its old attempt still running after its lease was taken back, and the job
//! claimed again here), only the newest is renewed, and the older is told its lease is
//! lost.
//!
//! # Messages
//! - [`RenewNow`]: renew at once (tests; the interval does the same).
//!
//! # Lifecycle
//! Runs on the maintenance arbiter (its own thread) with its own pool, every
//! `renew_interval` (at most lease/3, so two renewals can fail before a lease is lost).
//!
//! # Failure
//! A job missing from the renewal's result lost its lease (reaped, cancelled, claimed by
//! a newer generation): its cancellation fires with `LeaseLost`. A failed statement is
//! counted and retried at the next tick.

use std::collections::HashMap;
use std::sync::Arc;

use actix::prelude::*;
use dashmap::DashMap;

use crate::context::{CancelReason, JobContext};
use crate::job::{Generation, JobId, OwnerId};
use crate::metrics::{MailboxMeter, Metrics};
use crate::store::Store;

/// Attempts running in this scheduler now, by job and generation.
pub(crate) type Running = Arc<DashMap<(JobId, Generation), JobContext>>;

/// Renew now; resolves with (renewed, lost) counts.
#[derive(Message)]
#[rtype(result = "(usize, usize)")]
pub(crate) struct RenewNow;

pub(crate) struct LeaseRenewer {
    store: Store,
    owner: OwnerId,
    lease: std::time::Duration,
    interval: std::time::Duration,
    running: Running,
    renewing: bool,
    meter: Arc<MailboxMeter>,
    metrics: Arc<Metrics>,
    capacity: usize,
}

/// Tell an attempt its lease is gone, counting it once.
fn lost(metrics: &Metrics, job: JobId, generation: Generation, ctx: &JobContext) -> bool {
    if ctx.cancel_reason().is_some() {
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
        owner: OwnerId,
        running: Running,
        config: &crate::Config,
        metrics: Arc<Metrics>,
    ) -> Self {
        LeaseRenewer {
            store,
            owner,
            lease: config.lease,
            interval: config.renew_interval,
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
        self.renewing = true;
        let store = self.store.clone();
        let owner = self.owner.clone();
        let lease = self.lease;
        let sent = jobs.clone();
        Some(async move { store.renew(&owner, &jobs, lease).await }.into_actor(self).map(move |res, act, _| {
            act.renewing = false;
            match res {
                Ok(report) => {
                    act.metrics.add(|c| &c.leases_renewed, report.renewed.len() as u64);
                    let mut n_lost = 0;
                    for id in report.lost {
                        // Ended meanwhile (no longer in the registry): not a loss.
                        let Some(generation) = sent.iter().find(|(j, _)| *j == id).map(|(_, g)| *g) else {
                            continue;
                        };
                        if let Some(ctx) = act.running.get(&(id, generation)) {
                            n_lost += usize::from(lost(&act.metrics, id, generation, ctx.value()));
                        }
                    }
                    (report.renewed.len(), n_lost)
                }
                Err(e) => {
                    act.metrics.incr(|c| &c.db_errors);
                    tracing::warn!(error = %e, "leasehold lease renewal failed; retrying next tick");
                    (0, 0)
                }
            }
        }))
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
