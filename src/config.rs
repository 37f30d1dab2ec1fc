//! Configuration, in code: one struct, every field with its unit and default.
//!
//! Durations that come from text (environment, files) accept humantime strings such as
//! `"30s"` or `"1h 30m"` through [`Config::set`]. [`Config::validate`] runs at start and
//! names the field it refuses.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::store::{Backoff, StoreOptions};

pub const DEFAULT_SCHEMA: &str = "leasehold";
pub const DEFAULT_QUEUE: &str = "default";
pub const DEFAULT_CONCURRENCY: usize = 16;
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
pub const DEFAULT_RENEW_INTERVAL: Duration = Duration::from_secs(10);
pub const DEFAULT_POLL_MIN: Duration = Duration::from_millis(50);
pub const DEFAULT_POLL_MAX: Duration = Duration::from_secs(2);
pub const DEFAULT_CLAIM_BATCH_MAX: usize = 100;
pub const DEFAULT_CLAIM_AHEAD: usize = 32;
pub const DEFAULT_INFLIGHT_BYTES: usize = 64 * 1024 * 1024;
pub const DEFAULT_MAX_RUN_TIME: Duration = Duration::from_secs(30 * 60);
pub const DEFAULT_REAPER_INTERVAL: Duration = Duration::from_secs(5);
pub const DEFAULT_REAPER_BATCH: i64 = 1000;
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
pub const DEFAULT_EFFECT_KEEP: Duration = Duration::from_secs(30 * 24 * 3600);
pub const DEFAULT_SEQUENCER_IDLE: Duration = Duration::from_secs(5);
pub const DEFAULT_MAILBOX_CAPACITY: usize = 4096;
pub const DEFAULT_COMPLETION_BATCH: usize = 128;
pub const DEFAULT_COMPLETION_FLUSH: Duration = Duration::from_millis(2);
/// The longest duration any field accepts (100 years): deadlines are computed on the
/// monotonic clock and as PostgreSQL intervals, and both overflow far beyond it.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// How failed attempts are retried.
#[derive(Clone, Debug, PartialEq)]
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
#[derive(Clone, Debug)]
pub struct Config {
    /// PostgreSQL schema holding leasehold's tables. Default `leasehold`.
    pub schema: String,
    /// Queues this scheduler claims from. Default `["default"]`.
    pub queues: Vec<String>,
    /// Handlers run at once by this scheduler (keyed and unkeyed). An unkeyed job's slot
    /// is free again when its handler returns; its completion is then written by the
    /// batcher, and at most `max(concurrency, completion_batch)` jobs wait for that write
    /// before claims pause. Default 16.
    pub concurrency: usize,
    /// Lease taken at claim and on each renewal. Default 30 s.
    pub lease: Duration,
    /// How often running leases are renewed; at most `lease / 3`. Default 10 s.
    pub renew_interval: Duration,
    /// Polling interval right after work was found. Default 50 ms.
    pub poll_interval_min: Duration,
    /// Polling backs off (doubling on empty claims) up to this. Default 2 s. NOTIFY wakes
    /// the claimer earlier; this bound is what holds when a notification is lost.
    pub poll_interval_max: Duration,
    /// Most jobs claimed per statement. Default 100.
    pub claim_batch_max: usize,
    /// Jobs claimed beyond the free slots, to wait in this process for the next one: a
    /// handler that returns starts the next job at once, with no round trip, and claims
    /// come in batches even at concurrency 1. They are leased and renewed from their
    /// claim, count against `inflight_byte_budget`, are released at once on shutdown
    /// and given back if they wait a lease. The cost: a process that dies holds them
    /// until their leases expire, and other processes cannot run them meanwhile. 0 turns
    /// it off. Default 32.
    pub claim_ahead: usize,
    /// Payload bytes this scheduler holds at once, at most (the first job of a claim is
    /// always taken). Default 64 MiB.
    pub inflight_byte_budget: usize,
    /// Retry policy for failures and expired leases.
    pub retry: RetryPolicy,
    /// An attempt running longer fails with a timeout. Default 30 min.
    pub max_run_time: Duration,
    /// How often the reaper looks for expired leases. Default 5 s.
    pub reaper_interval: Duration,
    /// Most leases reaped per statement. Default 1000.
    pub reaper_batch: i64,
    /// On shutdown, in-flight jobs get this long to finish before being cancelled and
    /// released. Default 10 s.
    pub shutdown_grace: Duration,
    /// Listen for NOTIFY wake-ups (a hint; polling stays the truth). Default true.
    pub listen: bool,
    /// How long the effect ledger keeps an outcome; must exceed the longest retry window.
    /// Default 30 days.
    pub effect_keep: Duration,
    /// A key's sequencer stops after this long without work. Default 5 s.
    pub sequencer_idle: Duration,
    /// Mailbox capacity of each actor; a send past it is counted as an overflow (and
    /// still delivered: leasehold never drops a message). Default 4096.
    pub mailbox_capacity: usize,
    /// Completions written per statement by the completion batcher, at most. Default 128.
    pub completion_batch: usize,
    /// The batcher writes at once when idle and batches what arrives while a write is in
    /// flight; a completion waits at most this long for a slow write before a second
    /// batch starts alongside it. Default 2 ms.
    pub completion_flush: Duration,
    /// Delete terminal jobs older than this (checked by the reaper). Default None: keep.
    pub retention: Option<Duration>,
    /// Store limits: payload cap (default 256 KiB) and history detail.
    pub store: StoreOptions,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            schema: DEFAULT_SCHEMA.into(),
            queues: vec![DEFAULT_QUEUE.into()],
            concurrency: DEFAULT_CONCURRENCY,
            lease: DEFAULT_LEASE,
            renew_interval: DEFAULT_RENEW_INTERVAL,
            poll_interval_min: DEFAULT_POLL_MIN,
            poll_interval_max: DEFAULT_POLL_MAX,
            claim_batch_max: DEFAULT_CLAIM_BATCH_MAX,
            claim_ahead: DEFAULT_CLAIM_AHEAD,
            inflight_byte_budget: DEFAULT_INFLIGHT_BYTES,
            retry: RetryPolicy::default(),
            max_run_time: DEFAULT_MAX_RUN_TIME,
            reaper_interval: DEFAULT_REAPER_INTERVAL,
            reaper_batch: DEFAULT_REAPER_BATCH,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            listen: true,
            effect_keep: DEFAULT_EFFECT_KEEP,
            sequencer_idle: DEFAULT_SEQUENCER_IDLE,
            mailbox_capacity: DEFAULT_MAILBOX_CAPACITY,
            completion_batch: DEFAULT_COMPLETION_BATCH,
            completion_flush: DEFAULT_COMPLETION_FLUSH,
            retention: None,
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
        if self.sequencer_idle.is_zero() {
            return Err(refuse("sequencer_idle", "must be positive"));
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
        Ok(())
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

    /// Set one field from text, as read from an environment variable or a file.
    /// Durations are humantime strings ("30s", "1h 30m"); lists are comma-separated.
    pub fn set(&mut self, field: &str, value: &str) -> Result<()> {
        let dur = |f: &'static str| {
            humantime::parse_duration(value.trim())
                .map_err(|e| refuse(f, format!("{value:?}: {e}")))
        };
        let num = |f: &'static str| {
            value
                .trim()
                .parse::<usize>()
                .map_err(|e| refuse(f, format!("{value:?}: {e}")))
        };
        match field {
            "schema" => self.schema = value.trim().to_string(),
            "queues" => self.queues = value.split(',').map(|q| q.trim().to_string()).collect(),
            "concurrency" => self.concurrency = num("concurrency")?,
            "lease" => self.lease = dur("lease")?,
            "renew_interval" => self.renew_interval = dur("renew_interval")?,
            "poll_interval_min" => self.poll_interval_min = dur("poll_interval_min")?,
            "poll_interval_max" => self.poll_interval_max = dur("poll_interval_max")?,
            "claim_batch_max" => self.claim_batch_max = num("claim_batch_max")?,
            "claim_ahead" => self.claim_ahead = num("claim_ahead")?,
            "inflight_byte_budget" => self.inflight_byte_budget = num("inflight_byte_budget")?,
            "max_attempts" => self.retry.max_attempts = num("max_attempts")? as i32,
            "backoff_base" => self.retry.backoff.base = dur("backoff_base")?,
            "backoff_cap" => self.retry.backoff.cap = dur("backoff_cap")?,
            "max_run_time" => self.max_run_time = dur("max_run_time")?,
            "reaper_interval" => self.reaper_interval = dur("reaper_interval")?,
            "shutdown_grace" => self.shutdown_grace = dur("shutdown_grace")?,
            "effect_keep" => self.effect_keep = dur("effect_keep")?,
            "retention" => self.retention = Some(dur("retention")?),
            _ => return Err(refuse("config", format!("unknown field {field:?}"))),
        }
        Ok(())
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
    fn effect_ledger_shorter_than_the_retry_window_is_refused() {
        let mut c = Config::default();
        c.effect_keep = Duration::from_secs(60);
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("effect_keep"));
    }
}
