//! The model's state: the database rows, the processes' memory, the effect store, and
//! the ghost fields the properties read.
//!
//! # Time
//! There is no absolute clock. Every deadline is kept relative to now (`lease_until`
//! as "ticks left", `available_at` as "ticks until due", an attempt's local deadline as
//! "ticks left"), clamped where every smaller value behaves the same. A tick lowers
//! them all. Two states that differ only in how long ago everything happened are then
//! one state, so the clock advances forever in a finite state space.
//!
//! # Canonical form
//! Lists that are sets in the real system (a process's attempts, the requests in
//! flight to the effect store, the reaper's blocked rows) are kept sorted, so the same
//! situation reached in two orders is one state. Processes are interchangeable:
//! [`State::representative`] renames them to the least ordering (symmetry reduction).

use super::config::{Config, JobId, ProcId, NONE};

/// A job row's `state`, plus the two states a row has outside the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum JobState {
    /// Not enqueued yet (the host transaction's job before it commits), or never (its
    /// transaction rolled back).
    Unborn,
    Pending,
    Waiting,
    Running,
    Held,
    Done,
    Dead,
    Cancelled,
    /// Deleted by the retention policy.
    Pruned,
}

impl JobState {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Done | JobState::Dead | JobState::Cancelled | JobState::Pruned
        )
    }
}

/// One row of `jobs`. Fields that only mean something in some states are normalized
/// in the others (owner and lease only while running), so equal situations are equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Row {
    pub state: JobState,
    pub owner: ProcId,
    pub generation: u8,
    pub attempts: u8,
    /// `lease_until - now` in ticks while running; below 0 the lease has passed.
    pub lease_left: i8,
    /// `available_at - now` in ticks; 0 = due.
    pub due_in: u8,
    pub key_seq: u8,
    pub cancel_requested: bool,
}

impl Row {
    pub const UNBORN: Row = Row {
        state: JobState::Unborn,
        owner: NONE,
        generation: 0,
        attempts: 0,
        lease_left: 0,
        due_in: 0,
        key_seq: 0,
        cancel_requested: false,
    };

    /// Leave `running` (or never have been): clear what only a running row has.
    pub fn set(&mut self, state: JobState) {
        self.state = state;
        if state != JobState::Running {
            self.owner = NONE;
            self.lease_left = 0;
            self.cancel_requested = false;
        }
    }
}

/// One row of `job_keys`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyRow {
    pub next_seq: u8,
    pub open_jobs: u8,
}

/// Whether a process is there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Up {
    Running,
    /// Shutdown has begun (`StopClaiming`): it claims and chains nothing more, gave its
    /// ready queue back, and runs what it already started to the end.
    Stopping,
    Crashed,
}

/// The lease renewer's connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Renewer {
    Ok,
    /// Paused: the process is frozen (a stop-the-world pause) or its renewal connection
    /// hangs, so nothing renews its leases until the pause ends. Whether its other steps
    /// run meanwhile is the schedule's choice, and the checker tries both: one fault
    /// covers a frozen process and a hung renewer.
    Paused,
    /// The old RENEW waits on a row lock; `sent` is when it was sent (relative, ticks).
    Blocked {
        sent: i8,
    },
}

