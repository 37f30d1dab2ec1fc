//! Job identity, state and the values that cross the store boundary.
//!
//! # Who moves a job out of each state
//!
//! | state     | left by                                                             |
//! |-----------|---------------------------------------------------------------------|
//! | pending   | the claimer (claim → running); an operator (hold, cancel)           |
//! | waiting   | the transaction that ends its key's predecessor (promote → pending) |
//! | running   | the executor (complete → done, fail → pending/dead), the reaper (expired lease → pending/dead), shutdown (release → pending) |
//! | held      | an operator (release → pending, cancel)                             |
//! | dead      | an operator (retry → pending, cancel)                               |
//! | done, cancelled | nobody: terminal; only the retention policy deletes them     |

use std::fmt;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// A job's identity for effect keys: a random UUID the database mints when the job is
/// enqueued (`jobs.effect_identity`, migrations/0021_job_effect_identity.sql), as
/// lower-case hyphenated text (36 characters), e.g.
/// `0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c2a`. The first part of every
/// [`EffectKey`](crate::EffectKey) of the job.
///
/// Job ids alone are not enough: they start at 1 in every schema, again in a schema
/// created again, and rewind in a schema restored from an older dump, so two jobs that
/// charge through one payment gateway could send it the same key. No other job of any
/// schema, database or restore has this identity; a job restored from a dump keeps its
/// own (the same job: a retry gets the recorded outcome).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EffectIdentity(Arc<str>);

impl EffectIdentity {
    /// The identity of `text`, if it is one: a UUID as PostgreSQL prints it (hex digits,
    /// lower case, hyphens after the 8th, 12th, 16th and 20th).
    pub fn parse(text: &str) -> Option<EffectIdentity> {
        let b = text.as_bytes();
        let shaped = b.len() == Self::LEN
            && b.iter().enumerate().all(|(i, c)| match i {
                8 | 13 | 18 | 23 => *c == b'-',
                _ => c.is_ascii_digit() || (b'a'..=b'f').contains(c),
            });
        shaped.then(|| EffectIdentity(Arc::from(text)))
    }

    /// Length of an identity as text.
    pub const LEN: usize = 36;

    /// The identity as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for EffectIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A job's id, assigned by the database at enqueue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct JobId(pub i64);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The fencing token: +1 on every claim, never decreases. A write that carries an older
/// generation than the row's is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Generation(pub i64);

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Identity of one process start: `host:pid:random`. A restarted process gets a new
/// one, so it never inherits the authority of the process that died.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct OwnerId(Arc<str>);

impl OwnerId {
    /// A fresh owner id for this process start (and this scheduler within it).
    pub fn generate() -> Self {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "host".to_string());
        let nonce: u64 = rand::random();
        OwnerId(format!("{host}:{}:{nonce:016x}", std::process::id()).into())
    }

    /// An owner id with a chosen name (tests and tools; must still be unique).
    pub fn named(name: impl Into<String>) -> Self {
        OwnerId(name.into().into())
    }

    /// The id as text, as stored in the job's `owner` column and history.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The owner id without its host part (`pid:nonce`), short enough for an
    /// `application_name` (63 bytes), and unique all the same: the scheduler's own
    /// connections carry it, so `pg_stat_activity` tells whose backend is whose.
    pub fn short(&self) -> &str {
        let parts: Vec<&str> = self.0.rsplitn(3, ':').collect();
        if parts.len() == 3 {
            let host_len = parts[2].len() + 1;
            &self.0[host_len..]
        } else {
            &self.0
        }
    }
}

impl fmt::Display for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where a job is in its life. See the module docs for who moves it on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    /// Waiting for a claim: eligible from its `available_at` (run-at, delay or retry
    /// backoff).
    Pending,
    /// A keyed job behind an open predecessor of its key: not claimable; promoted to
    /// pending when that one ends.
    Waiting,
    /// Claimed under a lease by one owner and generation; its handler may be running.
    Running,
    /// Completed: the handler's result is stored. Terminal.
    Done,
    /// Failed for good (attempts spent, or a permanent error), with its last error: the
    /// dead-letter queue. An operator retries or cancels it.
    Dead,
    /// Put aside by an operator: not claimed until the hold is released. A held head
    /// blocks its key.
    Held,
    /// Cancelled by an operator. Terminal.
    Cancelled,
}

