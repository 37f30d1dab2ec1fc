//! What must hold: the safety properties, and the liveness check.
//!
//! # Safety
//! State predicates where the state shows it (two handlers of a key running, a lost
//! job, a stranded key, an effect applied twice); ghost bits set by the step that
//! breaks an event property (a start out of key order or without a live lease, a stale
//! write accepted, a healthy process's lease reaped, the current attempt fenced off).
//!
//! # Liveness
//! Not a state predicate: [`super::liveness`] checks that once faults stop, every fair
//! path reaches a [`settled`] state; its counterexample is reported as [`FAIR_END`].

use stateright::Property;

use super::actions::Leasehold;
use super::config::{Config, EffectStore};
use super::state::{broken, JobState, Phase, State, Up};

pub const NO_OVERLAP: &str = "no two handlers of a key run at once";
pub const START_ORDER: &str = "handlers of a key start in key_seq order";
pub const START_UNDER_LEASE: &str = "a handler starts only under its live lease";
pub const NO_STALE_WRITE: &str = "no stale generation's write is accepted";
pub const NO_LOST_JOB: &str = "no job is lost";
pub const NO_STRANDED_KEY: &str = "no key is stranded";
pub const HEALTHY_KEEPS_LEASES: &str = "a healthy process keeps its leases";
pub const EFFECT_ONCE: &str = "no effect is applied twice per effect key";
pub const CURRENT_NOT_FENCED: &str = "the fencing store never refuses the current attempt";
pub const FAIR_END: &str = "once faults stop, every fair path ends every job";

fn intact(s: &State, bit: u8) -> bool {
    s.ghost.broken & bit == 0
}

pub fn all(cfg: &Config) -> Vec<Property<Leasehold>> {
    let mut v = vec![
        Property::always(NO_OVERLAP, |m: &Leasehold, s: &State| {
            intact(s, broken::OVERLAP) && no_overlap(&m.cfg, s)
        }),
        Property::always(START_ORDER, |_, s: &State| intact(s, broken::START_ORDER)),
        Property::always(START_UNDER_LEASE, |_, s: &State| {
            intact(s, broken::START_WITHOUT_LEASE)
        }),
        Property::always(NO_STALE_WRITE, |_, s: &State| {
            intact(s, broken::STALE_WRITE)
        }),
        Property::always(NO_LOST_JOB, |m: &Leasehold, s: &State| {
            no_lost_job(&m.cfg, s)
        }),
        Property::always(NO_STRANDED_KEY, |m: &Leasehold, s: &State| {
            no_stranded_key(&m.cfg, s)
        }),
        Property::always(HEALTHY_KEEPS_LEASES, |_, s: &State| {
            intact(s, broken::HEALTHY_LEASE_LOST)
        }),
    ];
    if cfg.store == EffectStore::Dedup || cfg.fenced_store_claims_once {
        v.push(Property::always(EFFECT_ONCE, |_, s: &State| {
            s.store.applied.iter().all(|n| *n <= 1)
        }));
    }
    if cfg.store == EffectStore::Fenced {
        v.push(Property::always(CURRENT_NOT_FENCED, |_, s: &State| {
            intact(s, broken::CURRENT_REFUSED)
        }));
    }
    v
}

/// Handlers of one key that have started and not returned, in any live process. A
/// handler past its local deadline was stopped by the tick that passed it.
fn no_overlap(cfg: &Config, s: &State) -> bool {
    (0..cfg.keys).all(|k| {
        let running = s
            .procs
            .iter()
            .filter(|p| p.up != Up::Crashed)
            .flat_map(|p| p.attempts.iter())
            .filter(|a| matches!(a.phase, Phase::Handler(_)) && cfg.key_of(a.job) == Some(k))
            .count();
        running <= 1
    })
}

/// Open and still counted by its key: what a waiting job may wait behind.
fn holds_key(cfg: &Config, s: &State, j: usize) -> bool {
    match s.rows[j].state {
        JobState::Pending | JobState::Waiting | JobState::Running | JobState::Held => true,
        JobState::Dead => !cfg.jobs[j].continue_on_dead,
        _ => false,
    }
}

/// Every job is terminal, pending, held, running (its lease is renewed by a live owner
/// or passes and the reaper takes it back), or waiting behind an open predecessor.
fn no_lost_job(cfg: &Config, s: &State) -> bool {
    (0..s.rows.len()).all(|j| {
        let r = &s.rows[j];
        if r.state != JobState::Waiting {
            return true;
        }
        (0..s.rows.len()).any(|i| {
            cfg.jobs[i].key == cfg.jobs[j].key
                && s.rows[i].key_seq < r.key_seq
                && holds_key(cfg, s, i)
        })
    })
}

/// A key with open jobs has a head: pending, running, held, or dead and blocking.
fn no_stranded_key(cfg: &Config, s: &State) -> bool {
    (0..cfg.keys).all(|k| {
        s.keys[k as usize].open_jobs == 0
            || (0..s.rows.len()).any(|j| {
                cfg.jobs[j].key == Some(k)
                    && s.rows[j].state != JobState::Waiting
                    && holds_key(cfg, s, j)
            })
    })
}

/// Nothing left that the system itself must move on: no host transaction open, and
/// every job done, dead, cancelled or pruned, held, not enqueued (the host has not begun,
/// or rolled back), or waiting behind a held or blocking dead job of its key.
pub fn settled(cfg: &Config, s: &State) -> bool {
    if s.host == super::state::Host::Open {
        return false;
    }
    (0..s.rows.len()).all(|j| match s.rows[j].state {
        JobState::Unborn | JobState::Held => true,
        st if st.is_terminal() => true,
        JobState::Waiting => (0..s.rows.len()).any(|i| {
            cfg.jobs[i].key == cfg.jobs[j].key
                && (s.rows[i].state == JobState::Held
                    || (s.rows[i].state == JobState::Dead && !cfg.jobs[i].continue_on_dead))
        }),
        _ => false,
    })
}
