//! The public handle: build, start, enqueue, observe, stop.
//!
//! ```ignore
//! let scheduler = Scheduler::builder(pool, Config::default())
//!     .register(SendEmail)
//!     .start()
//!     .await?;
//! scheduler.enqueue::<SendEmail>(&email).await?;
//! scheduler.shutdown().await?;
//! ```
//!
//! Start it inside a running actix `System`. The host's pool serves completions and
//! handlers; the scheduler opens connections of its own: one per claim in flight (two)
//! for the claimer, and three (lease renewal, reaper, LISTEN) on its maintenance thread.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use dashmap::DashMap;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::actor::claimer::{Claimer, StopClaiming, MAX_CLAIMS_IN_FLIGHT};
use crate::actor::completer::Completer;
use crate::actor::lease_renewer::{LeaseRenewer, RenewNow, Running};
use crate::actor::listener::Listener;
use crate::actor::reaper::{ReapNow, Reaper};
use crate::actor::{stopped, Metered, Slots, Stop};
use crate::config::Config;
use crate::context::CancelReason;
use crate::env::Env;
use crate::error::{Error, Result};
use crate::handler::{Handler as JobHandler, Registry};
use crate::job::{JobId, NewJob, OwnerId};
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::store::{QueueStats, ReapReport, Store};

/// Collects handlers, then starts the scheduler.
pub struct SchedulerBuilder {
    pool: PgPool,
    config: Config,
    registry: Registry,
}

impl SchedulerBuilder {
    /// Register the handler of one job kind.
    pub fn register<H: JobHandler>(mut self, handler: H) -> Self {
        self.registry.insert(handler);
        self
    }

    /// Validate the config, migrate the schema, start the actors.
    pub async fn start(self) -> Result<Scheduler> {
        let SchedulerBuilder {
            pool,
            mut config,
            registry,
        } = self;
        config.validate()?;
        if registry.kinds().is_empty() {
            return Err(Error::Config {
                field: "handlers",
                reason: "register at least one handler".into(),
            });
        }
        config.store.default_max_attempts = config.retry.max_attempts;
        let store = Store::new(pool.clone(), &config.schema, config.store.clone())?;
        store.migrate().await?;
        let owner = OwnerId::generate();
        let metrics = Arc::new(Metrics::default());

        let maintenance = Arbiter::new();
        let connect = (*pool.connect_options()).clone();
        let side_pool = move |name: &str| {
            PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(Duration::from_secs(5))
                .connect_lazy_with(connect.clone().application_name(name))
        };
        let running: Running = Default::default();
        let renewer = {
            let (owner, config, m) = (owner.clone(), config.clone(), metrics.clone());
            let running = running.clone();
            let addr = on_maintenance(
                &maintenance,
                &store,
                side_pool.clone(),
                "leasehold-renewer",
                move |s| LeaseRenewer::new(s, owner, running, &config, m),
            );
            Metered::new(addr, metrics.meter("lease_renewer"))
        };
        let reaper = {
            let (owner, config, m) = (owner.clone(), config.clone(), metrics.clone());
            let addr = on_maintenance(
                &maintenance,
                &store,
                side_pool.clone(),
                "leasehold-reaper",
                move |s| Reaper::new(s, owner, &config, m),
            );
            Metered::new(addr, metrics.meter("reaper"))
        };
        let completer = Metered::new(
            Completer::new(
                store.clone(),
                owner.clone(),
                registry.kinds(),
                &config,
                metrics.clone(),
            )
            .start(),
            metrics.meter("completer"),
        );

        let claim_store = store.with_pool(
            PgPoolOptions::new()
                .max_connections(MAX_CLAIMS_IN_FLIGHT as u32)
                .acquire_timeout(Duration::from_secs(5))
                .connect_lazy_with(claim_session(&pool)),
        );
        let env = Arc::new(Env {
            claim_store,
            store: store.clone(),
            kinds: registry.kinds(),
            registry,
            owner: owner.clone(),
            metrics: metrics.clone(),
            slots: Slots::new(
                config.concurrency,
                config.completion_batch,
                config.inflight_byte_budget,
            ),
            renewer,
            completer,
            claimer: Default::default(),
            sequencers: DashMap::new(),
            running,
            stop_claiming: CancellationToken::new(),
            hard_stop: CancellationToken::new(),
            parked: Default::default(),
            config: config.clone(),
        });
        let claimer = Metered::new(Claimer::new(env.clone()).start(), metrics.meter("claimer"));
        let _ = env.claimer.set(claimer.clone());

        let listener = if config.listen {
            let (claimer, metrics, channel, mk) = (
                claimer.clone(),
                metrics.clone(),
                store.schema().channel(),
                side_pool,
            );
            Some(Listener::start_in_arbiter(
                &maintenance.handle(),
                move |_| Listener::new(mk("leasehold-listener"), channel, claimer, metrics),
            ))
        } else {
            None
        };
        tracing::info!(owner = %owner, queues = ?config.queues, kinds = ?env.kinds, "leasehold scheduler started");
        Ok(Scheduler {
            env,
            claimer,
            reaper,
            listener,
            maintenance: Some(maintenance),
        })
    }
}

