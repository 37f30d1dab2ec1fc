//! The steps of the model and when each may happen: stateright's `Model`.
//!
//! Each step is one transaction of the real code (or one statement, where the
//! transaction can wait between two), or one in-memory step of a process. Its name says
//! which; [`Action::statement`] points at the code.

use stateright::Model;

use super::config::{Config, JobId, ProcId};
use super::properties;
use super::state::{Effect, Ending, Host, JobState, Phase, Renewer, Reply, Spend, State, Up};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// The clock advances; local deadlines fire; working renewers renew.
    Tick,
    /// The host opens its transaction and enqueues a job (holding the key row).
    HostEnqueue,
    HostCommit,
    HostRollback,
    /// The claimer starts waiting jobs in free slots, runs the claim statement for the
    /// free slots and the ready queue's room, dispatches; stopping, it gives the ready
    /// queue back.
    Claim(ProcId),
    /// The claimer's give-back pass: jobs that waited a lease in the ready queue are
    /// taken off it, given back (still tracked, never to start here).
    GiveBack(ProcId),
    /// One RELEASE of a given-back job (`release_retrying`), and how it turns out:
    /// answered, or (a fault) no answer, committed or not.
    Release(ProcId, JobId, u8, Reply),
    /// Graceful shutdown begins: claiming stops, the ready queue is given back.
    Shutdown(ProcId),
    /// A ready attempt starts its handler, which calls `once` (ledger lookup, then the
    /// request to the effect store); `true`: the handler returns an error first. Without
    /// a live lease the attempt ends instead.
    Start(ProcId, JobId, u8, bool),
    /// The effect store takes the request in flight at this index.
    Deliver(u8),
    /// The handler records the effect's outcome and returns.
    Record(ProcId, JobId, u8),
    /// The attempt's ending transaction (complete or fail); `true`: a chained
    /// successor finds the slots held by a claim in flight and is parked.
    End(ProcId, JobId, u8, bool),
    /// A waiting ending transaction gets its key row (parking as for `End`).
    Resume(ProcId, JobId, u8, bool),
    /// A waiting reap gets its key row.
    ResumeReap(JobId),
    /// A waiting old RENEW gets its row locks.
    RenewResume(ProcId),
    Crash(ProcId),
    /// The process's renewals stop (frozen, or its renewal connection hangs).
    Pause(ProcId),
    Unpause(ProcId),
    Cancel(JobId),
    Hold(JobId),
    ReleaseHold(JobId),
    RetryDead(JobId),
    Prune,
}

impl Action {
    /// Who takes the step, and the code it models (`End` and `Resume` are told apart
    /// further by [`super::trace`], which sees the ending they write).
    pub fn statement(&self) -> (String, &'static str) {
        use Action::*;
        let p = |p: &ProcId| format!("p{p}");
        match self {
            Tick => (
                "clock".into(),
                "tick: reap.rs REAP, local deadlines, lease.rs RENEW",
            ),
            HostEnqueue => ("host".into(), "BEGIN; enqueue.rs ENQUEUE (enqueue_in)"),
            HostCommit => ("host".into(), "COMMIT of the host transaction"),
            HostRollback => ("host".into(), "ROLLBACK of the host transaction"),
            Claim(x) => (
                p(x),
                "claimer: dispatch.rs start_ready; claim.rs CLAIM; dispatch/wait_for_slot",
            ),
            GiveBack(x) => (
                p(x),
                "claim_after: dispatch.rs release_ready(waited a lease)",
            ),
            Release(x, .., Reply::Answered) => {
                (p(x), "release_retrying: fail.rs RELEASE, answered; untrack")
            }
            Release(x, .., Reply::LostAfterCommit) => {
                (p(x), "release_retrying: fail.rs RELEASE commits; no reply")
            }
            Release(x, .., Reply::NotCommitted) => {
                (p(x), "release_retrying: no answer, a lease passed: drop")
            }
            Shutdown(x) => (p(x), "StopClaiming: dispatch.rs release_ready(All)"),
            Start(x, .., false) => (p(x), "attempt_once: lease check, handler, once() acts"),
            Start(x, .., true) => (p(x), "attempt_once: lease check, handler errs"),
            Deliver(_) => ("store".into(), "effect store takes the request"),
            Record(x, ..) => (p(x), "once(): effects.rs RECORD; handler returns"),
            End(x, ..) => (p(x), "executor write_ending"),
            Resume(x, ..) => (p(x), "ending gets the key row; COMMIT"),
            ResumeReap(_) => ("reaper".into(), "reap gets the key row: end_heads; COMMIT"),
            RenewResume(x) => (p(x), "old RENEW gets its row locks; COMMIT"),
            Crash(x) => (p(x), "CRASH"),
            Pause(x) => (p(x), "PAUSE: no renewal (frozen, or hung connection)"),
            Unpause(x) => (p(x), "the pause ends"),
            Cancel(_) => ("operator".into(), "admin.rs cancel"),
            Hold(_) => ("operator".into(), "admin.rs hold"),
            ReleaseHold(_) => ("operator".into(), "admin.rs release_hold"),
            RetryDead(_) => ("operator".into(), "admin.rs retry_dead"),
            Prune => ("operator".into(), "admin.rs prune (retention)"),
        }
    }
}

