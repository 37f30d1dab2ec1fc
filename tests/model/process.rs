//! A scheduler process's side of each step: claimer, sequencers, executor, completer,
//! lease renewer, and the faults of a process. The database side is in [`super::db`].
//!
//! # Slots and the ready queue
//! An attempt holds a slot while queued, ready or running its handler; it gives it back
//! when the handler returns (`Slots::finishing`), before its ending is written, and that
//! slot starts the oldest job of the ready queue at once (src/actor/dispatch.rs
//! `start_ready`). The ready queue holds claimed jobs without a slot: those a claim took
//! ahead of the free slots (`Config::claim_ahead`, [`Config::ahead`] here) and chained
//! successors that found no slot. They are tracked and renewed from their claim; the
//! handler's start checks the lease as for any attempt. A job that waited longer than a
//! lease is given back (the claimer's give-back pass: `release_ready` with
//! `GiveBack::WaitedLongerThan(lease)`), and shutdown gives back the whole queue at once
//! (`GiveBack::All`).
//!
//! # Give-back
//! As in src/actor/dispatch.rs (`release_ready`, `give_back`, `release_retrying`): a job
//! given back leaves the ready queue and never starts in this process again, but stays
//! tracked, so the renewer renews it, until its release is settled. Each RELEASE
//! ([`State::release_step`]) is fenced; answered, the job is untracked; without an
//! answer (a fault) it is tried again, unless a lease has passed since the give-back, and
//! then the job is dropped (a row still running expires and the reaper takes it). A
//! renewal that finds the job no longer ours (a RELEASE that committed with its reply
//! lost, or an expiry) ends the retries for it. Given back for a paused queue
//! (`GiveBack::OfPausedQueues`, `start_ready`) is the same path; queue pauses are not
//! modelled.
//!
//! The claim statement is one step; the slots it reserves while in flight (`Slots::take`
//! before CLAIM) matter only to a chained successor arriving meanwhile, which then finds
//! no slot and waits in the ready queue: that step may queue it even though a slot
//! looks free. Not modelled: the finishing backpressure (`finishing_max`) and the byte
//! budget, which only delay claims. The claimer's `ahead_paused` is modelled (after a
//! give-back it claims nothing ahead until a slot is free): without it give-back and
//! claim-ahead could loop, each claim a new generation, and the state space is infinite.

use super::config::EffectStore;
use super::config::{Config, JobId, ProcId};
use super::db::Written;
use super::state::{
    broken, Attempt, Effect, Ending, Phase, Renewer, Reply, Request, Spend, State, Up,
};

impl Config {
    /// A fresh local deadline: sent + lease - margin (0 and never lowered without one).
    pub fn deadline_from(&self, sent: i8) -> i8 {
        if self.defects.no_local_deadline {
            0
        } else {
            (sent + self.lease - self.margin).max(-1)
        }
    }
}

fn holds_slot(phase: Phase) -> bool {
    matches!(phase, Phase::Queued | Phase::Ready | Phase::Handler(_))
}

impl State {
    pub fn free_slots(&self, cfg: &Config, p: ProcId) -> u8 {
        let held = self.procs[p as usize]
            .attempts
            .iter()
            .filter(|a| holds_slot(a.phase))
            .count() as u8;
        cfg.slots.saturating_sub(held)
    }

    /// The key's sequencer in `p` runs an attempt (from `Sequencer::run` until
    /// `execute_chained` returns, i.e. its ending is written).
    fn sequencer_busy(&self, cfg: &Config, p: ProcId, key: u8) -> bool {
        self.procs[p as usize].attempts.iter().any(|a| {
            cfg.key_of(a.job) == Some(key)
                && matches!(
                    a.phase,
                    Phase::Ready | Phase::Handler(_) | Phase::Ending(_) | Phase::Writing { .. }
                )
        })
    }

