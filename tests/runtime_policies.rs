//! Policies per kind (`Handler::policy`): a kind's attempts, retry delays (fixed or a
//! table), run time and priority replace the config's for its jobs, a job's own
//! attempts still win, an error's own retry delay beats the kind's, and a policy whose
//! retry window outlives the effect ledger is refused at start. Asserted on what the
//! handler ran and when, and on the rows.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{within, TestDb};
use leasehold::{
    Config, Error, Handler, JobContext, JobError, JobState, KindPolicy, NewJob, RetryDelay,
    Scheduler, StoreOptions,
};
use serde::{Deserialize, Serialize};
use worker::{fast_config, run_in_system, wait_until, POOL};

/// What one job asks: fail this many runs (with the error's own delay, if set), or
/// sleep (to time out).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Plan {
    fail_runs: u32,
    error_delay_ms: Option<u64>,
    sleep_ms: u64,
}

type Runs = Arc<Mutex<Vec<(i64, Instant)>>>;

fn runs_of(runs: &Runs, job: leasehold::JobId) -> Vec<Instant> {
    let runs = runs.lock().unwrap();
    runs.iter().filter(|r| r.0 == job.0).map(|r| r.1).collect()
}

async fn act(runs: &Runs, ctx: &JobContext, plan: &Plan) -> Result<(), JobError> {
    let before = {
        let mut runs = runs.lock().unwrap();
        let before = runs.iter().filter(|r| r.0 == ctx.job_id().0).count() as u32;
        runs.push((ctx.job_id().0, Instant::now()));
        before
    };
    if plan.sleep_ms > 0 {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(plan.sleep_ms)) => {}
            _ = ctx.cancelled() => return Err(JobError::retry("stopped")),
        }
    }
    if before < plan.fail_runs {
        return Err(match plan.error_delay_ms {
            Some(ms) => JobError::retry_after("busy", Duration::from_millis(ms)),
            None => JobError::retry("flaky"),
        });
    }
    Ok(())
}

/// A kind with a table of retry delays, two attempts, a short run time, a priority.
#[derive(Clone, Default)]
struct Strict(Runs);

impl Handler for Strict {
    type Payload = Plan;
    type Output = ();
    const KIND: &'static str = "strict";

    fn policy() -> KindPolicy {
        KindPolicy {
            max_attempts: Some(2),
            retry_delay: Some(RetryDelay::Table(vec![Duration::from_millis(200)])),
            max_run_time: Some(Duration::from_millis(300)),
            priority: Some(-3),
        }
    }

    async fn run(&self, ctx: JobContext, plan: Plan) -> Result<(), JobError> {
        act(&self.0, &ctx, &plan).await
    }
}

/// A kind with a growing table of delays and the config's other values.
#[derive(Clone, Default)]
struct Patient(Runs);

impl Handler for Patient {
    type Payload = Plan;
    type Output = ();
    const KIND: &'static str = "patient";

    fn policy() -> KindPolicy {
        KindPolicy {
            retry_delay: Some(RetryDelay::Table(vec![
                Duration::from_millis(100),
                Duration::from_millis(400),
            ])),
            ..KindPolicy::default()
        }
    }

    async fn run(&self, ctx: JobContext, plan: Plan) -> Result<(), JobError> {
        act(&self.0, &ctx, &plan).await
    }
}

/// The config's backoff is a minute: only a kind's (or an error's) delay retries sooner.
fn slow_config(db: &TestDb) -> Config {
    let mut c = fast_config(&db.schema);
    c.retry.backoff.base = Duration::from_secs(60);
    c.retry.backoff.cap = Duration::from_secs(60);
    c.retry.backoff.jitter = 0.0;
    c
}

fn plan(p: Plan, kind: &str) -> NewJob {
    NewJob::new(kind, &p).unwrap()
}

