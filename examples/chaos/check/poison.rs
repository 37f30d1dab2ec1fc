//! Poison is contained: a job whose result cannot be stored or read back (a NUL, over the
//! result cap, nested deeper than 128; returned, or completed in the handler's own
//! transaction), whose effect's outcome cannot be recorded, or whose payload cannot be
//! decoded ends dead with a reason that says so, an effect whose outcome could not be
//! recorded is not applied again, and nothing else suffers for it.
//!
//! Neighbours are the jobs that shared the poison job's statements, as far as the
//! artifacts show them:
//! - its claim: the same owner and the same claim time (`now()` of one transaction);
//! - its completion batch: attempts of the same process whose handlers returned ok
//!   within [`BATCH_WINDOW_NS`] of the poison handler's.
//!
//! A neighbour is affected when its handler never ran yet its generation was reaped or
//! failed, or its handler returned ok yet its generation did not end `completed` —
//! unless a fault hit its worker (or the database) then, or one aimed at the neighbour
//! itself (a session locking its row past the lease).

use std::collections::{HashMap, HashSet};

use super::execution::{attempts, Attempt, End};
use super::input::Input;
use super::leases::{lease_fault_near, targeted_fault_on};
use super::{Findings, Stats};

/// Completions the batcher may have written together with the poison one.
pub const BATCH_WINDOW_NS: i64 = 250_000_000;

pub fn check(c: &Input, f: &mut Findings, s: &mut Stats) {
    let worker_of: HashMap<&str, usize> = c
        .history
        .iter()
        .filter(|l| l.ev == "up")
        .filter_map(|l| l.owner.as_deref().map(|o| (o, l.w)))
        .collect();
    let lease_us = c.run.lease_ms as i64 * 1000;
    // An expiry that no fault explains: the worker had the job and never ended it.
    let unexplained_expiry = |job: i64| {
        c.expiries.iter().any(|x| {
            x.job_id == job
                && x.reaped_by != super::execution::RACE_REAPER
                && worker_of.get(x.owner.as_str()).is_none_or(|w| {
                    !lease_fault_near(
                        c,
                        *w,
                        x.lease_until_us - lease_us,
                        x.reaped_at_us + 1_000_000,
                    )
                })
        })
    };
    let mut poison: HashSet<i64> = HashSet::new();
    for j in &c.jobs {
        let expect = c.expect(j);
        let (want, what) = match expect {
            "poison_result" => ("result", "a poisoned result"),
            "poison_outcome" => ("outcome", "an effect outcome that cannot be recorded"),
            "poison_payload" => ("decod", "an undecodable (too deep) payload"),
            _ => continue,
        };
        poison.insert(j.id);
        match expect {
            "poison_result" => s.poison_results += 1,
            "poison_outcome" => s.poison_outcomes += 1,
            _ => s.poison_payloads += 1,
        }
        if expect == "poison_outcome" {
            // The effect happened once; no attempt may apply it again.
            let applied = c
                .effects
                .iter()
                .filter(|e| e.job == j.id && e.decision == "applied")
                .filter(|e| e.worker != crate::nemesis_operator::NEIGHBOUR_WORKER)
                .count();
            if applied > 1 {
                f.add(
                    "poison_outcome",
                    format!(
                        "job {} whose effect outcome could not be recorded applied its effect {applied} times",
                        j.id
                    ),
                );
            }
        }
        if j.state == "cancelled" {
            continue; // an operator's cancel got there first
        }
        // Every attempt a worker ended itself must have ended dead with the reason; the
        // others may only have ended by faults (a racing reaper, a killed or stopped
        // worker, a release at shutdown) before a worker got to them, so a job whose
        // attempts faults used up may end dead of an expiry. An operator's retry (the
        // retention loop races `retry_dead`) starts it over.
        // A poisoned result or outcome is refused only once it is written: an attempt that
        // failed first (a lost effect reply, a connection cut before `complete_in`) retries,
        // as any would; a decode failure comes first, so a payload's attempts may not fail
        // otherwise.
        let ended = |event: &str| match expect {
            "poison_payload" => matches!(event, "completed" | "failed" | "dead"),
            _ => matches!(event, "completed" | "dead"),
        };
        let ended_by_worker_otherwise = c.events.iter().any(|e| {
            e.job_id == j.id
                && ended(e.event.as_str())
                && !e
                    .detail
                    .as_deref()
                    .unwrap_or("")
                    .to_lowercase()
                    .contains(want)
        });
        let reason = j.last_error.as_deref().unwrap_or("").to_lowercase();
        let contained = reason.contains(want) || !unexplained_expiry(j.id);
        if j.state != "dead" || ended_by_worker_otherwise || !contained {
            f.add(
                match expect {
                    "poison_result" => "poison_result",
                    "poison_outcome" => "poison_outcome",
                    _ => "poison_payload",
                },
                format!(
                    "job {} with {what} ended {} after {} attempts, reason {:?}",
                    j.id, j.state, j.attempts, j.last_error
                ),
            );
        }
    }
    neighbours(c, &poison, f, s);
}