    /// In the renewal registry. Hardened: from the claim on (`Env::track`) until the
    /// ending is written or, given back, `give_back` untracks it. Old: from the start of
    /// `attempt_once` (ready: its sequencer or task runs it now), so jobs in the ready
    /// queue (or given back from it) and in a sequencer's backlog were not; or (a defect
    /// of claim-ahead) only jobs in the ready queue (or given back from it) were not.
    pub fn registered(&self, cfg: &Config, a: &Attempt) -> bool {
        let waiting = matches!(a.phase, Phase::ReadyQueue { .. } | Phase::GivenBack { .. });
        let backlog = a.phase == Phase::Queued;
        let d = &cfg.defects;
        !(d.renewal_from_handler_start && (waiting || backlog) || d.ahead_not_renewed && waiting)
    }

    fn add_attempt(&mut self, p: ProcId, a: Attempt) {
        let list = &mut self.procs[p as usize].attempts;
        list.push(a);
        list.sort();
    }

    fn remove_attempt(&mut self, p: ProcId, job: JobId, gen: u8) {
        self.procs[p as usize]
            .attempts
            .retain(|a| !(a.job == job && a.gen == gen));
    }

    fn set_phase(&mut self, p: ProcId, job: JobId, gen: u8, phase: Phase) {
        self.attempt_mut(p, job, gen).expect("attempt").phase = phase;
        self.procs[p as usize].attempts.sort();
    }

    /// `Claimer::dispatch`: an unkeyed job runs; a keyed one goes to its sequencer,
    /// which runs it, or queues it behind the attempt it runs.
    fn dispatch(&mut self, cfg: &Config, p: ProcId, job: JobId, gen: u8) {
        let queued = cfg
            .key_of(job)
            .is_some_and(|k| self.sequencer_busy(cfg, p, k));
        let phase = if queued { Phase::Queued } else { Phase::Ready };
        match self.attempt_mut(p, job, gen) {
            Some(a) => a.phase = phase,
            None => self.add_attempt(
                p,
                Attempt {
                    job,
                    gen,
                    phase,
                    deadline: cfg.deadline_from(0),
                    cancelled: false,
                },
            ),
        }
        self.procs[p as usize].attempts.sort();
    }

    /// `Sequencer::next_or_idle`: once the key's attempt is over, run the next queued.
    fn sequencer_next(&mut self, cfg: &Config, p: ProcId, key: Option<u8>) {
        let Some(k) = key else { return };
        if self.sequencer_busy(cfg, p, k) {
            return;
        }
        let next = self.procs[p as usize]
            .attempts
            .iter()
            .find(|a| a.phase == Phase::Queued && cfg.key_of(a.job) == Some(k))
            .copied();
        if let Some(a) = next {
            self.set_phase(p, a.job, a.gen, Phase::Ready);
        }
    }

    /// Jobs of `p`'s ready queue, oldest first (ties, as among jobs one claim took, by
    /// job id).
    fn ready_queue(&self, p: ProcId) -> Vec<Attempt> {
        let mut q: Vec<Attempt> = self.procs[p as usize]
            .attempts
            .iter()
            .filter(|a| matches!(a.phase, Phase::ReadyQueue { .. }))
            .copied()
            .collect();
        q.sort_by_key(|a| match a.phase {
            Phase::ReadyQueue { waited } => (-waited, a.job),
            _ => unreachable!(),
        });
        q
    }

    /// src/actor/dispatch.rs `start_ready`: free slots take the oldest waiting jobs.
    fn start_ready(&mut self, cfg: &Config, p: ProcId) {
        for a in self.ready_queue(p) {
            if self.free_slots(cfg, p) == 0 {
                break;
            }
            self.dispatch(cfg, p, a.job, a.gen);
        }
    }

    fn wait_for_slot(&mut self, p: ProcId, job: JobId, gen: u8, deadline: i8) {
        self.add_attempt(
            p,
            Attempt {
                job,
                gen,
                phase: Phase::ReadyQueue { waited: 0 },
                deadline,
                cancelled: false,
            },
        );
    }