#[test]
fn a_kinds_attempts_delays_run_time_and_priority_replace_the_configs() {
    run_in_system(within(60, "kind policies", async {
        let db = TestDb::with_options("rt_policy", StoreOptions::default(), POOL).await;
        let (strict, patient) = (Strict::default(), Patient::default());
        let s = Scheduler::builder(db.pool.clone(), slow_config(&db))
            .register(strict.clone())
            .register(patient.clone())
            .start()
            .await
            .unwrap();
        // Always failing: dead after the kind's two attempts (the config says 25),
        // retried after the kind's 200 ms (the config says a minute).
        let dies = s
            .enqueue_job(plan(
                Plan {
                    fail_runs: 99,
                    ..Plan::default()
                },
                "strict",
            ))
            .await
            .unwrap();
        // The job's own attempts win over the kind's.
        let three = s
            .enqueue_job(
                plan(
                    Plan {
                        fail_runs: 99,
                        ..Plan::default()
                    },
                    "strict",
                )
                .with_max_attempts(3),
            )
            .await
            .unwrap();
        // Runs past the kind's 300 ms run time (the config's is 30 min).
        let slow = s
            .enqueue_job(
                plan(
                    Plan {
                        sleep_ms: 5_000,
                        ..Plan::default()
                    },
                    "strict",
                )
                .with_max_attempts(1),
            )
            .await
            .unwrap();
        // The table's delays in turn: 100 ms, then 400 ms.
        let table = s
            .enqueue_job(plan(
                Plan {
                    fail_runs: 2,
                    ..Plan::default()
                },
                "patient",
            ))
            .await
            .unwrap();
        // The error's own delay beats the kind's table.
        let own = s
            .enqueue_job(plan(
                Plan {
                    fail_runs: 1,
                    error_delay_ms: Some(900),
                    ..Plan::default()
                },
                "patient",
            ))
            .await
            .unwrap();
        wait_until(20, "every job to end", || async {
            db.count_where("jobs", "state IN ('done', 'dead')").await == 5
        })
        .await;

        let row = db.store.job(dies).await.unwrap();
        assert_eq!(
            (row.state, row.attempts, row.max_attempts),
            (JobState::Dead, 2, 2)
        );
        assert_eq!(row.priority, -3, "the kind's priority");
        let r = runs_of(&strict.0, dies);
        assert!(
            r[1] - r[0] >= Duration::from_millis(180),
            "{:?}",
            r[1] - r[0]
        );
        assert!(
            r[1] - r[0] < Duration::from_secs(30),
            "the config's minute was used"
        );

        let row = db.store.job(three).await.unwrap();
        assert_eq!((row.state, row.attempts), (JobState::Dead, 3));

        let row = db.store.job(slow).await.unwrap();
        assert_eq!(row.state, JobState::Dead);
        let reason = row.last_error.unwrap_or_default();
        assert!(reason.contains("maximum run time of 300ms"), "{reason}");

        let r = runs_of(&patient.0, table);
        assert_eq!(r.len(), 3);
        assert!(
            r[1] - r[0] >= Duration::from_millis(90),
            "{:?}",
            r[1] - r[0]
        );
        assert!(
            r[2] - r[1] >= Duration::from_millis(380),
            "{:?}",
            r[2] - r[1]
        );
        assert_eq!(db.store.job(table).await.unwrap().state, JobState::Done);

        let r = runs_of(&patient.0, own);
        assert!(
            r[1] - r[0] >= Duration::from_millis(880),
            "{:?}",
            r[1] - r[0]
        );
        s.shutdown().await.unwrap();
        db.drop().await;
    }))
}

/// A kind whose retries could outlast the effect ledger's retention.
#[derive(Clone, Default)]
struct Forever(Runs);

impl Handler for Forever {
    type Payload = Plan;
    type Output = ();
    const KIND: &'static str = "forever";

    fn policy() -> KindPolicy {
        KindPolicy {
            max_attempts: Some(100),
            retry_delay: Some(RetryDelay::Fixed(Duration::from_secs(24 * 3600))),
            ..KindPolicy::default()
        }
    }

    async fn run(&self, ctx: JobContext, plan: Plan) -> Result<(), JobError> {
        act(&self.0, &ctx, &plan).await
    }
}

