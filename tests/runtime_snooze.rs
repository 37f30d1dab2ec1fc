//! A handler's "not yet" and "retry after": a snooze runs the job again after its delay
//! without spending an attempt (a job with one attempt survives several), is bounded per
//! kind (a handler that always snoozes still ends), keeps a keyed job at its key's head;
//! an error's own retry delay replaces the backoff. Asserted on what the handler ran and
//! when, and on the rows.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{within, TestDb};
use leasehold::{Handler, JobContext, JobError, JobState, NewJob, Scheduler, StoreOptions};
use serde::{Deserialize, Serialize};
use worker::{fast_config, run_in_system, wait_until, POOL};

/// What one job asks of the handler.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Plan {
    tag: String,
    /// Snooze this many runs (every run with `u32::MAX`), then complete.
    snoozes: u32,
    snooze_ms: u64,
    /// Fail the first run with this retry delay.
    retry_after_ms: Option<u64>,
}

/// One run: which job, tag and attempt, and when it started.
#[derive(Clone, Debug)]
struct Run {
    job: i64,
    tag: String,
    attempt: i32,
    at: Instant,
}

#[derive(Clone, Default)]
struct Snoozer {
    runs: Arc<Mutex<Vec<Run>>>,
}

impl Snoozer {
    fn runs_of(&self, job: leasehold::JobId) -> Vec<Run> {
        let runs = self.runs.lock().unwrap();
        runs.iter().filter(|r| r.job == job.0).cloned().collect()
    }
}

impl Handler for Snoozer {
    type Payload = Plan;
    type Output = ();
    const KIND: &'static str = "snoozer";
    const MAX_SNOOZES: u32 = 3;

    async fn run(&self, ctx: JobContext, plan: Plan) -> Result<(), JobError> {
        let before = {
            let mut runs = self.runs.lock().unwrap();
            let before = runs.iter().filter(|r| r.job == ctx.job_id().0).count() as u32;
            runs.push(Run {
                job: ctx.job_id().0,
                tag: plan.tag.clone(),
                attempt: ctx.job().attempt,
                at: Instant::now(),
            });
            before
        };
        if let (Some(ms), 0) = (plan.retry_after_ms, before) {
            return Err(JobError::retry_after(
                "429 Too Many Requests",
                Duration::from_millis(ms),
            ));
        }
        if before < plan.snoozes {
            return Err(JobError::snooze(Duration::from_millis(plan.snooze_ms)));
        }
        Ok(())
    }
}

fn job(plan: Plan) -> NewJob {
    NewJob::new(Snoozer::KIND, &plan).unwrap()
}

async fn start(db: &TestDb, h: &Snoozer) -> Scheduler {
    let mut config = fast_config(&db.schema);
    // A retry would wait a minute: only a snooze or a retry delay can run it sooner.
    config.retry.backoff.base = Duration::from_secs(60);
    config.retry.backoff.cap = Duration::from_secs(60);
    config.retry.backoff.jitter = 0.0;
    Scheduler::builder(db.pool.clone(), config)
        .register(h.clone())
        .start()
        .await
        .unwrap()
}

#[test]
fn a_snoozed_job_runs_again_after_its_delay_without_spending_an_attempt() {
    run_in_system(within(60, "snooze", async {
        let db = TestDb::with_options("rt_snooze", StoreOptions::default(), POOL).await;
        let h = Snoozer::default();
        let s = start(&db, &h).await;
        // One attempt only: a snooze that spent it would make the job dead.
        let id = s
            .enqueue_job(
                job(Plan {
                    tag: "later".into(),
                    snoozes: 2,
                    snooze_ms: 300,
                    ..Plan::default()
                })
                .with_max_attempts(1),
            )
            .await
            .unwrap();
        wait_until(10, "the snoozed job to complete", || async {
            db.store.job(id).await.unwrap().state == JobState::Done
        })
        .await;
        let runs = h.runs_of(id);
        assert_eq!(runs.len(), 3, "{runs:?}");
        for pair in runs.windows(2) {
            let gap = pair[1].at - pair[0].at;
            assert!(gap >= Duration::from_millis(280), "ran again after {gap:?}");
        }
        assert!(runs.iter().all(|r| r.attempt == 1), "{runs:?}");
        let row = db.store.job(id).await.unwrap();
        assert_eq!((row.attempts, row.snoozes), (1, 2), "{row:?}");
        let m = s.metrics();
        assert_eq!(m.counters.snoozed, 2);
        assert_eq!(m.counters.failed, 0);
        s.shutdown().await.unwrap();
        db.drop().await;
    }))
}

