//! Figures per (queue, kind): how attempts ended, how long jobs waited to start, and
//! how long handlers ran. Queues and kinds are configured and registered, so the set of
//! label pairs stays small.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use super::histogram::{Histogram, HistogramSnapshot};

/// How an attempt ended, as counted per (queue, kind).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Outcome {
    /// The job is done.
    Completed,
    /// The attempt failed; the job will be tried again.
    Retried,
    /// The attempt failed for good (permanent error or attempts exhausted).
    Dead,
    /// The handler said "not yet" (`JobError::snooze`): pending again after its delay,
    /// no attempt spent.
    Snoozed,
    /// An operator cancelled the job.
    Cancelled,
    /// The job was given back without counting the attempt (shutdown, lease not
    /// confirmed before the handler started).
    Released,
    /// The ending was refused: this worker had lost the job's fence.
    Stale,
    /// The ending could not be written (database unreachable); the lease decides.
    Unknown,
}

impl Outcome {
    /// Every outcome, in the order snapshots list them.
    pub const ALL: [Outcome; 8] = [
        Outcome::Completed,
        Outcome::Retried,
        Outcome::Dead,
        Outcome::Snoozed,
        Outcome::Cancelled,
        Outcome::Released,
        Outcome::Stale,
        Outcome::Unknown,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::Retried => "retried",
            Outcome::Dead => "dead",
            Outcome::Snoozed => "snoozed",
            Outcome::Cancelled => "cancelled",
            Outcome::Released => "released",
            Outcome::Stale => "stale",
            Outcome::Unknown => "unknown",
        }
    }

    fn index(self) -> usize {
        Outcome::ALL.iter().position(|o| *o == self).unwrap_or(0)
    }
}

/// The meter of one (queue, kind).
#[derive(Debug, Default)]
pub(crate) struct JobMeter {
    outcomes: [AtomicU64; Outcome::ALL.len()],
    enqueue_to_start: Histogram,
    run_time: Histogram,
}

impl JobMeter {
    pub(crate) fn ended(&self, outcome: Outcome) {
        self.outcomes[outcome.index()].fetch_add(1, Relaxed);
    }

    pub(crate) fn started_after(&self, waited: Duration) {
        self.enqueue_to_start.record(waited);
    }

    pub(crate) fn ran_for(&self, took: Duration) {
        self.run_time.record(took);
    }

    pub(crate) fn snapshot(&self, queue: &str, kind: &str) -> JobSnapshot {
        JobSnapshot {
            queue: queue.to_string(),
            kind: kind.to_string(),
            outcomes: Outcome::ALL
                .iter()
                .map(|o| (*o, self.outcomes[o.index()].load(Relaxed)))
                .collect(),
            enqueue_to_start: self.enqueue_to_start.snapshot(),
            run_time: self.run_time.snapshot(),
        }
    }
}

/// One (queue, kind)'s figures at one moment.
#[derive(Clone, Debug, PartialEq)]
pub struct JobSnapshot {
    /// The queue the jobs were claimed from.
    pub queue: String,
    /// The jobs' kind.
    pub kind: String,
    /// Attempts ended, by outcome (every outcome listed, zeros included).
    pub outcomes: Vec<(Outcome, u64)>,
    /// Database time from enqueue (or run-at) to claim, first attempts only.
    pub enqueue_to_start: HistogramSnapshot,
    /// Handler run time, from its start to its return (or its stop), for attempts
    /// whose handler was started.
    pub run_time: HistogramSnapshot,
}

impl JobSnapshot {
    /// Attempts that ended with `outcome`; 0 if none did.
    pub fn ended(&self, outcome: Outcome) -> u64 {
        self.outcomes
            .iter()
            .find(|(o, _)| *o == outcome)
            .map_or(0, |(_, n)| *n)
    }
}
