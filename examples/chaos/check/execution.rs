//! Real execution: when handlers actually ran, from the workers' own logs, not when the
//! database says a lease was held.
//!
//! An attempt is one handler run: its `start` line, its `effect` lines, and its end —
//! the `end` line its drop guard wrote (also for an aborted or panicked handler), or, for
//! a process that died without one (SIGKILL), the moment the harness had reaped that
//! process: it executed nothing after that.
//!
//! Clocks. Attempts are compared with each other on `CLOCK_MONOTONIC`, one clock for all
//! processes of the machine, allowing [`MONO_BOUND_NS`] (the time to write a line).
//! Attempts are compared with database times (`lease_until`, event times, which are
//! `now()` of the writing transaction) on the wall clock, which is the database's own
//! (same machine), allowing [`DB_CLOCK_BOUND_US`]; the harness measures the real gap and
//! `clock_bound` fails the run if it is larger.
//!
//! Rules (no exemption for cancelled jobs):
//! - `key_overlap`: two attempts of one key (or, unkeyed, of one job) never run at the
//!   same time. Two exceptions, both faults that break the lease from outside: a
//!   process frozen by SIGSTOP runs nothing, so an attempt whose process was frozen when
//!   the other began is excused if it ended within [`zombie_grace_ns`] of the process
//!   resuming (its lease is gone; it must stop as soon as it runs again), and so is one
//!   whose process froze between its lease check and its first line before the other
//!   began, if it started and ended within that grace; and an
//!   attempt whose live lease the nemesis's racing reaper (its clock ahead of the
//!   database's) took back is excused — no library can see that coming. Both are
//!   counted in the report.
//! - `key_start_order`: a key's jobs first start in `key_seq` order (per key epoch).
//! - `start_without_lease`: no handler starts after the lease in force for its
//!   generation ran out (the furthest `lease_until` written by then, from the lease
//!   audit; reaped or not), or after the generation was released, cancelled, failed or
//!   completed, and none starts for a generation the database never claimed. A start
//!   right after the process resumed from a SIGSTOP that froze it between its lease check
//!   and the handler's first line is excused if the handler stopped within the grace.
//! - `stale_effect`: no attempt calls the effect server after a newer generation of its
//!   job started (the racing reaper's victims excused, as above).

use std::collections::{BTreeMap, HashMap, HashSet};

use super::input::Input;
use super::{Findings, Stats};
use crate::model::{DB_CLOCK_BOUND_US, MONO_BOUND_NS};

/// How an attempt's end is known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum End {
    /// Its `end` line, with the outcome.
    Logged(String),
    /// No `end` line: its process ended (how), reaped by the harness.
    ProcessEnded(String),
    /// No `end` line and no record of the process ending: treated as running forever.
    Open,
}

#[derive(Clone, Debug)]
pub struct Attempt {
    pub job: i64,
    pub gen: i64,
    pub key: Option<String>,
    pub w: usize,
    pub inc: u32,
    pub start_mono: i64,
    pub start_us: i64,
    pub end_mono: i64,
    pub end_us: i64,
    pub end: End,
    /// (mono, step) of each call to the effect server.
    pub effects: Vec<(i64, String)>,
}

impl Attempt {
    fn who(&self) -> String {
        format!(
            "job {} gen {} (w{}.{})",
            self.job, self.gen, self.w, self.inc
        )
    }
}

