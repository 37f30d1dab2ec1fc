//! Printing the plan, the two runs side by side, and the verdict.

use std::collections::BTreeMap;

use crate::handler::{account, fault_plan, reference, Injected};
use crate::run::RunReport;
use crate::{ACCOUNTS, LEASE, PAYMENTS_PER_ACCOUNT, REAPER_INTERVAL, RENEW_INTERVAL, WORKERS};

pub(crate) fn print_plan() {
    println!(
        "leasehold payments demo: {ACCOUNTS} accounts x {PAYMENTS_PER_ACCOUNT} payments = {} payment jobs, keyed by account",
        ACCOUNTS * PAYMENTS_PER_ACCOUNT
    );
    println!(
        "{WORKERS} workers (schedulers) with lease {}, renewal every {}, reaper every {}",
        humantime::format_duration(LEASE),
        humantime::format_duration(RENEW_INTERVAL),
        humantime::format_duration(REAPER_INTERVAL)
    );
    println!("faults injected, the same in both runs:");
    let mut by_kind: BTreeMap<Injected, Vec<String>> = BTreeMap::new();
    for (a, s, f) in fault_plan() {
        by_kind
            .entry(f)
            .or_default()
            .push(reference(&account(a), s));
    }
    for (kind, refs) in by_kind {
        println!(
            "  {} x {:<50} {}",
            refs.len(),
            kind.describe(),
            refs.join(", ")
        );
    }
    println!();
}

fn states(r: &RunReport) -> String {
    r.by_state
        .iter()
        .map(|(s, n)| format!("{s} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

pub(crate) fn print_table(a: &RunReport, b: &RunReport) {
    let row = |label: &str, x: String, y: String| println!("{label:<42}{x:<28}{y}");
    row("", "leasehold".into(), "per-attempt keys (control)".into());
    row(
        "idempotency key sent to the gateway",
        "<schema>/<job>/charge".into(),
        "<schema>/<job>/charge-g<generation>".into(),
    );
    row("jobs by final state", states(a), states(b));
    row(
        "attempts (all jobs)",
        a.attempts.to_string(),
        b.attempts.to_string(),
    );
    row(
        "charges requested at the gateway",
        a.requested.to_string(),
        b.requested.to_string(),
    );
    row(
        "charges applied at the gateway",
        a.applied.to_string(),
        b.applied.to_string(),
    );
    row(
        "  payment jobs",
        a.payments.to_string(),
        b.payments.to_string(),
    );
    row(
        "  duplicate charges",
        a.duplicate_charges.to_string(),
        b.duplicate_charges.to_string(),
    );
    row(
        "  payments never charged",
        a.never_charged.to_string(),
        b.never_charged.to_string(),
    );
    row(
        "  charges the jobs hold receipts for",
        a.receipts_held.to_string(),
        b.receipts_held.to_string(),
    );
    row(
        "duplicates suppressed by the gateway",
        a.duplicates_suppressed.to_string(),
        b.duplicates_suppressed.to_string(),
    );
    row(
        "stale tokens fenced by the gateway",
        a.fenced.to_string(),
        b.fenced.to_string(),
    );
    row(
        "stale completions refused (all workers)",
        a.stale_refused.to_string(),
        b.stale_refused.to_string(),
    );
    row(
        "leases expired (lease_expiries)",
        a.leases_expired.to_string(),
        b.leases_expired.to_string(),
    );
    let order = |r: &RunReport| format!("{}/{ACCOUNTS} accounts in order", r.accounts_in_order);
    row("per-account order (gateway log)", order(a), order(b));
    let spread = |r: &RunReport| {
        r.claimed_per_worker
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(" / ")
    };
    row("claims per worker", spread(a), spread(b));
    row(
        "elapsed",
        format!("{:.1}s", a.elapsed.as_secs_f64()),
        format!("{:.1}s", b.elapsed.as_secs_f64()),
    );
}

/// Problems with a run that must charge every payment exactly once, in order.
pub(crate) fn exactly_once_problems(r: &RunReport) -> Vec<String> {
    let mut problems = Vec::new();
    let done = r.by_state.get("done").copied().unwrap_or(0) as usize;
    if done != r.payments {
        problems.push(format!(
            "{} of {} jobs done ({})",
            done,
            r.payments,
            states(r)
        ));
    }
    if r.applied != r.payments as u64 {
        problems.push(format!(
            "the gateway applied {} charges for {} payments",
            r.applied, r.payments
        ));
    }
    if r.duplicate_charges > 0 {
        problems.push(format!("{} duplicate charges", r.duplicate_charges));
    }
    if r.never_charged > 0 {
        problems.push(format!("{} payments never charged", r.never_charged));
    }
    if r.accounts_in_order != ACCOUNTS as usize {
        problems.push(format!(
            "{} accounts charged out of order",
            ACCOUNTS as usize - r.accounts_in_order
        ));
    }
    if r.undecided_left {
        problems.push("gateway requests were still undecided when the books were read".into());
    }
    if r.applied_in_log as u64 != r.applied {
        problems.push("the gateway's log and counters disagree".into());
    }
    problems
}
