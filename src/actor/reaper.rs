//! Reaper: takes back running jobs whose lease passed, and applies the retention policy.
//!
//! # Messages
//! - [`ReapNow`]: one pass now, returning its report (tests, tools).
//!
//! # Lifecycle
//! Runs on the maintenance arbiter with its own pool, every `reaper_interval`. With
//! `retention` set it also prunes done and cancelled jobs (never dead ones: they are
//! the dead-letter queue) and, every [`KEY_PRUNE_EVERY`] passes, key rows no job
//! refers to any more. Any
//! number of reapers, in any number of processes, may run at once: the store's reap is
//! one guarded statement. It never consults the handler registry.
//!
//! Each pass also writes the scheduler's heartbeat (the live-schedulers table that
//! `leasehold status` and the dashboard show); `Stop` deletes it.
//!
//! # Failure
//! The three parts of a pass are independent: the heartbeat is informational, so its
//! failure (a runtime role granted before the migration that added `schedulers`, say)
//! is counted in `informational_write_failures`, shown as the snapshot's
//! `informational_error` and logged once per distinct error, and never stops the reap or
//! the retention that follow. A failed reap or prune is counted in `db_errors` and
//! retried at the next tick; one does not stop the other.

use std::sync::Arc;

use actix::prelude::*;

use crate::error::{Error, Result};
use crate::job::OwnerId;
use crate::metrics::{MailboxMeter, Metrics};
use crate::store::{Backoff, Heartbeat, ReapReport, Store};

/// Retention deletes at most this many rows of each kind per pass.
const PRUNE_BATCH: i64 = 10_000;

/// Idle key rows are pruned every this many passes: finding them reads every idle key
/// row (see `Store::prune_keys`), and they are small.
const KEY_PRUNE_EVERY: u64 = 12;

/// Run one reap pass (until no expired lease is left, in batches) and report.
#[derive(Message)]
#[rtype(result = "Result<ReapReport>")]
pub(crate) struct ReapNow;

pub(crate) struct Reaper {
    store: Store,
    owner: OwnerId,
    backoff: Backoff,
    batch: i64,
    interval: std::time::Duration,
    retention: Option<std::time::Duration>,
    /// Passes since idle key rows were last pruned (see [`KEY_PRUNE_EVERY`]).
    passes: u64,
    heartbeat: Heartbeat,
    busy: bool,
    meter: Arc<MailboxMeter>,
    metrics: Arc<Metrics>,
}

impl Reaper {
    pub fn new(
        store: Store,
        owner: OwnerId,
        config: &crate::Config,
        metrics: Arc<Metrics>,
    ) -> Self {
        Reaper {
            heartbeat: Heartbeat {
                owner: owner.to_string(),
                queues: config.queues.clone(),
                concurrency: config.concurrency.try_into().unwrap_or(i32::MAX),
                every: config.reaper_interval,
            },
            store,
            owner,
            backoff: config.retry.backoff,
            batch: config.reaper_batch,
            interval: config.reaper_interval,
            retention: config.retention,
            passes: 0,
            busy: false,
            meter: metrics.meter("reaper"),
            metrics,
        }
    }

    fn reap_once(&mut self) -> impl ActorFuture<Self, Output = Result<ReapReport>> {
        self.busy = true;
        let store = self.store.clone();
        let owner = self.owner.clone();
        let backoff = self.backoff;
        let batch = self.batch;
        let retention = self.retention;
        self.passes += 1;
        let prune_keys = self.passes % KEY_PRUNE_EVERY == 1;
        let heartbeat = self.heartbeat.clone();
        async move {
            // Informational first, but never in the way: its error is only reported.
            let beat = store.heartbeat(&heartbeat).await;
            let reaped = reap_all(&store, &owner, &backoff, batch).await;
            let pruned = match retention {
                Some(keep) => Some(prune(&store, keep, prune_keys).await),
                None => None,
            };
            (beat, reaped, pruned)
        }
        .into_actor(self)
        .map(|(beat, reaped, pruned), act, _| {
            act.busy = false;
            act.metrics.informational_write(beat.err().as_ref());
            if let Some(Err(e)) = &pruned {
                act.pass_failed("retention", e);
            }
            match &reaped {
                Ok(r) => act.metrics.add(
                    |c| &c.reaped,
                    (r.retried.len() + r.dead.len() + r.cancelled.len()) as u64,
                ),
                Err(e) => act.pass_failed("reap", e),
            }
            reaped
        })
    }

