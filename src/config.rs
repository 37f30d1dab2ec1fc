//! Configuration, in code: one struct, every field with its unit and default.
//!
//! Durations that come from text (environment, files) accept humantime strings such as
//! `"30s"` or `"1h 30m"` through [`Config::set`]. [`Config::validate`] runs at start and
//! names the field it refuses.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::store::{Backoff, StoreOptions};

/// Default [`Config::schema`]: the PostgreSQL schema `leasehold`.
pub const DEFAULT_SCHEMA: &str = "leasehold";
/// The queue a job goes to when it names none and is enqueued through a [`crate::Store`];
/// also the one queue of a default [`Config::queues`].
pub const DEFAULT_QUEUE: &str = "default";
/// Default [`Config::concurrency`]: 16 handlers at once.
pub const DEFAULT_CONCURRENCY: usize = 16;
/// Default [`Config::lease`]: 30 s.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// Default [`Config::renew_interval`]: 10 s, a third of the default lease.
pub const DEFAULT_RENEW_INTERVAL: Duration = Duration::from_secs(10);
/// Default [`Config::poll_interval_min`]: 50 ms.
pub const DEFAULT_POLL_MIN: Duration = Duration::from_millis(50);
/// Default [`Config::poll_interval_max`]: 2 s.
pub const DEFAULT_POLL_MAX: Duration = Duration::from_secs(2);
/// Default [`Config::claim_batch_max`]: 200 jobs per claim statement. With claim-ahead
/// the claimer mostly tops up its queue of waiting jobs, one statement at a time, so a
/// statement's size bounds how fast a busy scheduler can claim: 200 against 100 gave 6%
/// more no-op jobs per second at concurrency 32 and 17% more at 128, and 7% fewer keyed
/// ones (10,000 keys × 10; interleaved runs, `bench -- --only e2e,keyed`).
pub const DEFAULT_CLAIM_BATCH_MAX: usize = 200;
/// Default [`Config::claim_ahead`]: at most 300 jobs claimed beyond the free slots, so
/// at tens of thousands of jobs per second the waiting jobs cover the time two claim
/// statements take (with 100, the queue ran dry between claims in a quarter of the
/// samples at concurrency 32; 300 gave 9% more no-op jobs per second there and 23% more
/// keyed ones, whose chained successors share this room). The pace
/// ([`DEFAULT_CLAIM_AHEAD_WINDOW`]) keeps slower work to far fewer.
pub const DEFAULT_CLAIM_AHEAD: usize = 300;
/// Default [`Config::claim_ahead_window`]: 100 ms of this scheduler's recent pace.
pub const DEFAULT_CLAIM_AHEAD_WINDOW: Duration = Duration::from_millis(100);
/// Default [`Config::connections`]: 3 connections in the scheduler's own pool.
pub const DEFAULT_CONNECTIONS: u32 = 3;
/// Default [`Config::writer_lock_wait`]: 250 ms. Long enough for the locks the
/// scheduler's own statements take (an enqueue into the key, a promotion: a few
/// milliseconds), short against a lease.
pub const DEFAULT_WRITER_LOCK_WAIT: Duration = Duration::from_millis(250);
/// Default [`Config::inflight_byte_budget`]: 64 MiB of payloads held at once.
pub const DEFAULT_INFLIGHT_BYTES: usize = 64 * 1024 * 1024;
/// Default [`Config::max_run_time`]: 30 min.
pub const DEFAULT_MAX_RUN_TIME: Duration = Duration::from_secs(30 * 60);
/// Default [`Config::reaper_interval`]: 5 s.
pub const DEFAULT_REAPER_INTERVAL: Duration = Duration::from_secs(5);
/// Default [`Config::reaper_batch`]: 1000 expired leases per statement.
pub const DEFAULT_REAPER_BATCH: i64 = 1000;
/// Default [`Config::shutdown_grace`]: 10 s.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// Default [`Config::effect_keep`]: 30 days.
pub const DEFAULT_EFFECT_KEEP: Duration = Duration::from_secs(30 * 24 * 3600);
/// Default [`Config::sequencer_idle`]: 5 s.
pub const DEFAULT_SEQUENCER_IDLE: Duration = Duration::from_secs(5);
/// Default [`Config::mailbox_capacity`]: 4096 messages per actor.
pub const DEFAULT_MAILBOX_CAPACITY: usize = 4096;
/// Default [`Config::completion_batch`]: 128 completions per statement.
pub const DEFAULT_COMPLETION_BATCH: usize = 128;
/// Default [`Config::completion_flush`]: 2 ms.
pub const DEFAULT_COMPLETION_FLUSH: Duration = Duration::from_millis(2);
/// Default [`Config::retention`]: done and cancelled jobs are kept 7 days.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// Default [`Config::metrics_cache`].
pub const DEFAULT_METRICS_CACHE: Duration = Duration::from_secs(5);
/// The longest duration any field accepts (100 years): deadlines are computed on the
/// monotonic clock and as PostgreSQL intervals, and both overflow far beyond it.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// How failed attempts are retried.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryPolicy {
    /// Attempts a job gets unless its `NewJob` says otherwise. Default 25.
    pub max_attempts: i32,
    /// Backoff after a failure or an expired lease (computed by the database).
    /// Default base 1 s, cap 10 min, jitter 0.25.
    pub backoff: Backoff,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: crate::store::DEFAULT_MAX_ATTEMPTS,
            backoff: Backoff::default(),
        }
    }
}

