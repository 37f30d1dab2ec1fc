//! Liveness under fair scheduling: once faults stop, every fair path settles.
//!
//! # The property
//! From every reachable state (faults included, so "after any faults the budget
//! allows"), every fair path of the fault-free system reaches a settled state
//! ([`super::properties::settled`]: every job done, dead, cancelled or pruned, or waiting
//! for an operator). The fault-free system drops the steps [`class_of`] gives no class:
//! crashes, pauses, graceful shutdowns, a give-back's RELEASE without an answer, handler
//! errors, and every operator action. The host transaction is not a fault: the host
//! begins it and ends it (commit or rollback) like any other actor, and a host that never
//! ends it blocks its key by design.
//!
//! # Fairness
//! Weak fairness per class: a class of steps that stays enabled (some step of it changes
//! the state) in every state of a path's suffix is taken in it infinitely often. That is
//! what the runtime guarantees: a message in an actor's mailbox is handled, a timer (tick,
//! reaper, renewer, the claimer's poll) fires, a free lock is granted, the effect store
//! answers, a pause ends. It is not strong fairness: nothing promises that a step enabled
//! only now and then is ever taken (SKIP LOCKED promises no worker any row), so a claim
//! that is possible only intermittently may lose every race.
//!
//! The classes are what one actor does for one thing: each attempt's steps by its job and
//! generation (start, record, write the ending, resume it, a given-back job's answered
//! RELEASE; an attempt belongs to the one process that claimed it), the effect store's answer to each request, each blocked
//! reap, the clock, the host. A process's claimer, give-back pass, blocked renewal and
//! pause end are one class each over all processes ("some process claims"), because
//! states are explored up to process renaming ([`super::state::State::representative`])
//! and a class must not change with the names. This is weaker than fairness per process,
//! so it admits more paths: a proof here holds under per-process fairness too, and a
//! counterexample shows the fair cycle, whose steps can be read to see which process
//! starves.
//!
//! # The check
//! The exploration keeps the fault-free edges of every reachable state (up to renaming)
//! with their class ([`Graph`]). Among non-settled states, Tarjan's algorithm finds the
//! strongly connected components. A component with a cycle is fair when every class
//! enabled in all of its states labels an edge inside it: then a path through all its
//! states and edges, forever, is fair, and never settles. (A class enabled in every state
//! of the component but taken on no edge inside it is enabled all along any path that
//! stays there and never taken: no such path is fair.) A non-settled state with no
//! fault-free step at all is a counterexample too: the path that stays there is fair.
//! Symmetry keeps this exact: classes are invariant under renaming, so a fair cycle of
//! the full system projects onto a fair cycle here.
//!
//! It replaces the earlier check that one fixed crash-free schedule settles from every
//! state ("always, some path settles"): that follows from this one (weak fairness is
//! machine-closed: every finite path goes on along some fair path, which settles), and
//! this one also rules out a schedule the fixed one never tried.
//!
//! In the hardened design the check finds no cycle at all among non-settled states, in
//! any configuration of `tests/model_check.rs` (a claim spends a generation, and the
//! clock only lowers clamped deadlines, so nothing fault-free comes round again): there
//! fairness only rules out stopping while a step is enabled. The cycle test is exercised
//! by a defect (a reaper that never requeues) and by a toy graph in that file.

use std::collections::VecDeque;

use super::actions::Action;
use super::state::{Reply, State};

/// A class of fault-free steps that weak fairness treats as one: kind, job, generation.
pub type Class = u32;

const TICK: u32 = 0;
const HOST: u32 = 1;
const CLAIM: u32 = 2;
const GIVE_BACK: u32 = 3;
const UNPAUSE: u32 = 4;
const RENEW_RESUME: u32 = 5;
const START: u32 = 6;
const RECORD: u32 = 7;
const END: u32 = 8;
const RESUME: u32 = 9;
const DELIVER: u32 = 10;
const RESUME_REAP: u32 = 11;
const RELEASE: u32 = 12;

fn class(kind: u32, job: u8, gen: u8) -> Class {
    kind << 16 | (job as u32) << 8 | gen as u32
}

/// The fairness class of `a` taken in `s`; `None` for a fault or an operator action,
/// which the fault-free system leaves out. (A chained ending that parks its successor
/// and one that does not are one class: which happens is a race, not a choice.)
pub fn class_of(s: &State, a: &Action) -> Option<Class> {
    use Action::*;
    Some(match *a {
        Tick => class(TICK, 0, 0),
        HostEnqueue | HostCommit | HostRollback => class(HOST, 0, 0),
        Claim(_) => class(CLAIM, 0, 0),
        GiveBack(_) => class(GIVE_BACK, 0, 0),
        Release(_, j, g, Reply::Answered) => class(RELEASE, j, g),
        Unpause(_) => class(UNPAUSE, 0, 0),
        RenewResume(_) => class(RENEW_RESUME, 0, 0),
        Start(_, j, g, false) => class(START, j, g),
        Record(_, j, g) => class(RECORD, j, g),
        End(_, j, g, _) => class(END, j, g),
        Resume(_, j, g, _) => class(RESUME, j, g),
        Deliver(i) => {
            let req = s.store.in_flight[i as usize];
            class(DELIVER, req.job, req.token.1)
        }
        ResumeReap(j) => class(RESUME_REAP, j, 0),
        Crash(_)
        | Pause(_)
        | Shutdown(_)
        | Release(..)
        | Start(.., true)
        | Cancel(_)
        | Hold(_)
        | ReleaseHold(_)
        | RetryDead(_)
        | Prune => return None,
    })
}

