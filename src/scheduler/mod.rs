//! The public handle: build, start, enqueue, observe, stop.
//!
//! ```no_run
//! # use leasehold::{Config, Handler, JobContext, JobError, Scheduler};
//! # struct SendEmail;
//! # impl Handler for SendEmail {
//! #     type Payload = String;
//! #     type Output = ();
//! #     const KIND: &'static str = "send_email";
//! #     async fn run(&self, _: JobContext, _: String) -> Result<(), JobError> { Ok(()) }
//! # }
//! # async fn example(pool: sqlx::PgPool, email: String) -> leasehold::Result<()> {
//! let scheduler = Scheduler::builder(pool, Config::default())
//!     .register(SendEmail)
//!     .start()
//!     .await?;
//! scheduler.enqueue::<SendEmail>(&email).await?;
//! scheduler.shutdown().await?;
//! # Ok(())
//! # }
//! ```
//!
//! Start it from any async context: an actix `System` (actix-web), or any tokio
//! runtime (axum, tonic, plain tokio). The scheduler runs its actors on a thread of its
//! own (see `runtime`); its handlers run on the runtime it was started from, or on
//! `Config::handler_threads` threads of its own. The host's pool serves enqueues, the
//! handle's store, and handlers; the scheduler opens connections of its own (see the
//! README's "Using it").

mod pools;
mod runtime;

use std::sync::Arc;

use sqlx::{PgConnection, PgPool};

use crate::actor::lease_renewer::RenewNow;
use crate::actor::reaper::ReapNow;
use crate::config::Config;
use crate::env::Env;
use crate::error::{Error, Result};
use crate::handler::{Handler as JobHandler, Registry};
use crate::job::{Enqueued, JobId, NewJob, OwnerId};
use crate::metrics::MetricsSnapshot;
use crate::periodic::Periodic;
use crate::store::{QueueStats, ReapReport, Store};
use runtime::{Core, StopOnDrop};

/// Collects handlers, then starts the scheduler.
pub struct SchedulerBuilder {
    pool: PgPool,
    config: Config,
    registry: Registry,
    schedules: Vec<Periodic>,
}

impl SchedulerBuilder {
    /// Register the handler of one job kind.
    pub fn register<H: JobHandler>(mut self, handler: H) -> Self {
        self.registry.insert(handler);
        self
    }

    /// Keep a periodic schedule going from this scheduler (and from every other process
    /// that registers it under the same name: each fire time is enqueued once). Its job
    /// without a queue goes to this scheduler's first queue. See [`crate::periodic`].
    pub fn periodic(mut self, schedule: Periodic) -> Self {
        self.schedules.push(schedule);
        self
    }

    /// Validate the config, migrate the schema, start the actors (on the scheduler's
    /// own thread). Call it from any async context. Behind a transaction-mode pooler
    /// without `store.transaction_pooler`, the migration step refuses (see
    /// [`Store::migrate`]). A caller that stops waiting (a timeout drops this future)
    /// leaves nothing running: a scheduler whose actors had started shuts itself down.
    pub async fn start(self) -> Result<Scheduler> {
        let started = runtime::start(self.pool, self.config, self.registry, self.schedules).await?;
        Ok(Scheduler {
            core: started.0.clone(),
            _guard: Arc::new(started),
        })
    }
}

/// A running scheduler: a cheap handle to clone and share (e.g. in actix-web's
/// `web::Data`). Stop it with [`Scheduler::shutdown`], from any clone, any number of
/// times. If the last handle is dropped without a shutdown, the scheduler shuts itself
/// down in the background (it stops claiming at once and releases what it holds).
#[derive(Clone)]
pub struct Scheduler {
    core: Arc<Core>,
    /// Shared by the handles only: its drop means the last handle is gone.
    _guard: Arc<StopOnDrop>,
}

/// What a shutdown did.
#[derive(Clone, Debug, PartialEq)]
pub struct ShutdownReport {
    /// Attempts that finished within the grace period.
    pub drained: u64,
    /// Attempts cancelled after the grace period (their jobs released at once).
    pub cancelled: u64,
    /// The final figures, taken after every actor stopped: `in_flight` and
    /// `sequencers` are 0 after a clean stop.
    pub metrics: MetricsSnapshot,
}

impl Scheduler {
    /// Start building a scheduler over the host's `pool`: enqueues, the handle's
    /// [`Store`] and the migration at start use it, and the scheduler opens connections
    /// of its own with the same connect options. Register handlers, then
    /// [`SchedulerBuilder::start`].
    pub fn builder(pool: PgPool, config: Config) -> SchedulerBuilder {
        SchedulerBuilder {
            pool,
            config,
            registry: Registry::default(),
            schedules: Vec::new(),
        }
    }

    fn env(&self) -> &Arc<Env> {
        &self.core.env
    }

    /// The metrics scrapes' gauge cache, shared by every clone of this handle.
    #[cfg(feature = "prometheus")]
    pub(crate) fn gauge_cache(&self) -> &crate::prometheus::GaugeCache {
        &self.env().gauge_cache
    }

    /// Enqueue a job for handler `H` in the first configured queue.
    pub async fn enqueue<H: JobHandler>(&self, payload: &H::Payload) -> Result<JobId> {
        self.enqueue_job(NewJob::new(H::KIND, payload)?).await
    }

    /// Enqueue a job this scheduler runs: its kind must be registered here, and its
    /// queue (the first configured one when the job names none) one this scheduler
    /// serves; a clear error otherwise, so no job waits for ever where nobody looks. A
    /// producer that enqueues for other processes uses [`Store::enqueue`].
    pub async fn enqueue_job(&self, job: NewJob) -> Result<JobId> {
        let job = self.ours(job)?;
        self.env().host_store.enqueue(job).await
    }