/// Everything a scheduler needs to know. `Config::default()` is a sensible production
/// start; tests shrink the durations.
///
/// It deserializes with serde from any format (TOML, YAML, JSON, the environment
/// through a crate such as `envy` or `config`): every field is optional and defaults as
/// documented, durations are humantime text (`"30s"`, `"1h 30m"`), and an unknown key is
/// an error that names it. [`Config::set`] sets one field (dotted path) from text.
///
/// A service typically reads a file, lets the environment override it, and validates:
///
/// ```
/// use std::time::Duration;
///
/// // Read from a file in practice (`std::fs::read_to_string`); any serde format works.
/// let text = r#"{ "queues": ["payments"], "concurrency": 8, "lease": "1m",
///                 "retry": { "max_attempts": 5, "backoff": { "cap": "5m" } } }"#;
/// let mut config: leasehold::Config = serde_json::from_str(text)
///     .map_err(|e| format!("jobs config: {e}"))?;
/// assert_eq!(config.lease, Duration::from_secs(60));
/// assert_eq!(config.retry.backoff.cap, Duration::from_secs(300));
/// assert_eq!(config.shutdown_grace, Duration::from_secs(10)); // not in the file: default
///
/// // Deployment overrides such as MYAPP_JOBS_CONCURRENCY=32, if any are set. Use a
/// // prefix of your own: every variable under it must name a field.
/// config.set_from_env("MYAPP_JOBS")?;
/// config.validate()?;
///
/// // A misspelt key is refused by name, not ignored.
/// let err = serde_json::from_str::<leasehold::Config>(r#"{ "concurency": 8 }"#).unwrap_err();
/// assert!(err.to_string().contains("concurency"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// PostgreSQL schema holding leasehold's tables. Default `leasehold`.
    pub schema: String,
    /// Queues this scheduler claims from. Default `["default"]`.
    pub queues: Vec<String>,
    /// Handlers run at once by this scheduler (keyed and unkeyed). An unkeyed job's slot
    /// is free again when its handler returns; its completion is then written by the
    /// batcher, and at most `max(concurrency, 3 × completion_batch)` jobs wait for that
    /// write before claims pause (two batches being written, one filling). Default 16.
    pub concurrency: usize,
    /// Queues with a limit of their own: at most this many of the queue's jobs held by
    /// this scheduler at once (running, or claimed and waiting for a slot), so a flooded
    /// queue cannot take the slots the others need. Each named queue must be in
    /// `queues`, its limit between 1 and `concurrency`. A limit is a cap, not a
    /// reservation: what a limited queue does not use (empty, paused, nothing due) goes
    /// to the other queues in the same claim, by priority across all of them. Default:
    /// none.
    pub queue_concurrency: std::collections::BTreeMap<String, usize>,
    /// Lease taken at claim and on each renewal. Default 30 s.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// How often running leases are renewed; at most `lease / 3`. Default 10 s.
    #[serde(with = "humantime_serde")]
    pub renew_interval: Duration,
    /// Polling interval right after work was found. Default 50 ms.
    #[serde(with = "humantime_serde")]
    pub poll_interval_min: Duration,
    /// Polling backs off (doubling on empty claims) up to this. Default 2 s. NOTIFY wakes
    /// the claimer earlier; this bound is what holds when a notification is lost.
    #[serde(with = "humantime_serde")]
    pub poll_interval_max: Duration,
    /// Most jobs claimed per statement. Default 200.
    pub claim_batch_max: usize,
    /// Threads of the scheduler's own that run handlers. `None` (the default): handlers
    /// run on the runtime the scheduler was started from — the host's, so they use its
    /// pools and clients on the runtime that made them; for an actix app that is the one
    /// thread of the arbiter that started it. `Some(n)`: a multi-thread runtime of `n`
    /// threads, so CPU-heavy handlers use every core and never stall the host; a handler
    /// there should open connections from a pool made for it (a pool belongs to the
    /// runtime that opened its connections).
    ///
    /// `Some(0)`: no thread of their own; handlers run on the scheduler's own thread,
    /// beside its actors. It once made short handlers much faster (no-op jobs at
    /// concurrency 1: about 1.7× the jobs per second of the default), when each job was
    /// handed between threads twice; now, in every mode, a handler that returns starts
    /// the next job waiting for a slot itself, on its own thread, and the two run within
    /// a few percent of each other (`bench -- --only e2e`). Its price stays: a handler
    /// that blocks or burns CPU holds up the claims, completions and key order of every
    /// other job of this scheduler (leases are renewed on another thread, so none is
    /// lost), and its use of the host's pools and clients crosses threads: a connection
    /// a handler opens belongs to the scheduler's thread. For the pool given to
    /// `Scheduler::builder` that thread therefore outlives the shutdown, idle, until the
    /// host closes that pool (or the process exits), so the host can go on using it;
    /// connections a handler opens in any other pool or client stop working at shutdown. With any
    /// `Some`, the job's context writes (effect ledger, progress) through a small pool
    /// of the scheduler's own, closed with it. Kept for hosts that want every part of
    /// the scheduler on one thread.
    pub handler_threads: Option<usize>,
    /// Connections of the scheduler's own pool that writes job endings (completions,
    /// failures, releases) and fetches a key's next job. Default 3. Endings that wait for
    /// a row another session holds take turns on all but one of them, so the last one
    /// keeps writing every other ending; with 1 there is no other, and while rows are held
    /// the other endings wait a few 25 ms turns each (about 200 ms with six held rows).
    pub connections: u32,
    /// How long one of those connections waits for a lock before it gives up and tries
    /// again later, holding no connection meanwhile (PostgreSQL's `lock_timeout`). A
    /// key's head cannot complete while a host's open transaction holds its key (its
    /// `enqueue_in`, say); without this bound each such wait held one of the few
    /// writer connections for as long as the host took, and every other job's ending
    /// waited behind it. Shorter: other endings never wait long for a connection; longer:
    /// fewer retries of a head whose key is held. Default 250 ms; at least 1 ms.
    #[serde(with = "humantime_serde")]
    pub writer_lock_wait: Duration,
    /// Jobs claimed beyond the free slots, at most, to wait in this process for the
    /// next one: a handler that returns starts the next job at once, with no round trip,
    /// and claims come in batches even at concurrency 1. They are leased and renewed
    /// from their claim, count against `inflight_byte_budget`, are released at once on
    /// shutdown and given back if they wait a lease. The cost: a process that dies holds
    /// them until their leases expire, and other processes cannot run them meanwhile;
    /// `claim_ahead_window` keeps that to what this process would start soon anyway.
    /// 0 turns it off. Default 300.
    pub claim_ahead: usize,
    /// Claim ahead only what this scheduler starts in this long at its recent pace (jobs
    /// claimed per second, smoothed), up to `claim_ahead`: fast handlers get the whole
    /// `claim_ahead` (at 10,000 jobs/s, 100 ms is 1,000 jobs), slow ones few or none, so
    /// one process does not hoard a queue of slow jobs that another could be running.
    /// A scheduler that has not started anything yet claims none ahead. `None`: always
    /// `claim_ahead`, whatever the pace. Default 100 ms.
    #[serde(with = "humantime_serde::option")]
    pub claim_ahead_window: Option<Duration>,
    /// Payload bytes this scheduler holds at once, at most (the first job of a claim is
    /// always taken). Default 64 MiB.
    pub inflight_byte_budget: usize,
    /// Retry policy for failures and expired leases.
    pub retry: RetryPolicy,
    /// An attempt running longer fails with a timeout. Default 30 min.
    #[serde(with = "humantime_serde")]
    pub max_run_time: Duration,
    /// How often the reaper looks for expired leases. Default 5 s.
    #[serde(with = "humantime_serde")]
    pub reaper_interval: Duration,
    /// Most leases reaped per statement. Default 1000.
    pub reaper_batch: i64,
    /// On shutdown, in-flight jobs get this long to finish before being cancelled and
    /// released. Default 10 s.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Listen for NOTIFY wake-ups (a hint; polling stays the truth). Default true.
    pub listen: bool,
    /// Where the listener connects, when not through the host pool's address: a
    /// `postgres://` URL straight to PostgreSQL. LISTEN needs a session of its own,
    /// which a transaction-mode pooler cannot give, so with
    /// `store.transaction_pooler` the listener uses this URL, and without one there is
    /// no listener: new jobs are found by polling alone (within `poll_interval_max` when
    /// idle), cancel requests reach a running attempt at its next renewal (within
    /// `renew_interval`), and a pause gives back jobs claimed ahead within about a
    /// second (the claim itself never takes a paused queue's jobs). One connection per
    /// scheduler, idle but for notifications. Default none.
    pub listen_url: Option<String>,
    /// How long the effect ledger keeps an outcome; must exceed the longest retry window.
    /// Default 30 days.
    #[serde(with = "humantime_serde")]
    pub effect_keep: Duration,
    /// A key's sequencer stops after this long without work. Default 5 s.
    #[serde(with = "humantime_serde")]
    pub sequencer_idle: Duration,
    /// Mailbox capacity of each actor; a send past it is counted as an overflow (and
    /// still delivered: leasehold never drops a message). Default 4096.
    pub mailbox_capacity: usize,
    /// Completions written per statement by the completion batcher, at most. Default 128.
    pub completion_batch: usize,
    /// The batcher writes at once when idle and batches what arrives while a write is in
    /// flight; a completion waits at most this long for a slow write before a second
    /// batch starts alongside it. Default 2 ms.
    #[serde(with = "humantime_serde")]
    pub completion_flush: Duration,
    /// Delete done and cancelled jobs that finished longer ago than this (checked by the
    /// reaper); dead jobs are kept (the dead-letter queue) until an operator retries or
    /// cancels them. `None` keeps everything. Default 7 days; at least
    /// [`DEFAULT_PRUNE_FLOOR`](crate::store::DEFAULT_PRUNE_FLOOR) (5 minutes: a worker
    /// whose ending's reply was lost reads its job's row back to learn whether its write
    /// committed, so the row must outlive that read).
    #[serde(with = "humantime_serde::option")]
    pub retention: Option<Duration>,
    /// How long a metrics scrape reuses the per-queue gauges read from the database
    /// (feature `prometheus`): every scrape within it, from any clone of the handle or
    /// actix-web worker, is served the same reading, so scrapes cannot load the
    /// database. Zero reads on every scrape. Default 5 s.
    #[serde(with = "humantime_serde")]
    pub metrics_cache: Duration,
    /// Store limits: payload cap (default 256 KiB) and history detail.
    pub store: StoreOptions,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            schema: DEFAULT_SCHEMA.into(),
            queues: vec![DEFAULT_QUEUE.into()],
            queue_concurrency: Default::default(),
            concurrency: DEFAULT_CONCURRENCY,
            lease: DEFAULT_LEASE,
            renew_interval: DEFAULT_RENEW_INTERVAL,
            poll_interval_min: DEFAULT_POLL_MIN,
            poll_interval_max: DEFAULT_POLL_MAX,
            claim_batch_max: DEFAULT_CLAIM_BATCH_MAX,
            claim_ahead: DEFAULT_CLAIM_AHEAD,
            claim_ahead_window: Some(DEFAULT_CLAIM_AHEAD_WINDOW),
            handler_threads: None,
            connections: DEFAULT_CONNECTIONS,
            writer_lock_wait: DEFAULT_WRITER_LOCK_WAIT,
            inflight_byte_budget: DEFAULT_INFLIGHT_BYTES,
            retry: RetryPolicy::default(),
            max_run_time: DEFAULT_MAX_RUN_TIME,
            reaper_interval: DEFAULT_REAPER_INTERVAL,
            reaper_batch: DEFAULT_REAPER_BATCH,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            listen: true,
            listen_url: None,
            effect_keep: DEFAULT_EFFECT_KEEP,
            sequencer_idle: DEFAULT_SEQUENCER_IDLE,
            mailbox_capacity: DEFAULT_MAILBOX_CAPACITY,
            completion_batch: DEFAULT_COMPLETION_BATCH,
            completion_flush: DEFAULT_COMPLETION_FLUSH,
            retention: Some(DEFAULT_RETENTION),
            metrics_cache: DEFAULT_METRICS_CACHE,
            store: StoreOptions::default(),
        }
    }
}

