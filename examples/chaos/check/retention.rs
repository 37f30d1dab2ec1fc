//! What retention may delete, and what must be left at the end.
//!
//! - `pruned_dead`: retention deleted a job that was not done or cancelled. Dead jobs
//!   are the dead-letter queue (an operator retries or cancels them); an open job is
//!   work. The audit copy says in which state each deleted row was.
//! - `stranded_key`: at the end, a key has waiting jobs but no head that could ever
//!   move them (no pending, running or held job, and no dead job for an operator to
//!   retry or cancel). Nothing will ever run them.
//! - `orphan_running`: at the end, after the drain and with every worker stopped, a job
//!   is still running: no live owner will ever end it, and it waits for a reaper.

use std::collections::BTreeMap;

use super::input::{Input, Job};
use super::{Findings, Stats};

pub fn check(c: &Input, f: &mut Findings, s: &mut Stats) {
    for o in &c.operator {
        match o.action.as_str() {
            "prune" => s.pruned_jobs += o.n,
            "retry_dead" if o.ok => s.dead_retried += 1,
            _ => {}
        }
    }
    let mut deleted_dead: BTreeMap<(&str, &str), Vec<i64>> = BTreeMap::new();
    for j in c.jobs.iter().filter(|j| j.deleted_at_us.is_some()) {
        if matches!(j.state.as_str(), "done" | "cancelled") {
            continue;
        }
        if let Some(k) = &j.job_key {
            deleted_dead
                .entry((j.queue.as_str(), k.as_str()))
                .or_default()
                .push(j.id);
        }
        f.add(
            "pruned_dead",
            format!(
                "job {} ({}, key {:?}) was deleted by retention while {}: {:?}",
                j.id, j.kind, j.job_key, j.state, j.last_error
            ),
        );
    }
    let mut keys: BTreeMap<(&str, &str), Vec<&Job>> = BTreeMap::new();
    for j in c.jobs.iter().filter(|j| j.deleted_at_us.is_none()) {
        if let Some(k) = &j.job_key {
            keys.entry((j.queue.as_str(), k.as_str()))
                .or_default()
                .push(j);
        }
        if j.state == "running" {
            f.add(
                "orphan_running",
                format!(
                    "job {} ({}) is still running after the drain with every worker stopped: owner {:?}, lease until {:?}, gen {}",
                    j.id, j.kind, j.owner, j.lease_until_us, j.generation
                ),
            );
        }
    }
    for ((queue, key), js) in keys {
        let waiting: Vec<i64> = js
            .iter()
            .filter(|j| j.state == "waiting")
            .map(|j| j.id)
            .collect();
        let head = js
            .iter()
            .any(|j| matches!(j.state.as_str(), "pending" | "running" | "held" | "dead"));
        if !waiting.is_empty() && !head {
            let cause = match deleted_dead.get(&(queue, key)) {
                Some(ids) => format!("retention deleted its unfinished job(s) {ids:?}"),
                None => "no deleted head found".into(),
            };
            f.add(
                "stranded_key",
                format!(
                    "key {queue}/{key}: jobs {waiting:?} wait with no head to move them ({cause})"
                ),
            );
        }
    }
}
