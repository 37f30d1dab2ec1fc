//! The one error type of leasehold.
//!
//! Errors are for things that went wrong (a database failure, bad input, a refused
//! config). A lost fence is not an error: store writes return outcome enums
//! ([`crate::CompleteOutcome`], [`crate::FailOutcome`], ...) whose `Stale` variant says
//! "you no longer own this job".

use crate::job::{JobId, JobState};

/// Everything that can go wrong in leasehold.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The database refused or failed a statement (includes a dropped connection). See
    /// [`Error::is_transient`] for whether trying again may help.
    #[error("database error: {0}")]
    Database(#[source] sqlx::Error),

    /// The serialized payload is larger than the configured cap; nothing was written.
    /// Store large data elsewhere and enqueue a reference to it, or raise the cap.
    #[error("payload of {size} bytes exceeds the limit of {limit} bytes; nothing was enqueued")]
    PayloadTooLarge {
        /// Bytes of the payload's JSON encoding.
        size: usize,
        /// The cap: [`StoreOptions::max_payload_bytes`](crate::StoreOptions::max_payload_bytes).
        limit: usize,
    },

    /// The payload could not be turned into JSON, contains a NUL (which PostgreSQL's
    /// jsonb cannot store), or is nested deeper than
    /// [`MAX_PAYLOAD_DEPTH`](crate::store::MAX_PAYLOAD_DEPTH) levels (which no reader
    /// could read back); nothing was written.
    #[error("payload cannot be stored: {0}; nothing was enqueued")]
    InvalidPayload(String),

    /// A value that cannot be stored, or could not be read back, refused with nothing
    /// written: a queue, kind, key, unique key or effect key that is empty or contains
    /// NUL; text too long for an index entry (see
    /// [`INDEXED_TEXT_ALWAYS_FITS`](crate::store::INDEXED_TEXT_ALWAYS_FITS));
    /// `max_attempts` below 1; a run-at time or delay out of range; a queue the
    /// scheduler does not serve; a result, progress or effect outcome with a NUL, nested
    /// deeper than [`MAX_PAYLOAD_DEPTH`](crate::store::MAX_PAYLOAD_DEPTH) levels, or
    /// over its size limit. Inside the caller's transaction, it is left usable (see
    /// [`Store::enqueue_in`](crate::Store::enqueue_in)).
    #[error("invalid {field}: {reason}")]
    InvalidInput {
        /// The field refused: `queue`, `kind`, `key`, `unique key`, `max_attempts`,
        /// `run_at`, `delay`, `result`, `progress`, `effect key`, `effect outcome`, ...
        field: &'static str,
        /// Why, in words.
        reason: String,
    },

    /// The schema name is not a plain identifier.
    #[error("invalid schema name {0:?}: use 1-63 characters of a-z, 0-9 and _, not starting with a digit")]
    InvalidSchema(String),

    /// A job was enqueued through a scheduler that has no handler for its kind (a typo,
    /// or a kind other processes run: enqueue those through [`crate::Store::enqueue`]).
    #[error("unknown job kind {0:?}: no handler is registered for it")]
    UnknownKind(String),

    /// The configuration was refused (by [`Config::validate`](crate::Config::validate),
    /// [`Config::set`](crate::Config::set) or at start); fix the field and start again.
    #[error("invalid config: {field}: {reason}")]
    Config {
        /// The field refused, dotted for nested ones (`retry.backoff`); `config` when
        /// [`Config::set`](crate::Config::set) refused a name or value (the reason
        /// names the field then); `handlers`, `handler_threads` or `scheduler` when a
        /// start failed.
        field: &'static str,
        /// Why, in words.
        reason: String,
    },

    /// An admin action named a job that does not exist.
    #[error("job {0} does not exist")]
    JobNotFound(JobId),

    /// An admin action that the job's current state does not allow (hold a job that is
    /// not pending, retry one that is not dead, ...); nothing was changed.
    #[error("job {id} is {state}; cannot {action}")]
    InvalidTransition {
        /// The job.
        id: JobId,
        /// Its state when the action was refused.
        state: JobState,
        /// The action refused: `hold`, `release a hold`, `cancel` or `retry`.
        action: &'static str,
    },

    /// A migration failed; the schema is left as it was before the call (the missing
    /// versions are applied in one transaction).
    #[error("migration {version} failed: {source}")]
    Migration {
        /// The schema version whose migration failed.
        version: i32,
        /// The database's error.
        source: sqlx::Error,
    },

    /// The schema is older than this build and the connected role may not migrate it
    /// (PostgreSQL refused with permission denied: a runtime role, which has no CREATE
    /// on the database or the schema). Nothing was changed. Run `leasehold migrate` (or
    /// [`Store::migrate`](crate::Store::migrate)) as the schema's owner, then start
    /// again. A schema newer than the build (a rolling deploy) is not an error.
    #[error(
        "schema {schema:?} is at version {found} and this build needs version {needed}, but this role may not migrate it ({source}); run `leasehold migrate` (or `Store::migrate`) as the schema's owner, then start again"
    )]
    SchemaOutdated {
        /// The schema's name.
        schema: String,
        /// The newest version applied to it; 0 when it has none (or does not exist).
        found: i32,
        /// The newest version this build knows ([`SCHEMA_VERSION`](crate::store::SCHEMA_VERSION)).
        needed: i32,
        /// The database's refusal.
        source: sqlx::Error,
    },

    /// An effect key was reused with a different request; nothing was done. A handler
    /// sees it as a permanent [`JobError`](crate::JobError): its step name or request is
    /// not stable across attempts, a bug no retry can fix.
    #[error(
        "effect key {key:?} was recorded for a different request; refusing to replay or repeat it"
    )]
    FingerprintMismatch {
        /// The effect key.
        key: String,
    },

    /// The scheduler has stopped, or is stopping, and takes no more work. A job to
    /// enqueue now can still go in through [`crate::Store::enqueue`].
    #[error("the scheduler is shutting down")]
    ShuttingDown,

    /// A batched write (the completion batcher's) failed, reported to each write of the
    /// batch. `transient`: the cause may pass (a lost connection, a busy pool, a
    /// deadlock), so the write is worth trying again; otherwise the database refused
    /// the statement itself.
    #[error("the batched write failed: {reason}")]
    Batch {
        /// The database's error, as text (shared by every write of the batch).
        reason: String,
        /// True when the cause may pass and the write is worth trying again.
        transient: bool,
    },

    /// A stored value could not be decoded (a corrupted row, or a bug).
    #[error("cannot decode {what}: {reason}")]
    Decode {
        /// What could not be decoded (`job state`, say).
        what: &'static str,
        /// Why.
        reason: String,
    },
}

