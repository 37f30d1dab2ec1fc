//! Job-side invariants: nothing lost (I1), the per-job history (generation, re-claims,
//! completions, attempts, holds, backoff), live leases per key, results, bad input.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::input::{Event, Input};
use super::{Findings, Stats};
use crate::workload::UNKNOWN_KIND;

/// Every acknowledged enqueue has its row; every row was asked for; every job ended
/// with a reason.
pub fn enqueues(c: &Input, f: &mut Findings, s: &mut Stats) {
    let by_cid: HashMap<i64, &super::input::Job> = c
        .jobs
        .iter()
        .filter_map(|j| j.cid.map(|cid| (cid, j)))
        .collect();
    for r in &c.enq {
        match r.status.as_str() {
            "ok" => s.acked += 1,
            "info" => s.unknown += 1,
            _ => s.refused += 1,
        }
        match (r.status.as_str(), by_cid.get(&(r.cid as i64))) {
            ("ok", None) => f.add(
                "lost",
                format!(
                    "cid {} (job {:?}, {}) acknowledged, no row",
                    r.cid, r.id, r.kind
                ),
            ),
            ("ok", Some(j)) if Some(j.id) != r.id => f.add(
                "lost",
                format!(
                    "cid {} acknowledged as job {:?} but the row is job {}",
                    r.cid, r.id, j.id
                ),
            ),
            ("info", Some(_)) => s.recovered += 1,
            ("rolled_back", Some(j)) => f.add(
                "unexpected",
                format!(
                    "cid {}: enqueued in a host transaction that rolled back, yet job {} exists",
                    r.cid, j.id
                ),
            ),
            ("refused", Some(j)) => f.add(
                "bad_input",
                format!(
                    "cid {} refused at enqueue ({:?}) but job {} exists",
                    r.cid, r.error, j.id
                ),
            ),
            _ => {}
        }
        // The good call a host made after calls the library refused in its transaction:
        // the transaction must still take it and commit (a database fault meanwhile
        // aside, which fails it otherwise).
        if r.scenario.as_deref() == Some("host_bad_input")
            && r.expect == "done"
            && r.error.as_deref().is_some_and(|e| {
                e.contains("current transaction is aborted") || e.contains("25P02")
            })
        {
            f.add(
                "host_tx_broken",
                format!("cid {}: {}", r.cid, r.error.as_deref().unwrap_or_default()),
            );
        }
        if r.expect == "refused" && r.status == "ok" {
            let what = match r.scenario.as_deref() {
                Some("deep_via_api") => "payload nested past 128 levels",
                _ => "oversized payload",
            };
            f.add(
                "bad_input",
                format!("cid {}: {what} accepted as job {:?}", r.cid, r.id),
            );
        }
    }
    for j in &c.jobs {
        if j.cid.and_then(|cid| c.enqueued(cid)).is_none() {
            f.add(
                "unexpected",
                format!(
                    "job {} (cid {:?}) was never enqueued by the harness",
                    j.id, j.cid
                ),
            );
        }
        match j.state.as_str() {
            // Running after the drain is `orphan_running` (check::retention).
            "done" | "held" | "running" => {}
            "dead" | "cancelled" => {
                if j.last_error.as_deref().map(str::is_empty).unwrap_or(true) {
                    f.add(
                        "missing_reason",
                        format!("job {} is {} without a reason", j.id, j.state),
                    );
                }
            }
            other => f.add(
                "stuck",
                format!(
                    "job {} ({}) is {other} after the drain (attempts {}, gen {})",
                    j.id, j.kind, j.attempts, j.generation
                ),
            ),
        }
    }
}

