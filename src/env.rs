//! The shared state of one running scheduler, handed to its actors and executions.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, OnceLock};

use dashmap::DashMap;
use tokio_util::sync::CancellationToken;

use crate::actor::claimer::Claimer;
use crate::actor::completer::Completer;
use crate::actor::lease_renewer::{LeaseRenewer, Running};
use crate::actor::sequencer::SequencerHandle;
use crate::actor::{Metered, Slots};
use crate::config::Config;
use crate::handler::Registry;
use crate::job::{ClaimedJob, OwnerId};
use crate::metrics::Metrics;
use crate::store::Store;

pub(crate) struct Env {
    pub store: Store,
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
    /// Attempts running now, by job and generation (one process may hold an old
    /// attempt and a newer claim of the same job), for the lease renewer and shutdown.
    pub running: Running,
    /// Fired when shutdown begins: from then on nothing claims (the claimer stops, and
    /// sequencers stop fetching their key's next job).
    pub stop_claiming: CancellationToken,
    /// Fired when the shutdown grace period ends: running attempts are cancelled and
    /// their jobs released.
    pub hard_stop: CancellationToken,
    /// Keyed successors claimed by a completion while every slot was busy: the claimer
    /// hands each the next free slot before it claims anything new.
    pub parked: Mutex<VecDeque<ClaimedJob>>,
}

impl Env {
    /// Queue a claimed successor for the next free slot.
    pub fn park(&self, job: ClaimedJob) {
        self.parked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(job);
        self.wake_claimer();
    }

    /// Tell the claimer that slots were freed (or a successor was parked). New work is
    /// announced by NOTIFY instead (the listener's `Wake`).
    pub fn wake_claimer(&self) {
        if let Some(claimer) = self.claimer.get() {
            let _ = claimer.tell(crate::actor::claimer::SlotsFreed);
        }
    }
}