/// Where an attempt is in the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// In the process's ready queue (src/actor/dispatch.rs `ReadyQueue`), without a
    /// slot: claimed ahead of a free slot, or a chained successor that found none.
    /// Tracked and renewed from its claim. `waited`: ticks since it was queued, clamped
    /// at lease + 1 (past a lease it is given back).
    ReadyQueue { waited: i8 },
    /// Delivered to its key's sequencer while another attempt of the key runs there
    /// (the sequencer's backlog). Holds a slot.
    Queued,
    /// Holds a slot; `Sequencer::run` / the claimer's task is about to start the handler.
    Ready,
    /// The handler runs; how far its one effect (`JobContext::once`) got.
    Handler(Effect),
    /// The handler returned; its slot is free; the ending is still to be written.
    Ending(Ending),
    /// The ending's transaction waits for the key row (an open host transaction holds
    /// it): a keyed completion that `complete_keyed` reported 'busy', written again in a
    /// transaction that waits for the key (src/actor/completer.rs `write_keyed` with
    /// `wait`), or a FAIL whose `kl` waits. It holds no job row (key rows are locked
    /// first), except under [`super::config::Defects::job_row_before_key_row`].
    /// `began`: when it began, relative to now (its statements' `now()`); kept only
    /// where a defect switch reads it, 0 otherwise.
    Writing { ending: Ending, began: i8 },
    /// Taken off the ready queue to be given back (src/actor/dispatch.rs `release_ready`,
    /// then `give_back`): it never starts here again and holds no slot, yet stays
    /// tracked, so the renewer renews it, until `release_retrying` returns: a RELEASE
    /// answered, a renewal that finds the job no longer ours, or no answer once a lease
    /// has passed since the give-back. `give_up`: ticks left of that lease (0: passed).
    GivenBack { give_up: i8 },
}

/// How one RELEASE of `release_retrying` (src/actor/dispatch.rs) turns out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reply {
    /// `Ok`: the fenced RELEASE ran (perhaps matching no row) and said so.
    Answered,
    /// `Err` after the RELEASE committed: its reply was lost (a cut connection).
    LostAfterCommit,
    /// `Err` without a commit: the database did not answer.
    NotCommitted,
}

/// Progress of the handler's effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Effect {
    /// The request is on its way to the effect store (or its answer back).
    Awaiting,
    /// The store answered: applied now, or already applied before (deduplicated).
    Answered,
    /// The store refused the request's fencing token.
    Refused,
}

/// The write that ends an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Ending {
    /// Complete; `chain`: also claim the key's successor (a slot was spare as the handler
    /// returned, `executor::attempt_once`).
    Complete { chain: bool },
    /// Fail the attempt (handler error, lost lease, local deadline, cancellation).
    Fail,
}

/// One claimed attempt in a process's memory, from its claim until its ending is
/// written (or it is dropped).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Attempt {
    pub job: JobId,
    pub gen: u8,
    pub phase: Phase,
    /// Local deadline minus now, in ticks (monotonic clock); below 0 it has passed.
    pub deadline: i8,
    /// The handler was told to stop (lost lease, cancel requested, deadline).
    pub cancelled: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Proc {
    pub up: Up,
    pub renewer: Renewer,
    /// The claimer's `ahead_paused`: it gave jobs back and claims none ahead until a
    /// slot is free again (without it, give-back and claim could loop forever).
    pub ahead_paused: bool,
    /// Sorted.
    pub attempts: Vec<Attempt>,
}

/// The host application's transaction that enqueues a job (`enqueue_in`) and holds
/// the key row's lock until it ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Host {
    NotYet,
    Open,
    Over,
}

/// A request on its way to the external effect store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Request {
    pub job: JobId,
    /// Fencing token: the job's key_seq and the attempt's generation.
    pub token: (u8, u8),
    pub from: ProcId,
}

/// The external effect store.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Store {
    /// Times each job's effect (its one effect key) was applied, at most 2.
    pub applied: Vec<u8>,
    /// The newest token applied, per key (per job for unkeyed jobs: index keys + job).
    pub newest: Vec<(u8, u8)>,
    /// Sorted.
    pub in_flight: Vec<Request>,
}

/// What is left of each kind of fault and operator action, and of faults and operator
/// actions in all (each step spends one of its kind and one of the total).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Budget {
    pub crashes: u8,
    pub pauses: u8,
    /// Handler errors.
    pub failures: u8,
    /// Graceful shutdowns (a process stops claiming and gives its ready queue back).
    pub shutdowns: u8,
    /// A give-back's RELEASE without an answer (`Err`): committed with its reply lost,
    /// or, once the give-back's lease has passed, not committed.
    pub lost_replies: u8,
    pub faults: u8,
    pub cancels: u8,
    pub holds: u8,
    pub retries: u8,
    pub prunes: u8,
    pub operator: u8,
}

