//! Attacks on "History (`job_events`) is informational too": the history table refuses
//! only some events (a trigger raising for `completed`, `reaped` or `released` alone), or
//! every event while handlers complete in their own transaction, run effects through
//! `JobContext::once`, or run keyed jobs in order; and a graceful shutdown releases its
//! jobs while history is refused. Jobs must keep being claimed, ended and reaped, each
//! handler running as its outcomes say and no more.

mod common;
#[path = "common/history.rs"]
mod history;
#[path = "common/worker.rs"]
mod worker;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use history::{all_in, recorded, refuse_events, run_mixed, states, Recorder};
use leasehold::{
    ClaimRequest, CompleteOutcome, Handler, JobContext, JobError, JobId, JobState, NewJob,
    Scheduler,
};
use sqlx::PgPool;
use worker::{fast_config, run_in_system, wait_until};

#[test]
fn only_completed_events_refused_jobs_still_end_and_run_once() {
    run_in_system(async {
        within(90, "completed refused", async {
            let db = TestDb::new("a2_hist_completed").await;
            run_mixed(&db, &["completed"]).await;
            db.drop().await;
        })
        .await
    });
}

#[test]
fn only_claimed_and_promoted_events_refused_jobs_still_end_and_run_once() {
    run_in_system(async {
        within(90, "claimed refused", async {
            let db = TestDb::new("a2_hist_claimed").await;
            run_mixed(&db, &["claimed", "promoted"]).await;
            db.drop().await;
        })
        .await
    });
}

#[test]
fn only_failure_and_snooze_events_refused_jobs_still_end_and_run_once() {
    run_in_system(async {
        within(90, "failed refused", async {
            let db = TestDb::new("a2_hist_failed").await;
            run_mixed(&db, &["failed", "snoozed"]).await;
            db.drop().await;
        })
        .await
    });
}

