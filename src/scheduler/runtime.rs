//! The scheduler's own thread: an actix `System` of its own runs the actors, and the
//! shutdown.
//!
//! # Why a thread of its own
//! The scheduler must start from any host (an actix-web app, axum, plain tokio) and stop
//! cleanly in any order: when actix-web's signal handling stops the host's `System`, or
//! when the host drops its handle, the scheduler's actors, connections and shutdown
//! must not depend on the host's runtime still running. So every actor lives in a
//! `System` of the scheduler's own, on a thread named after its owner id, with pools
//! made there (see `pools`); the host's pool is only used from the host (enqueue, the
//! handle's store) and from handlers.
//!
//! # Where handlers run
//! On the runtime `start` was called from (the host's: an actix worker's arbiter, or a
//! tokio runtime), so a handler uses the host's pool and clients on the runtime that
//! made them; or, with `Config::handler_threads = Some(n)`, on a multi-thread runtime of
//! the scheduler's own (CPU-heavy handlers then use every core and cannot stall the
//! host); or, with `Some(0)`, on the scheduler's own thread beside its actors. Wherever
//! they run, a handler that returns starts the next job waiting for a slot in its own
//! task, and the scheduler's thread watches the attempt and writes its ending (see
//! `actor::dispatch`).
//!
//! # Lifecycle
//! `start` spawns the thread, builds the actors there and returns when they run. The
//! shutdown runs on the scheduler's thread too, so any caller (another runtime, another
//! thread, a `Drop`) can start it and wait for its report; at its end the `System`
//! stops and the thread ends.
//!
//! # Callers that stop waiting
//! Whoever stops waiting (a `tokio::time::timeout` around `start` or `shutdown` drops
//! its future) changes nothing the scheduler does. The shutdown is begun by a plain
//! function call ([`Core::begin_stop`]) and runs as a task of the scheduler's own, once,
//! to its end; every caller, the first included, only waits for the one report it
//! publishes ([`Core::stopped`]). A scheduler whose `start` caller went away before it
//! got the handle is shut down by the [`StopOnDrop`] it would have got.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use dashmap::DashMap;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::pools::{claim_session, SidePools};
use super::ShutdownReport;
use crate::actor::claimer::{Claimer, StopClaiming, MAX_CLAIMS_IN_FLIGHT};
use crate::actor::completer::Completer;
use crate::actor::lease_renewer::{LeaseRenewer, Running};
use crate::actor::listener::{Channels, Listener};
use crate::actor::periodic::PeriodicRunner;
use crate::actor::queue_limits::QueueLimits;
use crate::actor::reaper::Reaper;
use crate::actor::{stopped, Metered, Slots, Stop};
use crate::config::Config;
use crate::context::CancelReason;
use crate::env::{Env, Handlers, Home};
use crate::error::{Error, Result};
use crate::handler::{Registry, RetryDelay};
use crate::job::OwnerId;
use crate::metrics::Metrics;
use crate::periodic::{Periodic, MIN_GRACE};
use crate::store::Store;

/// A running scheduler's parts, shared by its handles.
pub(super) struct Core {
    pub env: Arc<Env>,
    pub claimer: Metered<Claimer>,
    pub reaper: Metered<Reaper>,
    listener: Option<Addr<Listener>>,
    periodic: Option<Addr<PeriodicRunner>>,
    maintenance: std::sync::Mutex<Option<Arbiter>>,
    /// The scheduler's own `System`: its arbiter runs the shutdown.
    system: System,
    /// The handlers' runtime, when `Config::handler_threads` asks for one.
    handler_runtime: std::sync::Mutex<HandlerRuntime>,
    /// Cancelled when the scheduler's thread has ended (its runtime dropped), however it
    /// ended; any number of callers can wait for it.
    thread_ended: CancellationToken,
    /// Set by the first [`Core::begin_stop`]: the shutdown runs once.
    stop_begun: AtomicBool,
    /// The shutdown's report once it is written, for every caller of [`Core::stopped`].
    /// A watch channel rather than a `OnceCell` filled by the first caller's future:
    /// that future can be dropped half-way, and the report with it.
    report: tokio::sync::watch::Sender<Option<ShutdownReport>>,
}

