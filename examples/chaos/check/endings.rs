//! Endings are written promptly: a handler that returned ok has its generation's ending
//! in the database (completed, or refused and reaped) within a lease of its return,
//! unless a fault explains the wait: one on its worker or the database (a kill, a stop,
//! a partition, a restart), or one aimed at the job itself (a session locking its row,
//! a host transaction holding its key, its own long transaction).
//!
//! A completion that waits on anything else (a connection another key's wait holds, a
//! lock of no concern to it) keeps a finished job `running` under a renewed lease, and
//! the next fault runs it again. The lease rules cannot see that (the renewals are
//! healthy until the fault that ends them); this rule can.

use std::collections::{HashMap, HashSet};

use super::execution::{attempts, End, RACE_REAPER};
use super::input::Input;
use super::leases::{lease_fault_near, targeted_fault_on};
use super::{Findings, Stats};

pub fn check(c: &Input, f: &mut Findings, s: &mut Stats) {
    let lease_us = c.run.lease_ms as i64 * 1000;
    // The first ending of each generation, by the database's clock.
    let mut ended: HashMap<(i64, i64), (i64, &str)> = HashMap::new();
    for e in &c.events {
        if matches!(
            e.event.as_str(),
            "completed" | "failed" | "dead" | "released" | "reaped" | "cancelled"
        ) {
            let first = ended
                .entry((e.job_id, e.generation))
                .or_insert((e.at_us, e.event.as_str()));
            if e.at_us < first.0 {
                *first = (e.at_us, e.event.as_str());
            }
        }
    }
    // The racing reaper steals live leases (that fault explains the ending), and records
    // its reaps at its own clock, ahead of the database's: not a time to judge by.
    let raced: HashSet<(i64, i64)> = c
        .expiries
        .iter()
        .filter(|x| x.reaped_by == RACE_REAPER)
        .map(|x| (x.job_id, x.generation))
        .collect();
    for a in attempts(c)
        .iter()
        .filter(|a| a.end == End::Logged("ok".into()) && !raced.contains(&(a.job, a.gen)))
    {
        let Some(&(at, how)) = ended.get(&(a.job, a.gen)) else {
            continue; // never ended: the liveness and orphan rules speak of it
        };
        s.endings_checked += 1;
        let waited = at - a.end_us;
        if waited <= lease_us {
            continue;
        }
        let explained = lease_fault_near(c, a.w, a.end_us - 1_000_000, at)
            || targeted_fault_on(c, (a.job, a.gen), a.end_us - lease_us, at);
        if explained {
            s.endings_late_excused += 1;
            continue;
        }
        f.add(
            "ending_late",
            format!(
                "job {} gen {} (w{}.{}): its handler returned ok, its ending ({how}) came {} ms later with no fault to explain the wait",
                a.job,
                a.gen,
                a.w,
                a.inc,
                waited / 1000
            ),
        );
    }
}

/// No attempt is counted stale whose own completion committed: the worker's log says
/// its ending was refused because it no longer owned the job, yet the database recorded
/// that generation's completion (a handler that completed in its own transaction and
/// then returned an error, a completion whose reply was lost). Such a count fires the
/// stale-completion alert for a healthy worker.
pub fn false_stale(c: &Input, f: &mut Findings, s: &mut Stats) {
    let completed: HashSet<(i64, i64)> = c
        .events
        .iter()
        .filter(|e| e.event == "completed")
        .map(|e| (e.job_id, e.generation))
        .collect();
    for r in &c.stale_reports {
        s.stale_reports += 1;
        if completed.contains(&(r.job, r.generation)) {
            f.add(
                "false_stale",
                format!(
                    "job {} gen {}: {} counted stale in {}, yet that generation's completion committed",
                    r.job, r.generation, r.what, r.log
                ),
            );
        }
    }
}
