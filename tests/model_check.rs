//! The protocol model checker (issue 17): the hardened design keeps every property in
//! the bounded configuration, and each known defect, switched back on, is found again.
//!
//! # Reading the output
//! `cargo test --test model_check -- --nocapture` prints the state counts, and for each
//! defect the counterexample as a trace: one line per step (clock, who, the statement
//! it models) and the rows, keys and process attempts after it. See `tests/model/mod.rs`
//! for what is modelled and abstracted; the deeper check is `examples/model_check.rs`.

mod model;

use model::config::{EffectStore, JobSpec};
use model::properties::{
    CURRENT_NOT_FENCED, EFFECT_ONCE, HEALTHY_KEEPS_LEASES, NO_OVERLAP, NO_STRANDED_KEY, START_ORDER,
};
use model::{counterexample_of, explore, Config, Explored};

/// Unique states the bounded check must at least reach (measured: see the README); a
/// model change that silently prunes the exploration fails here.
const BOUNDED_FLOOR: usize = 1_000_000;

fn report(what: &str, out: &Explored) {
    println!(
        "{what}: {} states generated, {} unique (up to process renaming), depth {}, {:.1?}",
        out.states, out.unique, out.depth, out.elapsed
    );
    for f in &out.failures {
        println!("FAILED: {} ({} steps)\n{}", f.property, f.steps, f.trace);
    }
}

fn assert_holds(what: &str, cfg: Config) -> Explored {
    let out = explore(cfg, 2);
    report(what, &out);
    assert!(out.failures.is_empty(), "{what}: a property failed (trace above)");
    out
}

/// The defect's switch alone turns a configuration that keeps `property` into one that
/// breaks it; prints the shortest counterexample and returns its length.
fn assert_found(what: &str, fixed: Config, switch: impl FnOnce(&mut Config), property: &'static str) -> usize {
    assert_holds(&format!("{what}, hardened"), fixed.clone());
    let mut broken = fixed;
    switch(&mut broken);
    let out = counterexample_of(broken, property, 2);
    println!("{what}, old behaviour: {} states, {:.1?}", out.states, out.elapsed);
    let found = out.failures.iter().find(|f| f.property == property);
    let Some(found) = found else {
        panic!("{what}: no counterexample for {property:?}");
    };
    println!("counterexample to {property:?}, {} steps:\n{}", found.steps, found.trace);
    found.steps
}

fn keyed(keys: &[u8]) -> Vec<JobSpec> {
    keys.iter().map(|k| JobSpec::keyed(*k)).collect()
}

#[test]
fn hardened_design_keeps_every_property_in_the_bounded_configuration() {
    let out = assert_holds("bounded: 3 jobs, 2 keys, 2 processes", Config::bounded());
    assert!(out.unique >= BOUNDED_FLOOR, "explored only {} unique states", out.unique);
}

#[test]
fn renewal_that_waits_on_a_lock_lets_a_healthy_process_lose_its_leases() {
    // A completion holds its job row and waits for the key row of an open host
    // transaction; the old RENEW waits on that job row, and renews nothing else.
    let cfg = Config::bounded().quiet();
    assert_found("renewal waits on locks", cfg, |c| c.defects.renewal_waits_on_locks = true, HEALTHY_KEEPS_LEASES);
}

#[test]
fn renewal_that_waits_on_a_lock_without_a_local_deadline_runs_two_handlers_of_a_key() {
    let mut cfg = Config::bounded().quiet();
    cfg.defects.no_local_deadline = true;
    assert_found("renewal waits on locks, no local deadline", cfg, |c| c.defects.renewal_waits_on_locks = true, NO_OVERLAP);
}

#[test]
fn parked_successor_not_renewed_runs_stale_after_its_own_successor() {
    let mut cfg = Config::bounded().quiet();
    cfg.jobs = keyed(&[0, 0, 0]);
    cfg.keys = 1;
    assert_found("renewal from handler start", cfg, |c| c.defects.renewal_from_handler_start = true, START_ORDER);
}

#[test]
fn cancel_that_promotes_a_running_head_runs_two_handlers_of_a_key() {
    let mut cfg = Config::bounded().quiet();
    cfg.jobs = keyed(&[0, 0]);
    cfg.keys = 1;
    cfg.budget.cancels = 1;
    cfg.budget.operator = 1;
    assert_found("cancel promotes a running head", cfg, |c| c.defects.cancel_promotes_running_head = true, NO_OVERLAP);
}

#[test]
fn prune_that_deletes_a_dead_head_strands_its_key() {
    let mut cfg = Config::bounded().quiet();
    cfg.jobs = keyed(&[0, 0]);
    cfg.keys = 1;
    cfg.max_attempts = 1;
    cfg.budget.failures = 1;
    cfg.budget.faults = 1;
    cfg.budget.prunes = 1;
    cfg.budget.operator = 1;
    assert_found("prune deletes dead rows", cfg, |c| c.defects.prune_deletes_dead = true, NO_STRANDED_KEY);
}

#[test]
fn without_a_local_deadline_a_paused_renewal_runs_two_handlers_of_a_key() {
    let mut cfg = Config::bounded().quiet();
    cfg.jobs = keyed(&[0, 0]);
    cfg.keys = 1;
    cfg.budget.pauses = 1;
    cfg.budget.faults = 1;
    assert_found("no local deadline", cfg, |c| c.defects.no_local_deadline = true, NO_OVERLAP);
}

#[test]
fn fencing_store_never_refuses_the_current_attempt() {
    let mut cfg = Config::bounded();
    cfg.store = EffectStore::Fenced;
    cfg.budget.operator = 0;
    let out = assert_holds("fencing store, one fault", cfg);
    assert!(out.unique > 10_000);
    let _ = CURRENT_NOT_FENCED;
}

#[test]
fn fencing_alone_does_not_make_effects_at_most_once() {
    // The design's reason for effect keys: a store that only fences applies an effect
    // again when an attempt acted and lost its lease before recording it.
    let mut cfg = Config::bounded().quiet();
    cfg.jobs = keyed(&[0]);
    cfg.keys = 1;
    cfg.store = EffectStore::Fenced;
    cfg.budget.pauses = 1;
    cfg.budget.faults = 1;
    let mut claiming = cfg.clone();
    claiming.fenced_store_claims_once = true;
    let out = counterexample_of(claiming, EFFECT_ONCE, 2);
    let found = out.failures.iter().find(|f| f.property == EFFECT_ONCE).expect("a double effect");
    println!("counterexample to {EFFECT_ONCE:?} with a fencing store, {} steps:\n{}", found.steps, found.trace);
    cfg.store = EffectStore::Dedup;
    assert_holds("the same with a deduplicating store", cfg);
}