/// The handlers' runtime of its own (`Config::handler_threads = Some(n)`, n > 0). A
/// runtime may not be dropped where blocking is not allowed (inside another runtime,
/// where `start` and the shutdown run), so it is always stopped in the background.
struct HandlerRuntime(Option<tokio::runtime::Runtime>);

impl HandlerRuntime {
    fn stop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for HandlerRuntime {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The scheduler as `start` hands it over: dropped without a shutdown having begun (the
/// last handle gone, or a `start` whose caller stopped waiting before it got this), it
/// begins the shutdown in the background.
pub(super) struct StopOnDrop(pub Arc<Core>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if self.0.stop_begun() {
            return;
        }
        tracing::warn!(owner = %self.0.env.owner, "leasehold scheduler dropped without shutdown(); shutting down in the background");
        self.0.begin_stop();
    }
}

/// What the scheduler's thread sends back once its actors run.
struct Started {
    env: Arc<Env>,
    claimer: Metered<Claimer>,
    reaper: Metered<Reaper>,
    listener: Option<Addr<Listener>>,
    periodic: Option<Addr<PeriodicRunner>>,
    maintenance: Arbiter,
    system: System,
}

/// Each kind's policy ([`crate::Handler::policy`]) must pass what the config must: it is
/// the config with the kind's values in it (so, say, the effect ledger outlives the
/// kind's longest retry window).
fn check_policies(config: &Config, registry: &Registry) -> Result<()> {
    for (kind, policy) in registry.policies() {
        let mut c = config.clone();
        if let Some(n) = policy.max_attempts {
            c.retry.max_attempts = n;
        }
        if let Some(d) = policy.max_run_time {
            c.max_run_time = d;
        }
        match &policy.retry_delay {
            Some(RetryDelay::Exponential(b)) => c.retry.backoff = *b,
            Some(RetryDelay::Table(t)) if t.is_empty() => {
                return Err(Error::Config {
                    field: "handlers",
                    reason: format!("kind {kind:?}: its retry delay table is empty"),
                })
            }
            Some(other) => {
                let longest = other.longest();
                c.retry.backoff = crate::Backoff {
                    base: longest,
                    cap: longest,
                    jitter: 0.0,
                };
            }
            None => {}
        }
        if let Err(Error::Config { field, reason }) = c.validate() {
            return Err(Error::Config {
                field: "handlers",
                reason: format!("kind {kind:?}'s policy: {field} {reason}"),
            });
        }
    }
    Ok(())
}

/// Schedule names are unique; a schedule's job without a queue goes to the first
/// configured queue (as an enqueue through the scheduler does). A schedule that could
/// never fire is refused here rather than left to fail silently at each fire time: one
/// with no fire time left in its zone, a grace under [`MIN_GRACE`], or a job every
/// enqueue would refuse (checked by the same rules, with the kind's policy).
fn check_schedules(config: &Config, store: &Store, schedules: &mut [Periodic]) -> Result<()> {
    let mut names = std::collections::HashSet::new();
    let mut encoded = Vec::new();
    for p in schedules.iter_mut() {
        crate::store::check_name("periodic schedule name", p.name())?;
        if !names.insert(p.name().to_string()) {
            return Err(Error::Config {
                field: "periodic",
                reason: format!("two schedules are named {:?}", p.name()),
            });
        }
        p.when().check_fires_after(chrono::Utc::now())?;
        if p.grace_period() < MIN_GRACE {
            return Err(Error::Config {
                field: "periodic grace",
                reason: format!(
                    "schedule {:?}: a grace of {} would count every fire as missed (a fire \
                     is enqueued after its time, never at it); at least {} is needed",
                    p.name(),
                    humantime::format_duration(p.grace_period()),
                    humantime::format_duration(MIN_GRACE),
                ),
            });
        }
        let job = p.job_mut();
        if job.queue.is_none() {
            job.queue = Some(config.queues[0].clone());
        }
        store
            .check_job(p.job(), &mut encoded)
            .map_err(|e| Error::Config {
                field: "periodic job",
                reason: format!("schedule {:?}: every fire would be refused: {e}", p.name()),
            })?;
    }
    Ok(())
}

/// Validate, migrate (with the host's pool, from the caller), then start the actors on
/// the scheduler's own thread.
pub(super) async fn start(
    pool: PgPool,
    config: Config,
    registry: Registry,
    mut schedules: Vec<Periodic>,
) -> Result<StopOnDrop> {
    config.validate()?;
    if registry.kinds().is_empty() {
        return Err(Error::Config {
            field: "handlers",
            reason: "register at least one handler".into(),
        });
    }
    check_policies(&config, &registry)?;
    // Every store of the scheduler is made from this one, so each enqueue it makes
    // (through the handle, a periodic fire, a handler's follow-up) gets the kind's policy.
    let host_store =
        Store::for_config(pool.clone(), &config)?.with_kind_policies(registry.policies());
    check_schedules(&config, &host_store, &mut schedules)?;
    host_store.migrate().await?;
    host_store.check_history_grant().await?;
    let owner = OwnerId::generate();
    let (handler_runtime, handlers) = match config.handler_threads {
        Some(0) => (None, Handlers::SchedulerThread),
        Some(n) => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(n)
                .thread_name(format!("leasehold-handler {}", owner.short()))
                .enable_all()
                .build()
                .map_err(|e| Error::Config {
                    field: "handler_threads",
                    reason: format!("cannot start the handlers' runtime: {e}"),
                })?;
            let handle = rt.handle().clone();
            (Some(rt), Handlers::Runtime(handle))
        }
        None => (None, Handlers::Runtime(tokio::runtime::Handle::current())),
    };
    let handler_runtime = HandlerRuntime(handler_runtime);
    let side = SidePools {
        connect: (*pool.connect_options()).clone(),
        owner: owner.clone(),
        config: config.clone(),
    };
    let (tx, rx) = tokio::sync::oneshot::channel::<StopOnDrop>();
    let thread_ended = CancellationToken::new();
    let ended = thread_ended.clone();
    let name = format!("leasehold {}", owner.short());
    std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            // Dropped last, after `run` has dropped the runtime, or in a panic's unwind.
            let _ended = ended.drop_guard();
            let system = System::new();
            system.block_on(async move {
                let s = build(side, config, registry, host_store, handlers, schedules);
                let core = Arc::new(Core {
                    env: s.env,
                    claimer: s.claimer,
                    reaper: s.reaper,
                    listener: s.listener,
                    periodic: s.periodic,
                    maintenance: std::sync::Mutex::new(Some(s.maintenance)),
                    system: s.system,
                    handler_runtime: std::sync::Mutex::new(handler_runtime),
                    thread_ended,
                    stop_begun: AtomicBool::new(false),
                    report: tokio::sync::watch::Sender::new(None),
                });
                // If `start`'s caller stopped waiting, the handle comes back (or is
                // dropped with the channel) and its drop begins the shutdown, which
                // `run` below then runs: no scheduler runs on without a handle.
                let _ = tx.send(StopOnDrop(core));
            });
            // Until the shutdown stops this System; `run` drops its runtime on return.
            let _ = system.run();
        })
        .map_err(|e| Error::Config {
            field: "scheduler",
            reason: format!("cannot start the scheduler's thread: {e}"),
        })?;
    let started = rx.await.map_err(|_| Error::Config {
        field: "scheduler",
        reason: "the scheduler's thread ended while starting".into(),
    })?;
    let env = &started.0.env;
    tracing::info!(owner = %env.owner, queues = ?env.config.queues, kinds = ?env.kinds, "leasehold scheduler started");
    Ok(started)
}