fn refuse(field: &'static str, reason: impl Into<String>) -> Error {
    Error::Config {
        field,
        reason: reason.into(),
    }
}

impl Config {
    /// The store options this config implies: `store`, with the attempts of `retry`.
    /// One source of defaults: a [`crate::Store`] made with [`crate::Store::for_config`]
    /// enqueues with exactly what a scheduler with this config would.
    pub fn store_options(&self) -> StoreOptions {
        let mut options = self.store.clone();
        options.default_max_attempts = self.retry.max_attempts;
        options
    }

    /// Every duration field with its name, for the range check.
    fn durations(&self) -> Vec<(&'static str, Duration)> {
        let mut all = vec![
            ("lease", self.lease),
            ("renew_interval", self.renew_interval),
            ("poll_interval_min", self.poll_interval_min),
            ("poll_interval_max", self.poll_interval_max),
            ("retry.backoff.base", self.retry.backoff.base),
            ("retry.backoff.cap", self.retry.backoff.cap),
            ("max_run_time", self.max_run_time),
            ("reaper_interval", self.reaper_interval),
            ("shutdown_grace", self.shutdown_grace),
            ("effect_keep", self.effect_keep),
            ("sequencer_idle", self.sequencer_idle),
            ("completion_flush", self.completion_flush),
        ];
        if let Some(r) = self.retention {
            all.push(("retention", r));
        }
        all
    }

