//! The offline checker: a pure function of the artifact directory.
//!
//!     cargo run --example chaos -- check target/chaos/<seed>
//!
//! It reads the database dump (`db/`: jobs, job_events, lease_expiries, job_keys, the
//! effect ledger, each with the rows retention deleted), the effect server's log, the
//! workers' histories (real execution: handler starts, effect calls, ends) and metrics,
//! the enqueue, fault and operator logs ([`input`]), checks the invariants listed in
//! [`INVARIANTS`] ([`jobs`], [`effects`], [`leases`], [`execution`], [`endings`],
//! [`poison`], [`retention`]) and renders the report ([`report`]). Each violation is printed with a
//! witness: the job id and what was seen. `chaos selftest` ([`selftest`]) shows that
//! each rule fires on a small synthetic run that breaks it, and stays quiet on one that
//! does not.

mod effects;
mod endings;
mod execution;
mod input;
mod jobs;
mod leases;
mod periodic;
mod poison;
mod report;
mod retention;
pub mod selftest;
mod starts;
mod synth;

use std::collections::BTreeMap;
use std::path::Path;

pub use execution::RACE_REAPER;
pub use input::Input;

/// Every invariant, in report order, with what a violation means.
pub const INVARIANTS: [(&str, &str); 41] = [
    ("lost", "an acknowledged enqueue has no row"),
    ("unexpected", "a row no enqueue asked for"),
    ("stuck", "pending or waiting after the drain"),
    (
        "missing_reason",
        "dead or cancelled without a recorded reason",
    ),
    (
        "effect_applied_twice",
        "an effect (key, or job+step) applied more than once at the server",
    ),
    (
        "effect_key_unstable",
        "an effect key that is not <identity>/<job>/<step>, with one identity for all of a job's keys",
    ),
    (
        "effect_missing",
        "a done job whose effect step was never applied",
    ),
    (
        "stale_token_accepted",
        "a lower generation accepted after a higher one, or a ledger row outside its generation",
    ),
    (
        "stale_completion",
        "a completion or result not from the latest claim's generation",
    ),
    (
        "generation_order",
        "generation decreased, or a claim did not take generation + 1",
    ),
    (
        "unexplained_reclaim",
        "a re-claim with no recorded expiry, failure, release or retry before it",
    ),
    (
        "key_order",
        "the first applies of a key's jobs not in key_seq order",
    ),
    (
        "key_lease_overlap",
        "two live leases on one key (database events)",
    ),
    (
        "key_overlap",
        "two handlers of one key (or one job) running at the same time (workers' logs)",
    ),
    (
        "key_start_order",
        "a key's handlers first started out of key_seq order",
    ),
    (
        "start_without_lease",
        "a handler started after its generation's lease ended or the generation ended",
    ),
    (
        "stale_effect",
        "an attempt called the effect server after a newer generation of its job started",
    ),
    (
        "attempt_limit",
        "more attempts than max_attempts, or dead before they were spent",
    ),
    ("held_claimed", "a job claimed while held"),
    (
        "backoff",
        "a retry claimed before its backoff passed (database clock)",
    ),
    (
        "lease_lost_while_healthy",
        "a lease expired with no fault to explain it (renewal failed)",
    ),
    (
        "liveness",
        "no throughput after the faults, probe jobs late, or the drain did not finish",
    ),
    ("bad_input", "bad input not contained as specified"),
    (
        "dead_never_started",
        "an expired lease made its job dead though that attempt's handler never started",
    ),
    (
        "cancelled_unasked",
        "a running handler ended cancelled with no cancel requested on its row",
    ),
    (
        "false_stale",
        "an attempt counted stale though its own generation's completion committed",
    ),
    (
        "result_over_limit",
        "a stored result larger than the result cap",
    ),
    (
        "ending_late",
        "a handler returned ok and its ending came over a lease later, no fault to explain it",
    ),
    (
        "poison_result",
        "a result with NUL, over the cap or too deep (returned or completed in a transaction) not dead with a reason naming the result",
    ),
    (
        "poison_outcome",
        "an effect outcome that cannot be recorded not dead naming the outcome, or its effect applied again",
    ),
    (
        "poison_payload",
        "a payload too deep to decode not dead with a decode reason",
    ),
    (
        "poison_neighbour",
        "a job claimed or completed beside a poison job suffered for it",
    ),
    (
        "periodic_fire",
        "a periodic fire time enqueued twice, missed while a build ran, off its spec, or wrong on a daylight-saving night",
    ),
    (
        "pruned_dead",
        "retention deleted a dead (dead-letter) or unfinished job",
    ),
    (
        "stranded_key",
        "waiting jobs with no head that could ever move them",
    ),
    (
        "orphan_running",
        "a job left running after the drain with no live owner",
    ),
    (
        "clock_bound",
        "the database's clock was further from the workers' than the checker allows",
    ),
    (
        "reap_late",
        "an expired lease reaped later than two reaper intervals, no fault to explain it",
    ),
    (
        "host_tx_broken",
        "a host transaction unusable after a call the library refused in it",
    ),
    (
        "neighbour_effect_shared",
        "another schema's job's effect answered at the effect store as if it were one of ours",
    ),
    ("coverage", "a fault kind or guarded path never hit"),
];

