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
    /// The database refused or failed a statement (includes a dropped connection).
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),

    /// The serialized payload is larger than the configured cap; nothing was written.
    #[error("payload of {size} bytes exceeds the limit of {limit} bytes; nothing was enqueued")]
    PayloadTooLarge { size: usize, limit: usize },

    /// The payload could not be turned into JSON (or contains a NUL, which PostgreSQL's
    /// jsonb cannot store); nothing was written.
    #[error("payload cannot be stored: {0}; nothing was enqueued")]
    InvalidPayload(String),

    /// A queue, kind or key that PostgreSQL cannot store (empty, or containing NUL).
    #[error("invalid {field}: {reason}")]
    InvalidInput { field: &'static str, reason: String },

    /// The schema name is not a plain identifier.
    #[error("invalid schema name {0:?}: use 1-63 characters of a-z, 0-9 and _, not starting with a digit")]
    InvalidSchema(String),

    /// A job was enqueued through a scheduler that has no handler for its kind.
    #[error("unknown job kind {0:?}: no handler is registered for it")]
    UnknownKind(String),

    /// The configuration was refused at start; `field` names the culprit.
    #[error("invalid config: {field}: {reason}")]
    Config { field: &'static str, reason: String },

    /// An admin action named a job that does not exist.
    #[error("job {0} does not exist")]
    JobNotFound(JobId),

    /// An admin action that the job's current state does not allow.
    #[error("job {id} is {state}; cannot {action}")]
    InvalidTransition {
        id: JobId,
        state: JobState,
        action: &'static str,
    },

    /// A migration failed; the schema is left at the previous version.
    #[error("migration {version} failed: {source}")]
    Migration { version: i32, source: sqlx::Error },

    /// An effect key was reused with a different request; nothing was done.
    #[error(
        "effect key {key:?} was recorded for a different request; refusing to replay or repeat it"
    )]
    FingerprintMismatch { key: String },

    /// The scheduler has stopped, or is stopping, and takes no more work.
    #[error("the scheduler is shutting down")]
    ShuttingDown,

    /// A batched write (the completion batcher's) failed, reported to each write of the
    /// batch. `transient`: the cause may pass (a lost connection, a busy pool, a
    /// deadlock), so the write is worth trying again; otherwise the database refused
    /// the statement itself.
    #[error("the batched write failed: {reason}")]
    Batch { reason: String, transient: bool },

    /// A stored value could not be decoded (a corrupted row, or a bug).
    #[error("cannot decode {what}: {reason}")]
    Decode { what: &'static str, reason: String },
}

/// `Result` with leasehold's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

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