    /// Check every field; the error names the first one refused.
    pub fn validate(&self) -> Result<()> {
        for (field, d) in self.durations() {
            if d > MAX_DURATION {
                return Err(refuse(
                    field,
                    format!(
                        "{} is longer than the longest duration accepted (100 years)",
                        humantime::format_duration(d)
                    ),
                ));
            }
        }
        crate::store::Schema::new(&self.schema).map_err(|e| refuse("schema", e.to_string()))?;
        if self.queues.is_empty() {
            return Err(refuse("queues", "at least one queue is needed"));
        }
        for q in &self.queues {
            crate::store::check_name("queue", q).map_err(|e| refuse("queues", e.to_string()))?;
        }
        for (q, &n) in &self.queue_concurrency {
            if !self.queues.contains(q) {
                return Err(refuse(
                    "queue_concurrency",
                    format!(
                        "{q:?} is not one of this scheduler's queues {:?}",
                        self.queues
                    ),
                ));
            }
            if n == 0 || n > self.concurrency {
                return Err(refuse(
                    "queue_concurrency",
                    format!(
                        "{q:?}: {n} is not between 1 and concurrency ({})",
                        self.concurrency
                    ),
                ));
            }
        }
        if self.concurrency == 0 {
            return Err(refuse("concurrency", "must be at least 1"));
        }
        if self.lease < Duration::from_millis(100) {
            return Err(refuse("lease", "must be at least 100ms"));
        }
        if self.renew_interval.is_zero() || self.renew_interval > self.lease / 3 {
            return Err(refuse(
                "renew_interval",
                format!(
                    "must be positive and at most lease/3 ({}), got {}",
                    humantime::format_duration(self.lease / 3),
                    humantime::format_duration(self.renew_interval)
                ),
            ));
        }
        if self.poll_interval_min.is_zero() || self.poll_interval_min > self.poll_interval_max {
            return Err(refuse(
                "poll_interval_min",
                "must be positive and at most poll_interval_max",
            ));
        }
        if self.claim_batch_max == 0 {
            return Err(refuse("claim_batch_max", "must be at least 1"));
        }
        if self.inflight_byte_budget == 0 {
            return Err(refuse("inflight_byte_budget", "must be positive"));
        }
        if self.retry.max_attempts < 1 {
            return Err(refuse("retry.max_attempts", "must be at least 1"));
        }
        let b = &self.retry.backoff;
        if b.base.is_zero() || b.cap < b.base {
            return Err(refuse(
                "retry.backoff",
                "base must be positive and cap at least base",
            ));
        }
        if !(0.0..=1.0).contains(&b.jitter) {
            return Err(refuse("retry.backoff.jitter", "must be within 0.0..=1.0"));
        }
        if self.max_run_time.is_zero() {
            return Err(refuse("max_run_time", "must be positive"));
        }
        if self.reaper_interval.is_zero() || self.reaper_batch < 1 {
            return Err(refuse(
                "reaper_interval",
                "interval and batch must be positive",
            ));
        }
        if self.mailbox_capacity == 0 {
            return Err(refuse("mailbox_capacity", "must be at least 1"));
        }
        if self.completion_batch == 0 || self.completion_flush.is_zero() {
            return Err(refuse(
                "completion_batch",
                "batch size and flush interval must be positive",
            ));
        }
        if self.store.max_payload_bytes == 0 || self.store.max_payload_bytes > i32::MAX as usize {
            return Err(refuse(
                "store.max_payload_bytes",
                "must be positive and below 2 GiB",
            ));
        }
        if self.store.max_result_bytes == 0 {
            return Err(refuse("store.max_result_bytes", "must be positive"));
        }
        if self.writer_lock_wait < Duration::from_millis(1) {
            // lock_timeout 0 would mean no bound at all.
            return Err(refuse("writer_lock_wait", "must be at least 1ms"));
        }
        if self.connections == 0 {
            return Err(refuse("connections", "must be at least 1"));
        }
        if self.sequencer_idle.is_zero() {
            return Err(refuse("sequencer_idle", "must be positive"));
        }
        if let Some(keep) = self.retention {
            let floor = crate::store::DEFAULT_PRUNE_FLOOR;
            if keep < floor {
                return Err(refuse(
                    "retention",
                    format!(
                        "must be at least {} (a worker may still read a finished job back), got {}",
                        humantime::format_duration(floor),
                        humantime::format_duration(keep)
                    ),
                ));
            }
        }
        let window = self.longest_retry_window();
        if self.effect_keep < window {
            return Err(refuse(
                "effect_keep",
                format!(
                    "must cover the longest retry window ({}), got {}",
                    humantime::format_duration(window),
                    humantime::format_duration(self.effect_keep)
                ),
            ));
        }
        if let Some(url) = &self.listen_url {
            // sqlx parses any scheme: a MySQL URL would connect to port 5432 regardless.
            if !url.starts_with("postgres://") && !url.starts_with("postgresql://") {
                return Err(refuse(
                    "listen_url",
                    "must be a postgres:// or postgresql:// URL",
                ));
            }
            url.parse::<sqlx::postgres::PgConnectOptions>()
                .map_err(|e| refuse("listen_url", format!("not a PostgreSQL URL: {e}")))?;
        }
        Ok(())
    }

