//! Test support for job history (`job_events`) refused: a trigger that refuses some or
//! all history rows, and a handler that counts its runs per job.
//!
//! Include it next to `common` and `worker` with `#[path = "common/history.rs"] mod history;`.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold::{Handler, JobContext, JobError, JobId, JobState, NewJob, Scheduler};

use crate::common::{within, TestDb};
use crate::worker::fast_config;

/// A trigger refusing history rows whose event is one of `events` (every row when
/// empty), raising `history refused for <event>`, as a full tablespace or a DBA's
/// mistake would.
pub async fn refuse_events(db: &TestDb, events: &[&str]) {
    let cond = if events.is_empty() {
        "true".to_string()
    } else {
        format!(
            "NEW.event IN ({})",
            events
                .iter()
                .map(|e| format!("'{e}'"))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION \"{s}\".refuse_history() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN IF {cond} THEN RAISE EXCEPTION 'history refused for %', NEW.event; END IF;
              RETURN NEW; END $$;
         CREATE TRIGGER refuse_history BEFORE INSERT ON \"{s}\".job_events
           FOR EACH ROW EXECUTE FUNCTION \"{s}\".refuse_history();",
        s = db.schema
    ))
    .execute(&db.owner)
    .await
    .unwrap();
}

/// Runs per job, and what the payload asks: `"ok"`, `"fail_once"` (a retryable error on
/// the first attempt), `"snooze_once"` (a snooze on the first attempt), `"sleep"` (60 s).
#[derive(Clone, Default)]
pub struct Recorder {
    pub runs: Arc<Mutex<HashMap<JobId, u32>>>,
}

impl Handler for Recorder {
    type Payload = String;
    type Output = ();
    const KIND: &'static str = "recorded";

    async fn run(&self, ctx: JobContext, what: String) -> Result<(), JobError> {
        let n = {
            let mut runs = self.runs.lock().unwrap();
            let n = runs.entry(ctx.job_id()).or_default();
            *n += 1;
            *n
        };
        match (what.as_str(), n) {
            ("fail_once", 1) => Err(JobError::retry("first attempt fails")),
            ("snooze_once", 1) => Err(JobError::snooze(Duration::from_millis(50))),
            ("sleep", _) => {
                tokio::time::sleep(Duration::from_secs(60)).await;
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// A job of [`Recorder`]'s kind asking `what`.
pub fn recorded(what: &str) -> NewJob {
    NewJob::new("recorded", &what.to_string()).unwrap()
}

/// Whether every job of `ids` is in `state`.
pub async fn all_in(db: &TestDb, ids: &[JobId], state: JobState) -> bool {
    for id in ids {
        if db.store.job(*id).await.unwrap().state != state {
            return false;
        }
    }
    true
}

/// Each job of `ids` with its state.
pub async fn states(db: &TestDb, ids: &[JobId]) -> Vec<(i64, String)> {
    let mut out = Vec::new();
    for id in ids {
        out.push((id.0, db.state_of(*id).await));
    }
    out
}

/// Refuse the history rows of `refused` (every row when empty), then run 24 jobs (half
/// of them keyed, on three keys) that complete, fail once or snooze once under a
/// scheduler: every job ends done, each handler runs as its outcome says and no more,
/// and the refusal is counted and shown in the metrics.
pub async fn run_mixed(db: &TestDb, refused: &[&str]) {
    refuse_events(db, refused).await;
    let recorder = Recorder::default();
    let s = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
        .register(recorder.clone())
        .start()
        .await
        .unwrap();
    let mut jobs = Vec::new();
    for (n, what) in ["ok", "fail_once", "snooze_once"]
        .iter()
        .cycle()
        .take(24)
        .enumerate()
    {
        let mut j = recorded(what);
        if n % 2 == 0 {
            j = j.with_key(format!("acct-{}", n % 3));
        }
        jobs.push((db.store.enqueue(j).await.unwrap(), *what));
    }
    let ids: Vec<JobId> = jobs.iter().map(|j| j.0).collect();
    let done = tokio::time::timeout(Duration::from_secs(40), async {
        while !all_in(db, &ids, JobState::Done).await {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let metrics = s.metrics();
    let _ = within(20, "shutdown", s.shutdown()).await;
    let runs = recorder.runs.lock().unwrap().clone();
    assert!(
        done.is_ok(),
        "history refused for {refused:?}: jobs not all done after 40 s: {:?}; db_errors {}",
        states(db, &ids).await,
        metrics.counters.db_errors
    );
    for (id, what) in &jobs {
        let expected = if *what == "ok" { 1 } else { 2 };
        assert_eq!(
            runs.get(id),
            Some(&expected),
            "job {id} ({what}) runs: {runs:?}"
        );
    }
    assert!(
        metrics.counters.informational_write_failures >= 1
            && metrics
                .history_error
                .as_deref()
                .unwrap_or("")
                .contains("history refused"),
        "counted and shown: {:?} / {:?}",
        metrics.counters.informational_write_failures,
        metrics.history_error
    );
}