/// Every attempt in the histories, ends resolved.
pub fn attempts(c: &Input) -> Vec<Attempt> {
    let mut out: Vec<Attempt> = Vec::new();
    let mut open: HashMap<(usize, u32, i64, i64), usize> = HashMap::new();
    for l in &c.history {
        let k = (l.w, l.inc, l.job, l.generation);
        match l.ev.as_str() {
            "start" => {
                open.insert(k, out.len());
                out.push(Attempt {
                    job: l.job,
                    gen: l.generation,
                    key: l.key.clone(),
                    w: l.w,
                    inc: l.inc,
                    start_mono: l.mono_ns,
                    start_us: l.t_us,
                    end_mono: i64::MAX,
                    end_us: i64::MAX,
                    end: End::Open,
                    effects: Vec::new(),
                });
            }
            "effect" => {
                if let Some(i) = open.get(&k) {
                    out[*i].effects.push((l.mono_ns, l.step.clone()));
                }
            }
            "end" => {
                if let Some(i) = open.remove(&k) {
                    let a = &mut out[i];
                    a.end_mono = l.mono_ns;
                    a.end_us = l.t_us;
                    a.end = End::Logged(l.outcome.clone());
                }
            }
            _ => {}
        }
    }
    let ended: HashMap<(usize, u32), (i64, i64, &str)> = c
        .processes
        .iter()
        .map(|p| ((p.w, p.inc), (p.ended_mono_ns, p.ended_us, p.how.as_str())))
        .collect();
    for a in out.iter_mut().filter(|a| a.end == End::Open) {
        if let Some((mono, us, how)) = ended.get(&(a.w, a.inc)) {
            a.end_mono = *mono;
            a.end_us = *us;
            a.end = End::ProcessEnded(how.to_string());
        }
    }
    // A handler that completes the job inside its own transaction (`complete_in`) ends
    // its attempt when that transaction commits: the key moves on then, by design, and
    // what the handler runs after its commit is outside the attempt. The completion's
    // event time (database clock, just before the commit) bounds the end.
    let completed: HashMap<(i64, i64), i64> = c
        .events
        .iter()
        .filter(|e| e.event == "completed")
        .map(|e| ((e.job_id, e.generation), e.at_us))
        .collect();
    for a in out.iter_mut() {
        if let Some(at) = completed.get(&(a.job, a.gen)) {
            if *at < a.end_us && *at >= a.start_us {
                a.end_mono -= (a.end_us - at) * 1000;
                a.end_us = *at;
            }
        }
    }
    out
}

/// How long a handler may go on after its frozen process resumes: it is told its lease
/// is gone at once (the local deadline passed while frozen) and a handler that ignores
/// it is stopped within a renewal interval; one second more for the backlog of a process
/// that just woke up.
pub fn zombie_grace_ns(c: &Input) -> i64 {
    (c.run.renew_ms as i64 + 1000) * 1_000_000
}

/// SIGSTOP windows per worker id: (stopped, resumed, grace left after resuming), mono.
/// Windows closer together than the grace are one freeze: the process ran only between
/// them, and that running time is taken from the grace it has after the last one (two
/// SIGSTOPs 3 ms apart left a handler no time to stop in between).
fn frozen(c: &Input) -> HashMap<usize, Vec<(i64, i64, i64)>> {
    let grace = zombie_grace_ns(c);
    let mut raw: HashMap<usize, Vec<(i64, i64)>> = HashMap::new();
    for f in c.faults.iter().filter(|f| f.kind == "sigstop" && f.hit) {
        if let Some(w) = f.target.strip_prefix('w').and_then(|w| w.parse().ok()) {
            raw.entry(w)
                .or_default()
                .push((f.start_mono_ns, f.end_mono_ns));
        }
    }
    raw.into_iter()
        .map(|(w, mut ws)| {
            ws.sort_unstable();
            (w, merge_freezes(&ws, grace))
        })
        .collect()
}

/// See [`frozen`]: sorted (stopped, resumed) windows → merged (stopped, resumed, grace).
pub fn merge_freezes(ws: &[(i64, i64)], grace: i64) -> Vec<(i64, i64, i64)> {
    let mut out: Vec<(i64, i64, i64)> = Vec::new();
    for &(stop, cont) in ws {
        match out.last_mut() {
            Some(last) if stop - last.1 < last.2 => {
                last.2 -= (stop - last.1).max(0);
                last.1 = last.1.max(cont);
            }
            _ => out.push((stop, cont, grace)),
        }
    }
    out
}