    /// `Claimer::claim_after`: waiting jobs take the free slots (`start_ready`), then
    /// CLAIM for the rest of the free slots plus the room left in the ready queue; the
    /// first dispatched, the others queued. A stopping process only gives its queue back.
    pub fn claim_step(&mut self, cfg: &Config, p: ProcId) {
        if self.procs[p as usize].up == Up::Stopping {
            self.release_ready(cfg, p);
            return;
        }
        self.start_ready(cfg, p);
        let slots = self.free_slots(cfg, p);
        if slots > 0 {
            self.procs[p as usize].ahead_paused = false;
        }
        let room = self.ahead_room(cfg, p);
        for (n, (job, gen)) in self.claim(cfg, p, slots + room).into_iter().enumerate() {
            if n < slots as usize {
                self.dispatch(cfg, p, job, gen);
            } else {
                self.wait_for_slot(p, job, gen, cfg.deadline_from(0));
            }
        }
    }

    fn ahead_room(&self, cfg: &Config, p: ProcId) -> u8 {
        if self.procs[p as usize].ahead_paused && self.free_slots(cfg, p) == 0 {
            return 0;
        }
        cfg.ahead.saturating_sub(self.ready_queue(p).len() as u8)
    }

    /// Whether a claim step would do something: start a waiting job in a free slot,
    /// claim a due pending row into a free slot or the ready queue, or (stopping) give
    /// its queue back.
    pub fn claim_finds_work(&self, cfg: &Config, p: ProcId) -> bool {
        let queued = !self.ready_queue(p).is_empty();
        if self.procs[p as usize].up == Up::Stopping {
            return queued;
        }
        let free = self.free_slots(cfg, p) > 0;
        let pending = self.rows.iter().enumerate().any(|(j, r)| {
            r.state == super::state::JobState::Pending
                && r.due_in == 0
                && !self.row_locked(cfg, j as JobId)
        });
        (free && queued) || ((free || self.ahead_room(cfg, p) > 0) && pending)
    }

    /// Jobs of the ready queue that waited longer than a lease.
    pub fn overdue(&self, cfg: &Config, p: ProcId) -> bool {
        self.ready_queue(p)
            .iter()
            .any(|a| matches!(a.phase, Phase::ReadyQueue { waited } if waited > cfg.lease))
    }

    /// The claimer's give-back pass (`Claimer::claim_after`: dispatch.rs `release_ready`
    /// with `GiveBack::WaitedLongerThan(lease)`, then `ahead_paused`): jobs that waited
    /// longer than a lease leave the queue, given back ([`State::release_step`]).
    pub fn give_back(&mut self, cfg: &Config, p: ProcId) {
        self.procs[p as usize].ahead_paused = true;
        for a in self.ready_queue(p) {
            if matches!(a.phase, Phase::ReadyQueue { waited } if waited > cfg.lease) {
                self.hand_back(cfg, p, a);
            }
        }
    }

    /// dispatch.rs `release_ready(GiveBack::All)`: the whole ready queue is given back.
    fn release_ready(&mut self, cfg: &Config, p: ProcId) {
        for a in self.ready_queue(p) {
            self.hand_back(cfg, p, a);
        }
    }

    /// dispatch.rs `give_back`: off the ready queue, still tracked; `release_retrying`
    /// gives up a lease from now.
    fn hand_back(&mut self, cfg: &Config, p: ProcId, a: Attempt) {
        let give_up = cfg.lease;
        self.set_phase(p, a.job, a.gen, Phase::GivenBack { give_up });
    }

