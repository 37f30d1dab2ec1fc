//! Lease expiries explained by faults (else renewal failed), liveness after the faults,
//! and coverage: every fault kind hit, every guarded path reached.

use std::collections::HashMap;

use super::input::Input;
use super::{Findings, Stats};
use crate::model::FaultRecord;
use crate::nemesis::FAULTS;
use crate::workload::UNKNOWN_KIND;

/// The owner of every expired lease must have been faulted (process killed, stopped,
/// terminating, partitioned...) or the database disturbed in the lease's last window.
pub fn expiries(c: &Input, f: &mut Findings, s: &mut Stats) {
    let lease_us = c.run.lease_ms as i64 * 1000;
    let owner_of: HashMap<&str, (usize, u32)> = c
        .history
        .iter()
        .filter(|l| l.ev == "up")
        .filter_map(|l| l.owner.as_deref().map(|o| (o, (l.w, l.inc))))
        .collect();
    let term_at: HashMap<(usize, u32), i64> = c
        .history
        .iter()
        .filter(|l| l.ev == "term")
        .map(|l| ((l.w, l.inc), l.t_us))
        .collect();
    let ended_at: HashMap<(usize, u32), i64> = c
        .processes
        .iter()
        .map(|p| ((p.w, p.inc), p.ended_us))
        .collect();
    // Faults that can stop a renewal. The racing reaper is not one: its reaps are
    // recorded under its own name and counted apart.
    let lease_faults: Vec<&FaultRecord> = c
        .faults
        .iter()
        .filter(|x| {
            !matches!(
                x.kind.as_str(),
                "manual_hold"
                    | "manual_release"
                    | "manual_cancel"
                    | "effect_reply_lost"
                    | "reaper_race"
            )
        })
        .collect();
    let run_end = c.run.finished_us.max(c.run.drained_us);
    for x in &c.expiries {
        if x.reaped_by == "chaos-reaper-race" {
            s.expiries_race += 1;
            continue;
        }
        // Deadlines are judged by the database clock: a genuine reap happens now, not
        // after the run ended.
        if x.reaped_at_us > run_end {
            f.add(
                "unexplained_reclaim",
                format!(
                    "job {} gen {}: reaped by {} at {}, after the run ended ({run_end}): a reaper clock ahead of the database's",
                    x.job_id, x.generation, x.reaped_by, x.reaped_at_us
                ),
            );
        }
        let who = owner_of.get(x.owner.as_str()).copied();
        let gone = who
            .map(|w| {
                ended_at
                    .get(&w)
                    .map(|t| *t <= x.reaped_at_us)
                    .unwrap_or(false)
                    || term_at
                        .get(&w)
                        .map(|t| *t <= x.lease_until_us)
                        .unwrap_or(false)
            })
            .unwrap_or(false);
        let target = who.map(|w| format!("w{}", w.0));
        let window = lease_faults.iter().any(|fr| {
            let applies =
                matches!(fr.target.as_str(), "pg" | "all") || Some(&fr.target) == target.as_ref();
            applies
                && fr.start_us <= x.lease_until_us
                && fr.end_us >= x.lease_until_us - lease_us - 1_000_000
        });
        if gone || window || who.is_none() {
            s.expiries_explained += 1;
        } else {
            f.add(
                "lease_lost_while_healthy",
                format!(
                    "job {} gen {}: lease of {} (w{:?}) expired at {} with no fault on it or the database",
                    x.job_id,
                    x.generation,
                    x.owner,
                    who.map(|w| w.0),
                    x.lease_until_us
                ),
            );
        }
    }
}

/// Work completes after the faults, the probe jobs run promptly, the queue drains.
pub fn liveness(c: &Input, f: &mut Findings, s: &mut Stats) {
    s.completed_after_heal = c
        .events
        .iter()
        .filter(|e| e.event == "completed" && e.at_us > c.run.healed_us)
        .count() as u64;
    if s.completed_after_heal == 0 {
        f.add(
            "liveness",
            "no job completed after the faults were healed".into(),
        );
    }
    if !c.run.drain_complete {
        f.add(
            "liveness",
            "the queue did not drain within the limit".into(),
        );
    }
    let completed_at: HashMap<i64, i64> = c
        .events
        .iter()
        .filter(|e| e.event == "completed")
        .map(|e| (e.job_id, e.at_us))
        .collect();
    for r in c
        .enq
        .iter()
        .filter(|r| r.expect == "probe" && r.status == "ok")
    {
        let Some(j) = r.id.and_then(|id| c.job(id)) else {
            continue;
        };
        match completed_at.get(&j.id) {
            Some(t) => {
                let ms = (t - j.created_at_us) / 1000;
                s.probe_max_ms = s.probe_max_ms.max(ms);
                if ms > 20_000 {
                    f.add(
                        "liveness",
                        format!("probe job {} took {ms}ms after the faults", j.id),
                    );
                }
            }
            None if j.state != "cancelled" => f.add(
                "liveness",
                format!("probe job {} never completed ({})", j.id, j.state),
            ),
            None => {}
        }
    }
}

/// A run that did not reach a fault window or a guarded path proves nothing about it.
pub fn coverage(c: &Input, f: &mut Findings, s: &mut Stats) {
    for fr in &c.faults {
        let e = s.fault_hits.entry(fr.kind.clone()).or_default();
        e.0 += 1;
        e.1 += fr.hit as u64;
    }
    for (k, _) in FAULTS {
        if s.fault_hits.get(k).map(|h| h.1).unwrap_or(0) == 0 {
            f.add("coverage", format!("fault kind {k} was never hit"));
        }
    }
    let total_hit: u64 = s.fault_hits.values().map(|v| v.1).sum();
    if total_hit < c.run.min_faults as u64 {
        f.add(
            "coverage",
            format!(
                "{total_hit} faults hit, the profile needs {}",
                c.run.min_faults
            ),
        );
    }
    let unknown_kind_jobs = c.jobs.iter().filter(|j| j.kind == UNKNOWN_KIND).count() as u64;
    let dead_jobs = c.jobs.iter().filter(|j| j.state == "dead").count() as u64;
    s.guarded = vec![
        (
            "lease_expired_reaped",
            c.expiries.len() as u64 - s.expiries_race,
        ),
        ("reaper_race_reaped", s.expiries_race),
        ("released_on_shutdown", s.event("released")),
        ("stale_completions_refused", c.metric("stale_completions")),
        ("leases_lost", c.metric("leases_lost")),
        ("listener_reconnects", c.metric("listener_reconnects")),
        ("handler_panics", c.metric("panics")),
        ("max_run_timeouts", c.metric("timeouts")),
        ("decode_failures_dead", c.metric("decode_failures")),
        (
            "payload_too_large_refused",
            c.run.refused.get("payload_too_large").copied().unwrap_or(0),
        ),
        ("unknown_kind_never_claimed", unknown_kind_jobs),
        ("failed_then_retried", s.event("failed")),
        ("dead_lettered", dead_jobs),
        ("effect_ledger_reused", s.ledger_reused),
        ("effect_server_dedup", s.already),
        ("key_promotions", s.event("promoted")),
        ("operator_holds", s.event("held")),
        ("operator_cancels", s.event("cancelled")),
    ];
    for (name, n) in &s.guarded {
        if *n == 0 {
            f.add("coverage", format!("guarded path {name} was never reached"));
        }
    }
}
