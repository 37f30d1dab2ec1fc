//! What is checked: the jobs, the processes, the fault and operator budgets, the effect
//! store, and the switches that put the known defects back.

use super::state::Budget;

pub type ProcId = u8;
pub type JobId = u8;
/// No process (a row that is not running).
pub const NONE: u8 = u8::MAX;

/// One job of the checked workload.
#[derive(Clone, Copy, Debug)]
pub struct JobSpec {
    /// Index of its key; `None` for an unkeyed job.
    pub key: Option<u8>,
    /// Enqueued by the host transaction (`enqueue_in` inside the host's open transaction)
    /// instead of before the run. At most one job.
    pub via_host: bool,
    /// `DeadKeyPolicy::Continue` instead of the default `Block`.
    pub continue_on_dead: bool,
}

impl JobSpec {
    pub fn keyed(key: u8) -> Self {
        JobSpec {
            key: Some(key),
            via_host: false,
            continue_on_dead: false,
        }
    }
}

/// The external effect store the handlers act on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EffectStore {
    /// Applies an effect key once; a repeat gets the first outcome back.
    Dedup,
    /// Refuses a request whose fencing token (key_seq, generation) is older than the
    /// newest it applied for the key (an account); does not deduplicate.
    Fenced,
}

/// The known defects, each the old behaviour of one part (all false: the hardened design).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Defects {
    /// Old RENEW: a plain UPDATE, which waits on a row lock held by another transaction
    /// (a completion waiting for a key row), and renews nothing meanwhile.
    pub renewal_waits_on_locks: bool,
    /// Old registry: an attempt is renewed only from its handler's start (not while
    /// parked or queued behind its key), and nothing checks its lease before starting.
    pub renewal_from_handler_start: bool,
    /// Old cancel: a running head is cancelled at once and its successor promoted.
    pub cancel_promotes_running_head: bool,
    /// Old retention: deletes dead rows too, which the key's open_jobs still counts.
    pub prune_deletes_dead: bool,
    /// Old retention: deletes key rows with no open job, so the key's next enqueue
    /// starts key_seq again from 1 (below tokens a fencing store has seen).
    pub prune_restarts_key_seq: bool,
    /// No local deadline: a handler whose renewals stopped is never cancelled by its own
    /// process.
    pub no_local_deadline: bool,
    /// PROMOTE's chained claim sets `lease_until = now() + lease`, `now()` being the start
    /// of the completion's transaction, which may have waited for a key row longer than
    /// a lease: the successor is claimed with a lease that has already passed. (Found by
    /// this model; false is `clock_timestamp()`, as the hardened RENEW does.)
    pub promote_lease_from_transaction_start: bool,
    /// Old lock order: a keyed ending (and a reap that ends a key's head) locked its job
    /// row first, then waited for the key row with the job row held. The code locks key
    /// rows first (src/store/complete.rs "Lock order", the `kl` CTEs of FAIL and REAP,
    /// `complete_keyed`'s first SELECT), so a transaction waiting for a key row holds no
    /// job row.
    pub job_row_before_key_row: bool,
    /// A job claimed ahead is not in the renewal registry while it waits in the ready
    /// queue (the code tracks it from its claim: `Env::track` in the claimer).
    pub ahead_not_renewed: bool,
    /// A give-back whose RELEASE got no answer puts its jobs back in the ready queue, as
    /// if still held (the `Err` arm of dispatch.rs `release_ready` before the chaos
    /// harness found it): when that RELEASE committed with its reply lost, a slot that
    /// frees starts a job that is pending, perhaps already someone else's. Hardened, as
    /// `release_retrying` does: a given-back job never starts here again; it stays
    /// tracked (renewed) while the RELEASE is retried, until one is answered, a renewal
    /// finds the job no longer ours, or a lease has passed.
    pub give_back_error_keeps_jobs: bool,
    /// A reaper that never requeues: REAP records the expiry and leases the row again to
    /// its owner instead of putting it back (as a reaper that trusts owners to be alive
    /// would). No safety property sees it (the row is running under a live lease);
    /// liveness does: a crashed owner's job is re-leased forever and never ends.
    pub reap_never_requeues: bool,
}

#[derive(Clone, Debug)]
pub struct Config {
    pub jobs: Vec<JobSpec>,
    pub keys: u8,
    pub procs: u8,
    /// Execution slots per process (`concurrency`).
    pub slots: u8,
    /// Jobs a claim may take beyond the free slots, to wait in the process's ready
    /// queue (`Config::claim_ahead`; 0: claim only into free slots).
    pub ahead: u8,
    pub max_attempts: u8,
    /// Lease, in ticks. The renewer runs every tick.
    pub lease: i8,
    /// Local deadline margin, in ticks: deadline = renewal sent + lease - margin.
    pub margin: i8,
    pub budget: Budget,
    pub store: EffectStore,
    pub defects: Defects,
    /// Also claim at-most-once effects from the fencing store (a negative control: it
    /// does not deduplicate, so this is expected to fail).
    pub fenced_store_claims_once: bool,
    /// Check liveness under fairness (keeps the state graph; see `super::liveness`).
    pub liveness: bool,
}

