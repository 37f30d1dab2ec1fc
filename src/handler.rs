//! Handlers: one per job kind, with a typed payload.
//!
//! A handler returns `Ok(output)` (stored as the job's result) or a [`JobError`]:
//! retryable by default, or permanent (dead at once). A panic fails the attempt with
//! the panic message. Payloads are decoded here; one that does not decode is a
//! permanent failure with a clear reason, never a crash loop.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::context::JobContext;

/// Runs jobs of one kind.
///
/// ```
/// use leasehold::{Handler, JobContext, JobError};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// struct Email {
///     to: String,
///     subject: String,
/// }
///
/// struct SendEmail;
///
/// impl Handler for SendEmail {
///     type Payload = Email;
///     type Output = ();
///     const KIND: &'static str = "send_email";
///
///     async fn run(&self, ctx: JobContext, email: Email) -> Result<(), JobError> {
///         if email.to.is_empty() {
///             return Err(JobError::permanent("no recipient")); // dead at once
///         }
///         ctx.once("send", &email, |key| async move {
///             let _ = key; // pass it to the mail service as its idempotency key
///             Ok(())
///         })
///         .await
///     }
/// }
/// ```
pub trait Handler: Send + Sync + 'static {
    /// The job's arguments: serialized at enqueue, decoded from the stored JSON before
    /// each attempt. One that does not decode makes the job dead at once, with the
    /// reason. Keep it compatible with jobs already queued when you change it.
    type Payload: DeserializeOwned + Serialize + Send + 'static;
    /// What a successful attempt returns; stored as the job's result (JSON, at most
    /// [`StoreOptions::max_result_bytes`](crate::StoreOptions::max_result_bytes)).
    type Output: Serialize + Send + 'static;
    /// The kind name stored with each job. Changing it orphans queued jobs.
    const KIND: &'static str;
    /// How many times one job of this kind may [snooze](JobError::snooze) without
    /// spending an attempt. Default 100.
    const MAX_SNOOZES: u32 = 100;

    /// This kind's attempts, retry delays, run time and priority, where they differ
    /// from the scheduler's [`Config`](crate::Config). Default: none differ.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use leasehold::{Handler, JobContext, JobError, KindPolicy, RetryDelay};
    /// struct Webhook;
    /// impl Handler for Webhook {
    ///     type Payload = String;
    ///     type Output = ();
    ///     const KIND: &'static str = "webhook";
    ///     fn policy() -> KindPolicy {
    ///         KindPolicy {
    ///             max_attempts: Some(8),
    ///             // 10 s, 1 min, 10 min, then every hour.
    ///             retry_delay: Some(RetryDelay::Table(vec![
    ///                 Duration::from_secs(10),
    ///                 Duration::from_secs(60),
    ///                 Duration::from_secs(600),
    ///                 Duration::from_secs(3600),
    ///             ])),
    ///             max_run_time: Some(Duration::from_secs(30)),
    ///             priority: None,
    ///         }
    ///     }
    ///     async fn run(&self, _: JobContext, url: String) -> Result<(), JobError> {
    /// #       let _ = url;
    ///         Ok(())
    ///     }
    /// }
    /// ```
    fn policy() -> KindPolicy {
        KindPolicy::default()
    }

    /// Run one attempt. `Ok` completes the job with the output as its result; an
    /// error fails the attempt (retried with backoff, or dead when permanent or the
    /// last). The same job may run again after a crash or a lost lease: put each
    /// external effect under [`JobContext::once`], and stop when
    /// [`JobContext::cancelled`] resolves.
    fn run(
        &self,
        ctx: JobContext,
        payload: Self::Payload,
    ) -> impl Future<Output = Result<Self::Output, JobError>> + Send;
}

