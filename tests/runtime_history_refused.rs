//! The history table refuses every insert (a trigger raising, as a full tablespace or a
//! DBA's mistake would): claims, completions, failures, retries, keyed promotions and
//! snoozes go on without their history rows, each handler runs as often as its outcome
//! says and no more, the refusal is counted and shown in the metrics, and once the table
//! takes rows again history is written again.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use leasehold::{Handler, JobContext, JobError, JobId, JobState, NewJob, Scheduler};
use worker::{fast_config, run_in_system, wait_until};

/// Runs per job, and what the payload asks: `"ok"`, `"fail_once"` (a retryable error on
/// the first attempt), `"snooze_once"` (a snooze on the first attempt).
#[derive(Clone, Default)]
struct Recorder {
    runs: Arc<Mutex<HashMap<JobId, u32>>>,
}

impl Handler for Recorder {
    type Payload = String;
    type Output = ();
    const KIND: &'static str = "recorded";

    async fn run(&self, ctx: JobContext, what: String) -> Result<(), JobError> {
        let n = {
            let mut runs = self.runs.lock().unwrap();
            let n = runs.entry(ctx.job().id).or_default();
            *n += 1;
            *n
        };
        match (what.as_str(), n) {
            ("fail_once", 1) => Err(JobError::retry("first attempt fails")),
            ("snooze_once", 1) => Err(JobError::snooze(Duration::from_millis(50))),
            _ => Ok(()),
        }
    }
}

async fn refuse_history(db: &TestDb) {
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION \"{s}\".refuse_history() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'history tablespace is full'; END $$;
         CREATE TRIGGER refuse_history BEFORE INSERT ON \"{s}\".job_events
           FOR EACH ROW EXECUTE FUNCTION \"{s}\".refuse_history();",
        s = db.schema
    ))
    .execute(&db.owner)
    .await
    .unwrap();
}

#[test]
fn every_ending_goes_on_without_history_while_the_history_table_refuses_rows() {
    run_in_system(async {
        within(120, "jobs end while history is refused", async {
            let db = TestDb::new("history_refused").await;
            refuse_history(&db).await;
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
                .take(30)
                .enumerate()
            {
                let mut job = NewJob::new("recorded", &what.to_string()).unwrap();
                if n % 2 == 0 {
                    job = job.with_key(format!("acct-{}", n % 4));
                }
                jobs.push((db.store.enqueue(job).await.unwrap(), *what));
            }
            wait_until(60, "every job done", || async {
                let mut all = true;
                for (id, _) in &jobs {
                    all &= db.store.job(*id).await.unwrap().state == JobState::Done;
                }
                all
            })
            .await;
            let metrics = s.metrics();
            s.shutdown().await.unwrap();
            let runs = recorder.runs.lock().unwrap().clone();
            for (id, what) in &jobs {
                let expected = if *what == "ok" { 1 } else { 2 };
                assert_eq!(
                    runs.get(id),
                    Some(&expected),
                    "job {id} ({what}) ran {:?} times",
                    runs.get(id)
                );
            }
            assert_eq!(
                db.count_where("job_events", "true").await,
                0,
                "the trigger refused every row"
            );
            assert!(
                metrics.counters.informational_write_failures >= 1,
                "the refusal is counted: {:?}",
                metrics.counters
            );
            let shown = metrics.history_error.unwrap_or_default();
            assert!(
                shown.contains("history tablespace is full"),
                "shown: {shown:?}"
            );
            db.drop().await;
        })
        .await
    });
}

#[test]
fn history_is_written_again_once_the_table_takes_rows() {
    run_in_system(async {
        within(120, "history resumes", async {
            let db = TestDb::new("history_resumes").await;
            refuse_history(&db).await;
            let recorder = Recorder::default();
            let s = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
                .register(recorder.clone())
                .start()
                .await
                .unwrap();
            let first = db
                .store
                .enqueue(NewJob::new("recorded", &"ok".to_string()).unwrap())
                .await
                .unwrap();
            wait_until(30, "the first job done", || async {
                db.store.job(first).await.unwrap().state == JobState::Done
            })
            .await;
            assert!(s.metrics().history_error.is_some());
            sqlx::raw_sql(&format!(
                "DROP TRIGGER refuse_history ON \"{}\".job_events",
                db.schema
            ))
            .execute(&db.owner)
            .await
            .unwrap();
            // History is tried again HISTORY_RETRY_AFTER after the refusal: a job
            // enqueued every half second is claimed and completed with its rows from then.
            let resumed = tokio::time::timeout(
                leasehold::store::HISTORY_RETRY_AFTER + Duration::from_secs(20),
                async {
                    loop {
                        let id = db
                            .store
                            .enqueue(NewJob::new("recorded", &"ok".to_string()).unwrap())
                            .await
                            .unwrap();
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        let events = db.store.history(id).await.unwrap();
                        if events.iter().any(|e| e.event == "completed") {
                            return id;
                        }
                    }
                },
            )
            .await
            .expect("history written again");
            assert_eq!(db.store.job(resumed).await.unwrap().state, JobState::Done);
            wait_until(10, "the metrics to clear the refusal", || async {
                s.metrics().history_error.is_none()
            })
            .await;
            s.shutdown().await.unwrap();
            let runs = recorder.runs.lock().unwrap().clone();
            assert!(
                runs.values().all(|n| *n == 1),
                "every job ran once: {runs:?}"
            );
            db.drop().await;
        })
        .await
    });
}