#[test]
fn a_handler_that_always_snoozes_ends_dead_past_its_kinds_limit() {
    run_in_system(within(60, "snooze limit", async {
        let db = TestDb::with_options("rt_snooze_limit", StoreOptions::default(), POOL).await;
        let h = Snoozer::default();
        let mut config = fast_config(&db.schema);
        config.retry.backoff.base = Duration::from_millis(50);
        config.retry.backoff.cap = Duration::from_millis(50);
        let s = Scheduler::builder(db.pool.clone(), config)
            .register(h.clone())
            .start()
            .await
            .unwrap();
        let id = s
            .enqueue_job(
                job(Plan {
                    tag: "forever".into(),
                    snoozes: u32::MAX,
                    snooze_ms: 20,
                    ..Plan::default()
                })
                .with_max_attempts(2),
            )
            .await
            .unwrap();
        wait_until(10, "the job to end", || async {
            db.store.job(id).await.unwrap().state == JobState::Dead
        })
        .await;
        // Three snoozes (Snoozer::MAX_SNOOZES), then each snooze fails an attempt.
        let runs = h.runs_of(id);
        assert_eq!(runs.len(), 5, "{runs:?}");
        let row = db.store.job(id).await.unwrap();
        assert_eq!((row.attempts, row.snoozes), (2, 3), "{row:?}");
        let reason = row.last_error.unwrap_or_default();
        assert!(reason.contains("MAX_SNOOZES"), "{reason}");
        s.shutdown().await.unwrap();
        db.drop().await;
    }))
}

#[test]
fn a_snoozed_keyed_job_keeps_its_keys_later_jobs_waiting_behind_it() {
    run_in_system(within(60, "keyed snooze", async {
        let db = TestDb::with_options("rt_snooze_key", StoreOptions::default(), POOL).await;
        let h = Snoozer::default();
        let s = start(&db, &h).await;
        let first = s
            .enqueue_job(
                job(Plan {
                    tag: "first".into(),
                    snoozes: 1,
                    snooze_ms: 400,
                    ..Plan::default()
                })
                .with_key("acct-1"),
            )
            .await
            .unwrap();
        let second = s
            .enqueue_job(
                job(Plan {
                    tag: "second".into(),
                    ..Plan::default()
                })
                .with_key("acct-1"),
            )
            .await
            .unwrap();
        wait_until(10, "both jobs to complete", || async {
            db.count_where("jobs", "state = 'done'").await == 2
        })
        .await;
        let order: Vec<String> = h
            .runs
            .lock()
            .unwrap()
            .iter()
            .map(|r| r.tag.clone())
            .collect();
        assert_eq!(order, ["first", "first", "second"], "the key's order broke");
        assert_eq!(db.store.job(first).await.unwrap().snoozes, 1);
        assert_eq!(db.store.job(second).await.unwrap().attempts, 1);
        s.shutdown().await.unwrap();
        db.drop().await;
    }))
}

#[test]
fn an_errors_retry_delay_replaces_the_backoff() {
    run_in_system(within(60, "retry after", async {
        let db = TestDb::with_options("rt_retry_after", StoreOptions::default(), POOL).await;
        let h = Snoozer::default();
        let s = start(&db, &h).await;
        let id = s
            .enqueue_job(job(Plan {
                tag: "rate-limited".into(),
                retry_after_ms: Some(300),
                ..Plan::default()
            }))
            .await
            .unwrap();
        // The backoff is a minute: done within seconds only through the error's delay.
        wait_until(10, "the rate-limited job to complete", || async {
            db.store.job(id).await.unwrap().state == JobState::Done
        })
        .await;
        let runs = h.runs_of(id);
        assert_eq!(runs.len(), 2, "{runs:?}");
        assert!(runs[1].at - runs[0].at >= Duration::from_millis(280));
        let row = db.store.job(id).await.unwrap();
        assert_eq!(
            (row.attempts, row.snoozes),
            (2, 0),
            "a failure spends its attempt"
        );
        let by_outcome: HashMap<&str, u64> = s
            .metrics()
            .jobs
            .iter()
            .flat_map(|j| j.outcomes.iter().map(|(o, n)| (o.as_str(), *n)))
            .collect();
        assert_eq!(by_outcome.get("retried"), Some(&1), "{by_outcome:?}");
        s.shutdown().await.unwrap();
        db.drop().await;
    }))
}
