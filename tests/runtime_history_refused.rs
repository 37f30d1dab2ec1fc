//! The history table refuses every insert (a trigger raising, as a full tablespace or a
//! DBA's mistake would): claims, completions, failures, retries, keyed promotions and
//! snoozes go on without their history rows, each handler runs as often as its outcome
//! says and no more, the refusal is counted and shown in the metrics, and once the table
//! takes rows again history is written again.

mod common;
#[path = "common/history.rs"]
mod history;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::*;
use history::{recorded, refuse_events, run_mixed, Recorder};
use leasehold::{JobState, Scheduler};
use worker::{fast_config, run_in_system, wait_until};

#[test]
fn every_ending_goes_on_without_history_while_the_history_table_refuses_rows() {
    run_in_system(async {
        within(120, "jobs end while history is refused", async {
            let db = TestDb::new("history_refused").await;
            run_mixed(&db, &[]).await;
            assert_eq!(
                db.count_where("job_events", "true").await,
                0,
                "the trigger refused every row"
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
            refuse_events(&db, &[]).await;
            let recorder = Recorder::default();
            let s = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
                .register(recorder.clone())
                .start()
                .await
                .unwrap();
            let first = db.store.enqueue(recorded("ok")).await.unwrap();
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
                        let id = db.store.enqueue(recorded("ok")).await.unwrap();
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