/// `Result` with leasehold's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<sqlx::Error> for Error {
    /// A database error, except the store's refusal of an untold transaction pooler,
    /// which reaches here through sqlx's error type from the store's executors and is
    /// the configuration error it is.
    fn from(e: sqlx::Error) -> Error {
        match e {
            sqlx::Error::Configuration(inner) => {
                match inner.downcast::<crate::store::pooler::PoolerRefused>() {
                    Ok(refused) => Error::Config {
                        field: crate::store::pooler::POOLER_FIELD,
                        reason: refused.0.into(),
                    },
                    Err(inner) => Error::Database(sqlx::Error::Configuration(inner)),
                }
            }
            e => Error::Database(e),
        }
    }
}

impl Error {
    /// True when the error is a lost or refused connection rather than a refused
    /// statement: the write may or may not have happened, so callers retry idempotently.
    pub fn is_connection(&self) -> bool {
        match self {
            Error::Database(e) => is_connection_error(e),
            Error::Batch { transient, .. } => *transient,
            _ => false,
        }
    }
}

impl Error {
    /// True when the statement gave up waiting for a lock (`lock_timeout`): another
    /// session holds a row it needs, so trying again later may succeed.
    pub fn is_lock_wait(&self) -> bool {
        matches!(self, Error::Database(sqlx::Error::Database(db)) if db.code().as_deref() == Some("55P03"))
    }

    /// True when trying the same statement again may succeed: a lost connection, a
    /// deadlock or serialization failure, a lock or statement timeout.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Database(sqlx::Error::Database(db)) => {
                matches!(
                    db.code().as_deref(),
                    Some("40001" | "40P01" | "55P03" | "57014")
                ) || self.is_connection()
            }
            _ => self.is_connection(),
        }
    }
}

pub(crate) fn is_connection_error(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_)
        | sqlx::Error::Tls(_) => true,
        sqlx::Error::Database(db) => {
            // admin_shutdown, crash_shutdown, cannot_connect_now, and idle/terminated sessions.
            matches!(
                db.code().as_deref(),
                Some("57P01" | "57P02" | "57P03" | "08000" | "08003" | "08006")
            )
        }
        _ => false,
    }
}