/// Build the pools and start the actors; runs inside the scheduler's `System`.
fn build(
    side: SidePools,
    config: Config,
    registry: Registry,
    host_store: Store,
    handlers: Handlers,
    schedules: Vec<Periodic>,
) -> Started {
    let owner = side.owner.clone();
    let metrics = Arc::new(Metrics::default());
    host_store.report_history_to(metrics.clone());
    // The writer's lock waits are bounded (see `SidePools::writer`): by its sessions'
    // setting, or behind a transaction pooler by each of its transactions.
    let store = host_store
        .with_pool(side.writer())
        .with_pooled_lock_wait(config.writer_lock_wait);
    let maintenance = Arbiter::new();
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
    let row_waits = Arc::new(tokio::sync::Semaphore::new(
        crate::actor::completer::row_waiters(config.connections),
    ));
    let completer = Metered::new(
        Completer::new(
            store.clone(),
            owner.clone(),
            registry.kinds(),
            &config,
            metrics.clone(),
            row_waits.clone(),
        )
        .start(),
        metrics.meter("completer"),
    );
    let claim_store = store.with_pool(
        PgPoolOptions::new()
            .max_connections(MAX_CLAIMS_IN_FLIGHT as u32)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(claim_session(&side.connect, &owner)),
    );
    // Handlers off the host's runtime write through a pool of the scheduler's own.
    let handler_store = match config.handler_threads {
        None => host_store.clone(),
        Some(_) => store.with_pool(side.handlers()),
    };
    let env = Arc::new(Env {
        claim_store,
        ending_store: store.with_lock_wait_everywhere(crate::actor::completer::turn(&config)),
        row_waits,
        store: store.clone(),
        handler_store,
        host_store,
        handlers,
        home: Home::here(),
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
        ahead_target: Default::default(),
        claimer_woken: Default::default(),
        paused: Default::default(),
        queue_limits: QueueLimits::new(&config.queue_concurrency),
        #[cfg(feature = "prometheus")]
        gauge_cache: Default::default(),
        config: config.clone(),
    });
    let claimer = Metered::new(Claimer::new(env.clone()).start(), metrics.meter("claimer"));
    let _ = env.claimer.set(claimer.clone());
    let listener = config.listen_options(&side.connect).map(|options| {
        let channels = Channels {
            wake: store.schema().channel(),
            cancel: store.schema().cancel_channel(),
            pause: store.schema().pause_channel(),
        };
        let (claimer, metrics, side) = (claimer.clone(), metrics.clone(), side.clone());
        let renewer = env.renewer.clone();
        Listener::start_in_arbiter(&maintenance.handle(), move |_| {
            Listener::new(
                side.listener(options),
                channels,
                claimer,
                renewer,
                running,
                metrics,
            )
        })
    });
    // On the scheduler's own arbiter, beside the claimer: the writer pool it uses was
    // opened on this runtime.
    let periodic = (!schedules.is_empty())
        .then(|| PeriodicRunner::new(env.store.clone(), schedules, metrics.clone()).start());
    Started {
        env,
        claimer,
        reaper,
        listener,
        periodic,
        maintenance,
        system: System::current(),
    }
}