impl JobState {
    /// Every state, in the order of the life cycle (for listings and per-state gauges).
    pub const ALL: [JobState; 7] = [
        JobState::Pending,
        JobState::Waiting,
        JobState::Running,
        JobState::Done,
        JobState::Dead,
        JobState::Held,
        JobState::Cancelled,
    ];

    /// The state as stored in the database and shown to operators (`"pending"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Waiting => "waiting",
            JobState::Running => "running",
            JobState::Done => "done",
            JobState::Dead => "dead",
            JobState::Held => "held",
            JobState::Cancelled => "cancelled",
        }
    }

    /// The state named by `s` (as [`JobState::as_str`] writes it); `None` for any other
    /// text.
    pub fn parse(s: &str) -> Option<Self> {
        JobState::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// Done, dead and cancelled: nothing moves the job on by itself.
    pub fn is_terminal(self) -> bool {
        matches!(self, JobState::Done | JobState::Dead | JobState::Cancelled)
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a dead job does to its key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeadKeyPolicy {
    /// The key stays blocked until an operator retries or cancels the dead job (default:
    /// a ledger must not apply entry 3 after entry 2 failed for good).
    #[default]
    Block,
    /// The key moves on to its next job.
    Continue,
}

/// A job to enqueue. Build with [`NewJob::new`] and the `with_*` setters.
#[derive(Clone, Debug)]
pub struct NewJob {
    /// `None`: the enqueuing path's default queue, the first queue of a [`Scheduler`]
    /// (so a job enqueued through it lands where it is served), or `"default"` through a
    /// [`Store`].
    ///
    /// [`Scheduler`]: crate::Scheduler
    /// [`Store`]: crate::Store
    pub queue: Option<String>,
    /// The handler's [`Handler::KIND`](crate::Handler::KIND): only a scheduler that
    /// registered it claims the job.
    pub kind: String,
    /// Ordering key (an account, say): jobs with the same key in one queue run one at a
    /// time, in enqueue (commit) order. `None`: no ordering. Any text but the empty
    /// string and NUL (see [`NewJob::with_key`]).
    pub key: Option<String>,
    /// Lower runs first; claims are ordered by `(priority, available_at, id)`. `None`:
    /// the kind's policy's priority where the enqueuing store knows it, else 0. An
    /// explicit `Some(0)` is the job's own and wins over its kind's.
    pub priority: Option<i16>,
    /// Absolute run-at time (database clock is used when `None`).
    pub run_at: Option<DateTime<Utc>>,
    /// Delay from the database's `now()`; ignored when `run_at` is set.
    pub delay: Option<std::time::Duration>,
    /// `None`: the store's default.
    pub max_attempts: Option<i32>,
    /// The job's arguments, decoded by the handler into its `Payload`. Its JSON may
    /// take at most [`StoreOptions::max_payload_bytes`](crate::StoreOptions::max_payload_bytes).
    pub payload: serde_json::Value,
    /// What this job does to its key if it dies. Default [`DeadKeyPolicy::Block`].
    pub dead_key_policy: DeadKeyPolicy,
    /// Enqueue it only if no job of the same kind and unique key exists in the scope
    /// ([`NewJob::unique`]). `None`: no uniqueness.
    pub unique: Option<Unique>,
}

/// A unique key and its scope: a job is not enqueued when a job of the same kind and
/// unique key exists in the scope; the enqueue returns that job's id instead, and
/// [`Store::enqueue_outcome`](crate::Store::enqueue_outcome) says it was a duplicate.
/// Enforced by the database (unique indexes, and a lock per unique key while an
/// enqueue looks), so concurrent enqueuers in any number of processes get one job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unique {
    /// The unique key (at most one job per kind and key in the scope).
    pub key: String,
    /// Where the key must be unique.
    pub scope: UniqueScope,
}

/// Where a [`Unique`] key must be unique.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UniqueScope {
    /// While a job with the key is open: pending, waiting, running or held. Once it is
    /// done, dead or cancelled, the key may be enqueued again.
    WhileOpen,
    /// Once per period, in fixed windows of the database clock counted from the Unix
    /// epoch (`Period(1 hour)`: once per clock hour, whatever the job's state). The row
    /// is kept by retention until its window has passed.
    Period(std::time::Duration),
    /// Once, ever: the job's row is never pruned by retention, so the key stays taken.
    Forever,
}

impl NewJob {
    /// A job of `kind` with a typed payload, in the default queue of the path that
    /// enqueues it (see [`NewJob::queue`]).
    pub fn new(kind: impl Into<String>, payload: &impl Serialize) -> crate::Result<Self> {
        let payload = crate::store::to_json(payload).map_err(crate::Error::InvalidPayload)?;
        Ok(Self::from_json(kind, payload))
    }