    /// The listener's connect options: `listen_url` when given, else `pooled` (the
    /// host pool's) unless that goes through a transaction pooler; `None`: no listener.
    pub(crate) fn listen_options(
        &self,
        pooled: &sqlx::postgres::PgConnectOptions,
    ) -> Option<sqlx::postgres::PgConnectOptions> {
        if !self.listen {
            return None;
        }
        match &self.listen_url {
            Some(url) => url.parse().ok(),
            None if self.store.transaction_pooler => None,
            None => Some(pooled.clone()),
        }
    }

    /// From the first claim to the last possible attempt's lease: every attempt may hold
    /// a full run time and wait a full backoff. The effect ledger must outlive this.
    pub fn longest_retry_window(&self) -> Duration {
        let b = &self.retry.backoff;
        let mut total = Duration::ZERO;
        for attempt in 0..self.retry.max_attempts.max(1) as u32 {
            let backoff = b.base.saturating_mul(1u32 << attempt.min(30)).min(b.cap);
            total = total
                .saturating_add(backoff)
                .saturating_add(self.max_run_time.max(self.lease));
        }
        total
    }

    /// Set one field from text, as read from an environment variable or a file:
    /// `field` is its name, dotted for nested ones (`"retry.max_attempts"`,
    /// `"store.max_payload_bytes"`); durations are humantime text ("30s", "1h 30m"),
    /// lists comma-separated, `retention` also takes `"off"`. Every field can be set; an
    /// unknown one is refused by name.
    ///
    /// The value is only parsed here; call [`Config::validate`] (or start the
    /// scheduler, which does) to check it against the other fields.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let mut config = leasehold::Config::default();
    /// config.set("lease", "1m 30s")?;
    /// config.set("retry.max_attempts", "5")?;
    /// config.set("queues", "payments, emails")?;
    /// config.set("retention", "off")?;
    /// assert_eq!(config.lease, Duration::from_secs(90));
    /// assert_eq!(config.retry.max_attempts, 5);
    /// assert_eq!(config.queues, ["payments", "emails"]);
    /// assert_eq!(config.retention, None);
    ///
    /// // A misspelt field or a value of the wrong kind is refused, naming the field.
    /// let err = config.set("leese", "30s").unwrap_err();
    /// assert!(err.to_string().contains("leese"));
    /// config.validate()?;
    /// # Ok::<(), leasehold::Error>(())
    /// ```
    pub fn set(&mut self, field: &str, value: &str) -> Result<()> {
        let mut tree = serde_json::to_value(&*self).expect("a config serializes");
        let pointer = format!("/{}", field.trim().replace('.', "/"));
        // A queue's own limit may be set before the queue has one.
        if let Some(queue) = field.trim().strip_prefix("queue_concurrency.") {
            if let Some(map) = tree
                .get_mut("queue_concurrency")
                .and_then(|m| m.as_object_mut())
            {
                map.entry(queue.to_string())
                    .or_insert(serde_json::Value::from(0));
            }
        }
        let slot = tree
            .pointer_mut(&pointer)
            .ok_or_else(|| refuse("config", format!("unknown field {field:?}")))?;
        *slot = text_value(slot, value.trim());
        *self =
            serde_json::from_value(tree).map_err(|e| refuse("config", format!("{field}: {e}")))?;
        Ok(())
    }