/// Start a maintenance actor on `arbiter` over a store with its own one-connection pool.
/// The pool is made on that arbiter's thread: a connection belongs to the runtime that
/// opened it.
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

/// Take what `slot` holds, once, whatever a panic elsewhere left in its lock.
fn take_once<T>(slot: &std::sync::Mutex<Option<T>>) -> Option<T> {
    lock(slot).take()
}

/// `slot`'s lock, whatever a panic elsewhere left in it.
fn lock<T>(slot: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    slot.lock().unwrap_or_else(|p| p.into_inner())
}

/// Publishes [`Core::gone_report`] when dropped, unless a report is kept already.
struct PublishOnDrop(Arc<Core>);

impl Drop for PublishOnDrop {
    fn drop(&mut self) {
        self.0.publish(self.0.gone_report());
    }
}

/// How long a shutdown waits for the scheduler's thread to end after its actors stopped
/// (it only drops its runtime by then).
const THREAD_END_WAIT: Duration = Duration::from_secs(5);

impl Core {
    /// Whether the shutdown has begun (it may still be running).
    pub fn stop_begun(&self) -> bool {
        self.stop_begun.load(Ordering::SeqCst)
    }

    /// Begin the shutdown unless it has begun, and return at once: it runs as a task on
    /// the scheduler's thread, once, to its end, whoever waits for it (see
    /// [`Core::stopped`]). Claiming stops at once.
    pub fn begin_stop(self: &Arc<Self>) {
        if self.stop_begun.swap(true, Ordering::SeqCst) {
            return;
        }
        self.env.stop_claiming.cancel();
        let me = self.clone();
        let linger = self.lingers_for_host_pool();
        let spawned = self.system.arbiter().spawn(async move {
            // Should this task end before its report (a panic in it), the callers get
            // the report of a scheduler that was already gone instead of waiting on.
            let _fallback = PublishOnDrop(me.clone());
            let report = me.run_shutdown().await;
            lock(&me.handler_runtime).stop();
            me.publish(report);
            if let Some(host_pool) = &linger {
                host_pool.close_event().await;
            }
            System::current().stop();
        });
        if !spawned {
            tracing::warn!(owner = %self.env.owner, "leasehold scheduler thread was already gone at shutdown; leases of what it held will expire");
            lock(&self.handler_runtime).stop();
            self.publish(self.gone_report());
        }
    }

