//! Lease expiries explained by faults (else renewal failed), liveness after the faults,
//! and coverage: every fault kind hit, every guarded path reached.
//!
//! What explains an expiry: a fault that can stop a process's renewals (a kill, a stop,
//! a partition, a hung renewer connection, a database restart...) on the owner's worker
//! or the whole database, around the lease's last window. The faults a host or an
//! operator makes explain only the jobs they touched: a session's row locks explain
//! the expiry of the rows it locked, a host transaction holding a key explains that
//! key's jobs, and a `txhold` handler holding its own row past the lease explains its
//! own. Anything else they cause is the library's: renewal must never wait on a lock.

use std::collections::{HashMap, HashSet};

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
    let lease_faults = lease_faults(c);
    let targeted = targeted_explanations(c);
    let run_end = c.run.finished_us.max(c.run.drained_us);
    for x in &c.expiries {
        if x.reaped_by == super::execution::RACE_REAPER {
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
        let touched = targeted.iter().any(|(jobs, key, from, to)| {
            let job = c.job(x.job_id);
            let mine = jobs.contains(&(x.job_id, x.generation))
                || jobs.contains(&(x.job_id, 0))
                || (key.is_some() && job.and_then(|j| j.job_key.as_ref()) == key.as_ref());
            mine && *from <= x.lease_until_us && *to >= x.lease_until_us - lease_us - 1_000_000
        });
        if gone || window || touched || who.is_none() {
            s.expiries_explained += 1;
        } else {
            f.add(
                "lease_lost_while_healthy",
                format!(
                    "job {} gen {}: lease of {} ({}) expired at {} with no fault on it or the database",
                    x.job_id,
                    x.generation,
                    x.owner,
                    who.map(|w| format!("w{}.{}", w.0, w.1)).unwrap_or_default(),
                    x.lease_until_us
                ),
            );
        }
    }
}

/// Every expired lease is reaped within two reaper intervals (and a second of slack for
/// a pass's own work) of its end, unless a fault around it explains a delay: one that
/// disturbs the database or a process (any kind but the targeted ones), or a targeted
/// one on its job or key (the reaper skips rows and keys others hold). Reapers run in
/// every worker, and nothing they do besides reaping may hold it up: a refused
/// heartbeat (`informational_write_fails`) explains nothing.
pub fn reaps(c: &Input, f: &mut Findings, s: &mut Stats) {
    let bound_us = (2 * c.run.reaper_ms as i64 + 1_000) * 1000;
    let lease_faults = lease_faults(c);
    let targeted = targeted_explanations(c);
    for x in &c.expiries {
        if x.reaped_by == super::execution::RACE_REAPER {
            continue;
        }
        s.reaps_checked += 1;
        let due = x.lease_until_us + bound_us;
        if x.reaped_at_us <= due {
            continue;
        }
        let (from, to) = (x.lease_until_us - 1_000_000, x.reaped_at_us);
        let disturbed = lease_faults
            .iter()
            .any(|fr| fr.start_us <= to && fr.end_us >= from);
        let job = c.jobs.iter().find(|j| j.id == x.job_id);
        let touched = targeted.iter().any(|(jobs, key, start, end)| {
            let mine = jobs.contains(&(x.job_id, 0))
                || jobs.contains(&(x.job_id, x.generation))
                || (key.is_some() && job.and_then(|j| j.job_key.as_ref()) == key.as_ref());
            mine && *start <= to && *end >= from
        });
        if disturbed || touched {
            s.reaps_late_excused += 1;
        } else {
            f.add(
                "reap_late",
                format!(
                    "job {} gen {}: lease ended at {}, reaped {} ms later by {} (bound {} ms), no fault around it",
                    x.job_id,
                    x.generation,
                    x.lease_until_us,
                    (x.reaped_at_us - x.lease_until_us) / 1000,
                    x.reaped_by,
                    bound_us / 1000
                ),
            );
        }
    }
}

/// Kinds that act on named jobs or keys, not on a process: they explain only those.
pub const TARGETED: [&str; 12] = [
    "manual_hold",
    "manual_release",
    "manual_cancel",
    "effect_reply_lost",
    // The racing reaper's reaps are recorded under its own name and counted apart.
    "reaper_race",
    "row_lock",
    "host_enqueue_commit",
    "host_enqueue_rollback",
    "cancel_running_head",
    // A host transaction's refused calls and a refused heartbeat explain no expiry.
    "host_bad_input",
    "informational_write_fails",
    "neighbour_schema_effects",
];

/// Faults that can stop a process's renewals.
fn lease_faults(c: &Input) -> Vec<&FaultRecord> {
    c.faults
        .iter()
        .filter(|x| !TARGETED.contains(&x.kind.as_str()))
        .collect()
}

