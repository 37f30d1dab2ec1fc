//! The shared state of one running scheduler, handed to its actors and executions.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use dashmap::DashMap;
use tokio_util::sync::CancellationToken;

use crate::actor::claimer::Claimer;
use crate::actor::completer::Completer;
use crate::actor::dispatch::{PausedSet, ReadyQueue};
use crate::actor::lease_renewer::{LeaseRenewer, Running};
use crate::actor::queue_limits::QueueLimits;
use crate::actor::sequencer::SequencerHandle;
use crate::actor::{Metered, Slots};
use crate::config::Config;
use crate::context::JobContext;
use crate::handler::Registry;
use crate::job::{ClaimedJob, OwnerId};
use crate::metrics::Metrics;
use crate::store::Store;

pub(crate) struct Env {
    /// The store over the scheduler's own writer pool (job endings, fetch-next,
    /// releases), made on the scheduler's thread.
    pub store: Store,
    /// [`Env::store`] with every statement waiting at most one writer's turn
    /// (`actor::completer::KEY_TURN`) for a lock: the failures, snoozes and releases the
    /// executor writes itself. See [`Store::with_lock_wait_everywhere`].
    pub ending_store: Store,
    /// Endings that wait for a row another session holds take turns on all but one of
    /// the writer's connections (a permit each), so one stays free for every other
    /// ending: shared by the completer's waiting writes and the executor's own endings.
    pub row_waits: Arc<tokio::sync::Semaphore>,
    /// The store over the host's pool: enqueues through the handle, and the context
    /// handlers get when they run on the host's runtime.
    pub host_store: Store,
    /// The store in the context handlers get (effect ledger, progress, completion in
    /// the handler's transaction): the host's when handlers run on the host's runtime;
    /// otherwise one over a pool of the scheduler's own, so no connection of the host's
    /// pool is opened on a runtime that stops with the scheduler.
    pub handler_store: Store,
    /// Where handlers run (`Config::handler_threads`).
    pub handlers: Handlers,
    /// The scheduler's own thread, where executions are watched and actors run,
    /// whichever thread began them.
    pub home: Home,
    /// The same store over the claimer's own connections (see `scheduler::claim_session`).
    pub claim_store: Store,
    pub config: Config,
    pub owner: OwnerId,
    pub registry: Registry,
    /// Kinds this scheduler claims (exactly the registered ones).
    pub kinds: Vec<String>,
    pub metrics: Arc<Metrics>,
    pub slots: Slots,
    pub renewer: Metered<LeaseRenewer>,
    pub completer: Metered<Completer>,
    pub claimer: OnceLock<Metered<Claimer>>,
    /// Live sequencers by (queue, key).
    pub sequencers: DashMap<(String, String), SequencerHandle>,
    /// Attempts this scheduler holds, by job and generation (one process may hold an old
    /// attempt and a newer claim of the same job): from the moment of their claim until
    /// their ending is written or they are released, whether running, parked for a
    /// slot, or queued behind their key's running job. The lease renewer renews exactly
    /// these.
    pub running: Running,
    /// Fired when shutdown begins: from then on nothing claims (the claimer stops, and
    /// sequencers stop fetching their key's next job).
    pub stop_claiming: CancellationToken,
    /// Fired when the shutdown grace period ends: running attempts are cancelled and
    /// their jobs released.
    pub hard_stop: CancellationToken,
    /// Claimed jobs waiting for a free slot (claimed ahead, or a key's successor claimed
    /// while every slot was busy); see `actor::dispatch`. Their leases are renewed
    /// meanwhile (they are in `running`).
    pub ready: ReadyQueue,
    /// How many claimed jobs the claimer wants waiting for a slot now: its paced
    /// claim-ahead target (`Config::claim_ahead`, `claim_ahead_window`), 0 while
    /// claim-ahead is paused. A completion with every slot busy claims its key's successor
    /// only while `ready` is below this, so a parked successor is a claimed-ahead job by
    /// another road, inside the same bound (see `executor`).
    pub ahead_target: std::sync::atomic::AtomicUsize,
    /// A [`SlotsFreed`](crate::actor::claimer::SlotsFreed) is in the claimer's mailbox,
    /// not yet handled: the claimer looks at the slots when it handles it, so later
    /// endings send none (under load that was one message per job).
    pub claimer_woken: std::sync::atomic::AtomicBool,
    /// Per-queue limits (`Config::queue_concurrency`), counted by `track` and `untrack`.
    pub queue_limits: QueueLimits,
    /// The queues last seen paused: their claimed-ahead jobs are given back, not started.
    pub paused: PausedSet,
    /// The per-queue gauges last read for a metrics scrape, shared by every clone of
    /// the handle (so by every actix-web worker's `/metrics` route).
    #[cfg(feature = "prometheus")]
    pub gauge_cache: crate::prometheus::GaugeCache,
}