/// The claimer's sessions plan statements generically. A custom plan of the claim costs
/// about as much server time as running it (≈0.6 of ≈1.2 ms for 32 jobs), and PostgreSQL
/// keeps re-planning it because its generic plan looks dearer on paper (`LIMIT $3` is
/// guessed at a tenth of the table); the claim is written so the generic plan is the
/// right one ([`Store::explain_claim`] shows it on a table of millions). The setting is
/// made on sessions the scheduler owns, so the host's statements are left alone.
fn claim_session(pool: &PgPool) -> sqlx::postgres::PgConnectOptions {
    (*pool.connect_options())
        .clone()
        .application_name("leasehold-claimer")
        .options([("plan_cache_mode", "force_generic_plan")])
}

/// Start a maintenance actor on `arbiter` over a store with its own one-connection pool.
/// The pool is made on that arbiter's thread: a connection belongs to the runtime that
/// opened it, and the host's runtime may be busy with handlers.
fn on_maintenance<A, P>(
    arbiter: &Arbiter,
    store: &Store,
    side_pool: P,
    app_name: &'static str,
    make: impl FnOnce(Store) -> A + Send + 'static,
) -> Addr<A>
where
    A: Actor<Context = Context<A>>,
    P: FnOnce(&str) -> PgPool + Send + 'static,
{
    let store = store.clone();
    A::start_in_arbiter(&arbiter.handle(), move |_| {
        make(store.with_pool(side_pool(app_name)))
    })
}

/// A running scheduler. Stop it with [`Scheduler::shutdown`].
pub struct Scheduler {
    env: Arc<Env>,
    claimer: Metered<Claimer>,
    reaper: Metered<Reaper>,
    listener: Option<Addr<Listener>>,
    maintenance: Option<Arbiter>,
}

/// What a shutdown did.
#[derive(Clone, Debug, PartialEq)]
pub struct ShutdownReport {
    /// Attempts that finished within the grace period.
    pub drained: u64,
    /// Attempts cancelled after the grace period (their jobs released at once).
    pub cancelled: u64,
    /// The final figures, taken after every actor stopped (`shutdown` consumes the
    /// handle, so this is the only way to read them): `in_flight` and `sequencers`
    /// are 0 after a clean stop.
    pub metrics: MetricsSnapshot,
}

impl Scheduler {
    pub fn builder(pool: PgPool, config: Config) -> SchedulerBuilder {
        SchedulerBuilder {
            pool,
            config,
            registry: Registry::default(),
        }
    }

    /// Enqueue a job for handler `H` in the first configured queue.
    pub async fn enqueue<H: JobHandler>(&self, payload: &H::Payload) -> Result<JobId> {
        self.enqueue_job(
            NewJob::new(H::KIND, payload)?.with_queue(self.env.config.queues[0].clone()),
        )
        .await
    }

    /// Enqueue a job. Its kind must be registered here (a clear error otherwise); a
    /// producer that enqueues for other processes uses [`Store::enqueue`].
    pub async fn enqueue_job(&self, job: NewJob) -> Result<JobId> {
        self.check_kind(&job)?;
        self.env.store.enqueue(job).await
    }

    /// Enqueue inside the caller's transaction.
    pub async fn enqueue_in(&self, conn: &mut PgConnection, job: NewJob) -> Result<JobId> {
        self.check_kind(&job)?;
        self.env.store.enqueue_in(conn, job).await
    }

    /// Enqueue many jobs in one statement.
    pub async fn enqueue_many(&self, jobs: Vec<NewJob>) -> Result<Vec<JobId>> {
        for job in &jobs {
            self.check_kind(job)?;
        }
        self.env.store.enqueue_many(jobs).await
    }