impl Config {
    /// The exhaustive check of `cargo test`: 3 jobs on 2 keys (the third enqueued by a
    /// host transaction on the first key), 2 processes of 2 slots, one of each fault
    /// and operator action.
    pub fn bounded() -> Config {
        let mut host = JobSpec::keyed(0);
        host.via_host = true;
        Config {
            jobs: vec![JobSpec::keyed(0), JobSpec::keyed(1), host],
            keys: 2,
            procs: 2,
            slots: 2,
            ahead: 0,
            max_attempts: 2,
            lease: 2,
            margin: 1,
            // One fault (of any kind) and one operator action (of any kind) per run.
            budget: Budget {
                crashes: 1,
                pauses: 1,
                failures: 1,
                shutdowns: 0,
                lost_replies: 0,
                faults: 1,
                cancels: 1,
                holds: 1,
                retries: 1,
                prunes: 1,
                operator: 1,
            },
            store: EffectStore::Dedup,
            defects: Defects::default(),
            fenced_store_claims_once: false,
            liveness: true,
        }
    }

    /// Claim-ahead (the default path of the code, `Config::claim_ahead`): 2 jobs on 2
    /// keys (the second enqueued by the host transaction), 2 processes of 1 slot with
    /// room for 1 job claimed ahead; one fault of any kind, a graceful shutdown and a
    /// give-back's RELEASE without an answer among them; no operator action. (Claim-ahead on
    /// top of [`Config::bounded`] is more than `cargo test` can exhaust.)
    pub fn claim_ahead() -> Config {
        let mut cfg = Config::sized(2, 2, 2);
        cfg.slots = 1;
        cfg.ahead = 1;
        cfg.budget.shutdowns = 1;
        cfg.budget.lost_replies = 1;
        cfg.budget.cancels = 0;
        cfg.budget.holds = 0;
        cfg.budget.retries = 0;
        cfg.budget.prunes = 0;
        cfg.budget.operator = 0;
        cfg
    }

    /// `jobs` jobs spread over `keys` keys (the last one enqueued by the host
    /// transaction), `procs` processes; otherwise as [`Config::bounded`].
    pub fn sized(jobs: usize, keys: u8, procs: u8) -> Config {
        let mut cfg = Config::bounded();
        cfg.keys = keys.max(1);
        cfg.procs = procs;
        cfg.jobs = (0..jobs)
            .map(|j| JobSpec::keyed((j % cfg.keys as usize) as u8))
            .collect();
        if let Some(last) = cfg.jobs.last_mut() {
            last.via_host = true;
        }
        cfg
    }

    /// A budget with nothing in it, to switch on only what a check needs.
    pub fn quiet(mut self) -> Config {
        self.budget = Budget {
            crashes: 0,
            pauses: 0,
            failures: 0,
            shutdowns: 0,
            lost_replies: 0,
            faults: 0,
            cancels: 0,
            holds: 0,
            retries: 0,
            prunes: 0,
            operator: 0,
        };
        self
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.jobs.is_empty() || self.jobs.len() > 8 {
            return Err("1 to 8 jobs".into());
        }
        if self.procs == 0 || self.procs > 4 {
            return Err("1 to 4 processes".into());
        }
        if self.budget.crashes.max(self.budget.shutdowns) >= self.procs {
            return Err("at least one process must survive (liveness needs one)".into());
        }
        if self.jobs.iter().filter(|j| j.via_host).count() > 1 {
            return Err("at most one job enqueued by the host transaction".into());
        }
        if self
            .jobs
            .iter()
            .any(|j| j.key.is_some_and(|k| k >= self.keys))
        {
            return Err("a job's key is out of range".into());
        }
        if self
            .host_job()
            .is_some_and(|j| self.jobs[j as usize].key.is_none())
        {
            return Err("the host transaction's job must be keyed (it holds its key row)".into());
        }
        if self.lease <= self.margin || self.margin < 1 || self.lease > 6 {
            return Err("need 1 <= margin < lease <= 6".into());
        }
        Ok(())
    }

    pub fn key_of(&self, job: JobId) -> Option<u8> {
        self.jobs[job as usize].key
    }

    pub fn host_job(&self) -> Option<JobId> {
        self.jobs
            .iter()
            .position(|j| j.via_host)
            .map(|j| j as JobId)
    }

    /// The key row the open host transaction holds.
    pub fn host_key(&self) -> Option<u8> {
        self.host_job().and_then(|j| self.key_of(j))
    }

    /// Index into [`super::state::Store::newest`]: the job's key, or its own slot.
    pub fn token_scope(&self, job: JobId) -> usize {
        match self.key_of(job) {
            Some(k) => k as usize,
            None => self.keys as usize + job as usize,
        }
    }
}