#[test]
fn only_reaped_events_refused_a_dead_processs_lease_is_taken_back_and_run_once() {
    run_in_system(async {
        within(60, "reaped refused", async {
            let db = TestDb::new("a2_hist_reaped").await;
            let mut ids = Vec::new();
            for n in 0..3 {
                let mut j = recorded("ok");
                if n > 0 {
                    j = j.with_key("acct");
                }
                ids.push(db.store.enqueue(j).await.unwrap());
            }
            // A process claims the unkeyed job and the key's head, with a 1 s lease, and dies.
            let dead = db
                .store
                .claim(&ClaimRequest::new(
                    owner("dead"),
                    vec![leasehold::config::DEFAULT_QUEUE.to_string()],
                    5,
                    Duration::from_secs(1),
                ))
                .await
                .unwrap();
            assert_eq!(dead.len(), 2);
            refuse_events(&db, &["reaped"]).await;
            let recorder = Recorder::default();
            let s = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
                .register(recorder.clone())
                .start()
                .await
                .unwrap();
            let done = tokio::time::timeout(Duration::from_secs(20), async {
                while !all_in(&db, &ids, JobState::Done).await {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
            .await;
            let metrics = s.metrics();
            let _ = within(20, "shutdown", s.shutdown()).await;
            let runs = recorder.runs.lock().unwrap().clone();
            assert!(
                done.is_ok(),
                "reaped refused: jobs {:?}; db_errors {:?}; history_error {:?}",
                states(&db, &ids).await,
                metrics.counters.db_errors,
                metrics.history_error
            );
            assert!(
                runs.values().all(|n| *n == 1) && runs.len() == 3,
                "runs {runs:?}"
            );
            db.drop().await;
        })
        .await
    });
}

#[test]
fn a_graceful_shutdown_releases_its_jobs_while_released_events_are_refused() {
    run_in_system(async {
        within(90, "released refused", async {
            let db = TestDb::new("a2_hist_released").await;
            refuse_events(&db, &["released"]).await;
            let recorder = Recorder::default();
            let mut config = fast_config(&db.schema);
            // A long lease: a job not released stays running well past the test.
            config.lease = Duration::from_secs(60);
            config.renew_interval = Duration::from_secs(5);
            config.concurrency = 2;
            config.shutdown_grace = Duration::from_millis(500);
            let s = Scheduler::builder(db.pool.clone(), config)
                .register(recorder.clone())
                .start()
                .await
                .unwrap();
            let mut ids = Vec::new();
            for n in 0..4 {
                let mut j = recorded("sleep");
                if n == 3 {
                    j = j.with_key("acct");
                }
                ids.push(db.store.enqueue(j).await.unwrap());
            }
            wait_until(20, "two handlers running", || async {
                recorder.runs.lock().unwrap().len() >= 2
            })
            .await;
            let report = within(30, "shutdown", s.shutdown()).await;
            let after = states(&db, &ids).await;
            let running: Vec<_> = after.iter().filter(|(_, s)| s == "running").collect();
            assert!(
                running.is_empty(),
                "after a graceful shutdown with `released` history refused, jobs still running \
                 under the dead scheduler's 60 s lease: {after:?}; shutdown {:?}",
                report
                    .as_ref()
                    .map(|r| (r.drained, r.cancelled, r.metrics.history_error.clone()))
            );
            db.drop().await;
        })
        .await
    });
}

/// Completes inside its own transaction, with a business row in the same transaction.
struct InTx {
    pool: PgPool,
    schema: String,
    runs: Arc<AtomicU32>,
}

impl Handler for InTx {
    type Payload = i64;
    type Output = ();
    const KIND: &'static str = "in_tx";

    async fn run(&self, ctx: JobContext, n: i64) -> Result<(), JobError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let mut tx = self.pool.begin().await?;
        sqlx::query(&format!(
            "INSERT INTO \"{}\".biz (job_id, n) VALUES ($1, $2)",
            self.schema
        ))
        .bind(ctx.job_id().0)
        .bind(n)
        .execute(&mut *tx)
        .await?;
        match ctx
            .complete_in(&mut tx, Some(serde_json::json!({ "n": n })))
            .await?
        {
            CompleteOutcome::Completed => {
                // The caller's transaction must still be usable after the completion.
                sqlx::query(&format!(
                    "UPDATE \"{}\".biz SET after = true WHERE job_id = $1",
                    self.schema
                ))
                .bind(ctx.job_id().0)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok(())
            }
            other => {
                tx.rollback().await?;
                Err(JobError::retry(format!("complete_in: {other:?}")))
            }
        }
    }
}

#[test]
fn complete_in_a_handlers_transaction_while_history_is_refused_commits_its_write_once() {
    run_in_system(async {
        within(90, "complete_in refused", async {
            let db = TestDb::new("a2_hist_complete_in").await;
            sqlx::query(&format!(
                "CREATE TABLE \"{}\".biz (job_id bigint NOT NULL, n bigint NOT NULL, after boolean NOT NULL DEFAULT false)",
                db.schema
            ))
            .execute(&db.owner)
            .await
            .unwrap();
            refuse_events(&db, &[]).await;
            let runs = Arc::new(AtomicU32::new(0));
            let s = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
                .register(InTx {
                    pool: db.pool.clone(),
                    schema: db.schema.clone(),
                    runs: runs.clone(),
                })
                .start()
                .await
                .unwrap();
            let mut ids = Vec::new();
            for n in 0..6 {
                let mut j = NewJob::new("in_tx", &n).unwrap();
                if n % 2 == 0 {
                    j = j.with_key("acct");
                }
                ids.push(db.store.enqueue(j).await.unwrap());
            }
            let done = tokio::time::timeout(Duration::from_secs(30), async {
                while !all_in(&db, &ids, JobState::Done).await {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
            .await;
            let metrics = s.metrics();
            let _ = within(20, "shutdown", s.shutdown()).await;
            let rows: Vec<(i64, i64, bool)> = sqlx::query_as(&format!(
                "SELECT job_id, count(*), bool_and(after) FROM \"{}\".biz GROUP BY job_id ORDER BY job_id",
                db.schema
            ))
            .fetch_all(&db.pool)
            .await
            .unwrap();
            assert!(
                done.is_ok(),
                "jobs {:?}; business rows {rows:?}; runs {}; history_error {:?}",
                states(&db, &ids).await,
                runs.load(Ordering::SeqCst),
                metrics.history_error
            );
            assert_eq!(rows.len(), ids.len(), "one business row per job: {rows:?}");
            assert!(rows.iter().all(|(_, c, after)| *c == 1 && *after), "{rows:?}");
            assert_eq!(runs.load(Ordering::SeqCst), ids.len() as u32, "each handler ran once");
            db.drop().await;
        })
        .await
    });
}

/// Charges through `once`, then fails its first attempt after the charge.
#[derive(Clone, Default)]
struct Charge {
    applied: Arc<Mutex<HashMap<String, u32>>>,
    runs: Arc<Mutex<HashMap<JobId, u32>>>,
}

impl Handler for Charge {
    type Payload = i64;
    type Output = String;
    const KIND: &'static str = "charge";

    async fn run(&self, ctx: JobContext, cents: i64) -> Result<String, JobError> {
        let n = {
            let mut runs = self.runs.lock().unwrap();
            let n = runs.entry(ctx.job_id()).or_default();
            *n += 1;
            *n
        };
        let applied = self.applied.clone();
        let receipt: String = ctx
            .once("charge", &cents, |key| async move {
                *applied.lock().unwrap().entry(key.to_string()).or_default() += 1;
                Ok(format!("receipt-{key}"))
            })
            .await?;
        if n == 1 {
            return Err(JobError::retry("crash after the charge"));
        }
        Ok(receipt)
    }
}

#[test]
fn an_effect_through_once_is_applied_once_while_history_is_refused() {
    run_in_system(async {
        within(90, "once refused", async {
            let db = TestDb::new("a2_hist_once").await;
            refuse_events(&db, &[]).await;
            let charge = Charge::default();
            let s = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
                .register(charge.clone())
                .start()
                .await
                .unwrap();
            let mut ids = Vec::new();
            for n in 0..6 {
                let mut j = NewJob::new("charge", &(100 + n)).unwrap();
                if n % 2 == 1 {
                    j = j.with_key("acct");
                }
                ids.push(db.store.enqueue(j).await.unwrap());
            }
            let done = tokio::time::timeout(Duration::from_secs(30), async {
                while !all_in(&db, &ids, JobState::Done).await {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
            .await;
            let _ = within(20, "shutdown", s.shutdown()).await;
            let applied = charge.applied.lock().unwrap().clone();
            let runs = charge.runs.lock().unwrap().clone();
            assert!(
                done.is_ok(),
                "jobs {:?}; runs {runs:?}",
                states(&db, &ids).await
            );
            assert_eq!(applied.len(), ids.len(), "one effect per job: {applied:?}");
            assert!(
                applied.values().all(|n| *n == 1),
                "each effect applied once: {applied:?}"
            );
            assert!(
                runs.values().all(|n| *n == 2),
                "each job ran twice (fail, then ok): {runs:?}"
            );
            db.drop().await;
        })
        .await
    });
}

/// Logs (key, n) in run order.
#[derive(Clone, Default)]
struct Ordered {
    log: Arc<Mutex<Vec<(String, i64)>>>,
}

impl Handler for Ordered {
    type Payload = i64;
    type Output = ();
    const KIND: &'static str = "ordered";

    async fn run(&self, ctx: JobContext, n: i64) -> Result<(), JobError> {
        self.log
            .lock()
            .unwrap()
            .push((ctx.key().unwrap_or("").to_string(), n));
        tokio::time::sleep(Duration::from_millis(5)).await;
        if n % 4 == 1 && ctx.attempt() == 1 {
            return Err(JobError::retry("once"));
        }
        Ok(())
    }
}

#[test]
fn keyed_jobs_keep_their_order_while_history_is_refused() {
    run_in_system(async {
        within(90, "order refused", async {
            let db = TestDb::new("a2_hist_order").await;
            refuse_events(&db, &[]).await;
            let ordered = Ordered::default();
            let s = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
                .register(ordered.clone())
                .start()
                .await
                .unwrap();
            let mut ids = Vec::new();
            let mut jobs = Vec::new();
            for n in 0..8 {
                for k in 0..3 {
                    jobs.push(
                        NewJob::new("ordered", &n)
                            .unwrap()
                            .with_key(format!("k{k}")),
                    );
                }
            }
            ids.extend(db.store.enqueue_many(jobs).await.unwrap());
            let done = tokio::time::timeout(Duration::from_secs(40), async {
                while !all_in(&db, &ids, JobState::Done).await {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
            .await;
            let _ = within(20, "shutdown", s.shutdown()).await;
            let log = ordered.log.lock().unwrap().clone();
            assert!(done.is_ok(), "jobs {:?}", states(&db, &ids).await);
            for k in 0..3 {
                let key = format!("k{k}");
                let seen: Vec<i64> = log
                    .iter()
                    .filter(|(kk, _)| *kk == key)
                    .map(|(_, n)| *n)
                    .collect();
                let mut expected = Vec::new();
                for n in 0..8 {
                    expected.push(n);
                    if n % 4 == 1 {
                        expected.push(n);
                    }
                }
                assert_eq!(seen, expected, "key {key} ran in this order");
            }
            db.drop().await;
        })
        .await
    });
}
