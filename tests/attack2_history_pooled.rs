//! Both promises at once: a scheduler told of its transaction pooler
//! (`store.transaction_pooler = true`, through a real PgBouncer in transaction mode with
//! two server connections), while the history table refuses every row. Jobs must keep
//! being claimed and ended (failures, snoozes, keyed successors, completions in the
//! handler's own transaction), each handler running as its outcomes say and no more.

mod common;
#[path = "common/pgbouncer.rs"]
mod pgbouncer;
#[path = "common/worker.rs"]
mod worker;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use leasehold::{
    CompleteOutcome, Handler, JobContext, JobError, JobId, JobState, NewJob, Scheduler,
};
use pgbouncer::PgBouncer;
use sqlx::PgPool;
use worker::{fast_config, run_in_system};

#[derive(Clone)]
struct Mixed {
    runs: Arc<Mutex<HashMap<JobId, u32>>>,
    pool: PgPool,
    schema: String,
}

impl Handler for Mixed {
    type Payload = String;
    type Output = ();
    const KIND: &'static str = "mixed";

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
            ("in_tx", _) => {
                let mut tx = self.pool.begin().await?;
                sqlx::query(&format!(
                    "INSERT INTO \"{}\".biz (job_id) VALUES ($1)",
                    self.schema
                ))
                .bind(ctx.job_id().0)
                .persistent(false)
                .execute(&mut *tx)
                .await?;
                match ctx.complete_in(&mut tx, None).await? {
                    CompleteOutcome::Completed => {
                        tx.commit().await?;
                        Ok(())
                    }
                    other => Err(JobError::retry(format!("{other:?}"))),
                }
            }
            _ => Ok(()),
        }
    }
}

#[test]
fn a_pooled_scheduler_ends_its_jobs_while_history_is_refused() {
    run_in_system(async {
        within(100, "pooled, history refused", async {
            let db = TestDb::new("a2_hist_pooled").await;
            sqlx::raw_sql(&format!(
                "CREATE TABLE \"{s}\".biz (job_id bigint NOT NULL);
                 CREATE FUNCTION \"{s}\".refuse_history() RETURNS trigger LANGUAGE plpgsql AS
                   $$ BEGIN RAISE EXCEPTION 'history tablespace is full'; END $$;
                 CREATE TRIGGER refuse_history BEFORE INSERT ON \"{s}\".job_events
                   FOR EACH ROW EXECUTE FUNCTION \"{s}\".refuse_history();",
                s = db.schema
            ))
            .execute(&db.owner)
            .await
            .unwrap();
            let bouncer = PgBouncer::start(2);
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(4)
                .acquire_timeout(Duration::from_secs(10))
                .connect_with(bouncer.options().database(&test_db_name()))
                .await
                .unwrap();
            let mut config = fast_config(&db.schema);
            config.store.transaction_pooler = true;
            let runs = Arc::new(Mutex::new(HashMap::new()));
            let s = Scheduler::builder(pool.clone(), config)
                .register(Mixed {
                    runs: runs.clone(),
                    pool: pool.clone(),
                    schema: db.schema.clone(),
                })
                .start()
                .await
                .unwrap();
            let mut jobs = Vec::new();
            for (n, what) in ["ok", "fail_once", "snooze_once", "in_tx"]
                .iter()
                .cycle()
                .take(16)
                .enumerate()
            {
                let mut j = NewJob::new("mixed", &what.to_string()).unwrap();
                if n % 2 == 0 {
                    j = j.with_key(format!("acct-{}", n % 3));
                }
                jobs.push((db.store.enqueue(j).await.unwrap(), *what));
            }
            let done = tokio::time::timeout(Duration::from_secs(40), async {
                loop {
                    let mut all = true;
                    for (id, _) in &jobs {
                        all &= db.store.job(*id).await.unwrap().state == JobState::Done;
                    }
                    if all {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
            .await;
            let metrics = s.metrics();
            let _ = within(20, "shutdown", s.shutdown()).await;
            pool.close().await;
            drop(bouncer);
            let mut seen = Vec::new();
            for (id, what) in &jobs {
                seen.push((id.0, *what, db.state_of(*id).await));
            }
            let runs = runs.lock().unwrap().clone();
            assert!(
                done.is_ok(),
                "jobs {seen:?}; runs {runs:?}; history_error {:?}; db_errors {}",
                metrics.history_error,
                metrics.counters.db_errors
            );
            for (id, what) in &jobs {
                let expected = if *what == "fail_once" || *what == "snooze_once" {
                    2
                } else {
                    1
                };
                assert_eq!(runs.get(id), Some(&expected), "job {id} ({what}): {runs:?}");
            }
            assert_eq!(
                db.count_where("biz", "true").await,
                4,
                "one business row per in_tx job"
            );
            assert!(metrics.history_error.is_some());
            db.drop().await;
        })
        .await
    });
}