/// A job kind's own policies ([`Handler::policy`]); `None` falls back to the
/// scheduler's [`Config`](crate::Config).
///
/// `max_attempts` and `priority` are applied to every job of the kind that a
/// [`Scheduler`](crate::Scheduler) registering the kind enqueues, unless the job sets
/// its own (`NewJob::priority` of `None`; an explicit `Some(0)` is its own): through the handle, its
/// [`Scheduler::store`](crate::Scheduler::store), its periodic schedules, and its
/// handlers' follow-ups ([`JobContext::enqueue`](crate::JobContext::enqueue)). A
/// producer enqueueing through a bare [`Store`](crate::Store) of its own gets the
/// store's defaults. An operator's retry of a dead job keeps the attempts and priority
/// the job was enqueued with, from a fresh attempt count. `retry_delay` and
/// `max_run_time` apply in every process that runs the kind. A lease that expires
/// (a crashed process) is retried with `Config::retry`, since the reaper may run
/// where the kind is not registered.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KindPolicy {
    /// Attempts before a job of this kind is dead.
    pub max_attempts: Option<i32>,
    /// How long a failed attempt waits before its retry.
    pub retry_delay: Option<RetryDelay>,
    /// An attempt running longer fails with a timeout.
    pub max_run_time: Option<Duration>,
    /// The priority of this kind's jobs (lower runs first).
    pub priority: Option<i16>,
}

/// How long a failed attempt of a kind waits before its retry. An error with its own
/// delay ([`JobError::retry_after`]) overrides it.
#[derive(Clone, Debug, PartialEq)]
pub enum RetryDelay {
    /// Exponential with jitter, as [`Config::retry`](crate::Config::retry)'s backoff.
    Exponential(crate::Backoff),
    /// The same wait after every failure.
    Fixed(Duration),
    /// The wait after the first, second, ... failure; the last entry repeats.
    Table(Vec<Duration>),
}

impl RetryDelay {
    /// The longest wait this policy can give (for the effect ledger's retention check).
    pub(crate) fn longest(&self) -> Duration {
        match self {
            RetryDelay::Exponential(b) => b.cap,
            RetryDelay::Fixed(d) => *d,
            RetryDelay::Table(t) => t.iter().copied().max().unwrap_or_default(),
        }
    }

    /// The wait after failed attempt number `attempt` (1-based), when it is not the
    /// exponential backoff the store computes.
    pub(crate) fn fixed_wait(&self, attempt: i32) -> Option<Duration> {
        match self {
            RetryDelay::Exponential(_) => None,
            RetryDelay::Fixed(d) => Some(*d),
            RetryDelay::Table(t) => {
                let i = usize::try_from(attempt.max(1) - 1).unwrap_or(0);
                t.get(i).or(t.last()).copied()
            }
        }
    }
}

/// Why an attempt did not complete: a failure (retried or dead), or a snooze ("not yet").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobError {
    message: String,
    permanent: bool,
    retry_after: Option<Duration>,
    snooze: Option<Duration>,
}

impl JobError {
    /// A failure worth retrying (with backoff, until max attempts).
    pub fn retry(message: impl fmt::Display) -> Self {
        JobError {
            message: message.to_string(),
            permanent: false,
            retry_after: None,
            snooze: None,
        }
    }

    /// A failure no retry can fix: the job is dead at once.
    pub fn permanent(message: impl fmt::Display) -> Self {
        JobError {
            permanent: true,
            ..JobError::retry(message)
        }
    }

    /// A failure worth retrying after `delay` rather than after the backoff: a 429 or
    /// 503 with a `Retry-After` header, a rate limit's reset time. It spends an attempt
    /// like any failure (the last one makes the job dead); the delay is capped at
    /// [`MAX_DELAY`](crate::store::MAX_DELAY).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use leasehold::JobError;
    /// // The provider said `429 Too Many Requests`, `Retry-After: 30`.
    /// let e = JobError::retry_after("rate limited by the provider", Duration::from_secs(30));
    /// assert_eq!(e.retry_delay(), Some(Duration::from_secs(30)));
    /// ```
    pub fn retry_after(message: impl fmt::Display, delay: Duration) -> Self {
        JobError {
            retry_after: Some(delay),
            ..JobError::retry(message)
        }
    }

