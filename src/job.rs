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
    Pending,
    Waiting,
    Running,
    Done,
    Dead,
    Held,
    Cancelled,
}

impl JobState {
    pub const ALL: [JobState; 7] = [
        JobState::Pending,
        JobState::Waiting,
        JobState::Running,
        JobState::Done,
        JobState::Dead,
        JobState::Held,
        JobState::Cancelled,
    ];

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
    pub kind: String,
    pub key: Option<String>,
    pub priority: i16,
    /// Absolute run-at time (database clock is used when `None`).
    pub run_at: Option<DateTime<Utc>>,
    /// Delay from the database's `now()`; ignored when `run_at` is set.
    pub delay: Option<std::time::Duration>,
    /// `None`: the store's default.
    pub max_attempts: Option<i32>,
    pub payload: serde_json::Value,
    pub dead_key_policy: DeadKeyPolicy,
}

impl NewJob {
    /// A job of `kind` with a typed payload, in the default queue of the path that
    /// enqueues it (see [`NewJob::queue`]).
    pub fn new(kind: impl Into<String>, payload: &impl Serialize) -> crate::Result<Self> {
        let payload = serde_json::to_value(payload)
            .map_err(|e| crate::Error::InvalidPayload(e.to_string()))?;
        Ok(Self::from_json(kind, payload))
    }

    /// A job with an already-built JSON payload.
    pub fn from_json(kind: impl Into<String>, payload: serde_json::Value) -> Self {
        NewJob {
            queue: None,
            kind: kind.into(),
            key: None,
            priority: 0,
            run_at: None,
            delay: None,
            max_attempts: None,
            payload,
            dead_key_policy: DeadKeyPolicy::Block,
        }
    }

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
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }
    /// Lower runs first.
    pub fn with_priority(mut self, priority: i16) -> Self {
        self.priority = priority;
        self
    }
    pub fn with_run_at(mut self, at: DateTime<Utc>) -> Self {
        self.run_at = Some(at);
        self
    }
    pub fn with_delay(mut self, delay: std::time::Duration) -> Self {
        self.delay = Some(delay);
        self
    }
    pub fn with_max_attempts(mut self, n: i32) -> Self {
        self.max_attempts = Some(n);
        self
    }
    pub fn with_dead_key_policy(mut self, policy: DeadKeyPolicy) -> Self {
        self.dead_key_policy = policy;
        self
    }
}

/// The authority a worker holds over one claimed job: every later write carries it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fence {
    pub job: JobId,
    pub owner: OwnerId,
    pub generation: Generation,
}

/// A job as handed to a worker by a claim.
#[derive(Clone, Debug)]
pub struct ClaimedJob {
    pub id: JobId,
    pub queue: String,
    pub kind: String,
    pub key: Option<String>,
    pub key_seq: Option<i64>,
    pub priority: i16,
    pub payload: serde_json::Value,
    /// Set when the stored payload could not be decoded (`payload` is then null): the
    /// scheduler makes such a job dead at once with this reason, never its batch.
    pub payload_error: Option<String>,
    pub payload_bytes: i32,
    pub attempt: i32,
    pub max_attempts: i32,
    pub generation: Generation,
    pub owner: OwnerId,
    pub lease_until: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub claimed_at: DateTime<Utc>,
}

impl ClaimedJob {
    /// A fencing token that only grows across every attempt of every job of this job's
    /// key (see [`crate::JobContext::fencing_token`]): `key_seq` in the high 32 bits,
    /// the generation in the low 32; an unkeyed job's token is its generation.
    pub fn fencing_token(&self) -> u64 {
        let generation = self.generation.0 as u64 & 0xffff_ffff;
        match self.key_seq {
            Some(seq) => ((seq as u64) << 32) | generation,
            None => generation,
        }
    }

    pub fn fence(&self) -> Fence {
        Fence {
            job: self.id,
            owner: self.owner.clone(),
            generation: self.generation,
        }
    }
}

/// A job row as an operator sees it.
#[derive(Clone, Debug, Serialize)]
pub struct JobRecord {
    pub id: JobId,
    pub queue: String,
    pub kind: String,
    pub key: Option<String>,
    pub key_seq: Option<i64>,
    pub priority: i16,
    pub state: JobState,
    pub payload: serde_json::Value,
    /// Set when the stored payload or result could not be decoded (shown as null).
    pub payload_error: Option<String>,
    pub result: Option<serde_json::Value>,
    pub attempts: i32,
    pub max_attempts: i32,
    pub generation: Generation,
    pub owner: Option<String>,
    pub lease_until: Option<DateTime<Utc>>,
    pub available_at: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    /// When an operator asked to cancel this job while it ran (it ends cancelled unless
    /// that attempt completes).
    pub cancel_requested_at: Option<DateTime<Utc>>,
}

/// One line of a job's history.
#[derive(Clone, Debug, Serialize)]
pub struct JobEvent {
    pub job: JobId,
    pub generation: Generation,
    pub event: String,
    pub owner: Option<String>,
    pub at: DateTime<Utc>,
    pub detail: Option<String>,
}

/// Result of a fenced completion.
#[derive(Clone, Debug, PartialEq)]
pub enum CompleteOutcome {
    /// This call moved the job to done.
    Completed,
    /// An earlier call by the same owner and generation already completed it (its reply
    /// was lost); the stored result is returned and nothing was written.
    AlreadyCompleted { result: Option<serde_json::Value> },
    /// The worker no longer owns this generation: nothing was written.
    Stale,
}

/// Result of a fenced failure.
#[derive(Clone, Debug, PartialEq)]
pub enum FailOutcome {
    /// Back to pending, claimable again from `available_at` (database clock).
    Retrying { available_at: DateTime<Utc> },
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
    Applied,
    Stale,
}