/// The checked system: a configuration.
pub struct Leasehold {
    pub cfg: Config,
}

impl Leasehold {
    pub fn new(cfg: Config) -> Self {
        cfg.validate().expect("a valid model configuration");
        Leasehold { cfg }
    }

    /// Every step enabled in `s`, in a fixed order.
    pub fn enabled(&self, s: &State, out: &mut Vec<Action>) {
        let cfg = &self.cfg;
        out.push(Action::Tick);
        match s.host {
            Host::NotYet if !s.key_locked(cfg, cfg.host_key()) => out.push(Action::HostEnqueue),
            Host::Open => {
                out.push(Action::HostCommit);
                out.push(Action::HostRollback);
            }
            _ => {}
        }
        for (i, proc) in s.procs.iter().enumerate() {
            let p = i as ProcId;
            // A stopping process still runs and ends what it started.
            let running = proc.up != Up::Crashed;
            if proc.up != Up::Crashed && s.renewal_can_resume(cfg, p) {
                out.push(Action::RenewResume(p));
            }
            for a in &proc.attempts {
                let (j, g) = (a.job, a.gen);
                match a.phase {
                    Phase::Writing { ending: e, .. } if !s.key_locked(cfg, cfg.key_of(j)) => {
                        out.push(Action::Resume(p, j, g, false));
                        if e == (Ending::Complete { chain: true }) {
                            out.push(Action::Resume(p, j, g, true));
                        }
                    }
                    _ if !running => {}
                    Phase::Ready => {
                        out.push(Action::Start(p, j, g, false));
                        if s.budget.allows(Spend::Failure) {
                            out.push(Action::Start(p, j, g, true));
                        }
                    }
                    Phase::Handler(Effect::Answered) if !s.row_locked(cfg, j) => {
                        out.push(Action::Record(p, j, g))
                    }
                    Phase::Handler(Effect::Refused) => out.push(Action::Record(p, j, g)),
                    Phase::GivenBack { give_up } if !s.row_locked(cfg, j) => {
                        out.push(Action::Release(p, j, g, Reply::Answered));
                        if s.budget.allows(Spend::LostReply) {
                            // A lost reply of a RELEASE that matched no row is no
                            // different from one that never arrived.
                            if s.fence_ok(j, p, g) {
                                out.push(Action::Release(p, j, g, Reply::LostAfterCommit));
                            }
                            // Before the give-up, an `Err` without a commit changes
                            // nothing: the next try is the same step.
                            if give_up == 0 {
                                out.push(Action::Release(p, j, g, Reply::NotCommitted));
                            }
                        }
                    }
                    // Its UPDATE waits while another transaction has the row.
                    Phase::Ending(e) if !s.row_locked(cfg, j) => {
                        out.push(Action::End(p, j, g, false));
                        if e == (Ending::Complete { chain: true }) {
                            out.push(Action::End(p, j, g, true));
                        }
                    }
                    _ => {}
                }
            }
            if running && s.claim_finds_work(cfg, p) {
                out.push(Action::Claim(p));
            }
            if running && s.overdue(cfg, p) {
                out.push(Action::GiveBack(p));
            }
            if proc.up == Up::Running && s.budget.allows(Spend::Shutdown) {
                out.push(Action::Shutdown(p));
            }
            match proc.up {
                Up::Running | Up::Stopping if s.budget.allows(Spend::Crash) => {
                    out.push(Action::Crash(p))
                }
                _ => {}
            }
            match proc.renewer {
                Renewer::Ok if running && s.budget.allows(Spend::Pause) => {
                    out.push(Action::Pause(p))
                }
                Renewer::Paused if running => out.push(Action::Unpause(p)),
                _ => {}
            }
        }
        for i in 0..s.store.in_flight.len() {
            out.push(Action::Deliver(i as u8));
        }
        for (j, _) in &s.reaping {
            if !s.key_locked(cfg, cfg.key_of(*j)) {
                out.push(Action::ResumeReap(*j));
            }
        }
        for (i, r) in s.rows.iter().enumerate() {
            let j = i as JobId;
            let free = !s.row_locked(cfg, j) && !s.key_locked(cfg, cfg.key_of(j));
            if !free {
                continue;
            }
            let cancellable = match r.state {
                JobState::Running => !r.cancel_requested,
                st => matches!(
                    st,
                    JobState::Pending | JobState::Waiting | JobState::Held | JobState::Dead
                ),
            };
            if s.budget.allows(Spend::Cancel) && cancellable {
                out.push(Action::Cancel(j));
            }
            if s.budget.allows(Spend::Hold) && r.state == JobState::Pending {
                out.push(Action::Hold(j));
            }
            if r.state == JobState::Held {
                out.push(Action::ReleaseHold(j));
            }
            if s.budget.allows(Spend::Retry) && r.state == JobState::Dead {
                out.push(Action::RetryDead(j));
            }
        }
        let prunable = |st: JobState| {
            matches!(st, JobState::Done | JobState::Cancelled)
                || (st == JobState::Dead && cfg.defects.prune_deletes_dead)
        };
        let restarts = cfg.defects.prune_restarts_key_seq
            && s.keys.iter().enumerate().any(|(k, kr)| {
                kr.open_jobs == 0 && kr.next_seq > 0 && !s.key_locked(cfg, Some(k as u8))
            });
        if s.budget.allows(Spend::Prune) && (s.rows.iter().any(|r| prunable(r.state)) || restarts) {
            out.push(Action::Prune);
        }
    }

