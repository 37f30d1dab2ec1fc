//! Counters, mailbox gauges, latency histograms and per-(queue, kind) figures, read
//! through [`Metrics::snapshot`] (and exposed to Prometheus by `leasehold::prometheus`).
//!
//! actix 0.13 exposes no mailbox length, so leasehold counts: every send through a
//! metered actor address (the crate's internal `actor::Metered`) adds one to the actor kind's `sent`, every handled
//! message adds one to `handled`; the depth is the difference, and its high-water mark
//! is kept at send time. A send into a full mailbox is counted as an overflow and still
//! delivered.

mod histogram;
mod jobs;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;

pub use histogram::{HistogramSnapshot, LatencySummary};
pub use jobs::{JobSnapshot, Outcome};

use histogram::Histogram;
pub(crate) use jobs::JobMeter;

/// Counts for one actor kind (all sequencers share one meter).
#[derive(Debug, Default)]
pub struct MailboxMeter {
    sent: AtomicU64,
    handled: AtomicU64,
    high_water: AtomicU64,
    handling_nanos: AtomicU64,
    overflows: AtomicU64,
}

impl MailboxMeter {
    pub(crate) fn sent(&self) {
        let sent = self.sent.fetch_add(1, Relaxed) + 1;
        let depth = sent.saturating_sub(self.handled.load(Relaxed));
        self.high_water.fetch_max(depth, Relaxed);
    }

    pub(crate) fn overflowed(&self) {
        self.overflows.fetch_add(1, Relaxed);
    }

    /// Call at the start of a handler; the guard records the handling when dropped.
    pub(crate) fn handling(self: &Arc<Self>) -> HandlingGuard {
        HandlingGuard {
            meter: self.clone(),
            start: Instant::now(),
        }
    }

    /// Messages sent to this actor kind and not yet handled.
    pub fn depth(&self) -> u64 {
        self.sent
            .load(Relaxed)
            .saturating_sub(self.handled.load(Relaxed))
    }

    fn snapshot(&self, actor: &str) -> MailboxSnapshot {
        let handled = self.handled.load(Relaxed);
        let handling_nanos = self.handling_nanos.load(Relaxed);
        MailboxSnapshot {
            actor: actor.to_string(),
            depth: self.depth(),
            high_water: self.high_water.load(Relaxed),
            handled,
            mean_handling: Duration::from_nanos(handling_nanos.checked_div(handled).unwrap_or(0)),
            handling: Duration::from_nanos(handling_nanos),
            overflows: self.overflows.load(Relaxed),
        }
    }
}

pub(crate) struct HandlingGuard {
    meter: Arc<MailboxMeter>,
    start: Instant,
}

impl Drop for HandlingGuard {
    fn drop(&mut self) {
        self.meter
            .handling_nanos
            .fetch_add(self.start.elapsed().as_nanos() as u64, Relaxed);
        self.meter.handled.fetch_add(1, Relaxed);
    }
}

/// One actor kind's mailbox figures.
#[derive(Clone, Debug, PartialEq)]
pub struct MailboxSnapshot {
    /// The actor kind: `claimer`, `completer`, `lease_renewer`, `reaper` or
    /// `sequencer` (all sequencers share one meter).
    pub actor: String,
    /// Messages sent but not yet handled.
    pub depth: u64,
    /// Largest depth seen.
    pub high_water: u64,
    /// Messages handled since start.
    pub handled: u64,
    /// Mean time spent in a handler (not counting futures it spawned).
    pub mean_handling: Duration,
    /// Total time spent in handlers.
    pub handling: Duration,
    /// Sends that found the mailbox at capacity (delivered anyway).
    pub overflows: u64,
}

