//! Attack on "a history table that refuses a row (a trigger, ...) fails that statement;
//! the call is then sent once more without its history rows": a trigger on `job_events`
//! that refuses at commit (a constraint trigger, `DEFERRABLE INITIALLY DEFERRED`, as
//! deferred checks are written). For a call in a transaction of the store's own, the
//! refusal arrives at its COMMIT, still inside the call. For `complete_in` the commit
//! is the handler's: the history row is refused when the handler commits its business
//! transaction, and the fallback never sees it.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use leasehold::{
    CompleteOutcome, Handler, JobContext, JobError, JobId, JobState, NewJob, Scheduler,
};
use sqlx::PgPool;
use worker::{fast_config, run_in_system};

async fn refuse_history_at_commit(db: &TestDb, when: &str) {
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION \"{s}\".refuse_history() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'history tablespace is full (checked at commit)'; END $$;
         CREATE CONSTRAINT TRIGGER refuse_history AFTER INSERT ON \"{s}\".job_events
           DEFERRABLE INITIALLY DEFERRED
           FOR EACH ROW WHEN ({when}) EXECUTE FUNCTION \"{s}\".refuse_history();",
        s = db.schema
    ))
    .execute(&db.owner)
    .await
    .unwrap();
}

async fn all_done(db: &TestDb, ids: &[JobId]) -> bool {
    for id in ids {
        if db.store.job(*id).await.unwrap().state != JobState::Done {
            return false;
        }
    }
    true
}

struct Noop(Arc<AtomicU32>);

impl Handler for Noop {
    type Payload = i64;
    type Output = ();
    const KIND: &'static str = "noop";

    async fn run(&self, _ctx: JobContext, _n: i64) -> Result<(), JobError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

#[test]
fn jobs_end_when_history_is_refused_at_commit() {
    run_in_system(async {
        within(60, "deferred refusal", async {
            let db = TestDb::new("a2_hist_deferred").await;
            refuse_history_at_commit(&db, "true").await;
            let runs = Arc::new(AtomicU32::new(0));
            let s = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
                .register(Noop(runs.clone()))
                .start()
                .await
                .unwrap();
            let mut ids = Vec::new();
            for n in 0..6 {
                let mut j = NewJob::new("noop", &n).unwrap();
                if n % 2 == 0 {
                    j = j.with_key("acct");
                }
                ids.push(db.store.enqueue(j).await.unwrap());
            }
            let done = tokio::time::timeout(Duration::from_secs(20), async {
                while !all_done(&db, &ids).await {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
            .await;
            let metrics = s.metrics();
            let _ = within(20, "shutdown", s.shutdown()).await;
            assert!(
                done.is_ok(),
                "jobs not done; history_error {:?}",
                metrics.history_error
            );
            assert_eq!(runs.load(Ordering::SeqCst), 6, "each ran once");
            db.drop().await;
        })
        .await
    });
}

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
        match ctx.complete_in(&mut tx, None).await? {
            CompleteOutcome::Completed => {
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

async fn refuse_completed_at_once(db: &TestDb) {
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION \"{s}\".refuse_history() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'history tablespace is full'; END $$;
         CREATE TRIGGER refuse_history BEFORE INSERT ON \"{s}\".job_events
           FOR EACH ROW WHEN (NEW.event = 'completed') EXECUTE FUNCTION \"{s}\".refuse_history();",
        s = db.schema
    ))
    .execute(&db.owner)
    .await
    .unwrap();
}

/// The control: the same handlers, the same refusal of `completed` rows, by an ordinary
/// (immediate) trigger.
#[test]
fn complete_in_ends_its_jobs_when_completed_rows_are_refused_at_once() {
    complete_in_scenario("a2_hist_immediate_in", false);
}

#[ignore = "documented (README, job history): a history row refused at COMMIT (a deferred constraint trigger) fails the caller's commit of complete_in, outside any statement the store can send again"]
#[test]
fn complete_in_ends_its_jobs_when_history_is_refused_at_commit() {
    complete_in_scenario("a2_hist_deferred_in", true);
}

fn complete_in_scenario(name: &'static str, deferred: bool) {
    run_in_system(async move {
        within(60, "complete_in with refused history", async {
            let db = TestDb::new(name).await;
            sqlx::query(&format!(
                "CREATE TABLE \"{}\".biz (job_id bigint NOT NULL, n bigint NOT NULL)",
                db.schema
            ))
            .execute(&db.owner)
            .await
            .unwrap();
            // Only completions' rows are refused (claims keep writing theirs, so history
            // stays on until a completion's row is refused).
            if deferred {
                refuse_history_at_commit(&db, "NEW.event = 'completed'").await;
            } else {
                refuse_completed_at_once(&db).await;
            }
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
            for n in 0..3 {
                ids.push(db.store.enqueue(NewJob::new("in_tx", &n).unwrap()).await.unwrap());
            }
            let done = tokio::time::timeout(Duration::from_secs(20), async {
                while !all_done(&db, &ids).await {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
            .await;
            let metrics = s.metrics();
            let _ = within(20, "shutdown", s.shutdown()).await;
            let mut seen = Vec::new();
            for id in &ids {
                let r = db.store.job(*id).await.unwrap();
                seen.push((id.0, r.state, r.attempts, r.last_error));
            }
            let biz = db.count_where("biz", "true").await;
            assert!(
                done.is_ok(),
                "20 s in, with `completed` rows refused (deferred: {deferred}), the complete_in jobs are {seen:#?}; \
                 handler runs {}; business rows committed {biz}; history_error {:?}; \
                 informational_write_failures {}",
                runs.load(Ordering::SeqCst),
                metrics.history_error,
                metrics.counters.informational_write_failures
            );
            assert_eq!(biz, 3, "one business row per job");
            db.drop().await;
        })
        .await
    });
}