impl Env {
    /// Start tracking a job claimed by a statement sent at `sent`: its lease is renewed
    /// from now on, and its local deadline counts from `sent` (the database computed
    /// the lease after that moment).
    pub fn track(&self, job: ClaimedJob, sent: Instant) -> JobContext {
        let ctx = JobContext::new(
            job,
            self.handler_store.clone(),
            self.config.effect_keep,
            self.lease_deadline_after(sent),
        );
        let job = ctx.job();
        match self.running.insert(job.attempt(), ctx.clone()) {
            None => self.queue_limits.held(&job.queue, true),
            // The same attempt claimed again (its row went back to an earlier state under
            // this process): the older one no longer holds the job. Both hold a slot until
            // the older one has stopped.
            Some(older) if !older.same_context(&ctx) => {
                older.supersede();
                self.queue_limits.held(&job.queue, true);
            }
            Some(_) => {}
        }
        ctx
    }

    /// Stop tracking an attempt (its ending was written, or it was released).
    pub fn untrack(&self, ctx: &JobContext) {
        let removed = self
            .running
            .remove_if(&ctx.job().attempt(), |_, v| v.same_context(ctx))
            .is_some();
        if removed || ctx.take_superseded_count() {
            self.queue_limits.held(ctx.queue(), false);
        }
    }

    /// The local deadline of a lease the database confirmed for a statement sent at
    /// `sent`: `sent + lease − renew_interval / 2`. The margin leaves time to stop the
    /// handler (a quarter of the renew interval) before the lease can expire.
    pub fn lease_deadline_after(&self, sent: Instant) -> Instant {
        sent + self.config.lease - self.config.renew_interval / 2
    }

    /// Tell the claimer that slots were freed (or a successor was parked). New work is
    /// announced by NOTIFY instead (the listener's `Wake`).
    pub fn wake_claimer(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        let Some(claimer) = self.claimer.get() else {
            return;
        };
        // One message at a time: the claimer clears the flag before it looks, so an
        // ending after its look sends the next one.
        if !self.claimer_woken.swap(true, SeqCst)
            && claimer.tell(crate::actor::claimer::SlotsFreed).is_err()
        {
            self.claimer_woken.store(false, SeqCst);
        }
    }
}

/// The scheduler's own thread: its arbiter, and how to tell whether code runs on it.
pub(crate) struct Home {
    arbiter: actix::ArbiterHandle,
    thread: std::thread::ThreadId,
}

impl Home {
    /// The thread this is called on; call it on the scheduler's thread.
    pub fn here() -> Self {
        Home {
            arbiter: actix::Arbiter::current(),
            thread: std::thread::current().id(),
        }
    }

    /// Call `f` on the scheduler's thread: now when called there, otherwise as soon as
    /// its arbiter gets to it.
    pub fn call<F>(&self, f: F)
    where
        F: FnOnce() + Send + 'static,
    {
        if std::thread::current().id() == self.thread {
            f();
        } else {
            self.spawn(async move { f() });
        }
    }

    /// Run `fut` on the scheduler's thread: at once as a local task when called there,
    /// otherwise through its arbiter. The arbiter is gone only once the scheduler has
    /// shut down; `fut` is then dropped (an execution dropped this way ends its hold,
    /// and its job's lease expires, as after a crash).
    pub fn spawn<F>(&self, fut: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        if std::thread::current().id() == self.thread {
            actix::spawn(fut);
        } else if !self.arbiter.spawn(fut) {
            tracing::warn!("leasehold scheduler already stopped; work handed to it is dropped");
        }
    }
}

/// Where handlers run, from `Config::handler_threads`.
#[derive(Clone)]
pub(crate) enum Handlers {
    /// A runtime's threads: the one the scheduler was started from (the host's), or a
    /// multi-thread runtime of the scheduler's own.
    Runtime(tokio::runtime::Handle),
    /// The scheduler's own thread, beside its actors (`handler_threads = Some(0)`).
    SchedulerThread,
}

impl Handlers {
    /// Spawn a handler's call. `SchedulerThread` needs the caller to run on the
    /// scheduler's thread (an actor's arbiter): the executors always do.
    pub fn spawn<F>(&self, call: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match self {
            Handlers::Runtime(rt) => rt.spawn(call),
            Handlers::SchedulerThread => tokio::task::spawn_local(call),
        }
    }
}
