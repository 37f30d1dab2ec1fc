//! The exhaustive check: one breadth-first pass over every reachable state (up to process
//! renaming) that checks each safety property on each state and keeps the fault-free
//! edges for the fair-cycle check of [`super::liveness`].
//!
//! stateright's checkers have no fairness (its `eventually` sees only paths that end),
//! so this pass runs the exhaustive checks: the model is still stateright's `Model`, its
//! properties stateright `Property`s, and stateright's breadth-first checker still finds
//! the shortest counterexample of a safety property for the defect tests. One pass does
//! both jobs, so the state space is walked once.
//!
//! # Memory
//! A state is kept as a 128-bit fingerprint (two independent multiplicative hashes of its
//! representative), an id, its parent's id, and its fault-free edges (target, class): a
//! few dozen bytes. Only the breadth-first frontier holds whole states. A trace replays
//! the model from the initial state, following the fingerprints: at each step it takes
//! an enabled step of the real (not renamed) state whose result has the next
//! fingerprint, so the trace names processes as they were.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::time::{Duration, Instant};

use stateright::Model;

use super::actions::{Action, Leasehold};
use super::liveness::{self, Class, Graph};
use super::properties::{settled, FAIR_END};
use super::state::State;
use super::trace;
use super::{Explored, Found};

/// Every reachable state, breadth first, on this thread; stops after about `max_states`
/// unique states (0: no limit; the liveness check then needs the whole graph and is
/// skipped). `progress`: print the counts every 10 seconds.
pub fn explore(m: &Leasehold, max_states: usize, progress: bool) -> Explored {
    let started = Instant::now();
    let properties = m.properties();
    let mut failing: Vec<Option<u32>> = vec![None; properties.len()];
    let mut seen = Seen::default();
    let mut graph = Graph {
        offsets: vec![0],
        ..Graph::default()
    };
    let mut queue = VecDeque::new();
    let mut check = |s: &State, id: u32| {
        for (p, at) in properties.iter().zip(failing.iter_mut()) {
            if at.is_none() && !(p.condition)(m, s) {
                *at = Some(id);
            }
        }
    };
    let first = State::initial(&m.cfg).into_representative();
    check(&first, 0);
    seen.add(fingerprint(&first), u32::MAX);
    graph.settled.push(settled(&m.cfg, &first));
    queue.push_back(first);
    let (mut generated, mut depth, mut level_end) = (1usize, 0usize, 1u32);
    let mut next_report = Duration::from_secs(10);
    let mut actions = Vec::new();
    let mut id = 0u32;
    let mut truncated = false;
    while let Some(s) = queue.pop_front() {
        if id == level_end {
            depth += 1;
            level_end = seen.len() as u32;
        }
        actions.clear();
        m.enabled(&s, &mut actions);
        for a in &actions {
            let Some(next) = m.step(&s, *a) else { continue };
            generated += 1;
            let next = next.into_representative();
            let (to, new) = seen.add(fingerprint(&next), id);
            if new {
                check(&next, to);
                graph.settled.push(settled(&m.cfg, &next));
                queue.push_back(next);
            }
            if let Some(c) = liveness::class_of(&s, a) {
                graph.edges.push((to, c));
            }
        }
        graph.offsets.push(graph.edges.len() as u32);
        id += 1;
        if progress && started.elapsed() >= next_report {
            next_report += Duration::from_secs(10);
            println!(
                "... {generated} states, {} unique, depth {depth}, {}s",
                seen.len(),
                started.elapsed().as_secs()
            );
        }
        if max_states > 0 && seen.len() >= max_states {
            truncated = true;
            break;
        }
    }
    let mut failures: Vec<Found> = properties
        .iter()
        .zip(&failing)
        .filter_map(|(p, at)| at.map(|at| (p.name, at)))
        .map(|(property, at)| {
            let steps = seen.replay(m, &State::initial(&m.cfg), &seen.path_to(at));
            Found {
                property,
                steps: steps.len(),
                cycle: 0,
                trace: trace::render(m, &State::initial(&m.cfg), &steps),
            }
        })
        .collect();
    let mut census = None;
    if m.cfg.liveness && !truncated {
        let (counted, trap) = liveness::fair_trap(&graph);
        census = Some(counted);
        failures.extend(trap.map(|t| seen.liveness_trace(m, &graph, &t)));
    }
    failures.sort_by_key(|f| (f.steps, f.property));
    Explored {
        states: generated,
        unique: seen.len(),
        depth: depth + 1,
        elapsed: started.elapsed(),
        failures,
        liveness: census,
    }
}

/// The states found so far, by fingerprint.
#[derive(Default)]
struct Seen {
    ids: HashMap<u128, u32, BuildHasherDefault<Passthrough>>,
    fingerprints: Vec<u128>,
    parent: Vec<u32>,
}

impl Seen {
    fn len(&self) -> usize {
        self.fingerprints.len()
    }

