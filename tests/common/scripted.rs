//! A scripted handler that logs what it really did, in this process: when each
//! execution started and ended (on the monotonic clock, the end recorded by a drop
//! guard, so an aborted handler logs the moment it was dropped), and what cancellation
//! it saw. Tests of promises (one attempt of a key at a time, a job run once) assert on
//! this log, not on the lease columns.
//!
//! Include it next to `common` and `worker` with
//! `#[path = "common/scripted.rs"] mod scripted;`.
#![allow(dead_code)]

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold::{CancelReason, Handler, JobContext, JobError};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

/// What a scripted execution does.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Script {
    /// A label for the log.
    pub tag: String,
    /// Wait until this gate is opened ([`Scripted::open`]) before working.
    #[serde(default)]
    pub gate: Option<String>,
    /// Work this long (a cancellable tokio sleep).
    #[serde(default)]
    pub work_ms: u64,
    #[serde(default)]
    pub on_cancel: OnCancel,
    /// Complete the job inside the handler's own transaction.
    #[serde(default)]
    pub complete_in: bool,
    #[serde(default)]
    pub result: Output,
}

/// What the handler does when it is cancelled while working.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum OnCancel {
    /// Return an error at once.
    #[default]
    Stop,
    /// Keep working this many more milliseconds, then return an error.
    StopAfter(u64),
    /// Keep working to the end (only an abort stops it), then return Ok.
    Ignore,
}

/// What the handler returns.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub enum Output {
    #[default]
    Null,
    Text(String),
    /// A string holding a NUL, which jsonb cannot store.
    WithNul,
    /// A string of this many bytes.
    Huge(usize),
}

/// One execution of a handler.
#[derive(Clone, Debug)]
pub struct Exec {
    pub job: i64,
    pub generation: i64,
    pub key: Option<String>,
    pub key_seq: Option<i64>,
    pub tag: String,
    pub start: Instant,
    pub end: Option<Instant>,
    /// The first cancellation it saw, and when.
    pub cancel: Option<(CancelReason, Instant)>,
}

/// The execution log and the gates, shared by the handler and the test.
#[derive(Clone, Default)]
pub struct Scripted {
    log: Arc<Mutex<Vec<Exec>>>,
    gates: Arc<Mutex<HashSet<String>>>,
    pool: Option<PgPool>,
}

impl Scripted {
    /// A handler whose `complete_in` scripts use `pool`.
    pub fn new(pool: &PgPool) -> Scripted {
        Scripted {
            pool: Some(pool.clone()),
            ..Default::default()
        }
    }

    pub fn open(&self, gate: &str) {
        self.gates.lock().unwrap().insert(gate.to_string());
    }

    pub fn log(&self) -> Vec<Exec> {
        self.log.lock().unwrap().clone()
    }

    pub fn runs_of(&self, job: leasehold::JobId) -> Vec<Exec> {
        self.log().into_iter().filter(|e| e.job == job.0).collect()
    }

    /// Executions of `tag`.
    pub fn runs_tagged(&self, tag: &str) -> Vec<Exec> {
        self.log().into_iter().filter(|e| e.tag == tag).collect()
    }