pub fn check(c: &Input, f: &mut Findings, s: &mut Stats) {
    let all = attempts(c);
    s.attempts = all.len() as u64;
    for a in &all {
        match &a.end {
            End::Logged(o) if o == "dropped" => s.ends_dropped += 1,
            End::ProcessEnded(_) => s.ends_at_process_end += 1,
            End::Open => s.ends_open += 1,
            _ => {}
        }
    }
    overlap(c, &all, f, s);
    start_order(c, &all, f);
    without_lease(c, &all, f, s);
    stale_effects(&all, &race_reaped(c), f);
    flood_waits(c, &all, s);
    let clock = &c.run.clock;
    if clock.good_samples == 0 || clock.max_offset_us > DB_CLOCK_BOUND_US {
        f.add(
            "clock_bound",
            format!(
                "database clock {}µs from the workers' ({} good samples of {}); the checker allows {}µs",
                clock.max_offset_us, clock.good_samples, clock.samples, DB_CLOCK_BOUND_US
            ),
        );
    }
}

/// Generations whose live lease the racing reaper (a fault: its clock runs ahead) took.
fn race_reaped(c: &Input) -> HashSet<(i64, i64)> {
    c.expiries
        .iter()
        .filter(|x| x.reaped_by == RACE_REAPER)
        .map(|x| (x.job_id, x.generation))
        .collect()
}

/// The nemesis's reaper whose clock runs ahead of the database's.
pub const RACE_REAPER: &str = "chaos-reaper-race";

fn overlap(c: &Input, all: &[Attempt], f: &mut Findings, s: &mut Stats) {
    let frozen = frozen(c);
    let raced = race_reaped(c);
    let mut groups: BTreeMap<String, Vec<&Attempt>> = BTreeMap::new();
    for a in all {
        let g = match &a.key {
            Some(k) => format!("key {k}"),
            None => format!("job {}", a.job),
        };
        groups.entry(g).or_default().push(a);
    }
    for (group, mut list) in groups {
        list.sort_by_key(|a| a.start_mono);
        let mut active: Vec<&Attempt> = Vec::new();
        for b in list {
            active.retain(|a| a.end_mono > b.start_mono + MONO_BOUND_NS);
            for a in &active {
                let excused = frozen.get(&a.w).is_some_and(|ws| {
                    ws.iter().any(|(stop, cont, left)| {
                        a.start_mono <= *cont && *stop <= b.start_mono && a.end_mono <= cont + left
                    })
                });
                // The other way round: `b`'s process checked its lease and froze before
                // the handler's first line, while `a` was not yet running; it starts when
                // the process resumes, with `a` running (the start `without_lease`
                // excuses), and must stop within the grace.
                let resumed_late = frozen.get(&b.w).is_some_and(|ws| {
                    ws.iter().any(|(stop, cont, left)| {
                        *stop <= a.start_mono
                            && b.start_mono <= cont + left
                            && b.end_mono <= cont + left
                    })
                });
                if excused || resumed_late {
                    s.zombie_overlaps_excused += 1;
                    continue;
                }
                if raced.contains(&(a.job, a.gen)) {
                    s.race_overlaps_excused += 1;
                    continue;
                }
                let how = match &a.end {
                    End::Logged(o) => format!("ended {o}"),
                    End::ProcessEnded(h) => format!("process ended: {h}"),
                    End::Open => "never ended".into(),
                };
                f.add(
                    "key_overlap",
                    format!(
                        "{group}: {} started while {} was still running ({how}, {}ms later; state now {})",
                        b.who(),
                        a.who(),
                        (a.end_mono.saturating_sub(b.start_mono)) / 1_000_000,
                        c.job(a.job).map(|j| j.state.as_str()).unwrap_or("?"),
                    ),
                );
            }
            active.push(b);
        }
    }
}