    /// A job with an already-built JSON payload.
    pub fn from_json(kind: impl Into<String>, payload: serde_json::Value) -> Self {
        NewJob {
            queue: None,
            kind: kind.into(),
            key: None,
            priority: None,
            run_at: None,
            delay: None,
            max_attempts: None,
            payload,
            dead_key_policy: DeadKeyPolicy::Block,
            unique: None,
        }
    }

    /// Send the job to `queue` instead of the enqueuing path's default.
    pub fn with_queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }

    /// The queue this job goes to through a [`crate::Store`]: its own, or `"default"`.
    pub fn queue_name(&self) -> &str {
        self.queue
            .as_deref()
            .unwrap_or(crate::config::DEFAULT_QUEUE)
    }
    /// Jobs with the same key (in one queue) run one at a time, in enqueue order.
    ///
    /// A key is any text (quotes, SQL, non-ASCII, long strings: stored and shown as it
    /// is) except two, which every enqueue refuses with
    /// [`Error::InvalidInput`](crate::Error::InvalidInput) for `key`, nothing written:
    /// the empty string (`invalid key: must not be empty`; a job without a key is one
    /// without `with_key`: an empty key is most often an unset id, and one shared key
    /// would queue all such jobs behind each other), and NUL, which PostgreSQL text
    /// cannot store. The store's filters, the CLI's `--key` and the dashboard say the
    /// same: no job has the empty key (the dashboard's empty field is no filter). Queue
    /// and key together up to
    /// [`INDEXED_TEXT_ALWAYS_FITS`](crate::store::INDEXED_TEXT_ALWAYS_FITS) bytes
    /// always fit in PostgreSQL's index entries; longer ones fit if they compress, and
    /// are refused otherwise (the error names the field and the limit).
    ///
    /// ```
    /// # use leasehold::NewJob;
    /// let job = NewJob::from_json("charge", serde_json::json!({})).with_key("account:42");
    /// assert_eq!(job.key.as_deref(), Some("account:42"));
    /// ```
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }
    /// Lower runs first.
    pub fn with_priority(mut self, priority: i16) -> Self {
        self.priority = Some(priority);
        self
    }
    /// Not claimable before `at` (compared with the database clock).
    pub fn with_run_at(mut self, at: DateTime<Utc>) -> Self {
        self.run_at = Some(at);
        self
    }
    /// Not claimable before the database's `now()` at enqueue plus `delay` (at most
    /// [`MAX_DELAY`](crate::store::MAX_DELAY)); ignored when a run-at time is set.
    pub fn with_delay(mut self, delay: std::time::Duration) -> Self {
        self.delay = Some(delay);
        self
    }
    /// Attempts before the job is dead (at least 1), instead of the store's default.
    pub fn with_max_attempts(mut self, n: i32) -> Self {
        self.max_attempts = Some(n);
        self
    }
    /// What the job does to its key if it dies (default: block it).
    pub fn with_dead_key_policy(mut self, policy: DeadKeyPolicy) -> Self {
        self.dead_key_policy = policy;
        self
    }
    /// Enqueue it only if no job of its kind with this unique key exists in `scope`;
    /// otherwise the enqueue returns the existing job's id (see [`Unique`]).
    ///
    /// ```
    /// # use leasehold::{NewJob, UniqueScope};
    /// // One charge per order, however often the checkout retries its request.
    /// let job = NewJob::from_json("charge", serde_json::json!({"order": 42}))
    ///     .unique("order-42", UniqueScope::Forever);
    /// assert_eq!(job.unique.unwrap().key, "order-42");
    /// ```
    pub fn unique(mut self, key: impl Into<String>, scope: UniqueScope) -> Self {
        self.unique = Some(Unique {
            key: key.into(),
            scope,
        });
        self
    }
}

/// What an enqueue did with one job: its id, and whether that is an existing job's
/// because the new one was a duplicate of it ([`NewJob::unique`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Enqueued {
    /// The new job's id, or the existing one's for a duplicate.
    pub id: JobId,
    /// True when nothing was enqueued: a job of the same kind and unique key exists in
    /// the scope, and `id` is that job.
    pub duplicate: bool,
}