    /// Wait for the shutdown's report (begun by [`Core::begin_stop`]), then (at most
    /// [`THREAD_END_WAIT`]) for the scheduler's thread to end, so nothing of it runs once
    /// this returns. Dropping this future changes nothing but this caller's wait.
    pub async fn stopped(&self) -> ShutdownReport {
        let mut published = self.report.subscribe();
        let report = tokio::select! {
            biased;
            r = published.wait_for(Option::is_some) => r.ok().and_then(|r| r.clone()),
            _ = self.thread_ended.cancelled() => None,
        };
        let report = report.unwrap_or_else(|| {
            // The thread ended without a report (it panicked): what is known here.
            self.publish(self.gone_report());
            self.report
                .borrow()
                .clone()
                .unwrap_or_else(|| self.gone_report())
        });
        if self.lingers_for_host_pool().is_none()
            && tokio::time::timeout(THREAD_END_WAIT, self.thread_ended.cancelled())
                .await
                .is_err()
        {
            tracing::warn!(owner = %self.env.owner, "leasehold scheduler thread did not end in time after shutdown");
        }
        report
    }

    /// Keep `report` as the shutdown's, unless one is kept already.
    fn publish(&self, report: ShutdownReport) {
        self.report.send_if_modified(|slot| {
            if slot.is_some() {
                return false;
            }
            *slot = Some(report);
            true
        });
    }

    /// The report of a shutdown that could not run on the scheduler's thread: nothing
    /// drained, every attempt still registered cancelled (its lease expires).
    fn gone_report(&self) -> ShutdownReport {
        ShutdownReport {
            drained: 0,
            cancelled: self.env.running.len() as u64,
            metrics: self.env.metrics.snapshot(),
        }
    }

    /// With `handler_threads = Some(0)` the scheduler's thread outlives its shutdown until
    /// the host closes the pool it gave the scheduler: handlers ran on that thread, so a
    /// connection of the host's pool that one of them opened belongs to that thread's
    /// runtime (its socket is driven there). Were the runtime dropped, the host's next
    /// query on such a connection would fail, and the pool's ping before lending it out
    /// does not reliably notice (it can be answered from what the socket already holds).
    /// So the thread stays, idle but for those sockets, until the pool is closed or the
    /// process exits. `None` in every other mode.
    fn lingers_for_host_pool(&self) -> Option<PgPool> {
        (self.env.config.handler_threads == Some(0)).then(|| self.env.host_store.pool().clone())
    }

    async fn run_shutdown(&self) -> ShutdownReport {
        let env = self.env.clone();
        let at_start = env
            .metrics
            .in_flight
            .load(std::sync::atomic::Ordering::SeqCst);
        // 1. Stop claiming, and wait out a claim statement already in flight.
        env.stop_claiming.cancel();
        while let Ok(true) = self.claimer.ask(StopClaiming).await {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // 2. Drain within the grace period.
        let deadline = tokio::time::Instant::now() + env.config.shutdown_grace;
        while in_flight(&env) > 0 && tokio::time::Instant::now() < deadline {
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
        while in_flight(&env) > 0 && tokio::time::Instant::now() < release_deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // 4. Stop the actors, and close the scheduler's own connections.
        let all_stopped = self.stop_actors().await;
        env.claim_store.pool().close().await;
        env.store.pool().close().await;
        if env.config.handler_threads.is_some() {
            env.handler_store.pool().close().await;
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

    async fn stop_actors(&self) -> bool {
        let env = &self.env;
        let limit = Duration::from_secs(10);
        let sequencers: Vec<_> = env.sequencers.iter().map(|e| e.value().clone()).collect();
        env.sequencers.clear();
        for s in &sequencers {
            let _ = s.stop();
        }
        if let Some(p) = &self.periodic {
            let _ = p.send(Stop).await;
        }
        let _ = self.claimer.ask(Stop).await;
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
        let maintenance = take_once(&self.maintenance);
        if let Some(arbiter) = maintenance {
            arbiter.stop();
            let _ = tokio::task::spawn_blocking(move || arbiter.join()).await;
        }
        all_stopped
    }
}

fn in_flight(env: &Env) -> u64 {
    env.metrics
        .in_flight
        .load(std::sync::atomic::Ordering::SeqCst)
}