fn start_order(c: &Input, all: &[Attempt], f: &mut Findings) {
    let mut first: HashMap<i64, i64> = HashMap::new();
    for a in all {
        let e = first.entry(a.job).or_insert(a.start_mono);
        *e = (*e).min(a.start_mono);
    }
    // (key, epoch) → (key_seq, first start, job)
    type Started = Vec<(i64, i64, i64)>;
    let mut by_key: BTreeMap<(&str, u32), Started> = BTreeMap::new();
    for j in &c.jobs {
        let (Some(ke), Some(seq), Some(t)) = (c.key_epoch(j), j.key_seq, first.get(&j.id)) else {
            continue;
        };
        by_key.entry(ke).or_default().push((seq, *t, j.id));
    }
    for ((key, epoch), mut js) in by_key {
        js.sort();
        for pair in js.windows(2) {
            let ((sa, ta, ja), (sb, tb, jb)) = (pair[0], pair[1]);
            if tb + MONO_BOUND_NS < ta {
                f.add(
                    "key_start_order",
                    format!(
                        "key {key} (epoch {epoch}): job {jb} (key_seq {sb}) first started {}ms before job {ja} (key_seq {sa})",
                        (ta - tb) / 1_000_000
                    ),
                );
            }
        }
    }
}

/// The database's end of each generation: the reaped lease's deadline, or the first
/// event that ended it.
fn generation_ends(c: &Input) -> HashMap<(i64, i64), (i64, String)> {
    let mut out: HashMap<(i64, i64), (i64, String)> = HashMap::new();
    let mut put = |k: (i64, i64), at: i64, what: String| {
        let e = out.entry(k).or_insert((at, what.clone()));
        if at < e.0 {
            *e = (at, what);
        }
    };
    for x in &c.expiries {
        put(
            (x.job_id, x.generation),
            x.lease_until_us,
            "its lease ended (reaped)".into(),
        );
    }
    for e in &c.events {
        if matches!(
            e.event.as_str(),
            "completed" | "failed" | "dead" | "released" | "cancelled" | "reaped"
        ) {
            put(
                (e.job_id, e.generation),
                e.at_us,
                format!("it was {}", e.event),
            );
        }
    }
    out
}

fn without_lease(c: &Input, all: &[Attempt], f: &mut Findings, s: &mut Stats) {
    let ends = generation_ends(c);
    // A handler whose task checked its lease just before its process was frozen starts
    // when the process resumes, the lease gone meanwhile: no library can close that
    // window. Excused only if it started and ended within the grace after resuming
    // (told at once that its lease is lost, it must stop), as with overlaps.
    let frozen = frozen(c);
    let resumed_and_stopped = |a: &Attempt| {
        frozen.get(&a.w).is_some_and(|ws| {
            ws.iter().any(|(stop, cont, left)| {
                *stop <= a.start_mono && a.start_mono <= cont + left && a.end_mono <= cont + left
            })
        })
    };
    // (job, generation) → (written at, lease until), in write order.
    let mut leases: HashMap<(i64, i64), Vec<(i64, i64)>> = HashMap::new();
    for l in &c.leases {
        leases
            .entry((l.job_id, l.generation))
            .or_default()
            .push((l.written_at_us, l.lease_until_us));
    }
    let claimed: HashSet<(i64, i64)> = c
        .events
        .iter()
        .filter(|e| e.event == "claimed")
        .map(|e| (e.job_id, e.generation))
        .collect();
    for a in all {
        if !claimed.contains(&(a.job, a.gen)) {
            f.add(
                "start_without_lease",
                format!(
                    "{} started, but the database never claimed that generation",
                    a.who()
                ),
            );
            continue;
        }
        // The lease in force at the start: the furthest deadline written by then.
        let in_force = leases.get(&(a.job, a.gen)).and_then(|ws| {
            ws.iter()
                .filter(|(at, _)| *at <= a.start_us + DB_CLOCK_BOUND_US)
                .map(|(_, until)| *until)
                .max()
        });
        if let Some(until) = in_force {
            if a.start_us > until + DB_CLOCK_BOUND_US && resumed_and_stopped(a) {
                s.frozen_starts_excused += 1;
                continue;
            }
            if a.start_us > until + DB_CLOCK_BOUND_US {
                f.add(
                    "start_without_lease",
                    format!(
                        "{} started {}ms after its lease ran out (never renewed past it) ({})",
                        a.who(),
                        (a.start_us - until) / 1000,
                        a.key.as_deref().unwrap_or("unkeyed")
                    ),
                );
                continue;
            }
        }
        if let Some((at, what)) = ends.get(&(a.job, a.gen)) {
            if a.start_us > at + DB_CLOCK_BOUND_US {
                f.add(
                    "start_without_lease",
                    format!(
                        "{} started {}ms after {what} ({})",
                        a.who(),
                        (a.start_us - at) / 1000,
                        a.key.as_deref().unwrap_or("unkeyed")
                    ),
                );
            }
        }
    }
}

