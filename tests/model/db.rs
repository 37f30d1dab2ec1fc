//! The store's statements, one function per transaction (or per statement where a
//! transaction can wait between two), each named after the SQL it models.
//!
//! # Locks
//! A model step is atomic, so a lock matters only where a transaction holds one across
//! steps: the host transaction holds its key row until it commits; an ending (complete,
//! fail) that must leave a key waits for that row ([`super::state::Phase::Writing`]).
//! As in the code, key rows are locked before job rows (src/store/complete.rs "Lock
//! order"): the waiting ending holds no job row, and REAP takes key rows with SKIP
//! LOCKED and leaves a row whose key is busy to its next pass. The old order (job row
//! held while waiting for the key row, [`super::config::Defects::job_row_before_key_row`])
//! is a defect switch; only there do a waiting ending and a waiting reap
//! ([`super::state::State::reaping`]) lock a job row. Every other transaction runs when
//! the locks it needs are free, which is the same as waiting for them (none of them
//! holds a lock while it waits, so none can deadlock).

use super::config::{Config, JobId, ProcId};
use super::state::{broken, enqueued, Host, JobState, Phase, Row, State, Up};

/// How a fenced ending turned out.
pub enum Written {
    /// The fence no longer matched: zero rows, `Stale`.
    Stale,
    /// Its job row is locked and it waits for the key row the host transaction holds.
    Waiting,
    /// Committed; with the key's successor if the promotion claimed it for the writer.
    Committed(Option<(JobId, u8)>),
}

impl State {
    /// `WHERE id = $1 AND owner = $2 AND generation = $3 AND state = 'running'`.
    pub fn fence_ok(&self, job: JobId, p: ProcId, gen: u8) -> bool {
        let r = &self.rows[job as usize];
        r.state == JobState::Running && r.owner == p && r.generation == gen
    }

    /// A transaction that waits for a key row holds this job row (only in the old lock
    /// order: see the module docs).
    pub fn row_locked(&self, cfg: &Config, job: JobId) -> bool {
        cfg.defects.job_row_before_key_row && self.job_row_held(job)
    }

    fn job_row_held(&self, job: JobId) -> bool {
        self.reaping.iter().any(|(j, _)| *j == job)
            || self.procs.iter().any(|p| {
                p.up != Up::Crashed
                    && p.attempts
                        .iter()
                        .any(|a| a.job == job && matches!(a.phase, Phase::Writing { .. }))
            })
    }

    pub fn key_locked(&self, cfg: &Config, key: Option<u8>) -> bool {
        self.host == Host::Open && key.is_some() && cfg.host_key() == key
    }

    /// Every accepted write of a worker passes here: the ghost check that it came from
    /// the job's current claim (the fence in each statement is what makes it hold).
    fn accept(&mut self, job: JobId, p: ProcId, gen: u8) {
        if !self.fence_ok(job, p, gen) {
            self.ghost.broken |= broken::STALE_WRITE;
        }
    }

    /// The claim's SET: running, owner, generation + 1, attempts + 1, lease_until.
    pub fn claim_row(&mut self, cfg: &Config, job: JobId, p: ProcId) -> u8 {
        self.claim_row_at(cfg, job, p, 0)
    }

    /// [`State::claim_row`] with `lease_until` counted from `began` (relative to now).
    fn claim_row_at(&mut self, cfg: &Config, job: JobId, p: ProcId, began: i8) -> u8 {
        let r = &mut self.rows[job as usize];
        r.state = JobState::Running;
        r.owner = p;
        r.generation += 1;
        r.attempts += 1;
        r.lease_left = (began + cfg.lease).max(-1);
        r.cancel_requested = false;
        r.generation
    }

    /// src/store/claim.rs CLAIM: pending, due rows, `FOR UPDATE SKIP LOCKED`, ordered
    /// (by id: priorities and ages are equal here), at most `limit`.
    pub fn claim(&mut self, cfg: &Config, p: ProcId, limit: u8) -> Vec<(JobId, u8)> {
        let mut got = Vec::new();
        for j in 0..self.rows.len() as JobId {
            if got.len() == limit as usize {
                break;
            }
            let r = self.rows[j as usize];
            if r.state == JobState::Pending && r.due_in == 0 && !self.row_locked(cfg, j) {
                got.push((j, self.claim_row(cfg, j, p)));
            }
        }
        got
    }

