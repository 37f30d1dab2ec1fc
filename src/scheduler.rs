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
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::actor::claimer::{Claimer, StopClaiming, MAX_CLAIMS_IN_FLIGHT};
use crate::actor::completer::Completer;
use crate::actor::lease_renewer::{LeaseRenewer, RenewNow, Running};
use crate::actor::listener::{Channels, Listener};
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
            config,
            registry,
        } = self;
        config.validate()?;
        if registry.kinds().is_empty() {
            return Err(Error::Config {
                field: "handlers",
                reason: "register at least one handler".into(),
            });
        }
        let store = Store::for_config(pool.clone(), &config)?;
        store.migrate().await?;
        let owner = OwnerId::generate();
        let metrics = Arc::new(Metrics::default());

        let maintenance = Arbiter::new();
        let side = SidePools {
            connect: (*pool.connect_options()).clone(),
            owner: owner.clone(),
            config: config.clone(),
        };
        let running: Running = Default::default();
        let renewer = {
            let (owner, config, m) = (owner.clone(), config.clone(), metrics.clone());
            let running = running.clone();
            let fresh = side.clone();
            let addr = on_maintenance(&maintenance, &store, side.maker("renewer"), move |s| {
                LeaseRenewer::new(
                    s,
                    Box::new(move || fresh.pool("renewer")),
                    owner,
                    running,
                    &config,
                    m,
                )
            });
            Metered::new(addr, metrics.meter("lease_renewer"))
        };
        let reaper = {
            let (owner, config, m) = (owner.clone(), config.clone(), metrics.clone());
            let addr = on_maintenance(&maintenance, &store, side.maker("reaper"), move |s| {
                Reaper::new(s, owner, &config, m)
            });
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
                .connect_lazy_with(claim_session(&pool, &owner)),
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
            running: running.clone(),
            stop_claiming: CancellationToken::new(),
            hard_stop: CancellationToken::new(),
            ready: Default::default(),
            config: config.clone(),
        });
        let claimer = Metered::new(Claimer::new(env.clone()).start(), metrics.meter("claimer"));
        let _ = env.claimer.set(claimer.clone());

        let listener = if config.listen {
            let channels = Channels {
                wake: store.schema().channel(),
                cancel: store.schema().cancel_channel(),
            };
            let (claimer, metrics, side) = (claimer.clone(), metrics.clone(), side.clone());
            Some(Listener::start_in_arbiter(
                &maintenance.handle(),
                move |_| Listener::new(side.pool("listener"), channels, claimer, running, metrics),
            ))
        } else {
            None
        };
        tracing::info!(owner = %owner, queues = ?config.queues, kinds = ?env.kinds, "leasehold scheduler started");
        let core = Arc::new(Core {
            env,
            claimer,
            reaper,
            listener,
            maintenance: std::sync::Mutex::new(Some(maintenance)),
            report: tokio::sync::OnceCell::new(),
        });
        Ok(Scheduler {
            _guard: Arc::new(DropGuard(core.clone())),
            core,
        })
    }
}

/// Session settings of the scheduler's maintenance connections (renewer, reaper): no
/// statement of theirs may wait long on a lock or run away. The renewal never waits on
/// a row lock by design (`SKIP LOCKED`); `lock_timeout` also bounds waits on table
/// locks (a host's `LOCK TABLE` or DDL). Set only on the scheduler's own sessions; the
/// host's pool is untouched.
pub(crate) const MAINTENANCE_SESSION: &str =
    "SET lock_timeout = '5s'; SET statement_timeout = '60s'; SET idle_in_transaction_session_timeout = '60s'";

/// Makes the scheduler's own small pools, named after their role and the owner.
#[derive(Clone)]
struct SidePools {
    connect: PgConnectOptions,
    owner: OwnerId,
    config: Config,
}

impl SidePools {
    /// A one-connection pool for `role`, named `leasehold-<role> <pid>:<nonce>` in
    /// `pg_stat_activity` (see [`OwnerId::short`]). The renewer and reaper sessions
    /// get [`MAINTENANCE_SESSION`].
    fn pool(&self, role: &str) -> PgPool {
        let name = format!("leasehold-{role} {}", self.owner.short());
        let maintenance = role != "listener";
        // As the renewer's own bound (`LeaseRenewer::answer_within`).
        let statement_timeout = self.config.renew_interval.max(self.config.lease / 2);
        let renewer = role == "renewer";
        PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(5))
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if maintenance {
                        sqlx::Executor::execute(&mut *conn, sqlx::raw_sql(MAINTENANCE_SESSION))
                            .await?;
                    }
                    if renewer {
                        // A renewal is abandoned after this anyway (client side).
                        let ms = statement_timeout.as_millis().max(100);
                        sqlx::Executor::execute(
                            &mut *conn,
                            sqlx::raw_sql(&format!("SET statement_timeout = {ms}")),
                        )
                        .await?;
                    }
                    Ok(())
                })
            })
            .connect_lazy_with(self.connect.clone().application_name(&name))
    }

    fn maker(&self, role: &'static str) -> impl FnOnce() -> PgPool + Send + 'static {
        let me = self.clone();
        move || me.pool(role)
    }
}