pub fn class_name(c: Class) -> String {
    let (kind, j, g) = (c >> 16, (c >> 8) & 0xff, c & 0xff);
    let named = |what: &str| format!("{what} j{j}g{g}");
    match kind {
        TICK => "tick".into(),
        HOST => "host".into(),
        CLAIM => "claim".into(),
        GIVE_BACK => "give-back".into(),
        UNPAUSE => "unpause".into(),
        RENEW_RESUME => "renewal resumes".into(),
        START => named("start"),
        RECORD => named("record"),
        END => named("ending"),
        RESUME => named("ending resumes"),
        DELIVER => named("effect store answers"),
        RESUME_REAP => format!("reap resumes j{j}"),
        RELEASE => named("release answered"),
        _ => unreachable!("class {c}"),
    }
}

/// The fault-free steps between the explored states (by id, in discovery order).
#[derive(Default)]
pub struct Graph {
    /// State `i`'s edges are `edges[offsets[i]..offsets[i + 1]]`.
    pub offsets: Vec<u32>,
    /// Target state and class.
    pub edges: Vec<(u32, Class)>,
    pub settled: Vec<bool>,
}

impl Graph {
    pub fn edges_of(&self, v: u32) -> &[(u32, Class)] {
        &self.edges[self.offsets[v as usize] as usize..self.offsets[v as usize + 1] as usize]
    }

    /// Some step of class `c` leaves state `v`.
    pub fn enables(&self, v: u32, c: Class) -> bool {
        self.edges_of(v).iter().any(|e| e.1 == c)
    }
}

/// A liveness counterexample: states a fair path can stay among forever.
pub struct Trap {
    /// The component's states; the first is the one found earliest (closest to the
    /// initial state).
    pub states: Vec<u32>,
    /// Whether it has a cycle (otherwise it is one state with no fault-free step).
    pub cycle: bool,
}

/// What the fair-cycle check looked at.
#[derive(Clone, Copy, Debug, Default)]
pub struct Census {
    pub non_settled: usize,
    /// Components of non-settled states with a cycle (each unfair, unless reported).
    pub cycles: usize,
    pub largest: usize,
}

impl Census {
    /// One line for a report (a fair cycle or a stuck state is a failure, reported apart).
    pub fn summary(&self) -> String {
        match self.cycles {
            0 => format!(
                "{} non-settled states, no fault-free cycle among them",
                self.non_settled
            ),
            n => format!(
                "{} non-settled states, {n} fault-free cycles among them (largest {} states)",
                self.non_settled, self.largest
            ),
        }
    }
}

/// The non-settled components, found by an iterative Tarjan; the trap closest to the
/// initial state, if any.
pub fn fair_trap(g: &Graph) -> (Census, Option<Trap>) {
    let mut t = Tarjan::new(g.settled.len());
    let mut census = Census::default();
    let mut best: Option<Trap> = None;
    for root in 0..g.settled.len() as u32 {
        if g.settled[root as usize] || t.index[root as usize] != NEW {
            continue;
        }
        t.visit(g, root);
        while let Some(&mut (v, ref mut at)) = t.calls.last_mut() {
            if *at < g.offsets[v as usize + 1] {
                let w = g.edges[*at as usize].0;
                *at += 1;
                if g.settled[w as usize] {
                    continue;
                }
                if t.index[w as usize] == NEW {
                    t.visit(g, w);
                } else if t.comp[w as usize] == 0 {
                    t.low[v as usize] = t.low[v as usize].min(t.index[w as usize]);
                }
                continue;
            }
            t.calls.pop();
            if let Some(&(u, _)) = t.calls.last() {
                t.low[u as usize] = t.low[u as usize].min(t.low[v as usize]);
            }
            let Some(states) = t.component(v) else {
                continue;
            };
            census.non_settled += states.len();
            let cycle = states.len() > 1 || g.edges_of(v).iter().any(|e| e.0 == v);
            let trapped = if cycle {
                census.cycles += 1;
                census.largest = census.largest.max(states.len());
                let c = t.comps;
                is_fair(g, &states, |w| t.comp[w as usize] == c)
            } else {
                g.edges_of(v).is_empty()
            };
            let first = *states.iter().min().expect("a component has a state");
            if trapped && best.as_ref().is_none_or(|b| first < b.states[0]) {
                let mut states = states;
                states.sort_unstable();
                best = Some(Trap { states, cycle });
            }
        }
    }
    (census, best)
}

const NEW: u32 = u32::MAX;

