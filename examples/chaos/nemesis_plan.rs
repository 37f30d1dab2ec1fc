//! The nemesis's schedule, drawn from the seed: every fault kind once (in a seeded
//! order), then a weighted draw, each with its duration and size.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;

use crate::model::{now_mono_ns, now_us};

/// Every fault kind with its weight in the random part of the schedule.
pub const FAULTS: [(&str, u32); 23] = [
    ("sigkill", 10),
    ("sigstop", 12),
    ("sigterm", 5),
    ("pg_terminate_worker", 10),
    ("pg_terminate_listener", 6),
    ("pg_restart_fast", 3),
    ("pg_restart_immediate", 3),
    ("proxy_delay", 8),
    ("proxy_blackhole", 8),
    ("proxy_blackhole_renewer", 10),
    ("proxy_cut", 8),
    ("reaper_race", 6),
    ("effect_reply_lost", 6),
    ("manual_hold", 6),
    ("manual_cancel", 6),
    ("row_lock", 6),
    ("host_enqueue_commit", 4),
    ("host_enqueue_rollback", 3),
    ("cancel_running_head", 10),
    ("neighbour_cancel_hint", 4),
    ("host_bad_input", 4),
    ("informational_write_fails", 3),
    ("neighbour_schema_effects", 4),
];

/// When a fault began, on both clocks.
#[derive(Clone, Copy, Debug)]
pub struct Start {
    pub us: i64,
    pub mono: i64,
}

impl Start {
    pub fn now() -> Start {
        Start {
            us: now_us(),
            mono: now_mono_ns(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Planned {
    pub gap_ms: u64,
    pub kind: &'static str,
    pub target: usize,
    pub dur_ms: u64,
    pub n: u64,
}

/// The schedule for a seed (as long as any profile can use).
pub fn plan(rng: &mut StdRng, lease_ms: u64, gap: (u64, u64), len: usize) -> Vec<Planned> {
    let mut kinds: Vec<&'static str> = FAULTS.iter().map(|f| f.0).collect();
    kinds.shuffle(rng);
    let total: u32 = FAULTS.iter().map(|f| f.1).sum();
    while kinds.len() < len {
        let mut x = rng.gen_range(0..total);
        for (k, w) in FAULTS {
            if x < w {
                kinds.push(k);
                break;
            }
            x -= w;
        }
    }
    let lease = lease_ms as f64;
    kinds
        .into_iter()
        .map(|kind| {
            let (dur_ms, n) = match kind {
                "sigstop" | "proxy_blackhole" => ((lease * rng.gen_range(1.5..2.5)) as u64, 0),
                // n = 1: every worker's renewer at once (a stall of all renewals).
                "proxy_blackhole_renewer" => (
                    (lease * rng.gen_range(1.5..2.5)) as u64,
                    rng.gen_bool(0.4) as u64,
                ),
                "proxy_delay" => (rng.gen_range(1500..3000), rng.gen_range(30..250)),
                "sigkill" => (0, rng.gen_range(200..800)),
                "reaper_race" => (1500, 0),
                "effect_reply_lost" => (0, rng.gen_range(2..5)),
                "manual_hold" => (rng.gen_range(500..3000), 4),
                "manual_cancel" => (0, 3),
                // Held past the lease: a renewal that waits on the lock loses every
                // lease of its process.
                "row_lock" => (
                    (lease * rng.gen_range(1.5..2.5)) as u64,
                    rng.gen_range(1..=2),
                ),
                "host_enqueue_commit" | "host_enqueue_rollback" => {
                    ((lease * rng.gen_range(1.5..2.5)) as u64, 0)
                }
                "cancel_running_head" => (0, rng.gen_range(1..=3)),
                "neighbour_cancel_hint" => (0, rng.gen_range(1..=4)),
                "neighbour_schema_effects" => (0, rng.gen_range(1..=4)),
                "informational_write_fails" => ((lease * rng.gen_range(1.5..3.0)) as u64, 0),
                "pg_terminate_worker" => (0, rng.gen_range(1..4)),
                "proxy_cut" => (0, rng.gen_bool(0.3) as u64),
                _ => (0, 0),
            };
            Planned {
                gap_ms: rng.gen_range(gap.0..gap.1),
                kind,
                target: rng.gen_range(0..1000),
                dur_ms,
                n,
            }
        })
        .collect()
}
