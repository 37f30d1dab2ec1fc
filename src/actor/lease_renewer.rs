//! Lease renewer: extends the leases of this scheduler's running jobs, in batches.
//!
//! # Messages
//! - [`Track`] / [`Untrack`]: an attempt started / ended. Both name the generation: one
//!   process can hold two generations of a job at once (its old attempt still running
//!   after its lease was taken back, and the job claimed again by this same process),
//!   and the end of one must not stop the renewal of the other.
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

use crate::context::{CancelReason, JobContext};
use crate::job::{Generation, JobId, OwnerId};
use crate::metrics::{MailboxMeter, Metrics};
use crate::store::Store;

#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Track {
    pub job: JobId,
    pub generation: Generation,
    pub ctx: JobContext,
}

#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Untrack {
    pub job: JobId,
    pub generation: Generation,
}

/// Renew now; resolves with (renewed, lost) counts.
#[derive(Message)]
#[rtype(result = "(usize, usize)")]
pub(crate) struct RenewNow;

pub(crate) struct LeaseRenewer {
    store: Store,
    owner: OwnerId,
    lease: std::time::Duration,
    interval: std::time::Duration,
    tracked: HashMap<JobId, (Generation, JobContext)>,
    renewing: bool,
    meter: Arc<MailboxMeter>,
    metrics: Arc<Metrics>,
    capacity: usize,
}

impl LeaseRenewer {
    pub fn new(
        store: Store,
        owner: OwnerId,
        config: &crate::Config,
        metrics: Arc<Metrics>,
    ) -> Self {
        LeaseRenewer {
            store,
            owner,
            lease: config.lease,
            interval: config.renew_interval,
            tracked: HashMap::new(),
            renewing: false,
            meter: metrics.meter("lease_renewer"),
            metrics,
            capacity: config.mailbox_capacity,
        }
    }

    fn renew_once(&mut self) -> Option<impl ActorFuture<Self, Output = (usize, usize)>> {
        if self.renewing || self.tracked.is_empty() {
            return None;
        }
        self.renewing = true;
        let jobs: Vec<(JobId, Generation)> =
            self.tracked.iter().map(|(id, (g, _))| (*id, *g)).collect();
        let store = self.store.clone();
        let owner = self.owner.clone();
        let lease = self.lease;
        let sent = jobs.clone();
        Some(async move { store.renew(&owner, &jobs, lease).await }.into_actor(self).map(move |res, act, _| {
            act.renewing = false;
            match res {
                Ok(report) => {
                    act.metrics.add(|c| &c.leases_renewed, report.renewed.len() as u64);
                    let mut lost = 0;
                    for id in report.lost {
                        // Untracked meanwhile (the attempt ended), or replaced by a newer
                        // generation of this job: not a loss of what is tracked now.
                        let sent = sent.iter().find(|(j, _)| *j == id).map(|(_, g)| *g);
                        if act.tracked.get(&id).map(|(g, _)| *g) != sent {
                            continue;
                        }
                        if let Some((generation, ctx)) = act.tracked.remove(&id) {
                            lost += 1;
                            act.metrics.incr(|c| &c.leases_lost);
                            tracing::warn!(job = %id, generation = %generation, "leasehold lease lost; cancelling the attempt");
                            ctx.cancel(CancelReason::LeaseLost);
                        }
                    }
                    (report.renewed.len(), lost)
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

impl Handler<Track> for LeaseRenewer {
    type Result = ();
    fn handle(&mut self, msg: Track, _: &mut Self::Context) {
        let _m = self.meter.handling();
        // This process claimed the job again: the generation it tracked before has lost
        // its lease for certain. Tell that attempt, and renew only the newest.
        match self.tracked.get(&msg.job) {
            Some((g, old)) if *g < msg.generation => {
                self.metrics.incr(|c| &c.leases_lost);
                old.cancel(CancelReason::LeaseLost);
            }
            Some((g, _)) if *g > msg.generation => {
                msg.ctx.cancel(CancelReason::LeaseLost);
                return;
            }
            _ => {}
        }
        self.tracked.insert(msg.job, (msg.generation, msg.ctx));
    }
}

impl Handler<Untrack> for LeaseRenewer {
    type Result = ();
    fn handle(&mut self, msg: Untrack, _: &mut Self::Context) {
        let _m = self.meter.handling();
        if self.tracked.get(&msg.job).map(|(g, _)| *g) == Some(msg.generation) {
            self.tracked.remove(&msg.job);
        }
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