fn neighbours(c: &Input, poison: &HashSet<i64>, f: &mut Findings, s: &mut Stats) {
    let all = attempts(c);
    let ran: HashMap<(i64, i64), &Attempt> = all.iter().map(|a| ((a.job, a.gen), a)).collect();
    let mut ends: HashMap<(i64, i64), &str> = HashMap::new();
    for e in &c.events {
        if matches!(
            e.event.as_str(),
            "completed" | "failed" | "dead" | "released" | "reaped" | "cancelled"
        ) {
            ends.entry((e.job_id, e.generation))
                .or_insert(e.event.as_str());
        }
    }
    let worker_of: HashMap<&str, usize> = c
        .history
        .iter()
        .filter(|l| l.ev == "up")
        .filter_map(|l| l.owner.as_deref().map(|o| (o, l.w)))
        .collect();
    let lease_us = c.run.lease_ms as i64 * 1000;
    // The racing reaper's victims suffered for that fault, not for their neighbour.
    let raced: HashSet<(i64, i64)> = c
        .expiries
        .iter()
        .filter(|x| x.reaped_by == super::execution::RACE_REAPER)
        .map(|x| (x.job_id, x.generation))
        .collect();
    // Jobs dead by design (bad input of their own) are no victims of their neighbour.
    let dead_by_design: HashSet<i64> = c
        .jobs
        .iter()
        .filter(|j| c.expect(j) == "dead")
        .map(|j| j.id)
        .collect();
    let mut checked: HashSet<(i64, i64)> = HashSet::new();
    let mut judge = |n: (i64, i64), w: Option<usize>, from: i64, p: i64, f: &mut Findings| {
        if poison.contains(&n.0)
            || raced.contains(&n)
            || dead_by_design.contains(&n.0)
            || !checked.insert(n)
        {
            return;
        }
        s.poison_neighbours += 1;
        let end = ends.get(&n).copied().unwrap_or("no ending");
        let affected = match ran.get(&n) {
            None => matches!(end, "reaped" | "failed" | "dead"),
            Some(a) => a.end == End::Logged("ok".into()) && end != "completed",
        };
        // A fault on its worker from the claim until a lease after its handler ended
        // (a slow handler's ending is written then) explains the loss.
        let until = ran.get(&n).map_or(from, |a| a.end_us.max(from));
        let to = until + lease_us + 1_000_000;
        // So does a fault aimed at the neighbour itself: a session holding its row past
        // the lease (renewal skips a locked row, by design) loses its lease whatever its
        // neighbours are.
        let faulted =
            w.is_none_or(|w| lease_fault_near(c, w, from, to)) || targeted_fault_on(c, n, from, to);
        if affected && !faulted {
            let ran_how = match ran.get(&n) {
                None => "its handler never ran".to_string(),
                Some(_) => "its handler returned ok".to_string(),
            };
            f.add(
                "poison_neighbour",
                format!("job {} gen {} (beside poison job {p}): {ran_how}, and the generation ended {end}", n.0, n.1),
            );
        }
    };
    // Claim neighbours.
    let mut claims: HashMap<(&str, i64), Vec<(i64, i64)>> = HashMap::new();
    for e in c.events.iter().filter(|e| e.event == "claimed") {
        if let Some(o) = e.owner.as_deref() {
            claims
                .entry((o, e.at_us))
                .or_default()
                .push((e.job_id, e.generation));
        }
    }
    for ((owner, at), batch) in &claims {
        let Some(p) = batch.iter().find(|(j, _)| poison.contains(j)) else {
            continue;
        };
        for n in batch {
            judge(*n, worker_of.get(owner).copied(), *at, p.0, f);
        }
    }
    // Completion-batch neighbours of poisoned results that returned ok.
    for a in all
        .iter()
        .filter(|a| poison.contains(&a.job) && a.end == End::Logged("ok".into()))
    {
        for b in all.iter().filter(|b| {
            b.w == a.w
                && b.inc == a.inc
                && b.end == End::Logged("ok".into())
                && (b.end_mono - a.end_mono).abs() <= BATCH_WINDOW_NS
        }) {
            // From the neighbour's own start: a fault while it ran (a stop that let its
            // lease pass before its handler returned beside the poison job's) explains
            // its loss as much as one after.
            let from = (a.end_us - 250_000).min(b.start_us);
            judge((b.job, b.gen), Some(a.w), from, a.job, f);
        }
    }
}
