//! A model of leasehold's protocol and runtime, for the stateright model checker.
//!
//! # What is modelled
//! The database rows: each job's state, owner, generation, attempts, lease_until,
//! available_at, key_seq and cancel_requested; each key's next_seq and open_jobs; the
//! effect ledger; the row locks a transaction holds across steps. A clock. Two (up to
//! four) scheduler processes, each with its slots, claimer (claim statement for the free
//! slots and the ready queue's room, `Config::claim_ahead`), ready queue (src/actor/
//! dispatch.rs: jobs claimed ahead and chained successors waiting for a slot, given back
//! after a lease and at shutdown: tracked and renewed, never started again, while
//! `release_retrying` retries their RELEASE), per-key sequencers (attempts queued behind
//! the key's running one), executor (lease check, handler with one effect through
//! `JobContext::once`, ending), completer (`complete_keyed`: key rows locked first with
//! SKIP LOCKED, 'busy' completions written again waiting for the key row; chained
//! successor claims), lease renewer (renewal registry, local deadlines), the reaper, and
//! graceful shutdown (claiming stops, the ready queue is given back). A host
//! transaction that enqueues a job with `enqueue_in` and holds its key row until it
//! commits or rolls back. The operator's cancel, hold, release, retry_dead and prune.
//! Crashes and pauses of a process. An external effect store that deduplicates by
//! effect key, or one that fences by a per-key token (key_seq, generation).
//!
//! Each step is one transaction of the real code (or one statement, where the
//! transaction can wait between two) or one in-memory step of a process, named after
//! the code it models: [`actions::Action::statement`] (file and statement).
//!
//! # What is abstracted, and why
//! Each of these keeps the state space small enough to be exhausted in `cargo test`
//! (about 1.9 million states for 3 jobs, 2 keys, 2 processes of 2 slots) without removing an
//! interleaving that a property depends on:
//! - Time is relative ([`state`]): deadlines are "ticks left", clamped where smaller
//!   values behave alike, so the clock runs forever in a finite space. Lease 2 ticks,
//!   local deadline margin 1 tick, backoff 1 tick. Process clocks run at the
//!   database's rate (the margin is what covers drift).
//! - The reaper and the renewer run inside the tick (their intervals): a working
//!   renewer is never late, which is the timing assumption under which a healthy
//!   process keeps its leases. A renewal's send, update and reply are one step; a
//!   renewal that does not come is the pause fault, or the old RENEW waiting on a lock.
//! - A pause stops the process's renewals (a stop-the-world pause, or a hung renewal
//!   connection). Its other steps run or not as the schedule picks, and the checker
//!   tries every schedule, so this one fault covers a frozen process too.
//! - Reaps and completions take one row per transaction (the real ones batch: a batch
//!   only adds rows to the same waits). A claim statement is one step; a chained
//!   successor may find the slots held by a claim in flight and wait in the ready queue.
//!   The ready queue is ordered by how long each job waited (ties by job id).
//! - The handler starts and calls `once` in one step (lookup, then the request); with
//!   a deduplicating store the request is applied at once (its delay changes nothing a
//!   property reads), with a fencing store it is in flight until the store takes it.
//! - The sequencer's fetch-next (`claim_key`) is the claim statement restricted to a
//!   key: its database step is [`actions::Action::Claim`]. Priorities, kinds, payload
//!   budgets and shutdown's grace period (hard stop) are not modelled; claims take the
//!   lowest id.
//! - A step that would wait for a lock is not enabled until the lock is free; only
//!   transactions that wait across steps (the host transaction, which holds its key row;
//!   an ending waiting for a key row, which as in the code holds no job row since key
//!   rows are locked first; under the old lock order, an ending or a reap holding its
//!   job row while it waits; the old RENEW) are states.
//! - Processes are interchangeable (symmetry: [`state::State::representative`]).
//! - Budgets bound faults and operator actions: [`config::Config::bounded`] allows one
//!   fault (a crash, a pause or a handler error) and one operator action per run;
//!   [`config::Config::claim_ahead`] one fault of any kind, a graceful shutdown and a
//!   give-back's RELEASE without an answer (committed with its reply lost, or not
//!   committed once a lease has passed) among them.
//! - A give-back's RELEASE is retried per job (the code releases the batch in one
//!   statement: per job only adds interleavings); queue pauses, which give jobs back
//!   by the same path, are not modelled.
//!
//! # Properties
//! See [`properties`]: no two handlers of a key run at once; a key's handlers start
//! in key_seq order and only under a live lease; no stale generation's write is
//! accepted; no job lost; no key stranded; a healthy process keeps its leases; no
//! effect applied twice per effect key (deduplicating store), or the current attempt
//! never fenced off (fencing store). And liveness under weak fairness ([`liveness`]):
//! once faults stop, every fair path ends every job (or leaves it to an operator).
//!
//! # How it is checked
//! [`explore`] walks every reachable state once, breadth first ([`explorer`]): each
//! state is checked against the safety properties, and the fault-free steps between
//! states are kept as a graph in which no fair cycle may avoid the settled states.
//! [`counterexamples_of`] runs stateright's breadth-first checker for the shortest
//! counterexample of a safety property.
//!
//! # Defects
//! [`config::Defects`]: each switch puts one known old behaviour back;
//! `tests/model_check.rs` shows the counterexample the checker finds for each.

