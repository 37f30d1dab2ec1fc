//! This scheduler's recent pace (attempts ended per second), which sizes how far ahead
//! the claimer claims (`Config::claim_ahead_window`).
//!
//! It rises at once and decays with a half-second time constant: a burst of fast jobs
//! earns claim-ahead immediately, and a queue that turns slow stops being hoarded within
//! seconds (from 10,000 attempts/s to under 10/s in about 3.5 s). Attempts ended, not jobs claimed, so the slots a scheduler fills at start (a
//! burst of claims) do not read as a fast pace.

use std::time::{Duration, Instant};

/// Samples closer together than this are folded into the next one.
const MIN_SAMPLE: Duration = Duration::from_millis(50);

/// The decay's time constant.
const DECAY: Duration = Duration::from_millis(500);

pub(crate) struct Pace {
    at: Instant,
    ended: u64,
    per_sec: f64,
}

impl Pace {
    pub fn new(now: Instant, ended: u64) -> Self {
        Pace {
            at: now,
            ended,
            per_sec: 0.0,
        }
    }

    /// Fold in the count of attempts ended so far, read at `now`; returns the pace.
    pub fn update(&mut self, now: Instant, ended: u64) -> f64 {
        let dt = now.saturating_duration_since(self.at);
        if dt < MIN_SAMPLE {
            return self.per_sec;
        }
        let secs = dt.as_secs_f64();
        let sample = ended.saturating_sub(self.ended) as f64 / secs;
        let kept = (-secs / DECAY.as_secs_f64()).exp();
        self.per_sec = sample.max(self.per_sec * kept + sample * (1.0 - kept));
        self.at = now;
        self.ended = ended;
        self.per_sec
    }

    /// Jobs to hold ahead: what this pace starts in `window`, at most `max`.
    pub fn ahead(&self, window: Duration, max: usize) -> usize {
        let n = (self.per_sec * window.as_secs_f64()).floor();
        if n >= max as f64 {
            max
        } else {
            n as usize
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fast_burst_earns_claim_ahead_at_once_and_a_slow_queue_loses_it() {
        let t0 = Instant::now();
        let mut pace = Pace::new(t0, 0);
        // 1,000 attempts in 100 ms: 10,000/s, so 100 ms is 1,000 jobs, capped at 100.
        pace.update(t0 + Duration::from_millis(100), 1_000);
        assert_eq!(pace.ahead(Duration::from_millis(100), 100), 100);
        // Then 3 attempts a second (slow handlers): within four seconds the pace is
        // under 10/s, so nothing is claimed ahead.
        let mut ended = 1_000;
        for step in 1..=40 {
            ended += if step % 3 == 0 { 1 } else { 0 };
            pace.update(t0 + Duration::from_millis(100 + 100 * step), ended);
        }
        assert_eq!(
            pace.ahead(Duration::from_millis(100), 100),
            0,
            "{}",
            pace.per_sec
        );
    }

    #[test]
    fn samples_closer_than_the_minimum_are_folded_into_the_next() {
        let t0 = Instant::now();
        let mut pace = Pace::new(t0, 0);
        assert_eq!(pace.update(t0 + Duration::from_millis(10), 5), 0.0);
        let p = pace.update(t0 + Duration::from_millis(100), 10);
        assert!((p - 100.0).abs() < 1e-6, "{p}");
    }
}