pub struct Report {
    pub text: String,
    pub pass: bool,
}

/// Violations found so far, by invariant, each with its witness.
#[derive(Default)]
pub struct Findings {
    violations: BTreeMap<&'static str, Vec<String>>,
}

impl Findings {
    pub fn add(&mut self, inv: &'static str, witness: String) {
        debug_assert!(INVARIANTS.iter().any(|(k, _)| *k == inv), "{inv}");
        self.violations.entry(inv).or_default().push(witness);
    }

    pub fn count(&self, inv: &str) -> usize {
        self.violations.get(inv).map(Vec::len).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.violations.is_empty()
    }

    pub fn witnesses(&self, inv: &str) -> Option<&Vec<String>> {
        self.violations.get(inv)
    }
}

/// Figures for the report, gathered while checking.
#[derive(Default)]
pub struct Stats {
    pub acked: u64,
    pub unknown: u64,
    pub refused: u64,
    pub recovered: u64,
    pub claims: u64,
    pub reruns_explained: u64,
    pub reruns_unexplained: u64,
    pub events: BTreeMap<String, u64>,
    pub ledger_reused: u64,
    pub already: u64,
    pub fenced: u64,
    pub duplicates_at_server: u64,
    pub expiries_race: u64,
    pub expiries_explained: u64,
    pub completed_after_heal: u64,
    pub probe_max_ms: i64,
    /// kind → (attempted, hit)
    pub fault_hits: BTreeMap<String, (u64, u64)>,
    pub guarded: Vec<(&'static str, u64)>,
    // Real execution.
    pub attempts: u64,
    pub ends_dropped: u64,
    pub ends_at_process_end: u64,
    pub ends_open: u64,
    pub zombie_overlaps_excused: u64,
    /// Handlers that started right after their process resumed from a SIGSTOP, their
    /// lease gone while it was frozen, and stopped within the grace.
    pub frozen_starts_excused: u64,
    pub race_overlaps_excused: u64,
    pub flood_successor_waited: u64,
    pub chain_claim_to_start_max_ms: i64,
    // Poison and retention.
    pub poison_results: u64,
    pub poison_outcomes: u64,
    /// Stale counts read from the workers' logs (see `endings::false_stale`).
    pub stale_reports: u64,
    /// Periodic fires checked (see `periodic`).
    pub periodic_fires: u64,
    pub poison_payloads: u64,
    pub poison_neighbours: u64,
    /// Handlers that returned ok, their endings checked for delay; late ones a fault
    /// explained.
    pub endings_checked: u64,
    pub endings_late_excused: u64,
    pub pruned_jobs: u64,
    pub dead_retried: u64,
    /// Expired leases that made their job dead, checked for a handler start.
    pub dead_reaps_checked: u64,
    /// Generations that ran and ended cancelled, checked for a cancel request.
    pub running_cancels_checked: u64,
    /// Expired leases checked for a prompt reap; late ones a fault explained.
    pub reaps_checked: u64,
    pub reaps_late_excused: u64,
}

impl Stats {
    pub fn event(&self, name: &str) -> u64 {
        self.events.get(name).copied().unwrap_or(0)
    }
}

pub fn main(args: &[String]) -> ! {
    let Some(dir) = args.first() else {
        eprintln!("usage: chaos check <artifact dir>");
        std::process::exit(2)
    };
    match check(Path::new(dir)) {
        Ok(r) => {
            print!("{}", r.text);
            std::process::exit(if r.pass { 0 } else { 1 })
        }
        Err(e) => {
            eprintln!("chaos check: {e}");
            std::process::exit(2)
        }
    }
}

/// Check the artifacts in `dir`; also writes `report.json` there.
pub fn check(dir: &Path) -> Result<Report, String> {
    let input = Input::load(dir)?;
    let mut f = Findings::default();
    let mut s = Stats::default();
    jobs::enqueues(&input, &mut f, &mut s);
    jobs::histories(&input, &mut f, &mut s);
    jobs::results(&input, &mut f, &mut s);
    jobs::bad_input(&input, &mut f);
    effects::check(&input, &mut f, &mut s);
    execution::check(&input, &mut f, &mut s);
    endings::check(&input, &mut f, &mut s);
    endings::false_stale(&input, &mut f, &mut s);
    starts::check(&input, &mut f, &mut s);
    poison::check(&input, &mut f, &mut s);
    periodic::check(&input.periodic, &mut f, &mut s);
    retention::check(&input, &mut f, &mut s);
    leases::expiries(&input, &mut f, &mut s);
    leases::reaps(&input, &mut f, &mut s);
    leases::liveness(&input, &mut f, &mut s);
    leases::coverage(&input, &mut f, &mut s);
    let report = report::render(&input, &f, &s);
    let _ = crate::model::write_json(&dir.join("report.json"), &report::summary(&input, &f, &s));
    Ok(report)
}
