//! Attempts are spent only by handlers that ran, and only a recorded cancel stops one.
//!
//! - `dead_never_started`: an expired lease made its job dead, yet that generation's
//!   handler never started (the job waited in the process for a slot, or for its key).
//!   A crash must give such a job back without spending its attempt.
//! - `cancelled_unasked`: a generation ended `cancelled` by its own claimer (the attempt
//!   running it) without a `cancel_requested` event for it: something stopped a handler
//!   on a notification the row did not back (the `neighbour_cancel_hint` fault sends such
//!   notifications). An operator's cancel of a pending job is written at the job's
//!   current generation by the operator, not by a claimer, and is not judged.

use std::collections::{HashMap, HashSet};

use super::execution::attempts;
use super::input::Input;
use super::{Findings, Stats};

pub fn check(c: &Input, f: &mut Findings, s: &mut Stats) {
    let started: HashSet<(i64, i64)> = attempts(c).iter().map(|a| (a.job, a.gen)).collect();
    let claimer: HashMap<(i64, i64), &str> = c
        .events
        .iter()
        .filter(|e| e.event == "claimed")
        .filter_map(|e| Some(((e.job_id, e.generation), e.owner.as_deref()?)))
        .collect();
    let requested: HashSet<(i64, i64)> = c
        .events
        .iter()
        .filter(|e| e.event == "cancel_requested")
        .map(|e| (e.job_id, e.generation))
        .collect();
    for e in &c.events {
        let at = (e.job_id, e.generation);
        match e.event.as_str() {
            "reaped"
                if e.detail
                    .as_deref()
                    .is_some_and(|d| d.contains("; now dead")) =>
            {
                s.dead_reaps_checked += 1;
                if !started.contains(&at) {
                    f.add(
                        "dead_never_started",
                        format!(
                            "job {} gen {}: dead by an expired lease, and its handler never started",
                            e.job_id, e.generation
                        ),
                    );
                }
            }
            "cancelled"
                if started.contains(&at)
                    && e.owner.is_some()
                    && claimer.get(&at).copied() == e.owner.as_deref() =>
            {
                s.running_cancels_checked += 1;
                if !requested.contains(&at) {
                    f.add(
                        "cancelled_unasked",
                        format!(
                            "job {} gen {}: its running handler ended cancelled with no cancel requested",
                            e.job_id, e.generation
                        ),
                    );
                }
            }
            _ => {}
        }
    }
}