    /// src/store/keys.rs LEAVE_KEYS: the ended job no longer counts as open.
    pub fn leave_key(&mut self, key: u8) {
        let k = &mut self.keys[key as usize];
        k.open_jobs = k.open_jobs.saturating_sub(1);
    }

    /// src/store/keys.rs PROMOTE (the schema function `promote`, migrations/0003_claim.sql,
    /// also called inside `complete_keyed`): the key's next waiting job (by key_seq) becomes
    /// pending, or, chained, running for `chain` with a lease from `began` (its
    /// transaction's start, relative to now).
    pub fn promote(
        &mut self,
        cfg: &Config,
        key: u8,
        chain: Option<ProcId>,
        began: i8,
    ) -> Option<(JobId, u8)> {
        let next = (0..self.rows.len() as JobId)
            .filter(|&j| {
                cfg.key_of(j) == Some(key) && self.rows[j as usize].state == JobState::Waiting
            })
            .min_by_key(|&j| self.rows[j as usize].key_seq)?;
        let r = &mut self.rows[next as usize];
        r.due_in = 0; // greatest(available_at, now())
        r.set(JobState::Pending);
        chain.map(|p| (next, self.claim_row_at(cfg, next, p, began)))
    }

    /// `Store::end_heads_chained`: LEAVE_KEYS then PROMOTE, in the ending's transaction.
    pub fn end_head(
        &mut self,
        cfg: &Config,
        key: u8,
        chain: Option<ProcId>,
        began: i8,
    ) -> Option<(JobId, u8)> {
        self.leave_key(key);
        self.promote(cfg, key, chain, began)
    }

    /// A keyed completion: the schema function `complete_keyed`
    /// (migrations/0003_claim.sql, called by src/store/complete.rs COMPLETE_KEYED from
    /// src/actor/completer.rs `write_keyed`). Its first SELECT locks the key row with
    /// SKIP LOCKED; a key row the host transaction holds makes the item 'busy' (nothing
    /// written, nothing locked), and the completer writes it again in a transaction that
    /// waits for the key row ([`Written::Waiting`]). Unkeyed: COMPLETE_UNKEYED, which
    /// never touches a key row.
    pub fn complete(
        &mut self,
        cfg: &Config,
        job: JobId,
        p: ProcId,
        gen: u8,
        chain: bool,
    ) -> Written {
        if !self.fence_ok(job, p, gen) {
            return Written::Stale;
        }
        let key = cfg.key_of(job);
        if self.key_locked(cfg, key) {
            return Written::Waiting;
        }
        self.commit_complete(cfg, job, p, gen, chain, 0)
    }

    /// `complete_keyed` (`p_wait`) once its key row is free: the fenced UPDATE, the key's
    /// open_jobs, then `promote` (chain-claiming the successor). `began`: when its
    /// transaction began (its `now()`), which the old PROMOTE counts the successor's
    /// lease from.
    pub fn commit_complete(
        &mut self,
        cfg: &Config,
        job: JobId,
        p: ProcId,
        gen: u8,
        chain: bool,
        began: i8,
    ) -> Written {
        self.accept(job, p, gen);
        self.rows[job as usize].set(JobState::Done);
        let next = match cfg.key_of(job) {
            Some(k) => self.end_head(cfg, k, chain.then_some(p), began),
            None => None,
        };
        Written::Committed(next)
    }

    /// What FAIL (or REAP) moves a running row to, and whether that ends the key's head.
    fn failed_state(&self, cfg: &Config, job: JobId) -> (JobState, bool) {
        let r = &self.rows[job as usize];
        let keyed = cfg.key_of(job).is_some();
        if r.cancel_requested {
            (JobState::Cancelled, keyed)
        } else if r.attempts >= cfg.max_attempts {
            (
                JobState::Dead,
                keyed && cfg.jobs[job as usize].continue_on_dead,
            )
        } else {
            (JobState::Pending, false)
        }
    }