/// What the targeted faults explain: (jobs as (id, generation or 0 for any), key,
/// from, to).
type Targeted = Vec<(HashSet<(i64, i64)>, Option<String>, i64, i64)>;

fn targeted_explanations(c: &Input) -> Targeted {
    let mut out: Targeted = Vec::new();
    for fr in &c.faults {
        match fr.kind.as_str() {
            "row_lock" => out.push((
                fr.jobs.iter().map(|j| (*j, 0)).collect(),
                None,
                fr.start_us,
                fr.end_us,
            )),
            "host_enqueue_commit" | "host_enqueue_rollback" => {
                out.push((HashSet::new(), fr.key.clone(), fr.start_us, fr.end_us))
            }
            _ => {}
        }
    }
    // A txhold handler that held its own completing transaction past the lease.
    let lease = c.run.lease_ms;
    for l in c
        .history
        .iter()
        .filter(|l| l.ev == "start" && l.kind == "txhold")
    {
        let held: u64 = l
            .detail
            .strip_prefix("hold_ms=")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if held >= lease * 3 / 4 {
            let set = [(l.job, l.generation)].into_iter().collect();
            out.push((set, None, l.t_us, l.t_us + held as i64 * 1000));
        }
    }
    out
}

/// A fault a host or an operator made on this very job (a session locking its row, a
/// host transaction holding its key, its own long transaction) between `from` and `to`
/// (wall µs): what explains its expiry in [`expiries`] explains it here too.
pub fn targeted_fault_on(c: &Input, job: (i64, i64), from: i64, to: i64) -> bool {
    let key = c.job(job.0).and_then(|j| j.job_key.clone());
    targeted_explanations(c)
        .iter()
        .any(|(jobs, k, start, end)| {
            let mine = jobs.contains(&job)
                || jobs.contains(&(job.0, 0))
                || (k.is_some() && key.is_some() && *k == key);
            mine && *start <= to && *end >= from
        })
}

/// A fault that can stop renewals hit worker `w` (or the whole database) between
/// `from` and `to` (wall µs).
pub fn lease_fault_near(c: &Input, w: usize, from: i64, to: i64) -> bool {
    let target = format!("w{w}");
    lease_faults(c).iter().any(|fr| {
        (matches!(fr.target.as_str(), "pg" | "all") || fr.target == target)
            && fr.start_us <= to
            && fr.end_us >= from
    }) || c
        .processes
        .iter()
        .any(|p| p.w == w && p.ended_us >= from && p.ended_us <= to)
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
            if c.run.drain_stranded {
                "the drain stopped: only stranded keys were left open (see stranded_key)".into()
            } else {
                "the queue did not drain within the limit".into()
            },
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
    if !c.periodic.clock_end_us.is_empty() && c.periodic.fires.is_empty() {
        f.add("coverage", "the periodic schedules never fired".to_string());
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
        // Second edition: the scenarios and the retention operator.
        ("flood_successor_waited_for_slot", s.flood_successor_waited),
        ("poison_result_jobs", s.poison_results),
        ("poison_outcome_jobs", s.poison_outcomes),
        ("stale_counts_checked", s.stale_reports),
        ("periodic_fires_checked", s.periodic_fires),
        ("poison_payload_jobs", s.poison_payloads),
        ("poison_neighbours_checked", s.poison_neighbours),
        ("txhold_held_past_lease", txhold_long(c)),
        ("cancel_chain_heads", scenario_jobs(c, "cancel_chain")),
        ("dead_head_chains", scenario_jobs(c, "dead_head")),
        ("retention_pruned_jobs", s.pruned_jobs),
        ("retry_dead_ok", s.dead_retried),
        ("attempt_ends_by_drop_guard", s.ends_dropped),
        ("attempt_ends_at_process_kill", s.ends_at_process_end),
    ];
    for (name, n) in &s.guarded {
        if *n == 0 {
            f.add("coverage", format!("guarded path {name} was never reached"));
        }
    }
}

/// Jobs a scenario enqueued (acknowledged).
fn scenario_jobs(c: &Input, name: &str) -> u64 {
    c.enq
        .iter()
        .filter(|r| r.status == "ok" && r.scenario.as_deref() == Some(name))
        .count() as u64
}

/// `txhold` attempts that held their completing transaction at least a lease.
fn txhold_long(c: &Input) -> u64 {
    c.history
        .iter()
        .filter(|l| l.ev == "start" && l.kind == "txhold")
        .filter(|l| {
            l.detail
                .strip_prefix("hold_ms=")
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|ms| ms >= c.run.lease_ms)
        })
        .count() as u64
}