    /// Not yet: run the job again after `delay` without spending an attempt (an
    /// upstream is not ready, a business hour has not come). A keyed job stays at its
    /// key's head, so the key's later jobs wait behind it. Each job may snooze at most
    /// [`Handler::MAX_SNOOZES`] times; past that a snooze counts as a failed attempt, so
    /// a handler that always snoozes still ends (dead after its attempts). Counted in the
    /// metrics as the outcome `snoozed`; the delay is capped at
    /// [`MAX_DELAY`](crate::store::MAX_DELAY).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use leasehold::JobError;
    /// let e = JobError::snooze(Duration::from_secs(60));
    /// assert_eq!(e.snooze_delay(), Some(Duration::from_secs(60)));
    /// ```
    pub fn snooze(delay: Duration) -> Self {
        JobError {
            snooze: Some(delay),
            ..JobError::retry(format!("snoozed for {}", humantime::format_duration(delay)))
        }
    }

    /// The reason, as stored in the job's `last_error` and history.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// True when no retry can fix it: the job is dead at once.
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }

    /// The delay a [`JobError::retry_after`] asked for, instead of the backoff.
    pub fn retry_delay(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The delay of a [`JobError::snooze`]; `None` for a failure.
    pub fn snooze_delay(&self) -> Option<Duration> {
        self.snooze
    }
}

impl fmt::Display for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Any error converts into a retryable `JobError`, so handlers can use `?`.
impl<E: std::error::Error + Send + Sync + 'static> From<E> for JobError {
    fn from(e: E) -> Self {
        JobError::retry(e)
    }
}

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A handler with its payload type erased, so handlers of many kinds share one map.
pub(crate) trait ErasedHandler: Send + Sync {
    fn call(
        &self,
        ctx: JobContext,
        payload: serde_json::Value,
    ) -> BoxFuture<Result<serde_json::Value, AttemptError>>;

    /// [`Handler::MAX_SNOOZES`] of the kind.
    fn max_snoozes(&self) -> u32;

    /// [`Handler::policy`] of the kind.
    fn policy(&self) -> &KindPolicy;
}

/// How an attempt ended when it did not succeed (before the executor adds panics and
/// timeouts).
#[derive(Debug)]
pub(crate) enum AttemptError {
    Decode(String),
    Job(JobError),
    /// The handler's task found its lease unconfirmed when it first ran (its process
    /// was stopped in between, say): it did not call the handler.
    NotStarted,
}

/// A handler and its kind's policy, read once at registration.
struct Erased<H>(Arc<H>, KindPolicy);

impl<H: Handler> ErasedHandler for Erased<H> {
    fn max_snoozes(&self) -> u32 {
        H::MAX_SNOOZES
    }

    fn policy(&self) -> &KindPolicy {
        &self.1
    }

    fn call(
        &self,
        ctx: JobContext,
        payload: serde_json::Value,
    ) -> BoxFuture<Result<serde_json::Value, AttemptError>> {
        let handler = self.0.clone();
        Box::pin(async move {
            let payload: H::Payload = serde_json::from_value(payload).map_err(|e| {
                AttemptError::Decode(format!("payload does not match kind {:?}: {e}", H::KIND))
            })?;
            let output = handler.run(ctx, payload).await.map_err(AttemptError::Job)?;
            crate::store::to_json(&output).map_err(|e| {
                AttemptError::Job(JobError::permanent(format!(
                    "cannot encode the result: {e}"
                )))
            })
        })
    }
}

/// Kind name → handler.
#[derive(Clone, Default)]
pub(crate) struct Registry {
    handlers: HashMap<String, Arc<dyn ErasedHandler>>,
}

impl Registry {
    pub fn insert<H: Handler>(&mut self, handler: H) {
        self.handlers.insert(
            H::KIND.to_string(),
            Arc::new(Erased(Arc::new(handler), H::policy())),
        );
    }

    pub fn get(&self, kind: &str) -> Option<Arc<dyn ErasedHandler>> {
        self.handlers.get(kind).cloned()
    }

    /// Each kind's policy, for the checks at start and the stores' enqueues.
    pub fn policies(&self) -> Vec<(String, KindPolicy)> {
        self.handlers
            .iter()
            .map(|(k, h)| (k.clone(), h.policy().clone()))
            .collect()
    }

    pub fn kinds(&self) -> Vec<String> {
        let mut k: Vec<String> = self.handlers.keys().cloned().collect();
        k.sort();
        k
    }
}