/// The claimer's own connections (one per claim in flight), so a claim never waits for
/// the host's pool. They carry no session settings: the claim function sets what its
/// plans need for itself (see the store's claim module), which also holds behind a
/// transaction-mode pooler.
fn claim_session(pool: &PgPool, owner: &OwnerId) -> PgConnectOptions {
    (*pool.connect_options())
        .clone()
        .application_name(&format!("leasehold-claimer {}", owner.short()))
}

/// Start a maintenance actor on `arbiter` over a store with its own one-connection pool.
/// The pool is made on that arbiter's thread: a connection belongs to the runtime that
/// opened it, and the host's runtime may be busy with handlers.
fn on_maintenance<A, P>(
    arbiter: &Arbiter,
    store: &Store,
    side_pool: P,
    make: impl FnOnce(Store) -> A + Send + 'static,
) -> Addr<A>
where
    A: Actor<Context = Context<A>>,
    P: FnOnce() -> PgPool + Send + 'static,
{
    let store = store.clone();
    A::start_in_arbiter(&arbiter.handle(), move |_| {
        make(store.with_pool(side_pool()))
    })
}

/// A running scheduler: a cheap handle to clone and share (e.g. in actix-web's
/// `web::Data`). Stop it with [`Scheduler::shutdown`], from any clone, any number of
/// times. If the last handle is dropped without a shutdown, the scheduler shuts itself
/// down in the background (it stops claiming at once and releases what it holds).
#[derive(Clone)]
pub struct Scheduler {
    core: Arc<Core>,
    /// Shared by the handles only: its drop means the last handle is gone.
    _guard: Arc<DropGuard>,
}

struct Core {
    env: Arc<Env>,
    claimer: Metered<Claimer>,
    reaper: Metered<Reaper>,
    listener: Option<Addr<Listener>>,
    maintenance: std::sync::Mutex<Option<Arbiter>>,
    /// Set once by the first shutdown; later calls get the same report.
    report: tokio::sync::OnceCell<ShutdownReport>,
}

struct DropGuard(Arc<Core>);

impl Drop for DropGuard {
    fn drop(&mut self) {
        let core = self.0.clone();
        if core.report.initialized() {
            return;
        }
        // Stop claiming now, whatever happens to the rest.
        core.env.stop_claiming.cancel();
        tracing::warn!(owner = %core.env.owner, "leasehold scheduler dropped without shutdown(); shutting down in the background");
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move {
                    let _ = core.report.get_or_init(|| core.run_shutdown()).await;
                });
            }
            Err(_) => {
                // No runtime here: cancel what runs; leases of what was held expire.
                core.env.hard_stop.cancel();
            }
        }
    }
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
    pub fn builder(pool: PgPool, config: Config) -> SchedulerBuilder {
        SchedulerBuilder {
            pool,
            config,
            registry: Registry::default(),
        }
    }

    fn env(&self) -> &Arc<Env> {
        &self.core.env
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
        self.env().store.enqueue(job).await
    }

    /// Enqueue inside the caller's transaction (the same checks as
    /// [`Scheduler::enqueue_job`]).
    pub async fn enqueue_in(&self, conn: &mut PgConnection, job: NewJob) -> Result<JobId> {
        let job = self.ours(job)?;
        self.env().store.enqueue_in(conn, job).await
    }

    /// Enqueue many jobs in one statement (the same checks as
    /// [`Scheduler::enqueue_job`], for each).
    pub async fn enqueue_many(&self, jobs: Vec<NewJob>) -> Result<Vec<JobId>> {
        let jobs = jobs
            .into_iter()
            .map(|j| self.ours(j))
            .collect::<Result<Vec<_>>>()?;
        self.env().store.enqueue_many(jobs).await
    }

    /// The job, in this scheduler's first queue when it names none, if this scheduler
    /// runs it.
    fn ours(&self, mut job: NewJob) -> Result<NewJob> {
        let env = self.env();
        if self.core.report.initialized() || env.stop_claiming.is_cancelled() {
            return Err(Error::ShuttingDown);
        }
        if !env.registry.contains(&job.kind) {
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

    /// The store: admin actions, job lookup, history.
    pub fn store(&self) -> &Store {
        &self.env().store
    }

    /// This scheduler's owner id (unique per start).
    pub fn owner(&self) -> &OwnerId {
        &self.env().owner
    }

    pub fn config(&self) -> &Config {
        &self.env().config
    }

    /// Counters, mailbox gauges and latencies of this scheduler.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.env().metrics.snapshot()
    }

    /// Queue figures from the database (all processes).
    pub async fn queue_stats(&self) -> Result<Vec<QueueStats>> {
        self.env().store.queue_stats().await
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
    /// Idempotent: a second call (from any clone) waits for the first and returns the
    /// same report.
    pub async fn shutdown(&self) -> Result<ShutdownReport> {
        let core = self.core.clone();
        Ok(core
            .report
            .get_or_init(|| core.run_shutdown())
            .await
            .clone())
    }
}

impl Core {
    async fn run_shutdown(&self) -> ShutdownReport {
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
        let maintenance = self
            .maintenance
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(arbiter) = maintenance {
            arbiter.stop();
            let _ = tokio::task::spawn_blocking(move || arbiter.join()).await;
        }
        if !all_stopped {
            tracing::warn!("leasehold shutdown: an actor did not stop in time");
        }
        tracing::info!(owner = %env.owner, cancelled = left, "leasehold scheduler stopped");
        ShutdownReport {
            drained: at_start.saturating_sub(left),
            cancelled: left,
            metrics: env.metrics.snapshot(),
        }
    }
}