// The test and the example each use part of it.
#![allow(dead_code)]

pub mod actions;
pub mod config;
pub mod db;
pub mod explorer;
pub mod liveness;
pub mod process;
pub mod properties;
pub mod state;
pub mod trace;

use std::time::{Duration, Instant};

use std::collections::BTreeMap;

use stateright::report::{ReportData, ReportDiscovery, Reporter};
use stateright::{Checker, HasDiscoveries, Model};

pub use actions::Leasehold;
pub use config::Config;

/// One failed property, with its trace.
pub struct Found {
    pub property: &'static str,
    /// Steps from the initial state to the failing state.
    pub steps: usize,
    /// Of those, the steps of a fair cycle that repeats forever (liveness; 0 otherwise).
    pub cycle: usize,
    pub trace: String,
}

/// What a check explored.
pub struct Explored {
    /// States generated, repeats included.
    pub states: usize,
    pub unique: usize,
    pub depth: usize,
    pub elapsed: Duration,
    pub failures: Vec<Found>,
    /// What the fair-cycle check looked at (`None`: not checked).
    pub liveness: Option<liveness::Census>,
}

/// Every reachable state (up to process renaming): the safety properties, and liveness
/// under fairness when the configuration asks for it ([`explorer`], one thread).
pub fn explore(cfg: Config) -> Explored {
    explore_up_to(cfg, 1, 0, false)
}

/// [`explore`], stopping after about `max_states` states (0: no limit; liveness is then
/// not checked); `progress`: print the counts every 10 seconds. Without liveness it runs
/// stateright's depth-first checker on `threads` threads, which keeps no graph.
pub fn explore_up_to(cfg: Config, threads: usize, max_states: usize, progress: bool) -> Explored {
    if cfg.liveness {
        return explorer::explore(&Leasehold::new(cfg), max_states, progress);
    }
    let started = Instant::now();
    let mut builder = Leasehold::new(cfg)
        .checker()
        .symmetry_fn(state::State::representative)
        .threads(threads);
    if max_states > 0 {
        builder = builder.target_state_count(max_states);
    }
    let checker = builder.spawn_dfs();
    let checker = if progress {
        checker.join_and_report(&mut Progress)
    } else {
        checker.join()
    };
    finish(checker, started)
}

/// Prints the counts while a long check runs (the failures are printed as traces).
struct Progress;

impl Reporter<Leasehold> for Progress {
    fn report_checking(&mut self, data: ReportData) {
        if !data.done {
            println!(
                "... {} states, {} unique, depth {}, {}s",
                data.total_states,
                data.unique_states,
                data.max_depth,
                data.duration.as_secs()
            );
        }
    }

    fn report_discoveries(
        &mut self,
        _: &Leasehold,
        _: BTreeMap<&'static str, ReportDiscovery<Leasehold>>,
    ) {
    }

    fn delay(&self) -> Duration {
        Duration::from_secs(10)
    }
}

/// The shortest counterexample of any property, breadth first (no symmetry reduction,
/// so the trace names processes as they were).
pub fn counterexample(cfg: Config, threads: usize) -> Explored {
    search(cfg, threads, HasDiscoveries::AnyFailures)
}

/// Short counterexamples of every one of `properties`, breadth first.
pub fn counterexamples_of(cfg: Config, properties: &[&'static str], threads: usize) -> Explored {
    search(
        cfg,
        threads,
        HasDiscoveries::AllOf(properties.iter().copied().collect()),
    )
}

fn search(cfg: Config, threads: usize, until: HasDiscoveries) -> Explored {
    let started = Instant::now();
    let checker = Leasehold::new(cfg)
        .checker()
        .finish_when(until)
        .threads(threads)
        .spawn_bfs()
        .join();
    finish(checker, started)
}

fn finish(checker: impl Checker<Leasehold>, started: Instant) -> Explored {
    let m = checker.model();
    let mut failures: Vec<Found> = checker
        .discoveries()
        .into_iter()
        .map(|(property, path)| {
            let mut pairs = path.into_vec().into_iter();
            let (first, mut action) = pairs.next().expect("a path starts somewhere");
            let mut steps = Vec::new();
            for (st, next) in pairs {
                steps.push((action.expect("a step between states"), st));
                action = next;
            }
            // The checker keeps the last violating state it met (often a successor of the
            // first): end the trace at the first step that breaks the property.
            let holds = m.property(property).condition;
            if let Some(at) = steps.iter().position(|(_, st)| !holds(m, st)) {
                steps.truncate(at + 1);
            }
            let trace = trace::render(m, &first, &steps);
            Found {
                property,
                steps: steps.len(),
                cycle: 0,
                trace,
            }
        })
        .collect();
    failures.sort_by_key(|f| (f.steps, f.property));
    Explored {
        states: checker.state_count(),
        unique: checker.unique_state_count(),
        depth: checker.max_depth(),
        elapsed: started.elapsed(),
        failures,
        liveness: None,
    }
}