    fn pass_failed(&self, what: &str, e: &Error) {
        // A tick that was in flight when the scheduler stopped finds its pool closed by
        // the stop: nothing failed, and there is no next tick.
        if matches!(e, Error::Database(sqlx::Error::PoolClosed)) {
            tracing::debug!("leasehold {what} ended by shutdown");
            return;
        }
        self.metrics.incr(|c| &c.db_errors);
        tracing::warn!(error = %e, "leasehold {what} failed; retrying next tick");
    }
}

/// Reap until no expired lease is left, in batches.
async fn reap_all(
    store: &Store,
    owner: &OwnerId,
    backoff: &Backoff,
    batch: i64,
) -> Result<ReapReport> {
    let mut total = ReapReport::default();
    loop {
        let report = store.reap(owner, backoff, batch, None).await?;
        let n = report.retried.len() + report.dead.len() + report.cancelled.len();
        total.retried.extend(report.retried);
        total.unstarted.extend(report.unstarted);
        total.dead.extend(report.dead);
        total.cancelled.extend(report.cancelled);
        if (n as i64) < batch {
            return Ok(total);
        }
    }
}

/// One retention pass: finished jobs past `keep`, and (when `keys`) idle key rows.
async fn prune(store: &Store, keep: std::time::Duration, keys: bool) -> Result<()> {
    let mut pruned = store.prune_jobs(keep, PRUNE_BATCH).await?;
    if keys {
        pruned.keys = store.prune_keys(PRUNE_BATCH).await?;
    }
    if pruned != Default::default() {
        tracing::info!(
            jobs = pruned.jobs,
            effects = pruned.effects,
            keys = pruned.keys,
            "leasehold retention pruned"
        );
    }
    Ok(())
}

impl Actor for Reaper {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        // Listed as live from the start, not from the first pass.
        let (store, heartbeat) = (self.store.clone(), self.heartbeat.clone());
        ctx.spawn(
            async move { store.heartbeat(&heartbeat).await }
                .into_actor(self)
                .map(|beat, act, _| act.metrics.informational_write(beat.err().as_ref())),
        );
        ctx.run_interval(self.interval, |act, ctx| {
            if !act.busy {
                ctx.spawn(act.reap_once().map(|_, _, _| ()));
            }
        });
    }
}

impl Handler<ReapNow> for Reaper {
    type Result = ResponseActFuture<Self, Result<ReapReport>>;
    fn handle(&mut self, _: ReapNow, _: &mut Self::Context) -> Self::Result {
        let _m = self.meter.handling();
        Box::pin(self.reap_once())
    }
}

impl Handler<super::Stop> for Reaper {
    type Result = ResponseActFuture<Self, ()>;
    fn handle(&mut self, _: super::Stop, _: &mut Self::Context) -> Self::Result {
        let _m = self.meter.handling();
        let store = self.store.clone();
        let owner = self.heartbeat.owner.clone();
        Box::pin(
            async move {
                if let Err(e) = store.forget_scheduler(&owner).await {
                    tracing::warn!(error = %e, "leasehold: this scheduler's heartbeat row could not be deleted; it stops being listed after three heartbeats");
                }
                store.pool().close().await
            }
                .into_actor(self)
                .map(|_, _, ctx| ctx.stop()),
        )
    }
}