/// Walk each job's events in commit order.
pub fn histories(c: &Input, f: &mut Findings, s: &mut Stats) {
    let mut by_job: BTreeMap<i64, Vec<&Event>> = BTreeMap::new();
    for e in &c.events {
        by_job.entry(e.job_id).or_default().push(e);
        *s.events.entry(e.event.clone()).or_default() += 1;
    }
    // key → live lease intervals (start, end, job, generation)
    let mut intervals: BTreeMap<String, Vec<(i64, i64, i64, i64)>> = BTreeMap::new();
    for (job_id, evs) in &by_job {
        let walk = walk_job(c, *job_id, evs, f, s);
        if let Some(key) = c.job(*job_id).and_then(|j| j.job_key.clone()) {
            intervals.entry(key).or_default().extend(walk);
        }
    }
    for (k, mut iv) in intervals {
        iv.sort();
        let mut latest: Option<(i64, i64, i64)> = None; // (end, job, generation)
        for (start, end, job, g) in iv {
            if let Some((pend, pjob, pg)) = latest {
                if start < pend && pjob != job {
                    f.add(
                        "key_lease_overlap",
                        format!("key {k}: job {job} gen {g} claimed while job {pjob} gen {pg} held a live lease"),
                    );
                }
            }
            if latest.map(|l| end > l.0).unwrap_or(true) {
                latest = Some((end, job, g));
            }
        }
    }
}

/// How the previous generation ended: (generation, event, at, attempts then).
type Ended<'a> = Option<(i64, &'a str, i64, i32)>;

/// One job's events; returns its live lease intervals (start, end, job, generation).
fn walk_job(
    c: &Input,
    job_id: i64,
    evs: &[&Event],
    f: &mut Findings,
    s: &mut Stats,
) -> Vec<(i64, i64, i64, i64)> {
    let job = c.job(job_id);
    let max_attempts = job.map(|j| j.max_attempts).unwrap_or(i32::MAX);
    let mut intervals = Vec::new();
    let (mut last_gen, mut last_claim, mut attempts) = (0i64, 0i64, 0i32);
    let mut open: Option<(i64, i64)> = None; // (generation, claimed at)
    let mut ended: Ended = None;
    let mut held = false;
    let mut close = |open: &mut Option<(i64, i64)>, at: i64| {
        if let Some((g, start)) = open.take() {
            intervals.push((start, at, job_id, g));
        }
    };
    for e in evs {
        if e.generation < last_gen {
            f.add(
                "generation_order",
                format!(
                    "job {job_id}: event {} ({}) at generation {} after generation {last_gen}",
                    e.id, e.event, e.generation
                ),
            );
        }
        last_gen = last_gen.max(e.generation);
        match e.event.as_str() {
            "claimed" => {
                s.claims += 1;
                if e.generation != last_claim + 1 {
                    f.add(
                        "generation_order",
                        format!(
                            "job {job_id}: claim took generation {} after {last_claim}",
                            e.generation
                        ),
                    );
                }
                if held {
                    f.add(
                        "held_claimed",
                        format!("job {job_id}: claimed (gen {}) while held", e.generation),
                    );
                }
                if last_claim >= 1 {
                    reclaim(c, job_id, e, ended, open, f, s);
                }
                if let Some((g, _)) = open {
                    f.add(
                        "unexplained_reclaim",
                        format!(
                            "job {job_id}: gen {} claimed while gen {g} still held the lease",
                            e.generation
                        ),
                    );
                }
                attempts += 1;
                if attempts > max_attempts {
                    f.add(
                        "attempt_limit",
                        format!("job {job_id}: attempt {attempts} of max {max_attempts}"),
                    );
                }
                open = Some((e.generation, e.at_us));
                last_claim = e.generation;
            }
            "completed" => {
                if open.map(|o| o.0) != Some(e.generation) || e.generation != last_claim {
                    f.add(
                        "stale_completion",
                        format!("job {job_id}: completed at gen {} but the latest claim is gen {last_claim} (open {open:?})", e.generation),
                    );
                }
                close(&mut open, e.at_us);
            }
            "failed" | "dead" | "released" => {
                if e.generation != last_claim || open.map(|o| o.0) != Some(e.generation) {
                    f.add(
                        "stale_completion",
                        format!(
                            "job {job_id}: {} at gen {} but the live claim is {open:?}",
                            e.event, e.generation
                        ),
                    );
                }
                let how = if e.event == "released" {
                    attempts = (attempts - 1).max(0);
                    "released"
                } else {
                    "failed"
                };
                close(&mut open, e.at_us);
                ended = Some((e.generation, how, e.at_us, attempts));
            }
            "reaped" => {
                reaped(c, job_id, e, open, f);
                // A lease whose start was never recorded: the reaper gave the attempt back
                // and made the job pending at once, as a release does.
                let unstarted = e
                    .detail
                    .as_deref()
                    .is_some_and(|d| d.contains("never started"));
                if unstarted {
                    attempts = (attempts - 1).max(0);
                }
                // The racing reaper stamps its reap with its own clock, running ahead:
                // the lease it took really ended now, not at that stamp. Its victims'
                // later overlaps are the fault's doing (excused, as in `execution`), so
                // the interval closes at its claim: it cannot overlap anything later.
                let at = if e.owner.as_deref() == Some(super::execution::RACE_REAPER) {
                    open.map(|(_, start)| start).unwrap_or(e.at_us)
                } else {
                    e.at_us
                };
                close(&mut open, at);
                let how = if unstarted { "released" } else { "reaped" };
                ended = Some((e.generation, how, e.at_us, attempts));
            }
            "held" => held = true,
            "unheld" => held = false,
            "cancelled" => {
                held = false;
                close(&mut open, e.at_us);
            }
            "retried_by_operator" => {
                attempts = 0;
                ended = Some((e.generation, "retried_by_operator", e.at_us, 0));
            }
            _ => {}
        }
    }
    if let Some(j) = job {
        if j.generation != last_claim {
            f.add(
                "generation_order",
                format!("job {job_id}: row generation {} but the latest claim event is gen {last_claim}", j.generation),
            );
        }
        if j.attempts > j.max_attempts {
            f.add(
                "attempt_limit",
                format!(
                    "job {job_id}: attempts {} > max {}",
                    j.attempts, j.max_attempts
                ),
            );
        }
    }
    close(&mut open, i64::MAX);
    intervals
}