    /// One RELEASE of dispatch.rs `release_retrying` for a given-back job: fail.rs RELEASE
    /// (`Store::release_many`), fenced, so it matches no row once the job is not ours.
    /// Answered (`Ok`): `release_retrying` returns and `give_back` untracks the job.
    /// Not answered (`Err`, a fault; the statement committed or not): tried again while
    /// the give-back's lease lasts, the job still tracked and never started; past it,
    /// dropped (untracked: a row still running expires). With
    /// [`super::config::Defects::give_back_error_keeps_jobs`] an `Err` puts the job back
    /// in the ready queue, its wait as it was (over a lease).
    pub fn release_step(&mut self, cfg: &Config, p: ProcId, job: JobId, gen: u8, reply: Reply) {
        let phase = self.attempt(p, job, gen).expect("attempt").phase;
        let Phase::GivenBack { give_up } = phase else {
            unreachable!("only a given-back job is released")
        };
        if reply != Reply::NotCommitted {
            self.release(cfg, job, p, gen);
        }
        if reply == Reply::Answered {
            self.remove_attempt(p, job, gen);
            return;
        }
        self.budget.spend(Spend::LostReply);
        if cfg.defects.give_back_error_keeps_jobs {
            let waited = cfg.lease + 1;
            self.set_phase(p, job, gen, Phase::ReadyQueue { waited });
        } else if give_up == 0 {
            self.remove_attempt(p, job, gen);
        }
    }

    /// Graceful shutdown begins (`StopClaiming`): no claim and no chained successor
    /// from now on, and the ready queue is given back at once.
    pub fn shutdown(&mut self, cfg: &Config, p: ProcId) {
        self.budget.spend(Spend::Shutdown);
        self.procs[p as usize].up = Up::Stopping;
        self.release_ready(cfg, p);
    }

    /// `attempt_once` before the handler: hardened, nothing starts without a live lease
    /// (not lost, local deadline not passed); such an attempt writes its ending instead.
    /// The handler then calls `once` at once (or, `fails`, returns an error first).
    pub fn start(&mut self, cfg: &Config, p: ProcId, job: JobId, gen: u8, fails: bool) {
        let a = *self.attempt(p, job, gen).expect("attempt");
        let checked = !cfg.defects.renewal_from_handler_start;
        if checked && (a.cancelled || a.deadline < 0) {
            self.set_phase(p, job, gen, Phase::Ending(Ending::Fail));
            return;
        }
        let row = self.rows[job as usize];
        if let Some(k) = cfg.key_of(job) {
            let seen = &mut self.ghost.started_seq[k as usize];
            if row.key_seq < *seen {
                self.ghost.broken |= broken::START_ORDER;
            }
            *seen = (*seen).max(row.key_seq);
        }
        if !self.fence_ok(job, p, gen) || row.lease_left < 0 {
            self.ghost.broken |= broken::START_WITHOUT_LEASE;
        }
        if self.handler_of_key_runs(cfg, cfg.key_of(job)) {
            self.ghost.broken |= broken::OVERLAP;
        }
        if fails {
            self.budget.spend(Spend::Failure);
            self.set_phase(p, job, gen, Phase::Ending(Ending::Fail));
        } else {
            self.act(cfg, p, job, gen);
        }
    }

    /// Some live process runs a handler of this key now.
    fn handler_of_key_runs(&self, cfg: &Config, key: Option<u8>) -> bool {
        key.is_some()
            && self.procs.iter().filter(|q| q.up != Up::Crashed).any(|q| {
                q.attempts
                    .iter()
                    .any(|a| matches!(a.phase, Phase::Handler(_)) && cfg.key_of(a.job) == key)
            })
    }

    /// The handler returns: complete (chained if another slot is free and the process
    /// is not stopping) or fail. Its slot then starts the oldest waiting job.
    fn handler_returns(&mut self, cfg: &Config, p: ProcId, job: JobId, gen: u8, ok: bool) {
        let ending = if ok {
            let spare = self.free_slots(cfg, p) > 0;
            let claiming = self.procs[p as usize].up == Up::Running;
            Ending::Complete {
                chain: spare && claiming && cfg.key_of(job).is_some(),
            }
        } else {
            Ending::Fail
        };
        self.set_phase(p, job, gen, Phase::Ending(ending));
        self.start_ready(cfg, p);
    }