macro_rules! counters {
    ($($(#[doc = $doc:literal])* $name:ident),* $(,)?) => {
        /// The scheduler's own counters (monotonic since start).
        #[derive(Debug, Default)]
        pub struct Counters { $($(#[doc = $doc])* pub $name: AtomicU64,)* }

        /// A copy of [`Counters`] at one moment.
        #[derive(Clone, Debug, Default, PartialEq, Eq)]
        pub struct CounterSnapshot { $($(#[doc = $doc])* pub $name: u64,)* }

        impl Counters {
            fn snapshot(&self) -> CounterSnapshot {
                CounterSnapshot { $($name: self.$name.load(Relaxed),)* }
            }
        }

        impl CounterSnapshot {
            /// (name, value) pairs, for exporters.
            pub fn pairs(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)*]
            }

            /// (name, doc comment, value) triples: exporters use the doc as help text.
            pub fn described(&self) -> Vec<(&'static str, &'static str, u64)> {
                vec![$((stringify!($name), concat!($($doc),*).trim_start(), self.$name),)*]
            }
        }
    };
}

counters! {
    /// Jobs claimed (by the claimer or a sequencer's fetch-next).
    claimed,
    /// Of `claimed`: jobs claimed ahead of a free slot (`Config::claim_ahead`).
    claimed_ahead,
    /// Of `claimed`: keys' successors claimed by their predecessor's completion while
    /// every slot was busy, into the claim-ahead target's room: one that finds no slot
    /// free by then waits for one as a job claimed ahead does.
    chained_ahead,
    /// Claim statements run.
    claims,
    /// Claim statements that returned nothing.
    empty_claims,
    /// Attempts that completed the job.
    completed,
    /// Completion batches written by the completer (`completed / completion_batches` is
    /// the mean batch size).
    completion_batches,
    /// Attempts that failed and will be retried.
    failed,
    /// Attempts that made the job dead.
    dead,
    /// Jobs enqueued by this scheduler's periodic schedules (one per fire time, across
    /// every process).
    periodic_enqueued,
    /// Attempts that snoozed their job (`JobError::snooze`): pending again after the
    /// delay, no attempt spent.
    snoozed,
    /// Attempts that ended their job cancelled (an operator asked while it ran).
    cancelled,
    /// Completions (and failures) refused because the worker lost its fence.
    stale_completions,
    /// Completions whose reply was lost and found committed on asking again.
    completion_replays,
    /// Completion writes retried after a connection error.
    completion_retries,
    /// Leases lost while their attempt still ran: found gone at renewal, or not
    /// confirmed before the attempt's local deadline (cancellation fired). An attempt
    /// whose ending was being written is not counted.
    leases_lost,
    /// Of `leases_lost`: attempts stopped by their local deadline because no renewal
    /// confirmed the lease in time (the database did not answer, or the row stayed
    /// locked by someone else).
    lease_deadlines,
    /// Lease renewals that extended a lease.
    leases_renewed,
    /// Renewals that skipped a lease because another transaction held its row (never
    /// waited for; retried at the next tick).
    leases_busy,
    /// Renewal statements abandoned after `renew_interval` without an answer (the
    /// renewer then opens a fresh connection).
    renew_timeouts,
    /// Running attempts an operator asked to cancel (told by NOTIFY or renewal).
    cancels_requested,
    /// Handler results refused before they were written (NUL, or over
    /// `store.max_result_bytes`): the attempt failed for good.
    results_refused,
    /// Expired leases this scheduler's reaper took back.
    reaped,
    /// Retention passes this scheduler's reaper ran (each costs what was due).
    prune_passes,
    /// Retention passes skipped because another process was pruning the schema.
    prune_skipped,
    /// Candidate rows retention passes read (jobs and ledger rows found due, fire
    /// records, keys whose jobs were deleted): 0 for a pass with nothing due.
    prune_rows_read,
    /// Rows retention passes deleted (jobs, ledger rows, key rows, fire records).
    prune_rows_deleted,
    /// Retention statements that hit their statement timeout (each tried again with half
    /// the batch).
    prune_timeouts,
    /// Microseconds spent in retention passes.
    prune_micros,
    /// Jobs given back at shutdown.
    released,
    /// Handler panics.
    panics,
    /// Attempts not started because their lease was lost, or not confirmed in time,
    /// while they waited for a slot or for their key.
    not_started,
    /// Attempts that exceeded the maximum run time.
    timeouts,
    /// Payloads that could not be decoded (dead at once).
    decode_failures,
    /// NOTIFY wake-ups received.
    notifications,
    /// LISTEN connection re-established after a drop.
    listener_reconnects,
    /// Database errors seen by actors (each retried or left to the lease).
    db_errors,
    /// Informational writes that failed: the scheduler's heartbeat row (shown in
    /// [`MetricsSnapshot::informational_error`]), and history rows a protocol call went
    /// on without (shown in [`MetricsSnapshot::history_error`]; see
    /// [`HISTORY_RETRY_AFTER`](crate::store::HISTORY_RETRY_AFTER)). Nothing of the
    /// protocol waits on them, so they are only counted and logged once per distinct
    /// error.
    informational_write_failures,
}

/// Shared metrics of one scheduler.
#[derive(Debug, Default)]
pub struct Metrics {
    /// The scheduler's counters, added to by its actors.
    pub counters: Counters,
    mailboxes: DashMap<&'static str, Arc<MailboxMeter>>,
    claim_latency: Histogram,
    start_latency: Histogram,
    /// Per (queue, kind).
    jobs: DashMap<(String, String), Arc<JobMeter>>,
    /// Jobs this scheduler holds now: running, or claimed and queued for their key.
    pub(crate) in_flight: AtomicU64,
    /// Sequencer actors alive now.
    pub(crate) sequencers: AtomicU64,
    /// Claimed jobs waiting in this process for a free slot now.
    pub(crate) ready: AtomicU64,
    /// The latest informational write's error, until one succeeds again.
    informational: std::sync::Mutex<Option<String>>,
    /// The latest history refusal's error, until history is written again.
    history: std::sync::Mutex<Option<String>>,
}

impl crate::store::HistorySink for Metrics {
    fn history(&self, error: Option<&str>) {
        if error.is_some() {
            self.incr(|c| &c.informational_write_failures);
        }
        *self.history.lock().unwrap_or_else(|p| p.into_inner()) = error.map(str::to_string);
    }
}

impl Metrics {
    pub(crate) fn meter(&self, actor: &'static str) -> Arc<MailboxMeter> {
        self.mailboxes.entry(actor).or_default().clone()
    }

    pub(crate) fn incr(&self, counter: impl Fn(&Counters) -> &AtomicU64) {
        counter(&self.counters).fetch_add(1, Relaxed);
    }

    pub(crate) fn add(&self, counter: impl Fn(&Counters) -> &AtomicU64, n: u64) {
        counter(&self.counters).fetch_add(n, Relaxed);
    }

    /// How an informational write (see `informational_write_failures`) went: a failure
    /// is counted, and logged when its text differs from the one before (a database
    /// that refuses every heartbeat logs once, not every pass); a success after failures
    /// is logged once and clears the snapshot's `informational_error`.
    pub(crate) fn informational_write(&self, error: Option<&crate::Error>) {
        let mut last = self.informational.lock().unwrap_or_else(|p| p.into_inner());
        match error {
            Some(e) => {
                self.incr(|c| &c.informational_write_failures);
                let text = e.to_string();
                if last.as_deref() != Some(text.as_str()) {
                    tracing::warn!(error = %text, "leasehold could not write the scheduler's heartbeat (informational: jobs, leases and retention go on)");
                    *last = Some(text);
                }
            }
            None => {
                if last.take().is_some() {
                    tracing::info!("leasehold heartbeat written again");
                }
            }
        }
    }

    pub(crate) fn record_claim(&self, took: Duration) {
        self.claim_latency.record(took);
    }

    /// A first attempt started `waited` after its job became due.
    pub(crate) fn record_start(&self, job: &JobMeter, waited: Duration) {
        self.start_latency.record(waited);
        job.started_after(waited);
    }

    /// The meter of one (queue, kind), made on first use.
    pub(crate) fn job(&self, queue: &str, kind: &str) -> Arc<JobMeter> {
        let key = (queue.to_string(), kind.to_string());
        if let Some(meter) = self.jobs.get(&key) {
            return meter.clone();
        }
        self.jobs.entry(key).or_default().clone()
    }

    /// Every figure at this moment (what [`crate::Scheduler::metrics`] returns).
    pub fn snapshot(&self) -> MetricsSnapshot {
        let mut mailboxes: Vec<MailboxSnapshot> = self
            .mailboxes
            .iter()
            .map(|e| e.value().snapshot(e.key()))
            .collect();
        mailboxes.sort_by(|a, b| a.actor.cmp(&b.actor));
        let mut jobs: Vec<JobSnapshot> = self
            .jobs
            .iter()
            .map(|e| e.value().snapshot(&e.key().0, &e.key().1))
            .collect();
        jobs.sort_by(|a, b| (&a.queue, &a.kind).cmp(&(&b.queue, &b.kind)));
        MetricsSnapshot {
            counters: self.counters.snapshot(),
            mailboxes,
            in_flight: self.in_flight.load(Relaxed),
            sequencers: self.sequencers.load(Relaxed),
            ready: self.ready.load(Relaxed),
            informational_error: self
                .informational
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            history_error: self
                .history
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            claim_latency: self.claim_latency.summary(),
            enqueue_to_start: self.start_latency.summary(),
            claim_histogram: self.claim_latency.snapshot(),
            jobs,
        }
    }
}

/// Everything at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MetricsSnapshot {
    /// The counters, monotonic since the scheduler started.
    pub counters: CounterSnapshot,
    /// Mailbox figures per actor kind, sorted by actor.
    pub mailboxes: Vec<MailboxSnapshot>,
    /// Jobs this scheduler holds now: running, or claimed and queued for their key.
    pub in_flight: u64,
    /// Sequencer actors alive now (one per key with work in this process).
    pub sequencers: u64,
    /// Claimed jobs waiting in this process for a free slot (claimed ahead, or a key's
    /// successor claimed while every slot was busy).
    pub ready: u64,
    /// The latest informational write's error (the scheduler's heartbeat row), while
    /// they fail; `None` when the latest succeeded. Jobs, leases and retention never wait
    /// on these writes.
    pub informational_error: Option<String>,
    /// The latest refusal of the history table (`job_events`), while it lasts: the
    /// calls that met it went on without their history rows, and history is tried again
    /// every [`HISTORY_RETRY_AFTER`](crate::store::HISTORY_RETRY_AFTER); `None` once it
    /// is written again.
    pub history_error: Option<String>,
    /// Time of claim statements.
    pub claim_latency: LatencySummary,
    /// Database time from enqueue (or run-at) to claim, first attempts only.
    pub enqueue_to_start: LatencySummary,
    /// `claim_latency` as buckets.
    pub claim_histogram: HistogramSnapshot,
    /// Figures per (queue, kind), sorted.
    pub jobs: Vec<JobSnapshot>,
}

impl MetricsSnapshot {
    /// The mailbox figures of one actor kind (see [`MailboxSnapshot::actor`]); `None`
    /// for a kind not metered yet (`sequencer` before the first keyed job).
    pub fn mailbox(&self, actor: &str) -> Option<&MailboxSnapshot> {
        self.mailboxes.iter().find(|m| m.actor == actor)
    }

    /// The figures of one (queue, kind); `None` until this scheduler has claimed a job
    /// of it.
    pub fn job(&self, queue: &str, kind: &str) -> Option<&JobSnapshot> {
        self.jobs
            .iter()
            .find(|j| j.queue == queue && j.kind == kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mailbox_depth_is_sent_minus_handled_and_high_water_sticks() {
        let m = Arc::new(MailboxMeter::default());
        m.sent();
        m.sent();
        m.sent();
        drop(m.handling());
        assert_eq!(m.depth(), 2);
        drop(m.handling());
        drop(m.handling());
        let s = m.snapshot("x");
        assert_eq!((s.depth, s.high_water, s.handled), (0, 3, 3));
    }
}