/// A budgeted kind of step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spend {
    Crash,
    Pause,
    Failure,
    Shutdown,
    LostReply,
    Cancel,
    Hold,
    Retry,
    Prune,
}

impl Budget {
    fn slots(&mut self, kind: Spend) -> (&mut u8, &mut u8) {
        match kind {
            Spend::Crash => (&mut self.crashes, &mut self.faults),
            Spend::Pause => (&mut self.pauses, &mut self.faults),
            Spend::Failure => (&mut self.failures, &mut self.faults),
            Spend::Shutdown => (&mut self.shutdowns, &mut self.faults),
            Spend::LostReply => (&mut self.lost_replies, &mut self.faults),
            Spend::Cancel => (&mut self.cancels, &mut self.operator),
            Spend::Hold => (&mut self.holds, &mut self.operator),
            Spend::Retry => (&mut self.retries, &mut self.operator),
            Spend::Prune => (&mut self.prunes, &mut self.operator),
        }
    }

    pub fn allows(&self, kind: Spend) -> bool {
        let mut left = *self;
        let (one, all) = left.slots(kind);
        *one > 0 && *all > 0
    }

    pub fn spend(&mut self, kind: Spend) {
        let (one, all) = self.slots(kind);
        *one -= 1;
        *all -= 1;
    }
}

/// Event properties: set by the step that breaks them, never cleared.
pub mod broken {
    pub const START_ORDER: u8 = 1;
    pub const START_WITHOUT_LEASE: u8 = 2;
    pub const STALE_WRITE: u8 = 4;
    pub const HEALTHY_LEASE_LOST: u8 = 8;
    pub const CURRENT_REFUSED: u8 = 16;
    pub const OVERLAP: u8 = 32;
}

/// Fields no statement reads: what the properties need to remember.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ghost {
    /// Per key: the largest key_seq whose handler started.
    pub started_seq: Vec<u8>,
    /// Bit per process: paused since its last successful renewal.
    pub faulted: u8,
    /// [`broken`] bits.
    pub broken: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct State {
    pub rows: Vec<Row>,
    pub keys: Vec<KeyRow>,
    /// Effect ledger: bit per job (its one effect key is recorded).
    pub ledger: u8,
    /// Rows a reap has locked and changed, waiting for the key row to end the head (only
    /// under the old lock order: the REAP of the code skips such a row until its key
    /// row is free).
    pub reaping: Vec<(JobId, JobState)>,
    pub host: Host,
    pub procs: Vec<Proc>,
    pub store: Store,
    pub budget: Budget,
    pub ghost: Ghost,
}

impl State {
    pub fn initial(cfg: &Config) -> State {
        let mut keys = vec![
            KeyRow {
                next_seq: 0,
                open_jobs: 0
            };
            cfg.keys as usize
        ];
        let mut rows = vec![Row::UNBORN; cfg.jobs.len()];
        for (j, spec) in cfg.jobs.iter().enumerate() {
            if spec.via_host {
                continue;
            }
            rows[j] = enqueued(&mut keys, spec.key);
        }
        State {
            rows,
            keys,
            ledger: 0,
            reaping: Vec::new(),
            host: if cfg.host_job().is_some() {
                Host::NotYet
            } else {
                Host::Over
            },
            procs: vec![
                Proc {
                    up: Up::Running,
                    renewer: Renewer::Ok,
                    ahead_paused: false,
                    attempts: Vec::new()
                };
                cfg.procs as usize
            ],
            store: Store {
                applied: vec![0; cfg.jobs.len()],
                newest: vec![(0, 0); cfg.keys as usize + cfg.jobs.len()],
                in_flight: Vec::new(),
            },
            budget: cfg.budget,
            ghost: Ghost {
                started_seq: vec![0; cfg.keys as usize],
                faulted: 0,
                broken: 0,
            },
        }
    }

    pub fn attempt(&self, p: ProcId, job: JobId, gen: u8) -> Option<&Attempt> {
        self.procs[p as usize]
            .attempts
            .iter()
            .find(|a| a.job == job && a.gen == gen)
    }