    /// `JobContext::once`: the ledger first (a recorded outcome is reused); a cancelled
    /// attempt does not act; otherwise the request goes out with the effect key and the
    /// fencing token.
    fn act(&mut self, cfg: &Config, p: ProcId, job: JobId, gen: u8) {
        let a = *self.attempt(p, job, gen).expect("attempt");
        if self.ledger & (1 << job) != 0 {
            self.handler_returns(cfg, p, job, gen, true);
        } else if a.cancelled {
            self.handler_returns(cfg, p, job, gen, false);
        } else {
            let token = (self.rows[job as usize].key_seq, gen);
            self.store.in_flight.push(Request {
                job,
                token,
                from: p,
            });
            self.store.in_flight.sort();
            self.set_phase(p, job, gen, Phase::Handler(Effect::Awaiting));
            if cfg.store == EffectStore::Dedup {
                // Whenever a request reaches a deduplicating store, it applies the key
                // once: its delay changes nothing any property sees, so it arrives now.
                let at = self
                    .store
                    .in_flight
                    .iter()
                    .position(|r| r.job == job && r.token.1 == gen);
                self.deliver(cfg, at.expect("just sent"));
            }
        }
    }

    /// The effect store takes request `i`; its answer reaches the attempt if the
    /// attempt still waits for it.
    pub fn deliver(&mut self, cfg: &Config, i: usize) {
        let req = self.store.in_flight.remove(i);
        let job = req.job as usize;
        let scope = cfg.token_scope(req.job);
        let ok = match cfg.store {
            EffectStore::Dedup => {
                self.store.applied[job] = self.store.applied[job].max(1);
                true
            }
            EffectStore::Fenced if req.token < self.store.newest[scope] => {
                if self.fence_ok(req.job, req.from, req.token.1) {
                    self.ghost.broken |= broken::CURRENT_REFUSED;
                }
                false
            }
            EffectStore::Fenced => {
                self.store.applied[job] = (self.store.applied[job] + 1).min(2);
                self.store.newest[scope] = req.token;
                true
            }
        };
        if self.procs[req.from as usize].up == Up::Crashed {
            return;
        }
        if let Some(a) = self.attempt_mut(req.from, req.job, req.token.1) {
            if a.phase == Phase::Handler(Effect::Awaiting) {
                a.phase = Phase::Handler(if ok {
                    Effect::Answered
                } else {
                    Effect::Refused
                });
            }
        }
    }

    /// The answer is back: record the outcome in the ledger (fenced) and return; a
    /// refusal or a stale record makes the handler return an error.
    pub fn record_step(&mut self, cfg: &Config, p: ProcId, job: JobId, gen: u8) {
        let a = *self.attempt(p, job, gen).expect("attempt");
        let ok = a.phase == Phase::Handler(Effect::Answered) && self.record(job, p, gen);
        self.handler_returns(cfg, p, job, gen, ok);
    }

    /// The executor writes the attempt's ending (through the completer for a completion).
    /// `park`: a claim in flight holds the free slots when a chained successor arrives.
    pub fn end(&mut self, cfg: &Config, p: ProcId, job: JobId, gen: u8, park: bool) {
        let Phase::Ending(ending) = self.attempt(p, job, gen).expect("attempt").phase else {
            unreachable!("only an ended handler writes its ending")
        };
        let written = match ending {
            Ending::Complete { chain } => self.complete(cfg, job, p, gen, chain),
            Ending::Fail => self.fail(cfg, job, p, gen),
        };
        self.after_write(cfg, p, job, gen, ending, written, park);
    }

    /// A waiting ending transaction gets its key row, then runs its fenced UPDATE.
    pub fn resume(&mut self, cfg: &Config, p: ProcId, job: JobId, gen: u8, park: bool) {
        let phase = self.attempt(p, job, gen).expect("attempt").phase;
        let Phase::Writing { ending, began } = phase else {
            unreachable!("only a waiting transaction resumes")
        };
        // Its fenced UPDATE runs only now, after the key row (the job row was not held
        // meanwhile): the job may have been reaped and claimed again while it waited.
        let written = match ending {
            _ if !self.fence_ok(job, p, gen) => Written::Stale,
            Ending::Complete { chain } => self.commit_complete(cfg, job, p, gen, chain, began),
            Ending::Fail => self.commit_fail(cfg, job, p, gen),
        };
        self.after_write(cfg, p, job, gen, ending, written, park);
    }