    /// Read every `<prefix>_<FIELD>` environment variable (e.g. `LEASEHOLD_LEASE=45s`,
    /// `LEASEHOLD_RETRY__MAX_ATTEMPTS=5`: a double underscore for a dot) into this
    /// config with [`Config::set`]. Returns how many were set.
    ///
    /// Every variable under the prefix must name a field: an unknown one is an error
    /// naming it, so a typo in a deployment fails at start instead of being ignored.
    /// Variables are read in no particular order and the first error stops the reading,
    /// so after an error some fields may already be set; discard the config then.
    ///
    /// The error names the variable as well as the field. Variables whose names are not
    /// Unicode are not ours and are skipped; a value under the prefix that is not
    /// Unicode is an error.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// // As a deployment would set them.
    /// std::env::set_var("MYAPP_JOBS_LEASE", "45s");
    /// std::env::set_var("MYAPP_JOBS_RETRY__MAX_ATTEMPTS", "5");
    /// std::env::set_var("MYAPP_JOBS_QUEUES", "payments,emails");
    ///
    /// let mut config = leasehold::Config::default();
    /// let read = config.set_from_env("MYAPP_JOBS")?;
    /// assert_eq!(read, 3);
    /// assert_eq!(config.lease, Duration::from_secs(45));
    /// assert_eq!(config.retry.max_attempts, 5);
    /// config.validate()?;
    /// # Ok::<(), leasehold::Error>(())
    /// ```
    pub fn set_from_env(&mut self, prefix: &str) -> Result<usize> {
        let lead = format!("{prefix}_");
        let mut n = 0;
        // vars_os: a variable of the host's that is not Unicode is none of ours and
        // must not panic here; one under the prefix is refused by name.
        for (name, value) in std::env::vars_os() {
            let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&lead)) else {
                continue;
            };
            let var = format!("{lead}{rest}");
            let from_var = |e: Error| match e {
                Error::Config { field, reason } => Error::Config {
                    field,
                    reason: format!("{reason} (environment variable {var})"),
                },
                other => other,
            };
            let value = value.to_str().ok_or_else(|| {
                refuse(
                    "config",
                    format!("environment variable {var} is not Unicode"),
                )
            })?;
            let field = rest.to_lowercase().replace("__", ".");
            self.set(&field, value).map_err(from_var)?;
            n += 1;
        }
        Ok(n)
    }
}