    /// src/store/fail.rs FAIL: back to pending with backoff, dead when the
    /// attempts are spent, cancelled when a cancel was requested; the head ends (and the
    /// transaction waits for the key row) when the new state leaves the key.
    pub fn fail(&mut self, cfg: &Config, job: JobId, p: ProcId, gen: u8) -> Written {
        if !self.fence_ok(job, p, gen) {
            return Written::Stale;
        }
        let (_, ends_head) = self.failed_state(cfg, job);
        if ends_head && self.key_locked(cfg, cfg.key_of(job)) {
            return Written::Waiting;
        }
        self.commit_fail(cfg, job, p, gen)
    }

    pub fn commit_fail(&mut self, cfg: &Config, job: JobId, p: ProcId, gen: u8) -> Written {
        self.accept(job, p, gen);
        let (to, ends_head) = self.failed_state(cfg, job);
        self.set_ended(cfg, job, to, ends_head);
        Written::Committed(None)
    }

    /// Write a new state; a pending row waits one tick of backoff; end the head if told.
    fn set_ended(&mut self, cfg: &Config, job: JobId, to: JobState, ends_head: bool) {
        let r = &mut self.rows[job as usize];
        r.set(to);
        if to == JobState::Pending {
            r.due_in = 1;
        }
        if ends_head {
            self.end_head(
                cfg,
                cfg.key_of(job).expect("only keyed jobs end a head"),
                None,
                0,
            );
        }
    }

    /// src/store/reap.rs REAP: one running row whose lease passed, not locked (SKIP
    /// LOCKED); the expiry is recorded; pending with backoff, dead, or cancelled. A row
    /// whose expiry ends its key's head needs the key row too (`kl`, SKIP LOCKED): while
    /// the host transaction holds it the row is left for the next pass. (Old lock order:
    /// the reap held the row and waited.)
    pub fn reap(&mut self, cfg: &Config, job: JobId) {
        let (to, ends_head) = self.failed_state(cfg, job);
        let key_busy = ends_head && self.key_locked(cfg, cfg.key_of(job));
        if key_busy && !cfg.defects.job_row_before_key_row {
            return;
        }
        let r = self.rows[job as usize];
        let owner = r.owner;
        // A lease its owner let go (a RELEASE that left a cancelled job's row to its
        // expiry, a give-back dropped after a lease without an answer) is no loss of a
        // healthy process.
        let healthy = self.procs[owner as usize].up != Up::Crashed
            && self.ghost.faulted & (1 << owner) == 0
            && self.attempt(owner, job, r.generation).is_some();
        if healthy {
            self.ghost.broken |= broken::HEALTHY_LEASE_LOST;
        }
        if cfg.defects.reap_never_requeues {
            self.rows[job as usize].lease_left = cfg.lease;
            return;
        }
        if key_busy {
            self.reaping.push((job, to));
            self.reaping.sort();
        } else {
            self.set_ended(cfg, job, to, ends_head);
        }
    }

    /// The reap's `end_heads` once the key row is free; then it commits.
    pub fn commit_reap(&mut self, cfg: &Config, job: JobId) {
        let at = self
            .reaping
            .iter()
            .position(|(j, _)| *j == job)
            .expect("a blocked reap");
        let (_, to) = self.reaping.remove(at);
        self.set_ended(cfg, job, to, true);
    }

    /// src/store/fail.rs RELEASE (`Store::release_many`): give a claimed job back
    /// without counting the attempt: pending and due now, owner cleared, attempts - 1.
    /// One an operator asked to cancel is cancelled and its key moves on, its key row
    /// taken with SKIP LOCKED: while the host transaction holds it the row is left
    /// running (its expiry cancels it). False: nothing written (fence gone, or left).
    pub fn release(&mut self, cfg: &Config, job: JobId, p: ProcId, gen: u8) -> bool {
        if !self.fence_ok(job, p, gen) {
            return false;
        }
        let key = cfg.key_of(job);
        if self.rows[job as usize].cancel_requested {
            if self.key_locked(cfg, key) {
                return false;
            }
            self.accept(job, p, gen);
            self.rows[job as usize].set(JobState::Cancelled);
            if let Some(k) = key {
                self.end_head(cfg, k, None, 0);
            }
            return true;
        }
        self.accept(job, p, gen);
        let r = &mut self.rows[job as usize];
        r.set(JobState::Pending);
        r.attempts = r.attempts.saturating_sub(1);
        r.due_in = 0;
        true
    }