    /// `Sequencer::after`: a successor claimed by the completion runs if a slot is free,
    /// or waits in the ready queue (`wait_for_slot`); then the key's queued attempts.
    #[allow(clippy::too_many_arguments)]
    fn after_write(
        &mut self,
        cfg: &Config,
        p: ProcId,
        job: JobId,
        gen: u8,
        ending: Ending,
        w: Written,
        park: bool,
    ) {
        match w {
            Written::Waiting => self.set_phase(p, job, gen, Phase::Writing { ending, began: 0 }),
            Written::Stale => self.remove_attempt(p, job, gen),
            Written::Committed(next) => {
                self.remove_attempt(p, job, gen);
                if let Some((sj, sg)) = next {
                    // Claimed by the completion statement: its local deadline counts from
                    // when that statement was sent (the transaction's start).
                    let sent = match self.rows[sj as usize].lease_left {
                        left if cfg.defects.promote_lease_from_transaction_start => {
                            left - cfg.lease
                        }
                        _ => 0,
                    };
                    let deadline = cfg.deadline_from(sent.max(-cfg.lease));
                    self.wait_for_slot(p, sj, sg, deadline);
                    if !park && self.free_slots(cfg, p) > 0 {
                        self.dispatch(cfg, p, sj, sg);
                    }
                }
            }
        }
        self.sequencer_next(cfg, p, cfg.key_of(job));
    }

    /// The reaper takes back what had expired; the clock advances one tick; attempts
    /// past their local deadline are cancelled and stopped; every process whose renewer
    /// works renews. (Reaper and renewer run every tick: their intervals.)
    pub fn tick(&mut self, cfg: &Config) {
        for j in 0..self.rows.len() as JobId {
            let r = self.rows[j as usize];
            if r.state == super::state::JobState::Running
                && r.lease_left < 0
                && !self.row_locked(cfg, j)
            {
                self.reap(cfg, j);
            }
        }
        for r in &mut self.rows {
            if r.state == super::state::JobState::Running {
                r.lease_left = (r.lease_left - 1).max(-1);
            }
            r.due_in = r.due_in.saturating_sub(1);
        }
        let deadlines = !cfg.defects.no_local_deadline;
        for proc in &mut self.procs {
            if let Renewer::Blocked { sent } = &mut proc.renewer {
                *sent = (*sent - 1).max(-(cfg.lease + 1));
            }
            if cfg.defects.promote_lease_from_transaction_start {
                for a in &mut proc.attempts {
                    if let Phase::Writing { began, .. } = &mut a.phase {
                        *began = (*began - 1).max(-(cfg.lease + 1));
                    }
                }
            }
            for a in &mut proc.attempts {
                match &mut a.phase {
                    Phase::ReadyQueue { waited } => *waited = (*waited + 1).min(cfg.lease + 1),
                    Phase::GivenBack { give_up } => *give_up = (*give_up - 1).max(0),
                    _ => {}
                }
            }
            if !deadlines {
                proc.attempts.sort();
                continue;
            }
            for a in &mut proc.attempts {
                a.deadline = (a.deadline - 1).max(-1);
                // The deadline timer: cancel, and stop the handler. (A frozen process's
                // handler makes no step until its timer has fired either.)
                if a.deadline < 0 && matches!(a.phase, Phase::Handler(_)) {
                    a.cancelled = true;
                    a.phase = Phase::Ending(Ending::Fail);
                }
            }
            proc.attempts.sort();
        }
        for p in 0..self.procs.len() as ProcId {
            let proc = &self.procs[p as usize];
            if proc.up != Up::Crashed && proc.renewer == Renewer::Ok {
                self.renew(cfg, p);
                if self.procs[p as usize].renewer == Renewer::Ok {
                    // Renewed since its pause: healthy again for the lease property.
                    self.ghost.faulted &= !(1 << p);
                }
            }
        }
    }