    /// [`Scheduler::enqueue_job`], saying whether the job was a duplicate of an existing
    /// one ([`NewJob::unique`]); the id is then the existing job's.
    pub async fn enqueue_outcome(&self, job: NewJob) -> Result<Enqueued> {
        let job = self.ours(job)?;
        self.env().host_store.enqueue_outcome(job).await
    }

    /// Enqueue inside the caller's transaction (the same checks as
    /// [`Scheduler::enqueue_job`]): the job exists exactly when the caller's writes
    /// do. If the transaction rolls back, the job never existed; the wake-up (NOTIFY)
    /// is sent at commit. A keyed job takes its place in its key's order at commit, and
    /// holds the key's row lock until then: keep the transaction short.
    ///
    /// ```no_run
    /// use leasehold::{NewJob, Scheduler};
    /// use serde::Serialize;
    ///
    /// #[derive(Serialize)]
    /// struct Fulfil {
    ///     order_id: i64,
    /// }
    ///
    /// /// Insert the order and enqueue its fulfilment: both or neither.
    /// async fn place_order(
    ///     pool: &sqlx::PgPool,
    ///     scheduler: &Scheduler,
    ///     customer: &str,
    /// ) -> Result<i64, leasehold::Error> {
    ///     let mut tx = pool.begin().await?;
    ///     let order_id: i64 =
    ///         sqlx::query_scalar("INSERT INTO orders (customer) VALUES ($1) RETURNING id")
    ///             .bind(customer)
    ///             .fetch_one(&mut *tx)
    ///             .await?;
    ///     let job = NewJob::new("fulfil_order", &Fulfil { order_id })?
    ///         .with_key(format!("customer:{customer}")); // one customer's orders in order
    ///     scheduler.enqueue_in(&mut tx, job).await?;
    ///     tx.commit().await?;
    ///     Ok(order_id)
    /// }
    /// ```
    pub async fn enqueue_in(&self, conn: &mut PgConnection, job: NewJob) -> Result<JobId> {
        let job = self.ours(job)?;
        self.env().host_store.enqueue_in(conn, job).await
    }

    /// Enqueue many jobs in one statement (the same checks as
    /// [`Scheduler::enqueue_job`], for each).
    pub async fn enqueue_many(&self, jobs: Vec<NewJob>) -> Result<Vec<JobId>> {
        let jobs = jobs
            .into_iter()
            .map(|j| self.ours(j))
            .collect::<Result<Vec<_>>>()?;
        self.env().host_store.enqueue_many(jobs).await
    }

    /// The job, in this scheduler's first queue when it names none, if this scheduler
    /// runs it.
    fn ours(&self, mut job: NewJob) -> Result<NewJob> {
        let env = self.env();
        if self.core.stop_begun() || env.stop_claiming.is_cancelled() {
            return Err(Error::ShuttingDown);
        }
        // The kind's policy is applied by the store (`Store::with_kind_policies`), as on
        // every enqueue path of the scheduler.
        if env.registry.get(&job.kind).is_none() {
            return Err(Error::UnknownKind(job.kind.clone()));
        }
        let queues = &env.config.queues;
        match &job.queue {
            None => job.queue = Some(queues[0].clone()),
            Some(q) if queues.contains(q) => {}
            Some(q) => {
                return Err(Error::InvalidInput {
                    field: "queue",
                    reason: format!(
                        "{q:?} is not served by this scheduler (its queues: {queues:?}); enqueue \
                         through Store::enqueue for a queue other processes serve"
                    ),
                })
            }
        }
        Ok(job)
    }

    /// The store (over the host's pool): admin actions, job lookup, history.
    #[allow(
        clippy::misnamed_getters,
        reason = "users get the store over their own pool; `store` is the scheduler's, on its writer pool"
    )]
    pub fn store(&self) -> &Store {
        &self.env().host_store
    }

    /// This scheduler's owner id (unique per start).
    pub fn owner(&self) -> &OwnerId {
        &self.env().owner
    }

    /// The configuration this scheduler started with.
    pub fn config(&self) -> &Config {
        &self.env().config
    }

    /// Counters, mailbox gauges and latencies of this scheduler.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.env().metrics.snapshot()
    }

    /// Queue figures from the database (all processes).
    pub async fn queue_stats(&self) -> Result<Vec<QueueStats>> {
        self.env().host_store.queue_stats().await
    }

    /// Run one reap pass now.
    pub async fn reap_now(&self) -> Result<ReapReport> {
        self.core
            .reaper
            .ask(ReapNow)
            .await
            .map_err(|_| Error::ShuttingDown)?
    }

    /// Renew every running lease now; returns (renewed, lost).
    pub async fn renew_now(&self) -> Result<(usize, usize)> {
        self.env()
            .renewer
            .ask(RenewNow)
            .await
            .map_err(|_| Error::ShuttingDown)
    }

    /// Stop: no new claims; running attempts get `shutdown_grace` to finish; the rest are
    /// cancelled and their jobs released at once (claimable by any worker). Returns when
    /// every actor has stopped and the scheduler's own connections are closed.
    /// Idempotent: the shutdown runs once, and every call (from any clone, at any time)
    /// waits for it and returns its report. It runs on the scheduler's own thread, so it
    /// works from any runtime or thread, also after the host's actix `System` stopped
    /// (actix-web's signal handling does that on SIGTERM). A caller that stops waiting
    /// (a timeout drops this future) does not stop or restart it: the shutdown goes on
    /// to its end, and a later call returns its report.
    pub async fn shutdown(&self) -> Result<ShutdownReport> {
        self.core.begin_stop();
        Ok(self.core.stopped().await)
    }
}