    /// Wait until an execution tagged `tag` has started.
    pub async fn started(&self, tag: &str, secs: u64) -> Exec {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(e) = self.runs_tagged(tag).into_iter().next() {
                return e;
            }
            assert!(
                Instant::now() < deadline,
                "{tag} did not start within {secs}s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Wait until every execution tagged `tag` has ended (and at least one started).
    pub async fn ended(&self, tag: &str, secs: u64) -> Exec {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let runs = self.runs_tagged(tag);
            if !runs.is_empty() && runs.iter().all(|e| e.end.is_some()) {
                return runs.last().unwrap().clone();
            }
            assert!(
                Instant::now() < deadline,
                "{tag} did not end within {secs}s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// No two executions of one key overlapped in time, and each key's executions
    /// started in key_seq order. Panics with the two executions otherwise.
    pub fn assert_keys_serial(&self) {
        let mut log = self.log();
        log.sort_by_key(|e| e.start);
        for (i, a) in log.iter().enumerate() {
            let Some(key) = &a.key else { continue };
            for b in log[i + 1..].iter().filter(|b| b.key.as_ref() == Some(key)) {
                let a_end = a
                    .end
                    .unwrap_or_else(|| panic!("execution still running: {a:?}"));
                assert!(
                    b.start >= a_end,
                    "two executions of key {key} overlapped:\n  {a:?}\n  {b:?}"
                );
                assert!(
                    b.key_seq >= a.key_seq,
                    "key {key} ran out of key_seq order:\n  {a:?}\n  {b:?}"
                );
            }
        }
    }
}

/// Records the end of an execution when the handler's future is dropped (returned,
/// panicked or aborted).
struct EndGuard {
    log: Arc<Mutex<Vec<Exec>>>,
    at: usize,
}

impl Drop for EndGuard {
    fn drop(&mut self) {
        if let Ok(mut log) = self.log.lock() {
            log[self.at].end = Some(Instant::now());
        }
    }
}

impl Scripted {
    fn note_cancel(&self, at: usize, ctx: &JobContext) {
        if let Some(reason) = ctx.cancel_reason() {
            let mut log = self.log.lock().unwrap();
            if log[at].cancel.is_none() {
                log[at].cancel = Some((reason, Instant::now()));
            }
        }
    }
}

impl Handler for Scripted {
    type Payload = Script;
    type Output = serde_json::Value;
    const KIND: &'static str = "scripted";

    async fn run(&self, ctx: JobContext, script: Script) -> Result<serde_json::Value, JobError> {
        let at = {
            let mut log = self.log.lock().unwrap();
            log.push(Exec {
                job: ctx.job_id().0,
                generation: ctx.generation().0,
                key: ctx.key().map(str::to_string),
                key_seq: ctx.job().key_seq,
                tag: script.tag.clone(),
                start: Instant::now(),
                end: None,
                cancel: None,
            });
            log.len() - 1
        };
        let _end = EndGuard {
            log: self.log.clone(),
            at,
        };
        if let Some(gate) = &script.gate {
            while !self.gates.lock().unwrap().contains(gate) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        let until = Instant::now() + Duration::from_millis(script.work_ms);
        let mut stop_at: Option<Instant> = None;
        while Instant::now() < until {
            self.note_cancel(at, &ctx);
            if ctx.is_cancelled() {
                match script.on_cancel {
                    OnCancel::Stop => return Err(JobError::retry("stopped: cancelled")),
                    OnCancel::StopAfter(ms) => {
                        let s = *stop_at.get_or_insert(Instant::now() + Duration::from_millis(ms));
                        if Instant::now() >= s {
                            return Err(JobError::retry("stopped late: cancelled"));
                        }
                    }
                    OnCancel::Ignore => {}
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.note_cancel(at, &ctx);
        let value = match &script.result {
            Output::Null => serde_json::Value::Null,
            Output::Text(t) => serde_json::json!(t),
            Output::WithNul => serde_json::json!("a\u{0}b"),
            Output::Huge(n) => serde_json::json!("x".repeat(*n)),
        };
        if script.complete_in {
            let pool = self
                .pool
                .as_ref()
                .expect("Scripted::new(pool) for complete_in");
            let mut tx = pool.begin().await?;
            let out = ctx.complete_in(&mut tx, Some(value.clone())).await?;
            tx.commit().await?;
            if out != leasehold::CompleteOutcome::Completed {
                return Err(JobError::retry(format!("complete_in: {out:?}")));
            }
        }
        Ok(value)
    }
}

/// A job running `script`.
pub fn scripted(script: Script) -> leasehold::NewJob {
    leasehold::NewJob::new("scripted", &script).unwrap()
}

/// A script that works `ms` milliseconds, tagged `tag`.
pub fn work(tag: &str, ms: u64) -> Script {
    Script {
        tag: tag.into(),
        work_ms: ms,
        ..Default::default()
    }
}
