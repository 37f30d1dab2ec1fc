//! Reaper: takes back running jobs whose lease passed, and applies the retention policy.
//!
//! # Messages
//! - [`ReapNow`]: one pass now, returning its report (tests, tools).
//!
//! # Lifecycle
//! Runs on the maintenance arbiter with its own pool, every `reaper_interval`. With
//! `retention` set it also prunes done and cancelled jobs (never dead ones: they are
//! the dead-letter queue) and, every [`KEY_PRUNE_EVERY`] passes, key rows no job
//! refers to any more. A retention pass costs what is due, and one process prunes a
//! schema at a time (the others' passes are skipped: see `store::retention`). Any
//! number of reapers, in any number of processes, may run at once: the store's reap is
//! one guarded statement. It never consults the handler registry.
//!
//! A retention statement that hits its timeout is tried again with half the batch; the
//! next pass starts from that smaller batch and doubles it back, pass by pass, up to
//! [`PRUNE_BATCH`]. Each pass's figures (rows read, deleted, time, timeouts, skips) go
//! to the metrics' `prune_*` counters, and to the log when it deleted something.
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
use crate::store::{Backoff, Heartbeat, PruneOptions, PruneReport, ReapReport, Store};

/// Retention deletes at most this many rows of each kind per statement.
const PRUNE_BATCH: i64 = crate::store::DEFAULT_PRUNE_BATCH;

/// Idle key rows are pruned every this many passes: their pass costs two transactions
/// more, and key rows are small.
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
    /// The batch the next retention pass starts with (smaller than [`PRUNE_BATCH`] after
    /// a statement timed out).
    prune_batch: i64,
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
            prune_batch: PRUNE_BATCH,
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
        let prune = retention.map(|keep| {
            let mut options = PruneOptions::new(keep);
            options.batch = self.prune_batch;
            options.keys = self.passes % KEY_PRUNE_EVERY == 1;
            options
        });
        let heartbeat = self.heartbeat.clone();
        async move {
            // Informational first, but never in the way: its error is only reported.
            let beat = store.heartbeat(&heartbeat).await;
            let reaped = reap_all(&store, &owner, &backoff, batch).await;
            let pruned = match prune {
                Some(options) => Some(store.prune_with(&options).await),
                None => None,
            };
            (beat, reaped, pruned)
        }
        .into_actor(self)
        .map(|(beat, reaped, pruned), act, _| {
            act.busy = false;
            act.metrics.informational_write(beat.err().as_ref());
            match &pruned {
                Some(Ok(report)) => act.pruned(report),
                Some(Err(e)) => act.pass_failed("retention", e),
                None => {}
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

    /// A retention pass's figures into the metrics and the log; its batch carries to
    /// the next pass, doubled back towards [`PRUNE_BATCH`].
    fn pruned(&mut self, report: &PruneReport) {
        let m = &self.metrics;
        if report.skipped {
            m.incr(|c| &c.prune_skipped);
        } else {
            m.incr(|c| &c.prune_passes);
        }
        m.add(|c| &c.prune_rows_read, report.read);
        m.add(|c| &c.prune_rows_deleted, report.deleted());
        m.add(|c| &c.prune_timeouts, u64::from(report.timeouts));
        m.add(|c| &c.prune_micros, report.elapsed.as_micros() as u64);
        self.prune_batch = if report.timeouts > 0 {
            report.batch
        } else {
            report.batch.saturating_mul(2).min(PRUNE_BATCH)
        };
        if report.deleted() > 0 || report.timeouts > 0 {
            tracing::info!(
                jobs = report.jobs,
                effects = report.effects,
                keys = report.keys,
                fires = report.fires,
                read = report.read,
                timeouts = report.timeouts,
                batch = report.batch,
                elapsed_ms = report.elapsed.as_secs_f64() * 1000.0,
                "leasehold retention pruned"
            );
        } else {
            tracing::debug!(
                read = report.read,
                skipped = report.skipped,
                elapsed_ms = report.elapsed.as_secs_f64() * 1000.0,
                "leasehold retention pass"
            );
        }
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