/// The authority a worker holds over one claimed job: every later write carries it.
///
/// A write is applied only to the row with this id, owner, generation *and* identity,
/// still running. The identity is there because the other three repeat: job ids restart
/// at 1 in a schema dropped and created again, and a process's owner and a first claim's
/// generation are the same there, so an attempt of the dropped schema's job 1 would
/// otherwise hold the new job 1's fence.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Fence {
    /// The claimed job.
    pub job: JobId,
    /// The process start that claimed it.
    pub owner: OwnerId,
    /// The generation the claim gave it: a write carrying an older one is refused.
    pub generation: Generation,
    /// The job's identity ([`EffectIdentity`]), unique across schemas and their
    /// incarnations.
    pub identity: EffectIdentity,
}

impl Fence {
    /// The attempt this fence holds, as the batch writes of one owner name it.
    pub fn attempt(&self) -> Attempt {
        Attempt {
            job: self.job,
            generation: self.generation,
            identity: self.identity.clone(),
        }
    }
}

/// One attempt of one job, as batch writes of one owner name it ([`Store::renew`],
/// [`Store::release_many`], [`Store::complete_many`]): a [`Fence`] without its owner,
/// which the batch gives once.
///
/// [`Store::renew`]: crate::Store::renew
/// [`Store::release_many`]: crate::Store::release_many
/// [`Store::complete_many`]: crate::Store::complete_many
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Attempt {
    /// The claimed job.
    pub job: JobId,
    /// The claim's generation.
    pub generation: Generation,
    /// The job's identity (see [`Fence`] for why it is part of every write).
    pub identity: EffectIdentity,
}

/// A job as handed to a worker by a claim.
#[derive(Clone, Debug)]
pub struct ClaimedJob {
    /// The job's id.
    pub id: JobId,
    /// The queue it was claimed from.
    pub queue: String,
    /// Its handler's kind.
    pub kind: String,
    /// Its ordering key; `None` for an unkeyed job.
    pub key: Option<String>,
    /// Its position within its key, fixed at enqueue in commit order; `None` for an
    /// unkeyed job.
    pub key_seq: Option<i64>,
    /// Its priority (lower runs first).
    pub priority: i16,
    /// The payload as stored (JSON); null when `payload_error` is set.
    pub payload: serde_json::Value,
    /// Set when the stored payload could not be decoded (`payload` is then null): the
    /// scheduler makes such a job dead at once with this reason, never its batch.
    pub payload_error: Option<String>,
    /// Size of the payload's JSON encoding in bytes, as enqueued; counts against
    /// [`Config::inflight_byte_budget`](crate::Config::inflight_byte_budget).
    pub payload_bytes: i32,
    /// This attempt's number: 1 for the first (counted at claim, so a crash still
    /// counts).
    pub attempt: i32,
    /// Attempts the job gets before it is dead.
    pub max_attempts: i32,
    /// This claim's fencing token (the job's number of claims so far).
    pub generation: Generation,
    /// The claiming process start.
    pub owner: OwnerId,
    /// When the lease taken at claim expires (database clock); renewals move it on in
    /// the database, not here.
    pub lease_until: DateTime<Utc>,
    /// When the job was enqueued (database clock).
    pub created_at: DateTime<Utc>,
    /// When this claim happened (database clock).
    pub claimed_at: DateTime<Utc>,
    /// The job's identity for its effect keys (see [`EffectIdentity`]).
    pub effect_identity: EffectIdentity,
}

impl ClaimedJob {
    /// A fencing token that grows across every attempt of every job of this job's key
    /// (see [`crate::JobContext::fencing_token`]): the claim's time, in microseconds since
    /// the Unix epoch (database clock).
    pub fn fencing_token(&self) -> u64 {
        u64::try_from(self.claimed_at.timestamp_micros()).unwrap_or(0)
    }

    /// The fence every write about this attempt carries: id, owner, generation and the
    /// job's identity.
    pub fn fence(&self) -> Fence {
        Fence {
            job: self.id,
            owner: self.owner.clone(),
            generation: self.generation,
            identity: self.effect_identity.clone(),
        }
    }

    /// This attempt, as the batch writes of its owner name it.
    pub fn attempt(&self) -> Attempt {
        Attempt {
            job: self.id,
            generation: self.generation,
            identity: self.effect_identity.clone(),
        }
    }
}

