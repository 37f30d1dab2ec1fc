//! The two profiles: `short` (CI, a few minutes on 2 cores) and `long` (≥ 100,000 jobs,
//! ≥ 1,500 faults).

use std::time::Duration;

#[derive(Clone, Debug)]
pub struct Profile {
    pub name: &'static str,
    pub workers: usize,
    pub concurrency: usize,
    pub lease_ms: u64,
    pub renew_ms: u64,
    pub reaper_ms: u64,
    pub backoff_base_ms: u64,
    pub backoff_cap_ms: u64,
    pub jitter: f64,
    pub max_run_ms: u64,
    /// How long faults are injected (the workload runs meanwhile).
    pub fault_phase: Duration,
    /// Jobs enqueued over the fault phase.
    pub jobs: usize,
    /// At least this many faults (the schedule is drawn long enough).
    pub min_faults: usize,
    /// Pause between fault starts, ms.
    pub gap_ms: (u64, u64),
    /// After the faults: how long the queue may take to drain.
    pub drain_limit: Duration,
    /// The watchdog's deadline for the whole run, cluster start included.
    pub hard_deadline: Duration,
    /// Ordering keys: `keys` in all, the first `hot_keys` of them taking 30 % of keyed jobs.
    pub keys: usize,
    pub hot_keys: usize,
}

impl Profile {
    pub fn short() -> Profile {
        Profile {
            name: "short",
            workers: 3,
            concurrency: 8,
            lease_ms: 2000,
            renew_ms: 500,
            reaper_ms: 300,
            backoff_base_ms: 80,
            backoff_cap_ms: 1500,
            jitter: 0.25,
            max_run_ms: 4500,
            fault_phase: Duration::from_secs(85),
            jobs: 3000,
            min_faults: 30,
            gap_ms: (250, 1000),
            drain_limit: Duration::from_secs(60),
            hard_deadline: Duration::from_secs(285),
            keys: 120,
            hot_keys: 4,
        }
    }

    pub fn long() -> Profile {
        Profile {
            name: "long",
            workers: 4,
            concurrency: 12,
            fault_phase: Duration::from_secs(25 * 60),
            jobs: 110_000,
            min_faults: 1500,
            // A hot key runs one job at a time; 25 minutes of faults leave a backlog on
            // it that only drains at the key's own pace.
            drain_limit: Duration::from_secs(600),
            hard_deadline: Duration::from_secs(25 * 60 + 1200),
            keys: 2000,
            hot_keys: 12,
            ..Profile::short()
        }
    }

    pub fn by_name(name: &str) -> Option<Profile> {
        match name {
            "short" => Some(Profile::short()),
            "long" => Some(Profile::long()),
            _ => None,
        }
    }
}
