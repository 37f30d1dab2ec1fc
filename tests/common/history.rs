//! Test support for job history (`job_events`) refused: a trigger that refuses some or
//! all history rows, and a handler that counts its runs per job.
//!
//! Include it next to `common` with `#[path = "common/history.rs"] mod history;`.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold::{Handler, JobContext, JobError, JobId, NewJob};

use crate::common::TestDb;

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
