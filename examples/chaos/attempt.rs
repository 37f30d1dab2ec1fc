//! The worker's history of real execution: one line when a handler starts, one before
//! each call to the effect server, one when the handler's future is dropped.
//!
//! Why a drop guard: the checker's per-key order is judged on when handlers really ran,
//! not on lease intervals in the database. A handler that returns writes its own `end`,
//! but one whose task is aborted (a lost lease it ignored, the max run time, shutdown)
//! or that panics never reaches its last line. Its future is dropped all the same, and
//! [`Attempt`]'s `Drop` writes the `end` then, at the moment the handler stopped
//! existing. Only a SIGKILL leaves no `end`; the checker ends such attempts when the
//! harness reaped the process (see `check::execution`).

use std::sync::{Arc, Mutex};

use leasehold::JobContext;

use crate::model::{now_mono_ns, now_us, HistoryLine, Jsonl};

/// One worker incarnation's history file.
pub struct History {
    pub w: usize,
    pub inc: u32,
    pid: u32,
    file: Mutex<Jsonl>,
}

impl History {
    pub fn new(w: usize, inc: u32, file: Jsonl) -> History {
        History {
            w,
            inc,
            pid: std::process::id(),
            file: Mutex::new(file),
        }
    }

    /// A line about no attempt (`up`, `term`, `down`).
    pub fn mark(&self, ev: &str, owner: Option<String>, detail: String) {
        self.write(HistoryLine {
            ev: ev.into(),
            owner,
            detail,
            ..self.base()
        });
    }

    fn base(&self) -> HistoryLine {
        HistoryLine {
            t_us: now_us(),
            mono_ns: now_mono_ns(),
            w: self.w,
            inc: self.inc,
            pid: self.pid,
            ..Default::default()
        }
    }

    fn write(&self, line: HistoryLine) {
        // A poisoned lock only means another attempt panicked while writing; the file
        // itself is fine, and losing this line would lose evidence.
        let mut f = self.file.lock().unwrap_or_else(|p| p.into_inner());
        f.write(&line);
    }

    fn attempt_line(&self, ctx: &JobContext, ev: &str) -> HistoryLine {
        HistoryLine {
            ev: ev.into(),
            job: ctx.job_id().0,
            generation: ctx.generation().0,
            attempt: ctx.attempt(),
            kind: ctx.kind().to_string(),
            key: ctx.key().map(str::to_string),
            key_seq: ctx.job().key_seq,
            ..self.base()
        }
    }

    /// The handler of `ctx` starts now; the returned guard writes its end.
    pub fn start(self: &Arc<Self>, ctx: &JobContext, detail: String) -> Attempt {
        let mut line = self.attempt_line(ctx, "start");
        line.detail = detail;
        self.write(line);
        Attempt {
            history: self.clone(),
            ctx: ctx.clone(),
            ending: Mutex::new(None),
        }
    }
}

/// How the handler said it ended: (outcome, ledger hits, detail).
type Ending = (String, u32, String);

/// A running attempt; dropping it writes the `end` line.
pub struct Attempt {
    history: Arc<History>,
    ctx: JobContext,
    ending: Mutex<Option<Ending>>,
}

impl Attempt {
    /// About to call the effect server for `step` (not for a ledger hit: that calls
    /// nothing).
    pub fn effect(&self, step: &str) {
        let mut line = self.history.attempt_line(&self.ctx, "effect");
        line.step = step.to_string();
        self.history.write(line);
    }

    /// Say how the handler ends; written when the guard drops.
    pub fn finish(&self, outcome: &str, ledger_hits: u32, detail: String) {
        *self.ending.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((outcome.to_string(), ledger_hits, detail));
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        let ending = self.ending.lock().unwrap_or_else(|p| p.into_inner()).take();
        let (outcome, hits, detail) = ending.unwrap_or_else(|| {
            let why = if std::thread::panicking() {
                "panicked"
            } else {
                "future dropped before the handler returned (task aborted)"
            };
            ("dropped".to_string(), 0, why.to_string())
        });
        let mut line = self.history.attempt_line(&self.ctx, "end");
        line.outcome = outcome;
        line.ledger_hits = hits;
        line.detail = detail;
        self.history.write(line);
    }
}
