//! A lock-free latency histogram with power-of-two microsecond buckets: cheap to record
//! from any thread, exact enough for p50/p99 (within 2x) and for Prometheus buckets
//! whose bounds are those powers of two.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Bucket `i` counts durations above 2^(i-1) µs and up to 2^i µs (bucket 0: up to 1 µs),
/// so a bucket's upper bound is inclusive, as Prometheus' `le` is.
const BUCKETS: usize = 40;

/// The bucket bounds exposed to Prometheus: every other power of two from 16 µs to about
/// 19 hours (17 bounds, x4 apart). Each is a bucket boundary, so the cumulative counts
/// are exact; the finer buckets still serve the quantiles.
const EXPOSED: std::ops::RangeInclusive<usize> = 4..=36;

#[derive(Debug)]
pub(crate) struct Histogram {
    buckets: [AtomicU64; BUCKETS],
    sum_nanos: AtomicU64,
    max_micros: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_nanos: AtomicU64::new(0),
            max_micros: AtomicU64::new(0),
        }
    }
}

/// Quantiles from a log-scale histogram (bucket upper bounds, so within 2x).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LatencySummary {
    /// Durations recorded since the scheduler started.
    pub count: u64,
    /// Median: the upper bound of the bucket holding it, so at most twice the truth
    /// (and never above `max`). Zero when nothing was recorded.
    pub p50: Duration,
    /// 99th percentile, within 2x like `p50`.
    pub p99: Duration,
    /// The longest duration recorded, exact to the microsecond.
    pub max: Duration,
}

/// A histogram at one moment, in the shape Prometheus wants.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HistogramSnapshot {
    /// Durations recorded since the scheduler started.
    pub count: u64,
    /// Sum of the recorded durations, in seconds.
    pub sum_secs: f64,
    /// (upper bound in seconds, observations at or below it): cumulative, ascending,
    /// without the `+Inf` bucket (that is `count`).
    pub buckets: Vec<(f64, u64)>,
}

/// The bucket of a duration: the smallest `i` with `d <= 2^i µs`.
fn bucket_of(d: Duration) -> usize {
    let micros_up = d.as_nanos().div_ceil(1000).min(u64::MAX as u128) as u64;
    if micros_up <= 1 {
        return 0;
    }
    ((64 - (micros_up - 1).leading_zeros()) as usize).min(BUCKETS - 1)
}

fn bound(i: usize) -> Duration {
    Duration::from_micros(1u64 << i)
}

impl Histogram {
    pub(crate) fn record(&self, d: Duration) {
        self.buckets[bucket_of(d)].fetch_add(1, Relaxed);
        self.sum_nanos
            .fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Relaxed);
        self.max_micros
            .fetch_max(d.as_micros().min(u64::MAX as u128) as u64, Relaxed);
    }

    fn counts(&self) -> Vec<u64> {
        self.buckets.iter().map(|b| b.load(Relaxed)).collect()
    }

    pub(crate) fn summary(&self) -> LatencySummary {
        let counts = self.counts();
        let count: u64 = counts.iter().sum();
        if count == 0 {
            return LatencySummary::default();
        }
        let quantile = |q: f64| {
            let target = ((count as f64) * q).ceil().max(1.0) as u64;
            let mut seen = 0;
            for (i, c) in counts.iter().enumerate() {
                seen += c;
                if seen >= target {
                    return bound(i);
                }
            }
            Duration::ZERO
        };
        let max = Duration::from_micros(self.max_micros.load(Relaxed));
        LatencySummary {
            count,
            p50: quantile(0.5).min(max),
            p99: quantile(0.99).min(max),
            max,
        }
    }

    pub(crate) fn snapshot(&self) -> HistogramSnapshot {
        let counts = self.counts();
        let mut seen = 0;
        let mut buckets = Vec::with_capacity(EXPOSED.count());
        for (i, c) in counts.iter().enumerate() {
            seen += c;
            if EXPOSED.contains(&i) && i % 2 == 0 {
                buckets.push((bound(i).as_secs_f64(), seen));
            }
        }
        HistogramSnapshot {
            count: counts.iter().sum(),
            sum_secs: Duration::from_nanos(self.sum_nanos.load(Relaxed)).as_secs_f64(),
            buckets,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_within_a_factor_of_two() {
        let h = Histogram::default();
        for ms in 1..=100 {
            h.record(Duration::from_millis(ms));
        }
        let s = h.summary();
        assert_eq!(s.count, 100);
        assert!(
            s.p50 >= Duration::from_millis(25) && s.p50 <= Duration::from_millis(100),
            "{s:?}"
        );
        assert_eq!(s.max, Duration::from_millis(100));
    }

    #[test]
    fn a_duration_on_a_bound_counts_in_that_bucket_and_just_above_in_the_next() {
        assert_eq!(bucket_of(Duration::ZERO), 0);
        assert_eq!(bucket_of(Duration::from_micros(1)), 0);
        assert_eq!(bucket_of(Duration::from_nanos(1001)), 1);
        assert_eq!(bucket_of(Duration::from_micros(1024)), 10);
        assert_eq!(bucket_of(Duration::from_nanos(1_024_001)), 11);
    }

    #[test]
    fn exposed_buckets_are_cumulative_and_sum_is_in_seconds() {
        let h = Histogram::default();
        h.record(Duration::from_micros(1024)); // exactly the 2^10 µs bound
        h.record(Duration::from_micros(1025));
        h.record(Duration::from_secs(2));
        let s = h.snapshot();
        assert_eq!(s.count, 3);
        assert!((s.sum_secs - 2.002049).abs() < 1e-9, "{}", s.sum_secs);
        assert_eq!(s.buckets.len(), 17);
        let at = |secs: f64| s.buckets.iter().find(|b| b.0 == secs).unwrap().1;
        assert_eq!(at(0.001024), 1);
        assert_eq!(at(0.004096), 2);
        assert_eq!(at(1.048576), 2);
        assert_eq!(at(4.194304), 3);
        assert!(s
            .buckets
            .windows(2)
            .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1));
    }
}