#[test]
fn a_policy_whose_retries_outlive_the_effect_ledger_is_refused_at_start() {
    run_in_system(within(60, "policy checked at start", async {
        let db = TestDb::with_options("rt_policy_bad", StoreOptions::default(), POOL).await;
        let err = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
            .register(Forever::default())
            .start()
            .await
            .err()
            .expect("100 daily retries outlive 30 days of effect records");
        match &err {
            Error::Config { field, reason } => {
                assert_eq!(*field, "handlers");
                assert!(
                    reason.contains("\"forever\"") && reason.contains("effect_keep"),
                    "{reason}"
                );
            }
            other => panic!("{other}"),
        }
        db.drop().await;
    }))
}

/// A `strict` job that fails every run, setting neither attempts nor priority.
fn dies() -> NewJob {
    plan(
        Plan {
            fail_runs: 99,
            ..Plan::default()
        },
        "strict",
    )
}

/// Enqueues two `strict` follow-ups, setting neither attempts nor priority: one on its
/// own, one in the transaction that completes this job.
#[derive(Clone)]
struct Chain {
    pool: sqlx::PgPool,
}

impl Handler for Chain {
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "chain";

    async fn run(&self, ctx: JobContext, _: serde_json::Value) -> Result<(), JobError> {
        ctx.enqueue(dies()).await?;
        let mut tx = self.pool.begin().await?;
        ctx.enqueue_in(&mut tx, dies()).await?;
        ctx.complete_in(&mut tx, None).await?;
        tx.commit().await?;
        Ok(())
    }
}

#[test]
fn every_enqueue_path_of_a_scheduler_gives_the_kinds_attempts_and_priority() {
    run_in_system(within(60, "kind policies on every enqueue path", async {
        let db = TestDb::with_options("rt_policy_paths", StoreOptions::default(), POOL).await;
        let strict = Strict::default();
        let s = Scheduler::builder(db.pool.clone(), slow_config(&db))
            .register(strict.clone())
            .register(Chain {
                pool: db.pool.clone(),
            })
            .periodic(leasehold::Periodic::every("strict", Duration::from_secs(2), dies()).unwrap())
            .start()
            .await
            .unwrap();
        // The handle's store (one job, and one by COPY), and a handler's follow-ups.
        s.store().enqueue(dies()).await.unwrap();
        s.store().enqueue_copy(vec![dies()]).await.unwrap();
        let chain = s
            .enqueue_job(NewJob::from_json("chain", serde_json::json!({})))
            .await
            .unwrap();
        let first_fire = || async {
            sqlx::query_scalar::<_, i64>(&format!(
                "SELECT job_id FROM {} WHERE name = 'strict' ORDER BY fire_at LIMIT 1",
                db.table("periodic_fires")
            ))
            .fetch_optional(&db.pool)
            .await
            .unwrap()
        };
        wait_until(15, "a periodic fire and the chain's follow-ups", || async {
            first_fire().await.is_some() && db.state_of(chain).await == "done"
        })
        .await;
        let rows: Vec<(i64, i32, i16)> = sqlx::query_as(&format!(
            "SELECT id, max_attempts, priority FROM {} WHERE kind = 'strict' ORDER BY id",
            db.table("jobs")
        ))
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert!(rows.len() >= 5, "{rows:?}");
        for (id, attempts, priority) in &rows {
            assert_eq!(
                (*attempts, *priority),
                (2, -3),
                "job {id} of kind strict: its kind's attempts and priority ({rows:?})"
            );
        }
        // The periodic job dies after its kind's two attempts; an operator's retry runs
        // it from a fresh count, with the same two attempts.
        let fired = leasehold::JobId(first_fire().await.unwrap());
        wait_until(15, "the periodic job dead", || async {
            db.state_of(fired).await == "dead"
        })
        .await;
        s.store()
            .act(fired, &leasehold::store::Action::Retry, "test")
            .await
            .unwrap();
        wait_until(15, "the retried job dead again", || async {
            db.state_of(fired).await == "dead" && runs_of(&strict.0, fired).len() == 4
        })
        .await;
        let job = s.store().job(fired).await.unwrap();
        assert_eq!((job.attempts, job.max_attempts, job.priority), (2, 2, -3));
        s.shutdown().await.unwrap();
        db.drop().await;
    }))
}