/// A claim of generation g > 1 must follow a recorded end of g - 1, and a failure or an
/// expiry must be followed by at least the minimum backoff (database clock).
fn reclaim(
    c: &Input,
    job_id: i64,
    e: &Event,
    ended: Ended,
    open: Option<(i64, i64)>,
    f: &mut Findings,
    s: &mut Stats,
) {
    match ended {
        Some((g, how, at, att)) if g == e.generation - 1 && open.is_none() => {
            s.reruns_explained += 1;
            if how == "failed" || how == "reaped" {
                let min = c.min_backoff_us(att);
                if e.at_us + 2000 < at + min {
                    f.add(
                        "backoff",
                        format!(
                            "job {job_id}: gen {} claimed {}ms after the {how} of gen {g}, minimum backoff {}ms (attempt {att})",
                            e.generation,
                            (e.at_us - at) / 1000,
                            min / 1000
                        ),
                    );
                }
            }
        }
        _ => {
            s.reruns_unexplained += 1;
            f.add(
                "unexplained_reclaim",
                format!(
                    "job {job_id}: claim of gen {} with no recorded end of gen {} (last end {:?}, open {:?})",
                    e.generation,
                    e.generation - 1,
                    ended.map(|x| (x.0, x.1)),
                    open
                ),
            );
        }
    }
}

/// A reap needs its expiry record, taken after the lease ended, of the live claim.
fn reaped(c: &Input, job_id: i64, e: &Event, open: Option<(i64, i64)>, f: &mut Findings) {
    match c.expiry(job_id, e.generation) {
        None => f.add(
            "unexplained_reclaim",
            format!(
                "job {job_id}: reaped at gen {} without a lease expiry record",
                e.generation
            ),
        ),
        Some(x) if x.reaped_at_us < x.lease_until_us => f.add(
            "unexplained_reclaim",
            format!(
                "job {job_id}: gen {} reaped at {} before its lease ended at {}",
                e.generation, x.reaped_at_us, x.lease_until_us
            ),
        ),
        _ => {}
    }
    if open.map(|o| o.0) != Some(e.generation) {
        f.add(
            "unexplained_reclaim",
            format!(
                "job {job_id}: reaped gen {} but the live claim is {open:?}",
                e.generation
            ),
        );
    }
}