fn stale_effects(all: &[Attempt], raced: &HashSet<(i64, i64)>, f: &mut Findings) {
    let mut by_job: HashMap<i64, Vec<&Attempt>> = HashMap::new();
    for a in all {
        by_job.entry(a.job).or_default().push(a);
    }
    for list in by_job.values() {
        for a in list
            .iter()
            .filter(|a| !a.effects.is_empty() && !raced.contains(&(a.job, a.gen)))
        {
            let newer = list
                .iter()
                .filter(|b| b.gen > a.gen)
                .min_by_key(|b| b.start_mono);
            let Some(b) = newer else { continue };
            if let Some((t, step)) = a
                .effects
                .iter()
                .find(|(t, _)| *t > b.start_mono + MONO_BOUND_NS)
            {
                f.add(
                    "stale_effect",
                    format!(
                        "{} called the effect server for {step} {}ms after {} had started",
                        a.who(),
                        (t - b.start_mono) / 1_000_000,
                        b.who()
                    ),
                );
            }
        }
    }
}

/// Coverage of the flood: a chain's next job that started well after its predecessor
/// ended (it waited for a slot), and the longest wait between a chain job's claim and
/// its handler's start.
fn flood_waits(c: &Input, all: &[Attempt], s: &mut Stats) {
    let mut by_job: HashMap<i64, (i64, i64)> = HashMap::new(); // first start, last end (µs)
    for a in all
        .iter()
        .filter(|a| a.key.as_deref().is_some_and(|k| k.starts_with("chain-")))
    {
        let e = by_job.entry(a.job).or_insert((a.start_us, a.end_us));
        e.0 = e.0.min(a.start_us);
        e.1 = e.1.max(a.end_us);
    }
    let mut chains: BTreeMap<&str, Vec<(i64, i64)>> = BTreeMap::new();
    for j in &c.jobs {
        if let (Some(k), Some(seq)) = (&j.job_key, j.key_seq) {
            if by_job.contains_key(&j.id) {
                chains.entry(k.as_str()).or_default().push((seq, j.id));
            }
        }
    }
    for js in chains.values_mut() {
        js.sort();
        for pair in js.windows(2) {
            let (prev, next) = (by_job[&pair[0].1], by_job[&pair[1].1]);
            if next.0 - prev.1 >= 300_000 {
                s.flood_successor_waited += 1;
            }
        }
    }
    let claims: HashMap<(i64, i64), i64> = c
        .events
        .iter()
        .filter(|e| e.event == "claimed")
        .map(|e| ((e.job_id, e.generation), e.at_us))
        .collect();
    for a in all
        .iter()
        .filter(|a| a.key.as_deref().is_some_and(|k| k.starts_with("chain-")))
    {
        if let Some(at) = claims.get(&(a.job, a.gen)) {
            s.chain_claim_to_start_max_ms =
                s.chain_claim_to_start_max_ms.max((a.start_us - at) / 1000);
        }
    }
}