    pub fn attempt_mut(&mut self, p: ProcId, job: JobId, gen: u8) -> Option<&mut Attempt> {
        self.procs[p as usize]
            .attempts
            .iter_mut()
            .find(|a| a.job == job && a.gen == gen)
    }

    /// Forget what no later step can read, so equal futures are one state: a lease
    /// outside `running`, backoff outside `pending`, attempt counts and generations of
    /// rows that never run again, and the deadline and cancel flag of an attempt whose
    /// handler has returned or that was given back.
    pub fn normalize(&mut self) {
        for r in &mut self.rows {
            if r.state != JobState::Pending {
                r.due_in = 0;
            }
            match r.state {
                JobState::Done | JobState::Cancelled | JobState::Pruned => {
                    r.generation = 0;
                    r.attempts = 0;
                }
                // Only a claim after retry_dead runs it again, from attempt 0.
                JobState::Dead => r.attempts = 0,
                _ => {}
            }
        }
        for p in &mut self.procs {
            for a in &mut p.attempts {
                // A given-back job never starts: no deadline or cancel reaches a handler.
                let never_read = matches!(
                    a.phase,
                    Phase::Ending(_) | Phase::Writing { .. } | Phase::GivenBack { .. }
                );
                if never_read {
                    a.deadline = 0;
                    a.cancelled = false;
                }
            }
            p.attempts.sort();
        }
    }

    /// The same state with processes renamed: process `i` becomes `perm[i]`.
    fn renamed(&self, perm: &[u8]) -> State {
        let mut s = self.clone();
        let map = |p: ProcId| if p == NONE { NONE } else { perm[p as usize] };
        for r in &mut s.rows {
            r.owner = map(r.owner);
        }
        let mut procs: Vec<Option<Proc>> = vec![None; s.procs.len()];
        for (i, proc) in std::mem::take(&mut s.procs).into_iter().enumerate() {
            procs[perm[i] as usize] = Some(proc);
        }
        s.procs = procs
            .into_iter()
            .map(|p| p.expect("a permutation"))
            .collect();
        for req in &mut s.store.in_flight {
            req.from = map(req.from);
        }
        s.store.in_flight.sort();
        let mut faulted = 0;
        for (i, to) in perm.iter().enumerate() {
            if self.ghost.faulted & (1 << i) != 0 {
                faulted |= 1 << to;
            }
        }
        s.ghost.faulted = faulted;
        s
    }

    /// The least renaming of the processes: one state per class of interchangeable
    /// situations (stateright's symmetry reduction).
    pub fn representative(&self) -> State {
        self.clone().into_representative()
    }

    /// [`State::representative`] of a state the caller gives up (one clone fewer).
    pub fn into_representative(self) -> State {
        let mut best: Option<State> = None;
        for perm in permutations(self.procs.len()) {
            if perm.iter().enumerate().all(|(i, to)| *to as usize == i) {
                continue;
            }
            let s = self.renamed(&perm);
            if s < *best.as_ref().unwrap_or(&self) {
                best = Some(s);
            }
        }
        best.unwrap_or(self)
    }
}

/// A job enqueued in its own committed transaction (the ENQUEUE statement): the key's
/// next sequence number, and the head only if the key had no open job.
pub fn enqueued(keys: &mut [KeyRow], key: Option<u8>) -> Row {
    let mut row = Row {
        state: JobState::Pending,
        ..Row::UNBORN
    };
    if let Some(k) = key {
        let kr = &mut keys[k as usize];
        kr.next_seq += 1;
        row.key_seq = kr.next_seq;
        if kr.open_jobs > 0 {
            row.state = JobState::Waiting;
        }
        kr.open_jobs += 1;
    }
    row
}

fn permutations(n: usize) -> Vec<Vec<u8>> {
    if n == 0 {
        return vec![Vec::new()];
    }
    let mut out = Vec::new();
    for rest in permutations(n - 1) {
        for at in 0..=rest.len() {
            let mut p = rest.clone();
            p.insert(at, (n - 1) as u8);
            out.push(p);
        }
    }
    out
}
