//! The protocol model checker (issue 17): the hardened design keeps every property in
//! the bounded configuration, and each known defect, switched back on, is found again.
//!
//! # Reading the output
//! `cargo test --test model_check -- --nocapture` prints the state counts, and for each
//! defect its counterexample as a trace: one line per step (clock, who, the statement it
//! models) with the rows, keys and process attempts after it. `tests/model/mod.rs` says
//! what is modelled and abstracted; `examples/model_check.rs` runs deeper checks.
//!
//! # Defect tests
//! Each checks a configuration twice: as hardened (every property holds, exhaustively)
//! and with one defect switched back on (the property breaks). So the switch, and
//! nothing else in the configuration, is what the counterexample shows.
//!
//! # Claim-ahead
//! `claim_ahead_keeps_every_property_with_give_back_and_shutdown` checks the ready queue
//! (jobs claimed beyond the free slots, the give-back after a lease and at shutdown) in
//! its own smaller configuration. The give-back is modelled as src/actor/dispatch.rs does
//! it (`release_ready`, `give_back`, `release_retrying`): the jobs never start here
//! again, stay tracked and renewed while their RELEASE is retried, and leave when one is
//! answered, a renewal finds them no longer ours, or no answer comes for a lease; a
//! RELEASE that commits with its reply lost, and one that gets no answer after a lease,
//! are among the faults explored. Two tests walk those two paths step by step; two defect
//! tests show what breaks when a job claimed ahead is not renewed, and when a give-back
//! whose reply was lost puts its jobs back in the ready queue (what dispatch.rs did before
//! the chaos harness found it).
//!
//! # Liveness
//! Every exhaustive check also checks liveness under weak fairness (`tests/model/
//! liveness.rs`): once faults stop, no fair path avoids the settled states. A failure is
//! printed as the path to a fair cycle and the cycle. `reaper_that_never_requeues_...`
//! shows one on a defect no safety property sees; the toy-graph test shows the cycle test
//! itself telling a fair cycle from one that starves a step.
//!
//! # Time
//! About 34 s in a debug build on 2 cores: the bounded check (1,902,030 states, 32 s)
//! and the fencing-store check (1,624,792 states, 26 s) run in parallel, one thread each,
//! and dominate; the rest take about 2 s together (claim-ahead: 144,333 states, 1.8 s).

mod model;

use model::actions::Action;
use model::config::{EffectStore, JobSpec};
use model::liveness::{fair_trap, Graph};
use model::properties::{
    CURRENT_NOT_FENCED, EFFECT_ONCE, FAIR_END, HEALTHY_KEEPS_LEASES, NO_OVERLAP, NO_STRANDED_KEY,
    START_ORDER, START_UNDER_LEASE,
};
use model::state::{Budget, JobState, Phase, Reply, State};
use model::{counterexamples_of, explore, Config, Explored, Found, Leasehold};

/// Unique states the bounded check must reach at least: a model change that silently
/// cuts the exploration short fails here. It reached 1,902,030 once a given-back job
/// stayed tracked while its RELEASE is retried (a step of its own after the give-back
/// pass, as in dispatch.rs); 1,772,416 before, when the pass released at once; 680,734
/// with 1 slot per process, before the exploration became one pass.
const BOUNDED_FLOOR: usize = 1_800_000;

fn report(what: &str, out: &Explored) {
    println!(
        "{what}: {} states generated, {} unique (up to process renaming), depth {}, {:.1?}",
        out.states, out.unique, out.depth, out.elapsed
    );
    if let Some(l) = &out.liveness {
        println!("  fair liveness: {}", l.summary());
    }
    for f in &out.failures {
        println!("FAILED: {} ({} steps)\n{}", f.property, f.steps, f.trace);
    }
}

fn assert_holds(what: &str, cfg: Config) -> Explored {
    let out = explore(cfg);
    report(what, &out);
    assert!(
        out.failures.is_empty(),
        "{what}: a property failed (trace above)"
    );
    out
}