/// A job row as an operator sees it.
#[derive(Clone, Debug, Serialize)]
pub struct JobRecord {
    /// The job's id.
    pub id: JobId,
    /// Its queue.
    pub queue: String,
    /// Its handler's kind.
    pub kind: String,
    /// Its ordering key; `None` for an unkeyed job.
    pub key: Option<String>,
    /// Its position within its key (commit order of the enqueues); `None` for an
    /// unkeyed job.
    pub key_seq: Option<i64>,
    /// Its priority (lower runs first).
    pub priority: i16,
    /// Where it is in its life; see the module docs for who moves it on.
    pub state: JobState,
    /// The payload as stored (JSON); null if it could not be decoded (see
    /// `payload_error`).
    pub payload: serde_json::Value,
    /// Set when the stored payload or result could not be decoded (shown as null).
    pub payload_error: Option<String>,
    /// The handler's output, stored by the completing attempt; `None` until the job is
    /// done.
    pub result: Option<serde_json::Value>,
    /// Attempts started so far (counted at claim; a release at shutdown gives one back;
    /// an operator's retry starts again from 0).
    pub attempts: i32,
    /// After this many attempts a failure or an expired lease makes the job dead.
    pub max_attempts: i32,
    /// Times a handler snoozed it ([`JobError::snooze`](crate::JobError::snooze)); each
    /// gave its attempt back.
    pub snoozes: i32,
    /// What a handler last recorded with
    /// [`JobContext::record_progress`](crate::JobContext::record_progress); kept after
    /// the job ends.
    pub progress: Option<serde_json::Value>,
    /// Claims so far: the fencing token of the latest one (0 if never claimed).
    pub generation: Generation,
    /// Owner id of the process that claimed the latest generation, kept after the job
    /// ends; `None` if never claimed.
    pub owner: Option<String>,
    /// While running: when the reaper may take the job back (database clock). `None`
    /// in every other state.
    pub lease_until: Option<DateTime<Utc>>,
    /// From when a pending job may be claimed (run-at, delay or retry backoff;
    /// database clock).
    pub available_at: DateTime<Utc>,
    /// When the enqueue ran (database clock). A job enqueued in a longer transaction
    /// becomes visible at its commit, later than this.
    pub created_at: DateTime<Utc>,
    /// When the job reached done, dead or cancelled; `None` before.
    pub finished_at: Option<DateTime<Utc>>,
    /// Reason of the latest failed attempt, expired lease, release or operator action;
    /// `None` if there was none.
    pub last_error: Option<String>,
    /// When an operator asked to cancel this job while it ran (it ends cancelled unless
    /// that attempt completes).
    pub cancel_requested_at: Option<DateTime<Utc>>,
}

/// One line of a job's history.
#[derive(Clone, Debug, Serialize)]
pub struct JobEvent {
    /// The job.
    pub job: JobId,
    /// The job's generation when it happened.
    pub generation: Generation,
    /// What happened: `claimed`, `completed`, `failed`, `dead`, `reaped`, `released`,
    /// `held`, `unheld`, `cancel_requested`, `cancelled` or `retried_by_operator`
    /// (`claimed` and `completed` only with
    /// [`StoreOptions::full_history`](crate::StoreOptions::full_history)).
    pub event: String,
    /// Who made the transition: a worker's or reaper's owner id, or `operator`.
    pub owner: Option<String>,
    /// When it happened (database clock).
    pub at: DateTime<Utc>,
    /// The reason or error text, when there is one.
    pub detail: Option<String>,
}

/// Result of a fenced completion.
#[derive(Clone, Debug, PartialEq)]
pub enum CompleteOutcome {
    /// This call moved the job to done.
    Completed,
    /// An earlier call by the same owner and generation already completed it (its reply
    /// was lost); the stored result is returned and nothing was written.
    AlreadyCompleted {
        /// The result stored by the earlier call.
        result: Option<serde_json::Value>,
    },
    /// The worker no longer owns this generation: nothing was written.
    Stale,
}

/// Result of a fenced failure.
#[derive(Clone, Debug, PartialEq)]
pub enum FailOutcome {
    /// Back to pending, claimable again from `available_at` (database clock).
    Retrying {
        /// When the job becomes claimable again (database clock).
        available_at: DateTime<Utc>,
    },
    /// Attempts exhausted (or a permanent error): dead, with the reason stored.
    Dead,
    /// An operator asked to cancel the job while this attempt ran: cancelled, and its
    /// key moved on.
    Cancelled,
    /// The worker no longer owns this generation: nothing was written.
    Stale,
}

/// Result of a fenced write that has no other variants (release).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FenceOutcome {
    /// The write was made: the fence still held.
    Applied,
    /// The worker no longer owns this generation: nothing was written.
    Stale,
}