    /// The state's id, and whether it is new.
    fn add(&mut self, fp: u128, parent: u32) -> (u32, bool) {
        let next = self.fingerprints.len() as u32;
        let id = *self.ids.entry(fp).or_insert(next);
        if id == next {
            self.fingerprints.push(fp);
            self.parent.push(parent);
        }
        (id, id == next)
    }

    /// The states from the initial one (excluded) to `id`, shortest first.
    fn path_to(&self, mut id: u32) -> Vec<(u128, Option<Class>)> {
        let mut path = Vec::new();
        while id != 0 {
            path.push((self.fingerprints[id as usize], None));
            id = self.parent[id as usize];
        }
        path.reverse();
        path
    }

    /// The steps of the real system from `from` through states with these fingerprints
    /// (by steps of the given class, where one is given).
    fn replay(
        &self,
        m: &Leasehold,
        from: &State,
        path: &[(u128, Option<Class>)],
    ) -> Vec<(Action, State)> {
        let mut cur = from.clone();
        let mut steps = Vec::new();
        let mut actions = Vec::new();
        for &(fp, class) in path {
            actions.clear();
            m.enabled(&cur, &mut actions);
            let step = actions.iter().find_map(|a| {
                if class.is_some() && liveness::class_of(&cur, a) != class {
                    return None;
                }
                let next = m.step(&cur, *a)?;
                (fingerprint(&next.representative()) == fp).then_some((*a, next))
            });
            let (a, next) = step.expect("an explored edge replays");
            cur = next.clone();
            steps.push((a, next));
        }
        steps
    }

    /// The path to the trap, then its fair cycle (or the state no step leaves).
    fn liveness_trace(&self, m: &Leasehold, g: &Graph, trap: &liveness::Trap) -> Found {
        let start = State::initial(&m.cfg);
        let prefix = self.replay(m, &start, &self.path_to(trap.states[0]));
        let entry = prefix.last().map_or(start.clone(), |(_, s)| s.clone());
        let mut trace = trace::render(m, &start, &prefix);
        let mut cycle = Vec::new();
        if trap.cycle {
            let around = liveness::fair_cycle(g, trap);
            let path: Vec<_> = around
                .iter()
                .map(|&(w, c)| (self.fingerprints[w as usize], Some(c)))
                .collect();
            cycle = self.replay(m, &entry, &path);
            let mut states: Vec<u32> = around.iter().map(|e| e.0).collect();
            states.push(trap.states[0]);
            let mut always: Vec<Class> = g.edges_of(trap.states[0]).iter().map(|e| e.1).collect();
            always.sort_unstable();
            always.dedup();
            always.retain(|&c| states.iter().all(|&v| g.enables(v, c)));
            let always: Vec<String> = always.into_iter().map(liveness::class_name).collect();
            trace.push_str(&format!(
                "  then, forever, this fair cycle (enabled all along it, and taken in it: {}):\n",
                always.join(", ")
            ));
            let t = prefix.iter().filter(|(a, _)| *a == Action::Tick).count();
            trace.push_str(&trace::render_from(m, &entry, &cycle, "cycle", t));
            if cycle.last().is_some_and(|(_, s)| *s != entry) {
                trace.push_str("  (back at the cycle's first state, processes renamed)\n");
            }
        } else {
            trace.push_str(
                "  then no step but a fault or an operator action changes anything: \
                 the fair path stays here forever\n",
            );
        }
        Found {
            property: FAIR_END,
            steps: prefix.len() + cycle.len(),
            cycle: cycle.len(),
            trace,
        }
    }
}

/// A state's fingerprint: two multiplicative hashes (FxHash's step with two constants and
/// rotations) of its representative, fed byte-sized fields one at a time.
pub fn fingerprint(s: &State) -> u128 {
    let mut h = Fingerprint {
        a: 0x243f_6a88_85a3_08d3,
        b: 0x1319_8a2e_0370_7344,
    };
    s.hash(&mut h);
    (h.a as u128) << 64 | h.b as u128
}

struct Fingerprint {
    a: u64,
    b: u64,
}

impl Fingerprint {
    fn mix(&mut self, x: u64) {
        self.a = (self.a.rotate_left(5) ^ x).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        self.b = (self.b.rotate_left(23) ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

impl Hasher for Fingerprint {
    fn write(&mut self, bytes: &[u8]) {
        for &x in bytes {
            self.mix(x as u64);
        }
    }

    fn write_u8(&mut self, x: u8) {
        self.mix(x as u64);
    }

    fn write_u32(&mut self, x: u32) {
        self.mix(x as u64);
    }

    fn write_u64(&mut self, x: u64) {
        self.mix(x);
    }

    fn write_usize(&mut self, x: usize) {
        self.mix(x as u64);
    }

    fn finish(&self) -> u64 {
        self.a ^ self.b
    }
}

/// The map of fingerprints hashes a key that is a hash already.
#[derive(Default)]
struct Passthrough(u64);

impl Hasher for Passthrough {
    fn write(&mut self, _: &[u8]) {
        unreachable!("only fingerprints are keys")
    }

    fn write_u128(&mut self, x: u128) {
        self.0 = x as u64;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}