/// `fixed` keeps every property; with `switch` applied, each of `properties` breaks.
/// Prints each counterexample, and returns every failure found: the shortest safety
/// counterexamples (stateright's breadth-first search), and when `properties` has
/// [`FAIR_END`], every failure of the exhaustive check.
fn assert_found(
    what: &str,
    fixed: Config,
    switch: impl FnOnce(&mut Config),
    properties: &[&'static str],
) -> Vec<Found> {
    assert_holds(&format!("{what}, hardened"), fixed.clone());
    let mut broken = fixed;
    switch(&mut broken);
    let (live, safety): (Vec<&'static str>, Vec<&'static str>) =
        properties.iter().partition(|p| **p == FAIR_END);
    let mut found = Vec::new();
    for out in [
        (!safety.is_empty()).then(|| counterexamples_of(broken.clone(), &safety, 2)),
        (!live.is_empty()).then(|| explore(broken)),
    ]
    .into_iter()
    .flatten()
    {
        println!(
            "{what}, old behaviour: searched {} states in {:.1?}",
            out.states, out.elapsed
        );
        found.extend(out.failures);
    }
    for property in properties {
        let Some(f) = found.iter().find(|f| f.property == *property) else {
            panic!("{what}: no counterexample to {property:?}");
        };
        println!(
            "counterexample to {property:?}, {} steps:\n{}",
            f.steps, f.trace
        );
    }
    found
}

fn on_one_key(jobs: usize) -> Config {
    let mut cfg = Config::bounded().quiet();
    cfg.jobs = vec![JobSpec::keyed(0); jobs];
    cfg.keys = 1;
    cfg
}

#[test]
fn hardened_design_keeps_every_property_in_the_bounded_configuration() {
    let out = assert_holds(
        "bounded: 3 jobs on 2 keys, 2 processes of 2 slots",
        Config::bounded(),
    );
    assert!(
        out.unique >= BOUNDED_FLOOR,
        "explored only {} unique states",
        out.unique
    );
}

#[test]
fn renewal_that_waits_on_a_lock_lets_a_healthy_process_lose_its_leases() {
    // Under the old lock order a completion holds its job row and waits for the key row
    // of an open host transaction; the old RENEW waits on that job row and renews
    // nothing meanwhile. (The code's order, key rows first, leaves no job row held.)
    let mut cfg = Config::bounded().quiet();
    cfg.defects.job_row_before_key_row = true;
    assert_found(
        "renewal waits on locks",
        cfg,
        |c| c.defects.renewal_waits_on_locks = true,
        &[HEALTHY_KEEPS_LEASES],
    );
}

#[test]
fn renewal_that_waits_on_a_lock_without_a_local_deadline_runs_two_handlers_of_a_key() {
    let mut cfg = Config::bounded().quiet();
    cfg.defects.no_local_deadline = true;
    cfg.defects.job_row_before_key_row = true;
    let switch = |c: &mut Config| c.defects.renewal_waits_on_locks = true;
    assert_found(
        "renewal waits on locks, no local deadline",
        cfg,
        switch,
        &[NO_OVERLAP],
    );
}

#[test]
fn parked_successor_not_renewed_runs_stale_after_its_own_successor() {
    let cfg = on_one_key(3);
    assert_found(
        "registry from handler start",
        cfg,
        |c| c.defects.renewal_from_handler_start = true,
        &[START_ORDER],
    );
}

#[test]
fn cancel_that_promotes_a_running_head_runs_two_handlers_of_a_key() {
    let mut cfg = on_one_key(2);
    cfg.budget.cancels = 1;
    cfg.budget.operator = 1;
    assert_found(
        "cancel promotes a running head",
        cfg,
        |c| c.defects.cancel_promotes_running_head = true,
        &[NO_OVERLAP],
    );
}

#[test]
fn prune_that_deletes_a_dead_head_strands_its_key() {
    let mut cfg = on_one_key(2);
    cfg.max_attempts = 1;
    cfg.budget.failures = 1;
    cfg.budget.faults = 1;
    cfg.budget.prunes = 1;
    cfg.budget.operator = 1;
    let switch = |c: &mut Config| c.defects.prune_deletes_dead = true;
    assert_found(
        "prune deletes dead rows",
        cfg,
        switch,
        &[NO_STRANDED_KEY, FAIR_END],
    );
}

#[test]
fn prune_that_restarts_key_seq_gets_the_next_job_fenced_off() {
    // Retention deleted key rows with no open job; the key's next enqueue starts its
    // key_seq at 1 again, below the tokens the fencing store has seen for the key.
    let mut cfg = on_one_key(3);
    cfg.jobs[2].via_host = true;
    cfg.store = EffectStore::Fenced;
    cfg.budget.prunes = 1;
    cfg.budget.operator = 1;
    let switch = |c: &mut Config| c.defects.prune_restarts_key_seq = true;
    assert_found(
        "prune restarts key_seq",
        cfg,
        switch,
        &[CURRENT_NOT_FENCED, START_ORDER],
    );
}

#[test]
fn promote_that_counts_the_lease_from_its_transaction_start_claims_a_successor_already_expired() {
    // Found by this model, in the code as it is: PROMOTE's chained claim sets
    // lease_until = now() + lease, and now() is the start of the completion's
    // transaction, which waited for the key row of an open host transaction. The
    // successor is born expired and reaped from a healthy process; with one attempt
    // allowed it is dead without having run.
    let mut cfg = Config::bounded().quiet();
    cfg.max_attempts = 1;
    let switch = |c: &mut Config| c.defects.promote_lease_from_transaction_start = true;
    assert_found(
        "PROMOTE counts the lease from now()",
        cfg,
        switch,
        &[HEALTHY_KEEPS_LEASES],
    );
}

#[test]
fn without_a_local_deadline_a_paused_renewal_runs_two_handlers_of_a_key() {
    let mut cfg = on_one_key(2);
    cfg.budget.pauses = 1;
    cfg.budget.faults = 1;
    assert_found(
        "no local deadline",
        cfg,
        |c| c.defects.no_local_deadline = true,
        &[NO_OVERLAP],
    );
}

#[test]
fn fencing_store_never_refuses_the_current_attempt() {
    // Three jobs of one account (the third enqueued by the host transaction), one fault
    // of any kind, and a cancel or a retry: every effect request is delayed at will.
    let mut cfg = on_one_key(3);
    cfg.jobs[2].via_host = true;
    cfg.store = EffectStore::Fenced;
    cfg.budget = Config::bounded().budget;
    cfg.budget.holds = 0;
    cfg.budget.prunes = 0;
    assert_holds(
        "fencing store, 3 jobs on 1 key, one fault, one cancel or retry",
        cfg,
    );
}

#[test]
fn fencing_alone_does_not_make_effects_at_most_once() {
    // The design's reason for effect keys: a store that only fences applies an effect
    // again when an attempt acted and lost its lease before recording it, and a late
    // request of an old attempt is applied first.
    let mut cfg = on_one_key(1);
    cfg.budget.pauses = 1;
    cfg.budget.faults = 1;
    assert_found(
        "at-most-once claimed of a fencing store",
        cfg,
        |c| {
            c.store = EffectStore::Fenced;
            c.fenced_store_claims_once = true;
        },
        &[EFFECT_ONCE],
    );
}

#[test]
fn claim_ahead_keeps_every_property_with_give_back_and_shutdown() {
    assert_holds(
        "claim-ahead: 2 jobs on 2 keys, 2 processes of 1 slot + 1 ahead",
        Config::claim_ahead(),
    );
}

fn claim_ahead_quiet() -> Config {
    Config::claim_ahead().quiet()
}

#[test]
fn job_claimed_ahead_and_not_renewed_while_it_waits_is_reaped_from_a_healthy_process() {
    // It waits in the ready queue behind a busy slot; nothing renews it; its lease
    // passes and the reaper takes it back (an attempt counted, never run here).
    assert_found(
        "claim-ahead not renewed",
        claim_ahead_quiet(),
        |c| c.defects.ahead_not_renewed = true,
        &[HEALTHY_KEEPS_LEASES],
    );
}

/// Claim-ahead with one give-back RELEASE that gets no answer, and no other fault.
fn claim_ahead_one_lost_reply() -> Config {
    let quiet = claim_ahead_quiet();
    Config {
        budget: Budget {
            lost_replies: 1,
            faults: 1,
            ..quiet.budget
        },
        ..quiet
    }
}

/// Takes `steps` from the initial state, each of which must be enabled where it is
/// taken and keep every safety property; returns the state after each.
fn walk(cfg: Config, steps: &[Action]) -> (Leasehold, Vec<State>) {
    let m = Leasehold::new(cfg);
    let properties = stateright::Model::properties(&m);
    let mut states = vec![State::initial(&m.cfg)];
    let mut enabled = Vec::new();
    for a in steps {
        let s = states.last().expect("a state");
        enabled.clear();
        m.enabled(s, &mut enabled);
        assert!(enabled.contains(a), "{a:?} not enabled: {enabled:?}");
        let next = m.step(s, *a).unwrap_or_else(|| s.clone());
        for p in &properties {
            assert!((p.condition)(&m, &next), "{a:?} broke {:?}", p.name);
        }
        states.push(next);
    }
    (m, states)
}

/// p0 claims j0 into its slot and j1 (the host's job, committed) ahead; j1 waits a lease
/// and is given back: its RELEASE is yet to run.
const GIVEN_BACK: [Action; 7] = [
    Action::HostEnqueue,
    Action::HostCommit,
    Action::Claim(0),
    Action::Tick,
    Action::Tick,
    Action::Tick,
    Action::GiveBack(0),
];

fn given_back(s: &State, job: u8) -> bool {
    s.attempt(0, job, 1)
        .is_some_and(|a| matches!(a.phase, Phase::GivenBack { .. }))
}

#[test]
fn give_back_whose_reply_is_lost_stays_renewed_until_a_renewal_finds_it_not_ours() {
    // dispatch.rs `release_retrying`: the RELEASE commits and its reply is lost. The job
    // is pending, nothing in p0 may start it, and it stays tracked; the next renewal
    // finds it no longer p0's and the retries end.
    let mut steps = GIVEN_BACK.to_vec();
    steps.push(Action::Release(0, 1, 1, Reply::LostAfterCommit));
    steps.push(Action::Tick);
    let (m, states) = walk(claim_ahead_one_lost_reply(), &steps);
    let lost = &states[steps.len() - 1];
    assert_eq!(lost.rows[1].state, JobState::Pending);
    assert!(given_back(lost, 1), "retried: still tracked");
    let mut enabled = Vec::new();
    m.enabled(lost, &mut enabled);
    assert!(!enabled.iter().any(|a| matches!(a, Action::Start(_, 1, ..))));
    let renewed = states.last().expect("a state");
    assert!(
        renewed.attempt(0, 1, 1).is_none(),
        "a renewal ends the retries"
    );
    assert_eq!(renewed.rows[1].state, JobState::Pending);
}

#[test]
fn give_back_without_an_answer_for_a_lease_drops_its_jobs_to_expire() {
    // Renewed while the RELEASE is retried (its lease never passes), then no answer once
    // a lease has passed since the give-back: dropped, no longer renewed, and its lease
    // expires; the reaper puts it back (no healthy process lost a lease it held).
    let mut steps = GIVEN_BACK.to_vec();
    steps.extend([Action::Tick, Action::Tick, Action::Tick]);
    let (_, before) = walk(claim_ahead_one_lost_reply(), &steps);
    let row = before.last().expect("a state").rows[1];
    assert!(given_back(before.last().expect("a state"), 1));
    assert_eq!(
        (row.state, row.owner, row.lease_left),
        (JobState::Running, 0, 2)
    );
    steps.push(Action::Release(0, 1, 1, Reply::NotCommitted));
    steps.extend([Action::Tick, Action::Tick, Action::Tick, Action::Tick]);
    let (_, after) = walk(claim_ahead_one_lost_reply(), &steps);
    let dropped = &after[steps.len() - 4];
    assert!(dropped.attempt(0, 1, 1).is_none());
    assert_eq!(dropped.rows[1].state, JobState::Running);
    assert_eq!(
        after.last().expect("a state").rows[1].state,
        JobState::Pending
    );
}

#[test]
fn give_back_whose_reply_is_lost_must_not_keep_the_jobs_waiting() {
    // RELEASE committed (the job is pending, anyone may claim it) but its reply was
    // lost: src/actor/dispatch.rs `release_ready` used to put such jobs back in the ready
    // queue, and a slot that frees starts one before the next renewal tells it the
    // lease is gone: a handler without a lease. (Hardened, the same configuration keeps
    // every property: the job stays given back, renewed, and never starts.)
    assert_found(
        "give-back keeps jobs after a lost reply",
        claim_ahead_one_lost_reply(),
        |c| c.defects.give_back_error_keeps_jobs = true,
        &[START_UNDER_LEASE],
    );
}

#[test]
fn reaper_that_never_requeues_leaves_a_crashed_owners_job_running_forever() {
    // The owner crashes mid-job. Hardened, the reaper puts the job back and the other
    // process runs it. A reaper that re-leases expired rows instead breaks no safety
    // property (the row is running under a live lease, the key has its head), yet the
    // job never ends: the fair cycle is the clock going round the re-leased lease.
    let mut cfg = on_one_key(2);
    cfg.budget.crashes = 1;
    cfg.budget.faults = 1;
    let found = assert_found(
        "reaper never requeues",
        cfg,
        |c| c.defects.reap_never_requeues = true,
        &[FAIR_END],
    );
    for f in &found {
        assert_eq!(
            f.property, FAIR_END,
            "a safety property failed:\n{}",
            f.trace
        );
        assert!(f.cycle > 0, "expected a fair cycle, not a stuck state");
    }
}

/// A toy graph: states 0 and 1 go round by class 1; class 2 leads from 0, and from 1 if
/// `leave_from_1`, to state 2, which is settled.
fn toy(leave_from_1: bool) -> Graph {
    let mut edges = vec![(1, 1), (2, 2), (0, 1)];
    if leave_from_1 {
        edges.push((2, 2));
    }
    Graph {
        offsets: vec![0, 2, edges.len() as u32, edges.len() as u32],
        edges,
        settled: vec![false, false, true],
    }
}

#[test]
fn fair_cycle_check_counts_only_cycles_that_take_every_step_enabled_all_along_them() {
    // Class 2 is enabled in both states of the cycle and never taken in it: unfair.
    let (census, trap) = fair_trap(&toy(true));
    assert_eq!((census.non_settled, census.cycles), (2, 1));
    assert!(trap.is_none(), "a cycle that starves class 2 is not fair");
    // Class 2 is disabled in state 1: going round forever is fair, and never settles.
    let (_, trap) = fair_trap(&toy(false));
    let trap = trap.expect("a fair cycle");
    assert!(trap.cycle);
    assert_eq!(trap.states, [0, 1]);
}