    fn check_kind(&self, job: &NewJob) -> Result<()> {
        if !self.env.registry.contains(&job.kind) {
            return Err(Error::UnknownKind(job.kind.clone()));
        }
        Ok(())
    }

    /// The store: admin actions, job lookup, history.
    pub fn store(&self) -> &Store {
        &self.env.store
    }

    /// This scheduler's owner id (unique per start).
    pub fn owner(&self) -> &OwnerId {
        &self.env.owner
    }

    pub fn config(&self) -> &Config {
        &self.env.config
    }

    /// Counters, mailbox gauges and latencies of this scheduler.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.env.metrics.snapshot()
    }

    /// Queue figures from the database (all processes).
    pub async fn queue_stats(&self) -> Result<Vec<QueueStats>> {
        self.env.store.queue_stats().await
    }

    /// Run one reap pass now.
    pub async fn reap_now(&self) -> Result<ReapReport> {
        self.reaper
            .ask(ReapNow)
            .await
            .map_err(|_| Error::ShuttingDown)?
    }

    /// Renew every running lease now; returns (renewed, lost).
    pub async fn renew_now(&self) -> Result<(usize, usize)> {
        self.env
            .renewer
            .ask(RenewNow)
            .await
            .map_err(|_| Error::ShuttingDown)
    }

    /// Stop: no new claims; running attempts get `shutdown_grace` to finish; the rest are
    /// cancelled and their jobs released at once (claimable by any worker). Returns when
    /// every actor has stopped and the scheduler's own connections are closed.
    pub async fn shutdown(mut self) -> Result<ShutdownReport> {
        let env = self.env.clone();
        let at_start = env
            .metrics
            .in_flight
            .load(std::sync::atomic::Ordering::SeqCst);
        // 1. Stop claiming, and wait out a claim statement already in flight.
        env.stop_claiming.cancel();
        loop {
            match self.claimer.ask(StopClaiming).await {
                Ok(true) => tokio::time::sleep(Duration::from_millis(2)).await,
                _ => break,
            }
        }
        // 2. Drain within the grace period.
        let deadline = tokio::time::Instant::now() + env.config.shutdown_grace;
        while env
            .metrics
            .in_flight
            .load(std::sync::atomic::Ordering::SeqCst)
            > 0
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // 3. Cancel what is left; the executions release their jobs.
        let left = env.running.len() as u64;
        for entry in env.running.iter() {
            entry.value().cancel(CancelReason::Shutdown);
        }
        env.hard_stop.cancel();
        let release_deadline =
            tokio::time::Instant::now() + Duration::from_secs(10) + env.config.lease;
        while env
            .metrics
            .in_flight
            .load(std::sync::atomic::Ordering::SeqCst)
            > 0
            && tokio::time::Instant::now() < release_deadline
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // 4. Stop the actors.
        let limit = Duration::from_secs(10);
        let sequencers: Vec<_> = env.sequencers.iter().map(|e| e.value().clone()).collect();
        env.sequencers.clear();
        for s in &sequencers {
            let _ = s.stop();
        }
        let _ = self.claimer.ask(Stop).await;
        env.claim_store.pool().close().await;
        let _ = env.completer.ask(Stop).await;
        let _ = env.renewer.ask(Stop).await;
        let _ = self.reaper.ask(Stop).await;
        if let Some(l) = &self.listener {
            let _ = l.send(Stop).await;
        }
        let mut all_stopped = stopped(self.claimer.addr(), limit).await
            & stopped(env.completer.addr(), limit).await
            & stopped(env.renewer.addr(), limit).await
            & stopped(self.reaper.addr(), limit).await;
        if let Some(l) = &self.listener {
            all_stopped &= stopped(l, limit).await;
        }
        let seq_deadline = tokio::time::Instant::now() + limit;
        while env
            .metrics
            .sequencers
            .load(std::sync::atomic::Ordering::SeqCst)
            > 0
            && tokio::time::Instant::now() < seq_deadline
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        if let Some(arbiter) = self.maintenance.take() {
            arbiter.stop();
            let _ = tokio::task::spawn_blocking(move || arbiter.join()).await;
        }
        if !all_stopped {
            tracing::warn!("leasehold shutdown: an actor did not stop in time");
        }
        tracing::info!(owner = %env.owner, cancelled = left, "leasehold scheduler stopped");
        Ok(ShutdownReport {
            drained: at_start.saturating_sub(left),
            cancelled: left,
            metrics: env.metrics.snapshot(),
        })
    }
}
