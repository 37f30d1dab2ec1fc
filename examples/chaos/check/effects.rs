//! Effect invariants, from the effect server's log and the library's ledger: each
//! effect applied once (per key and per job+step), keys stable, no stale fencing token
//! accepted, done jobs' effects present, and per-key order of first applies.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::input::{Input, Job};
use super::{Findings, Stats};
use crate::model::EffectLog;

pub fn check(c: &Input, f: &mut Findings, s: &mut Stats) {
    let mut applied_by_key: HashMap<&str, u64> = HashMap::new();
    let mut applied_by_step: HashMap<(i64, &str), Vec<&str>> = HashMap::new();
    let mut highest: HashMap<i64, i64> = HashMap::new();
    let mut first_apply: HashMap<i64, u64> = HashMap::new();
    let mut unstable: HashSet<&str> = HashSet::new();
    // Every key of a job carries the job's one effect identity: its first key's.
    let mut identity: HashMap<i64, String> = HashMap::new();
    // A neighbour schema's effects (`neighbour_schema_effects`) are judged apart: each is
    // a new effect of a job of another schema, whose ids are this schema's.
    let (neighbour, mut log): (Vec<&EffectLog>, Vec<&EffectLog>) = c
        .effects
        .iter()
        .partition(|e| e.worker == crate::nemesis_operator::NEIGHBOUR_WORKER);
    for e in neighbour {
        if e.decision != "applied" {
            f.add(
                "neighbour_effect_shared",
                format!(
                    "a neighbour schema's job {} effect {:?} was answered {:?} (server seq {}), as if another job's",
                    e.job, e.effect_key, e.decision, e.seq
                ),
            );
        }
    }
    log.sort_by_key(|e| e.seq);
    for e in &log {
        let stable = leasehold::EffectKey::parse(&e.effect_key).is_some_and(|k| {
            let first = identity
                .entry(e.job)
                .or_insert_with(|| k.identity().to_string());
            k.job().0 == e.job && k.step() == e.step && k.identity() == first.as_str()
        });
        if !stable && unstable.insert(&e.effect_key) {
            f.add(
                "effect_key_unstable",
                format!(
                    "job {} step {}: effect key {:?}",
                    e.job, e.step, e.effect_key
                ),
            );
        }
        match e.decision.as_str() {
            "applied" | "already" => {
                let h = highest.entry(e.job).or_insert(i64::MIN);
                if e.generation < *h {
                    f.add(
                        "stale_token_accepted",
                        format!(
                            "job {}: server seq {} accepted gen {} after gen {}",
                            e.job, e.seq, e.generation, h
                        ),
                    );
                }
                *h = (*h).max(e.generation);
                if e.decision == "applied" {
                    *applied_by_key.entry(&e.effect_key).or_default() += 1;
                    applied_by_step
                        .entry((e.job, &e.step))
                        .or_default()
                        .push(&e.effect_key);
                    first_apply.entry(e.job).or_insert(e.seq);
                } else {
                    s.already += 1;
                }
            }
            "fenced" => s.fenced += 1,
            _ => {}
        }
    }
    for (k, n) in &applied_by_key {
        if *n > 1 {
            s.duplicates_at_server += n - 1;
            f.add(
                "effect_applied_twice",
                format!("effect key {k} applied {n} times"),
            );
        }
    }
    for ((job, step), keys) in &applied_by_step {
        let distinct: HashSet<&&str> = keys.iter().collect();
        if distinct.len() > 1 {
            s.duplicates_at_server += distinct.len() as u64 - 1;
            f.add(
                "effect_applied_twice",
                format!(
                    "job {job} step {step} applied under {} keys: {distinct:?}",
                    distinct.len()
                ),
            );
        }
    }
    for j in &c.jobs {
        if j.state == "done" && (j.kind == "charge" || j.kind == "slow") {
            for step in 0..j.steps.unwrap_or(0) {
                if !applied_by_step.contains_key(&(j.id, format!("s{step}").as_str())) {
                    f.add(
                        "effect_missing",
                        format!(
                            "job {} is done but its step s{step} was never applied",
                            j.id
                        ),
                    );
                }
            }
        }
    }
    ledger(c, f);
    key_order(c, &first_apply, f);
}

/// A ledger row is written only under its generation's fence: between that
/// generation's claim and the next one.
fn ledger(c: &Input, f: &mut Findings) {
    let claim_at: HashMap<(i64, i64), i64> = c
        .events
        .iter()
        .filter(|e| e.event == "claimed")
        .map(|e| ((e.job_id, e.generation), e.at_us))
        .collect();
    for l in &c.ledger {
        match claim_at.get(&(l.job_id, l.generation)) {
            None => f.add(
                "stale_token_accepted",
                format!(
                    "ledger {}: generation {} of job {} was never claimed",
                    l.effect_key, l.generation, l.job_id
                ),
            ),
            Some(start) => {
                let next = claim_at.get(&(l.job_id, l.generation + 1));
                if l.recorded_at_us < *start
                    || next.map(|n| l.recorded_at_us >= *n).unwrap_or(false)
                {
                    f.add(
                        "stale_token_accepted",
                        format!(
                            "ledger {}: recorded by gen {} at {} outside its claim [{start}, {next:?})",
                            l.effect_key, l.generation, l.recorded_at_us
                        ),
                    );
                }
            }
        }
    }
}

/// Per key (and key epoch: retention restarts a key's sequence once it has no open
/// job), the first applies at the server follow key_seq. Cancelled jobs included: a
/// cancelled head's attempt may not act once its key has moved on.
fn key_order(c: &Input, first_apply: &HashMap<i64, u64>, f: &mut Findings) {
    let mut by_key: BTreeMap<(&str, u32), Vec<&Job>> = BTreeMap::new();
    for j in &c.jobs {
        if let Some(ke) = c.key_epoch(j) {
            by_key.entry(ke).or_default().push(j);
        }
    }
    for ((k, _), mut js) in by_key {
        js.sort_by_key(|j| j.key_seq);
        let mut prev: Option<(&Job, u64)> = None;
        for j in js {
            let Some(seq) = first_apply.get(&j.id) else {
                continue;
            };
            if let Some((p, pseq)) = prev {
                if *seq < pseq {
                    f.add(
                        "key_order",
                        format!(
                            "key {k}: job {} (key_seq {:?}) applied at server seq {seq}, before job {} (key_seq {:?}) at seq {pseq}",
                            j.id, j.key_seq, p.id, p.key_seq
                        ),
                    );
                }
            }
            prev = Some((j, *seq));
        }
    }
}