/// `text` as the JSON the field's current value suggests: a number or boolean for those,
/// a list for lists, `null` for "off"/"none" where a value may be absent, text otherwise.
fn text_value(current: &serde_json::Value, text: &str) -> serde_json::Value {
    use serde_json::Value;
    match current {
        Value::Number(_) => text
            .parse::<serde_json::Number>()
            .map(Value::Number)
            .unwrap_or_else(|_| Value::String(text.into())),
        Value::Bool(_) => text
            .parse::<bool>()
            .map(Value::Bool)
            .unwrap_or_else(|_| Value::String(text.into())),
        Value::Array(_) => Value::Array(
            text.split(',')
                .map(|t| Value::String(t.trim().into()))
                .collect(),
        ),
        _ if matches!(text, "off" | "none" | "") => Value::Null,
        _ => Value::String(text.into()),
    }
}

/// Durations as humantime text in serde (`"30s"`, `"1h 30m"`); a bare number is seconds.
pub(crate) mod humantime_serde {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Text {
        Text(String),
        Seconds(f64),
    }

    fn parse<E: serde::de::Error>(t: Text) -> Result<Duration, E> {
        match t {
            Text::Text(s) => humantime::parse_duration(s.trim())
                .map_err(|e| E::custom(format!("{s:?} is not a duration: {e}"))),
            Text::Seconds(n) => Duration::try_from_secs_f64(n)
                .map_err(|e| E::custom(format!("{n} seconds is not a duration: {e}"))),
        }
    }

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        parse(Text::deserialize(d)?)
    }

    /// For `Option<Duration>`: `null` is `None`.
    pub mod option {
        use super::*;

        pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
            match d {
                Some(d) => super::serialize(d, s),
                None => s.serialize_none(),
            }
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
            Option::<Text>::deserialize(d)?.map(parse).transpose()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_valid() {
        Config::default().validate().unwrap();
    }

    #[test]
    fn renew_interval_above_a_third_of_the_lease_is_refused_by_name() {
        let mut c = Config::default();
        c.renew_interval = c.lease / 2;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("renew_interval"), "{err}");
    }

    #[test]
    fn humantime_strings_set_durations() {
        let mut c = Config::default();
        c.set("lease", "1m 30s").unwrap();
        assert_eq!(c.lease, Duration::from_secs(90));
        assert!(c
            .set("lease", "soon")
            .unwrap_err()
            .to_string()
            .contains("lease"));
    }

    #[test]
    fn durations_past_the_range_of_deadlines_are_refused_by_name() {
        let years = Duration::from_secs(200 * 365 * 24 * 3600);
        for (field, set) in [
            (
                "lease",
                (|c: &mut Config, d| c.lease = d) as fn(&mut Config, Duration),
            ),
            ("retry.backoff.cap", |c, d| c.retry.backoff.cap = d),
            ("max_run_time", |c, d| c.max_run_time = d),
            ("retention", |c, d| c.retention = Some(d)),
            ("shutdown_grace", |c, d| c.shutdown_grace = d),
        ] {
            let mut c = Config::default();
            set(&mut c, years);
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{field}: {err}");
        }
    }

    #[test]
    fn the_store_options_of_a_config_carry_its_retry_attempts() {
        let mut c = Config::default();
        c.retry.max_attempts = 3;
        assert_eq!(c.store_options().default_max_attempts, 3);
    }

    #[test]
    fn every_field_can_be_set_from_text_by_its_dotted_name() {
        let mut c = Config::default();
        c.set("retry.max_attempts", "5").unwrap();
        c.set("retry.backoff.cap", "2m").unwrap();
        c.set("store.max_result_bytes", "1000").unwrap();
        c.set("queues", "a, b").unwrap();
        c.set("listen", "false").unwrap();
        c.set("retention", "off").unwrap();
        c.set("claim_ahead", "0").unwrap();
        assert_eq!(c.retry.max_attempts, 5);
        assert_eq!(c.retry.backoff.cap, Duration::from_secs(120));
        assert_eq!(c.store.max_result_bytes, 1000);
        assert_eq!(c.queues, vec!["a".to_string(), "b".to_string()]);
        assert!(!c.listen);
        assert_eq!(c.retention, None);
        assert_eq!(c.claim_ahead, 0);
        let err = c.set("leese", "30s").unwrap_err().to_string();
        assert!(err.contains("leese"), "{err}");
        let err = c.set("concurrency", "many").unwrap_err().to_string();
        assert!(err.contains("concurrency"), "{err}");
    }

    /// Environment variables are process-wide and tests run in parallel: this prefix is
    /// used by no other test.
    const SFE: &str = "LEASEHOLD_TEST_SFE";

    fn set_sfe(vars: &[(&str, &str)]) {
        let lead = format!("{SFE}_");
        for (name, _) in std::env::vars() {
            if name.starts_with(&lead) {
                std::env::remove_var(name);
            }
        }
        for (name, value) in vars {
            std::env::set_var(format!("{lead}{name}"), value);
        }
    }

    #[test]
    fn set_from_env_sets_the_fields_under_its_prefix_and_refuses_unknown_or_bad_ones_by_name() {
        set_sfe(&[
            ("LEASE", "45s"),
            ("RETRY__MAX_ATTEMPTS", "5"),
            ("RETRY__BACKOFF__CAP", "2m"),
            ("QUEUES", "a, b"),
            ("LISTEN", "false"),
        ]);
        // Starts like the prefix but is not under it (no underscore after it).
        std::env::set_var(format!("{SFE}X_LEASE"), "1s");
        let mut c = Config::default();
        let read = c.set_from_env(SFE);
        std::env::remove_var(format!("{SFE}X_LEASE"));
        assert_eq!(read.unwrap(), 5);
        assert_eq!(c.lease, Duration::from_secs(45));
        assert_eq!(c.retry.max_attempts, 5);
        assert_eq!(c.retry.backoff.cap, Duration::from_secs(120));
        assert_eq!(c.queues, vec!["a".to_string(), "b".to_string()]);
        assert!(!c.listen);
        assert_eq!(
            c.concurrency, DEFAULT_CONCURRENCY,
            "a field not in the environment"
        );

        set_sfe(&[("LEASE", "45s"), ("LEESE", "30s")]);
        let err = Config::default().set_from_env(SFE).unwrap_err().to_string();
        assert!(err.contains("leese"), "{err}");
        assert!(
            err.contains(&format!("{SFE}_LEESE")),
            "names the variable: {err}"
        );
        assert!(
            err.contains(&format!("{SFE}_LEESE")),
            "names the variable: {err}"
        );

        set_sfe(&[("RETRY__BACKOFF__BASE", "soon")]);
        let err = Config::default().set_from_env(SFE).unwrap_err().to_string();
        assert!(err.contains("retry.backoff.base"), "{err}");

        set_sfe(&[]);
        assert_eq!(Config::default().set_from_env(SFE).unwrap(), 0);
    }

    #[test]
    fn a_config_file_with_an_unknown_key_is_refused_naming_it() {
        let err = serde_json::from_str::<Config>(r#"{ "lease": "10s", "concurency": 4 }"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("concurency"), "{err}");
        let ok: Config = serde_json::from_str(r#"{ "lease": "10s", "retention": null }"#).unwrap();
        assert_eq!((ok.lease, ok.retention), (Duration::from_secs(10), None));
        // What serializes, deserializes back.
        let text = serde_json::to_string(&Config::default()).unwrap();
        let back: Config = serde_json::from_str(&text).unwrap();
        assert_eq!(back.lease, Config::default().lease);
    }

    #[test]
    fn effect_ledger_shorter_than_the_retry_window_is_refused() {
        let c = Config {
            effect_keep: Duration::from_secs(60),
            ..Config::default()
        };
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("effect_keep"));
    }

    #[test]
    fn a_retention_below_the_floor_is_refused_and_the_floor_itself_accepted() {
        let floor = crate::store::DEFAULT_PRUNE_FLOOR;
        let short = Config {
            retention: Some(floor - Duration::from_secs(1)),
            ..Config::default()
        };
        let err = short.validate().unwrap_err().to_string();
        assert!(err.contains("retention") && err.contains("5m"), "{err}");
        let at = Config {
            retention: Some(floor),
            ..Config::default()
        };
        at.validate().unwrap();
    }
}
