//! The human report (printed, `report.txt`) and its JSON summary (`report.json`).

use std::collections::BTreeMap;
use std::fmt::Write;

use super::input::Input;
use super::{Findings, Report, Stats, INVARIANTS};

fn states(c: &Input) -> BTreeMap<&str, u64> {
    let mut states = BTreeMap::new();
    for j in &c.jobs {
        *states.entry(j.state.as_str()).or_default() += 1;
    }
    states
}

fn pairs<K: std::fmt::Display, V: std::fmt::Display>(it: impl Iterator<Item = (K, V)>) -> String {
    it.map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn render(c: &Input, f: &Findings, s: &Stats) -> Report {
    let run = &c.run;
    let mut t = String::new();
    let _ = writeln!(t, "==== leasehold chaos report ====");
    let _ = writeln!(
        t,
        "seed={} profile={} wall={:.0}s {} workers={}x{} lease={}ms renew={}ms reaper={}ms backoff={}..{}ms",
        run.seed, run.profile, run.wall_secs, run.pg_version, run.workers, run.concurrency,
        run.lease_ms, run.renew_ms, run.reaper_ms, run.backoff_base_ms, run.backoff_cap_ms
    );
    let _ = writeln!(
        t,
        "jobs: enqueue_ok={} enqueue_unknown={} (recovered={} absent={}) refused={} {:?}",
        s.acked,
        s.unknown,
        s.recovered,
        s.unknown - s.recovered,
        s.refused,
        run.refused
    );
    let _ = writeln!(t, "      final states: {}", pairs(states(c).into_iter()));
    let _ = writeln!(
        t,
        "attempts: claims={} re-runs={} (explained={} unexplained={}) lease_expiries={} (race reaper {}, explained by faults {}) failed={} released={}",
        s.claims,
        s.reruns_explained + s.reruns_unexplained,
        s.reruns_explained,
        s.reruns_unexplained,
        c.expiries.len(),
        s.expiries_race,
        s.expiries_explained,
        s.event("failed"),
        s.event("released")
    );
    let es = &run.effect_server;
    let _ = writeln!(
        t,
        "effects: requests={} applied={} dedup_hits={} fenced={} mismatch={} replies_dropped={} ledger_reused={} duplicates_at_server={}",
        es.requests, es.applied, s.already, s.fenced, es.mismatch, es.replies_dropped, s.ledger_reused, s.duplicates_at_server
    );
    let _ = writeln!(
        t,
        "completions: completed={} stale_completions_refused={} replays_after_lost_reply={} leases_lost={} db_errors_seen={}",
        s.event("completed"),
        c.metric("stale_completions"),
        c.metric("completion_replays"),
        c.metric("leases_lost"),
        c.metric("db_errors")
    );
    let _ = writeln!(
        t,
        "execution: attempts={} ended_by_drop_guard={} ended_at_process_kill={} never_ended={} frozen_overlaps_excused={} frozen_starts_excused={} race_reaped_overlaps_excused={} flood_successors_waited={} chain_claim_to_start_max={}ms",
        s.attempts,
        s.ends_dropped,
        s.ends_at_process_end,
        s.ends_open,
        s.zombie_overlaps_excused,
        s.frozen_starts_excused,
        s.race_overlaps_excused,
        s.flood_successor_waited,
        s.chain_claim_to_start_max_ms
    );
    let _ = writeln!(
        t,
        "clock: database vs workers max {}µs over {} good samples (of {}), round trip max {}µs; allowed {}µs (db), {}µs (monotonic)",
        run.clock.max_offset_us,
        run.clock.good_samples,
        run.clock.samples,
        run.clock.max_rtt_us,
        crate::model::DB_CLOCK_BOUND_US,
        crate::model::MONO_BOUND_NS / 1000
    );
    let _ = writeln!(
        t,
        "poison: results={} payloads={} neighbours_checked={}; endings: checked={} late_excused={}; retention: pruned={} dead_retried={}; keys with ambiguous epochs: {}",
        s.poison_results,
        s.poison_payloads,
        s.poison_neighbours,
        s.endings_checked,
        s.endings_late_excused,
        s.pruned_jobs,
        s.dead_retried,
        c.ambiguous_keys.len()
    );
    let total: u64 = s.fault_hits.values().map(|v| v.1).sum();
    let _ = writeln!(
        t,
        "faults ({total} hit): {}",
        pairs(s.fault_hits.iter().map(|(k, v)| (k, v.1)))
    );
    let _ = writeln!(
        t,
        "guarded paths: {}",
        pairs(s.guarded.iter().map(|(k, v)| (k, v)))
    );
    let _ = writeln!(
        t,
        "liveness: completed_after_heal={} probe_max_latency={}ms drain_complete={}",
        s.completed_after_heal, s.probe_max_ms, run.drain_complete
    );
    let _ = writeln!(
        t,
        "violations: {}",
        pairs(INVARIANTS.iter().map(|(k, _)| (k, f.count(k))))
    );
    // CHAOS_WITNESSES=n prints more witnesses per invariant (8 by default).
    let shown = std::env::var("CHAOS_WITNESSES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    for (inv, what) in INVARIANTS {
        if let Some(w) = f.witnesses(inv) {
            let _ = writeln!(t, "  {inv} ({what}): {}", w.len());
            for line in w.iter().take(shown) {
                let _ = writeln!(t, "    - {line}");
            }
        }
    }
    let pass = f.is_empty();
    let _ = writeln!(t, "RESULT: {}", if pass { "PASS" } else { "FAIL" });
    Report { text: t, pass }
}

pub fn summary(c: &Input, f: &Findings, s: &Stats) -> serde_json::Value {
    serde_json::json!({
        "seed": c.run.seed,
        "profile": c.run.profile,
        "pass": f.is_empty(),
        "states": states(c),
        "faults": s.fault_hits.iter().map(|(k, v)| (k.clone(), v.1)).collect::<BTreeMap<_, _>>(),
        "guarded": s.guarded.iter().map(|(k, v)| (k.to_string(), *v)).collect::<BTreeMap<_, _>>(),
        "violations": INVARIANTS.iter().map(|(k, _)| (k.to_string(), f.count(k))).collect::<BTreeMap<_, _>>(),
    })
}