    /// src/store/effects.rs RECORD: the ledger row, inserted only under the fence (the
    /// job row `FOR SHARE`). False: `Stale`.
    pub fn record(&mut self, job: JobId, p: ProcId, gen: u8) -> bool {
        if !self.fence_ok(job, p, gen) {
            return false;
        }
        self.accept(job, p, gen);
        self.ledger |= 1 << job;
        true
    }

    /// src/store/enqueue.rs ENQUEUE in the host's transaction, at its commit: the key's
    /// next_seq and open_jobs (taken under the row lock it held), pending iff no open job.
    pub fn host_commit(&mut self, cfg: &Config) {
        let job = cfg.host_job().expect("a host job");
        self.rows[job as usize] = enqueued(&mut self.keys, cfg.key_of(job));
        self.host = Host::Over;
    }

    /// src/store/admin.rs cancel. Running: only `cancel_requested` (and the owner told);
    /// with the old behaviour, cancelled at once and the successor promoted.
    pub fn cancel(&mut self, cfg: &Config, job: JobId) {
        let key = cfg.key_of(job);
        let r = self.rows[job as usize];
        match r.state {
            JobState::Running if !cfg.defects.cancel_promotes_running_head => {
                self.rows[job as usize].cancel_requested = true;
                let owner = r.owner as usize;
                if self.procs[owner].up != Up::Crashed {
                    if let Some(a) = self.attempt_mut(r.owner, job, r.generation) {
                        a.cancelled = true;
                    }
                }
            }
            JobState::Waiting => {
                self.rows[job as usize].set(JobState::Cancelled);
                self.leave_key(key.expect("waiting jobs are keyed"));
            }
            JobState::Dead if cfg.jobs[job as usize].continue_on_dead => {
                self.rows[job as usize].set(JobState::Cancelled);
            }
            _ => {
                self.rows[job as usize].set(JobState::Cancelled);
                if let Some(k) = key {
                    self.end_head(cfg, k, None, 0);
                }
            }
        }
    }

    /// src/store/admin.rs retry_dead: a blocking dead head resumes as the head; one whose
    /// key moved on re-enters at the key's end.
    pub fn retry_dead(&mut self, cfg: &Config, job: JobId) {
        let mut to = JobState::Pending;
        if let (Some(k), true) = (cfg.key_of(job), cfg.jobs[job as usize].continue_on_dead) {
            let kr = &mut self.keys[k as usize];
            kr.next_seq += 1;
            kr.open_jobs += 1;
            self.rows[job as usize].key_seq = kr.next_seq;
            if kr.open_jobs > 1 {
                to = JobState::Waiting;
            }
        }
        let r = &mut self.rows[job as usize];
        r.attempts = 0;
        r.due_in = 0;
        r.set(to);
    }

    /// src/store/admin.rs prune: done and cancelled rows (and their ledger rows) go;
    /// dead rows stay (the old retention deleted them too). Key rows are kept, so
    /// key_seq never restarts (the old retention deleted those with no open job).
    pub fn prune(&mut self, cfg: &Config) {
        if cfg.defects.prune_restarts_key_seq {
            for k in 0..cfg.keys {
                if self.keys[k as usize].open_jobs == 0 && !self.key_locked(cfg, Some(k)) {
                    self.keys[k as usize].next_seq = 0;
                }
            }
        }
        for j in 0..self.rows.len() {
            let st = self.rows[j].state;
            let gone = matches!(st, JobState::Done | JobState::Cancelled)
                || (st == JobState::Dead && cfg.defects.prune_deletes_dead);
            if gone {
                self.rows[j] = Row {
                    state: JobState::Pruned,
                    ..Row::UNBORN
                };
                self.ledger &= !(1 << j);
            }
        }
    }
}