/// Tarjan's bookkeeping, with an explicit call stack.
struct Tarjan {
    index: Vec<u32>,
    low: Vec<u32>,
    /// The component a state was assigned to, plus one; 0 while it is on the stack.
    comp: Vec<u32>,
    stack: Vec<u32>,
    /// A state being visited, and its next edge.
    calls: Vec<(u32, u32)>,
    next: u32,
    comps: u32,
}

impl Tarjan {
    fn new(n: usize) -> Tarjan {
        Tarjan {
            index: vec![NEW; n],
            low: vec![0; n],
            comp: vec![0; n],
            stack: Vec::new(),
            calls: Vec::new(),
            next: 0,
            comps: 0,
        }
    }

    fn visit(&mut self, g: &Graph, v: u32) {
        self.index[v as usize] = self.next;
        self.low[v as usize] = self.next;
        self.next += 1;
        self.stack.push(v);
        self.calls.push((v, g.offsets[v as usize]));
    }

    /// `v`'s component, if `v` is its root (all of it is visited now).
    fn component(&mut self, v: u32) -> Option<Vec<u32>> {
        if self.low[v as usize] != self.index[v as usize] {
            return None;
        }
        self.comps += 1;
        let at = self
            .stack
            .iter()
            .rposition(|&x| x == v)
            .expect("on the stack");
        let states = self.stack.split_off(at);
        for &x in &states {
            self.comp[x as usize] = self.comps;
        }
        Some(states)
    }
}

/// Every class enabled in all of `states` labels an edge inside them.
fn is_fair(g: &Graph, states: &[u32], inside: impl Fn(u32) -> bool) -> bool {
    let mut always: Vec<Class> = g.edges_of(states[0]).iter().map(|e| e.1).collect();
    always.sort_unstable();
    always.dedup();
    always.retain(|&c| states.iter().all(|&v| g.enables(v, c)));
    always.iter().all(|&c| {
        states
            .iter()
            .any(|&v| g.edges_of(v).iter().any(|&(w, k)| k == c && inside(w)))
    })
}

/// A cycle through a fair trap, from and back to its first state, that is fair itself:
/// for every class enabled somewhere in the trap it visits a state where the class is
/// not enabled, or takes an edge of it. Steps as (target, class).
pub fn fair_cycle(g: &Graph, trap: &Trap) -> Vec<(u32, Class)> {
    let inside = |w: u32| trap.states.binary_search(&w).is_ok();
    let mut owed: Vec<Class> = trap
        .states
        .iter()
        .flat_map(|&v| g.edges_of(v).iter().map(|e| e.1))
        .collect();
    owed.sort_unstable();
    owed.dedup();
    let entry = trap.states[0];
    let mut cur = entry;
    let mut cycle: Vec<(u32, Class)> = Vec::new();
    let pay = |owed: &mut Vec<Class>, v: u32, taken: Option<Class>| {
        owed.retain(|&c| g.enables(v, c) && Some(c) != taken);
    };
    pay(&mut owed, cur, None);
    while !owed.is_empty() || cycle.is_empty() {
        let owed_now = owed.clone();
        let goal = |v: u32, step: Option<(u32, Class)>| match step {
            Some((w, c)) => inside(w) && (owed_now.contains(&c) || owed_now.is_empty()),
            None => owed_now.iter().any(|&c| !g.enables(v, c)),
        };
        let leg = path_within(g, cur, &inside, goal);
        for &(w, c) in &leg {
            pay(&mut owed, w, Some(c));
        }
        cur = leg.last().expect("a leg takes a step").0;
        cycle.extend(leg);
    }
    if cur != entry {
        cycle.extend(path_within(g, cur, &inside, |_, step| {
            step.is_some_and(|(w, _)| w == entry)
        }));
    }
    cycle
}

/// The shortest path from `from` inside the trap to a state `goal(state, None)` accepts
/// (not `from` itself) or through an edge `goal(source, Some(edge))` accepts.
fn path_within(
    g: &Graph,
    from: u32,
    inside: &impl Fn(u32) -> bool,
    goal: impl Fn(u32, Option<(u32, Class)>) -> bool,
) -> Vec<(u32, Class)> {
    let mut came: std::collections::HashMap<u32, (u32, Class)> = Default::default();
    let mut queue = VecDeque::from([from]);
    let unwind = |came: &std::collections::HashMap<u32, (u32, Class)>, mut v: u32| {
        let mut path = Vec::new();
        while v != from {
            let (u, c) = came[&v];
            path.push((v, c));
            v = u;
        }
        path.reverse();
        path
    };
    while let Some(v) = queue.pop_front() {
        if v != from && goal(v, None) {
            return unwind(&came, v);
        }
        for &(w, c) in g.edges_of(v) {
            if !inside(w) {
                continue;
            }
            if goal(v, Some((w, c))) {
                let mut path = unwind(&came, v);
                path.push((w, c));
                return path;
            }
            if w != from && !came.contains_key(&w) {
                came.insert(w, (v, c));
                queue.push_back(w);
            }
        }
    }
    unreachable!("a fair trap is strongly connected and pays every class it owes")
}