    /// The state after `action`, or `None` when it changes nothing.
    pub fn step(&self, s: &State, action: Action) -> Option<State> {
        let cfg = &self.cfg;
        let mut n = s.clone();
        use Action::*;
        match action {
            Tick => n.tick(cfg),
            HostEnqueue => n.host = Host::Open,
            HostCommit => n.host_commit(cfg),
            HostRollback => n.host = Host::Over,
            Claim(p) => n.claim_step(cfg, p),
            GiveBack(p) => n.give_back(cfg, p),
            Release(p, j, g, reply) => n.release_step(cfg, p, j, g, reply),
            Shutdown(p) => n.shutdown(cfg, p),
            Start(p, j, g, fails) => n.start(cfg, p, j, g, fails),
            Deliver(i) => n.deliver(cfg, i as usize),
            Record(p, j, g) => n.record_step(cfg, p, j, g),
            End(p, j, g, park) => n.end(cfg, p, j, g, park),
            Resume(p, j, g, park) => n.resume(cfg, p, j, g, park),
            ResumeReap(j) => n.commit_reap(cfg, j),
            RenewResume(p) => n.renew_resume(cfg, p),
            Crash(p) => n.crash(p),
            Pause(p) => n.pause(p),
            Unpause(p) => n.unpause(p),
            Cancel(j) => {
                n.budget.spend(Spend::Cancel);
                n.cancel(cfg, j);
            }
            Hold(j) => {
                n.budget.spend(Spend::Hold);
                n.rows[j as usize].set(JobState::Held);
            }
            ReleaseHold(j) => n.rows[j as usize].set(JobState::Pending),
            RetryDead(j) => {
                n.budget.spend(Spend::Retry);
                n.retry_dead(cfg, j);
            }
            Prune => {
                n.budget.spend(Spend::Prune);
                n.prune(cfg);
            }
        }
        n.normalize();
        (n != *s).then_some(n)
    }
}

impl Model for Leasehold {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State::initial(&self.cfg)]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        self.enabled(s, out);
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        self.step(s, action)
    }

    fn properties(&self) -> Vec<stateright::Property<Self>> {
        properties::all(&self.cfg)
    }
}