/// A done job's result comes from its latest generation, whose handler ended ok.
pub fn results(c: &Input, f: &mut Findings, s: &mut Stats) {
    let mut ended_ok: HashSet<(i64, i64)> = HashSet::new();
    for l in &c.history {
        // A txhold handler completes in its own transaction: its commit may land just
        // before its future is dropped (the max run time's abort), with no line after.
        let committed_then_dropped = l.kind == "txhold" && l.outcome == "dropped";
        if l.ev == "end" && (l.outcome == "ok" || committed_then_dropped) {
            ended_ok.insert((l.job, l.generation));
        }
        s.ledger_reused += l.ledger_hits as u64;
    }
    // Whatever any path stored (returned, completed in a transaction), within the cap.
    for j in &c.jobs {
        let bytes = j.result.as_ref().map_or(0, |r| r.to_string().len());
        if c.run.max_result_bytes > 0 && bytes > c.run.max_result_bytes {
            f.add(
                "result_over_limit",
                format!(
                    "job {} ({}) stored a result of {bytes} bytes, over the cap of {}",
                    j.id, j.state, c.run.max_result_bytes
                ),
            );
        }
    }
    for j in c.jobs.iter().filter(|j| j.state == "done") {
        let gen = j
            .result
            .as_ref()
            .and_then(|r| r.get("gen"))
            .and_then(|g| g.as_i64());
        match gen {
            Some(g) if g != j.generation => f.add(
                "stale_completion",
                format!(
                    "job {}: result from gen {g} accepted, latest generation is {}",
                    j.id, j.generation
                ),
            ),
            Some(g) if !ended_ok.contains(&(j.id, g)) => f.add(
                "stale_completion",
                format!(
                    "job {}: result of gen {g} but no handler of that generation ended ok",
                    j.id
                ),
            ),
            None => f.add(
                "stale_completion",
                format!("job {}: done without a result", j.id),
            ),
            _ => {}
        }
    }
}

/// Attempt limits at the end, and bad input ending as specified: an undecodable
/// payload is dead at its first attempt that ran (an earlier one may have been reaped
/// before it ran), never retried.
pub fn bad_input(c: &Input, f: &mut Findings) {
    let retried: HashSet<i64> = c
        .events
        .iter()
        .filter(|e| e.event == "failed")
        .map(|e| e.job_id)
        .collect();
    for j in &c.jobs {
        let expect = c.expect(j);
        // Dead at once by design: bad input, and poison (see `poison`).
        let dies_at_once = expect == "dead" || expect.starts_with("poison");
        if j.state == "dead" && j.attempts < j.max_attempts && !dies_at_once {
            f.add(
                "attempt_limit",
                format!(
                    "job {} ({}) dead after {} of {} attempts: {:?}",
                    j.id, j.kind, j.attempts, j.max_attempts, j.last_error
                ),
            );
        }
        if j.kind == UNKNOWN_KIND {
            if j.generation != 0 {
                f.add(
                    "bad_input",
                    format!("job {} of an unknown kind was claimed", j.id),
                );
            }
        } else if j.kind == "strict" && expect == "dead" && j.state != "cancelled" {
            let decode = j
                .last_error
                .as_deref()
                .map(|e| e.contains("does not match kind"))
                .unwrap_or(false);
            if j.state != "dead" || !decode || retried.contains(&j.id) {
                f.add(
                    "bad_input",
                    format!(
                        "job {}: undecodable payload ended {} after {} attempts ({:?}), retried: {}",
                        j.id,
                        j.state,
                        j.attempts,
                        j.last_error,
                        retried.contains(&j.id)
                    ),
                );
            }
        }
    }
}