    /// src/store/lease.rs RENEW for the registry's attempts. Hardened: rows locked by
    /// another transaction are skipped (FOR UPDATE SKIP LOCKED) and count as busy, not
    /// lost. Old: a plain UPDATE that waits for the lock.
    fn renew(&mut self, cfg: &Config, p: ProcId) {
        let mine: Vec<Attempt> = self.procs[p as usize]
            .attempts
            .iter()
            .filter(|a| self.registered(cfg, a))
            .copied()
            .collect();
        if mine.is_empty() {
            return;
        }
        if cfg.defects.renewal_waits_on_locks && mine.iter().any(|a| self.row_locked(cfg, a.job)) {
            self.procs[p as usize].renewer = Renewer::Blocked { sent: 0 };
            return;
        }
        self.renewed(cfg, p, &mine, 0);
    }

    /// The renewal's reply: deadlines from the send time; lost leases (and requested
    /// cancels) cancel their handlers. A given-back job found no longer ours is cancelled
    /// (lease_renewer.rs `lost`, `LeaseLost`), and `release_retrying` leaves it out of its
    /// next RELEASE; with nothing left to release it returns and `give_back` untracks it.
    /// (Per job, here: a RELEASE in between would match no row of this generation.)
    fn renewed(&mut self, cfg: &Config, p: ProcId, mine: &[Attempt], sent: i8) {
        for a in mine {
            if self.row_locked(cfg, a.job) {
                continue;
            }
            let ours = self.fence_ok(a.job, p, a.gen);
            if !ours && matches!(a.phase, Phase::GivenBack { .. }) {
                self.remove_attempt(p, a.job, a.gen);
                continue;
            }
            let row = &mut self.rows[a.job as usize];
            if ours {
                row.lease_left = (sent + cfg.lease).max(-1);
            }
            let cancel = !ours || row.cancel_requested;
            let at = self.attempt_mut(p, a.job, a.gen).expect("attempt");
            if ours {
                at.deadline = cfg.deadline_from(sent);
            }
            at.cancelled |= cancel;
        }
        self.procs[p as usize].attempts.sort();
    }

    /// The old RENEW got its lock and commits, with `now()` of its start.
    pub fn renew_resume(&mut self, cfg: &Config, p: ProcId) {
        let Renewer::Blocked { sent } = self.procs[p as usize].renewer else {
            unreachable!()
        };
        let mine: Vec<Attempt> = self.procs[p as usize]
            .attempts
            .iter()
            .filter(|a| self.registered(cfg, a))
            .copied()
            .collect();
        self.procs[p as usize].renewer = Renewer::Ok;
        self.renewed(cfg, p, &mine, sent);
    }

    pub fn renewal_can_resume(&self, cfg: &Config, p: ProcId) -> bool {
        let proc = &self.procs[p as usize];
        matches!(proc.renewer, Renewer::Blocked { .. })
            && !proc
                .attempts
                .iter()
                .any(|a| self.registered(cfg, a) && self.row_locked(cfg, a.job))
    }

    /// The process dies: its memory and its connections (an open ending transaction
    /// rolls back). Its rows stay running until their leases pass.
    pub fn crash(&mut self, p: ProcId) {
        self.budget.spend(Spend::Crash);
        let proc = &mut self.procs[p as usize];
        proc.up = Up::Crashed;
        proc.renewer = Renewer::Ok;
        proc.ahead_paused = false;
        proc.attempts.clear();
    }

    /// The process pauses (or its renewal connection hangs): no renewal until it ends.
    pub fn pause(&mut self, p: ProcId) {
        self.budget.spend(Spend::Pause);
        self.procs[p as usize].renewer = Renewer::Paused;
        self.ghost.faulted |= 1 << p;
    }

    pub fn unpause(&mut self, p: ProcId) {
        self.procs[p as usize].renewer = Renewer::Ok;
    }
}
