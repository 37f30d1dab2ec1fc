//! Attack (fresh context): a schema dropped and created again under a running scheduler
//! while an attempt of the dropped schema's job 1 still runs, then the new schema's job
//! 1 runs through the same scheduler. Both attempts have job 1, the scheduler's owner
//! and generation 1; only the job's identity tells them apart. The scheduler's registry
//! of running attempts (lease renewal, cancellation) must keep them apart: the old
//! attempt holds no job any more, so its renewal must find its lease lost (and tell its
//! handler), whatever the new job 1 does; a cancel of the new job 1 must reach the new
//! job 1's handler only; and the new job 1 must run.
//!
//! The schema is created again in one transaction (drop, the migration script, the new
//! job 1), right after a renewal tick, so that the new job 1 is claimed before the next
//! renewal looks at the old attempt (as it is whenever the new job is enqueued while the
//! process runs).

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use leasehold::{
    CancelReason, Handler, JobContext, JobError, JobId, NewJob, Scheduler, Store, StoreOptions,
};
use serde::{Deserialize, Serialize};
use worker::{config_with_lease, run_in_system, wait_until};

const LEASE_SECS: u64 = 6;

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Work {
    tag: String,
}

/// What the handlers saw, by tag: started, and the context of the run (for its cancel
/// reason). A run works until the test lets it finish or it is told to stop.
#[derive(Default)]
struct Books {
    started: Mutex<Vec<String>>,
    contexts: Mutex<HashMap<String, JobContext>>,
    stopped: Mutex<Vec<(String, Option<CancelReason>)>>,
    finish: Mutex<HashSet<String>>,
}

impl Books {
    fn has_started(&self, tag: &str) -> bool {
        self.started.lock().unwrap().iter().any(|t| t == tag)
    }
    fn reason(&self, tag: &str) -> Option<CancelReason> {
        self.contexts
            .lock()
            .unwrap()
            .get(tag)
            .and_then(|c| c.cancel_reason())
    }
    fn finish_all(&self) {
        let mut f = self.finish.lock().unwrap();
        f.insert("old".into());
        f.insert("new".into());
    }
}

struct LongWork(Arc<Books>);

impl Handler for LongWork {
    type Payload = Work;
    type Output = serde_json::Value;
    const KIND: &'static str = "long_work";

    async fn run(&self, ctx: JobContext, w: Work) -> Result<serde_json::Value, JobError> {
        self.0.started.lock().unwrap().push(w.tag.clone());
        self.0
            .contexts
            .lock()
            .unwrap()
            .insert(w.tag.clone(), ctx.clone());
        // A long export: one batch every 50 ms, stopping when told to.
        for _ in 0..1200 {
            if self.0.finish.lock().unwrap().contains(&w.tag) {
                return Ok(serde_json::json!({ "tag": w.tag }));
            }
            if ctx.is_cancelled() {
                self.0
                    .stopped
                    .lock()
                    .unwrap()
                    .push((w.tag.clone(), ctx.cancel_reason()));
                return Err(JobError::retry(format!(
                    "stopped: {:?}",
                    ctx.cancel_reason()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(JobError::retry("ran out of batches"))
    }
}

fn work(tag: &str, key: Option<&str>) -> NewJob {
    let j = NewJob::new(LongWork::KIND, &Work { tag: tag.into() }).unwrap();
    match key {
        Some(k) => j.with_key(k),
        None => j,
    }
}

/// A fresh schema's database and the script that creates its schema from nothing.
async fn db_and_script(test: &str) -> (TestDb, String) {
    let db = TestDb::unmigrated(test, StoreOptions::default(), 4).await;
    let script = db.store.migration_script().await.unwrap();
    assert!(script.contains("CREATE SCHEMA"), "{script:.300}");
    db.store.migrate().await.unwrap();
    (db, script)
}

/// Drop the schema and create it again with `jobs` enqueued, in one transaction.
async fn create_again_with(db: &TestDb, script: &str, jobs: Vec<NewJob>) -> Vec<JobId> {
    let body = script.replace("BEGIN;\n", "").replace("COMMIT;\n", "");
    let fresh = Store::new(db.owner.clone(), &db.schema, StoreOptions::default()).unwrap();
    let mut tx = db.owner.begin().await.unwrap();
    sqlx::raw_sql(&format!("DROP SCHEMA \"{}\" CASCADE", db.schema))
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::raw_sql(&body).execute(&mut *tx).await.unwrap();
    let mut ids = Vec::new();
    for j in jobs {
        ids.push(fresh.enqueue_in(&mut tx, j).await.unwrap());
    }
    tx.commit().await.unwrap();
    ids
}

/// Wait for the scheduler's next renewal tick.
async fn after_a_renewal(s: &Scheduler) {
    let before = s.metrics().counters.leases_renewed;
    wait_until(10, "a renewal tick", || async {
        s.metrics().counters.leases_renewed > before
    })
    .await;
}

async fn start(db: &TestDb, books: &Arc<Books>) -> Scheduler {
    Scheduler::builder(
        db.pool.clone(),
        config_with_lease(&db.schema, Duration::from_secs(LEASE_SECS)),
    )
    .register(LongWork(books.clone()))
    .start()
    .await
    .unwrap()
}

async fn finish(s: Scheduler, books: &Books, db: TestDb) {
    books.finish_all();
    within(30, "shutdown", s.shutdown()).await.unwrap();
    db.drop().await;
}

/// Set up: the old job 1 running, then the schema created again with the new job 1.
async fn old_running_then_new(
    db: &TestDb,
    script: &str,
    s: &Scheduler,
    books: &Books,
    key: Option<&str>,
) {
    let old = s.enqueue_job(work("old", key)).await.unwrap();
    assert_eq!(old, JobId(1));
    wait_until(10, "the old job 1 to start", || async {
        books.has_started("old")
    })
    .await;
    after_a_renewal(s).await;
    let new = create_again_with(db, script, vec![work("new", key)]).await;
    assert_eq!(new, vec![JobId(1)], "ids restart at 1");
}

#[test]
fn a_keyed_job_1_of_a_schema_created_again_runs_though_the_dropped_schemas_keyed_job_1_ran_under_its_key(
) {
    run_in_system(async {
        within(90, "keyed job 1 again", async {
            let (db, script) = db_and_script("a4_again_keyed").await;
            let books = Arc::new(Books::default());
            let s = start(&db, &books).await;
            old_running_then_new(&db, &script, &s, &books, Some("acct-7")).await;
            // The old attempt holds no job: its next renewal finds it lost and its handler
            // stops, so the key's job 1 of the new schema gets its turn. Two renewal
            // intervals and a lease are plenty.
            let limit = 2 * LEASE_SECS;
            let started = within(limit + 5, "watching", async {
                let t = tokio::time::Instant::now();
                while t.elapsed() < Duration::from_secs(limit) {
                    if books.has_started("new") {
                        return true;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                false
            })
            .await;
            let fresh = Store::new(db.pool.clone(), &db.schema, StoreOptions::default()).unwrap();
            let rec = fresh.job(JobId(1)).await.unwrap();
            let old_reason = books.reason("old");
            let renewed = s.metrics().counters.leases_renewed;
            finish(s, &books, db).await;
            assert!(
                started,
                "the new schema's job 1 (key acct-7) never started in {limit} s: the dropped \
                 schema's attempt of job 1 was never told it lost its lease (cancel reason \
                 {old_reason:?}; its renewals kept being confirmed, {renewed} leases renewed), \
                 and the new job 1 waited behind it; the new job 1 is {:?} (generation {})",
                rec.state, rec.generation
            );
        })
        .await
    });
}

#[test]
fn the_dropped_schemas_attempt_of_job_1_is_told_it_lost_its_lease_while_the_new_job_1_runs() {
    run_in_system(async {
        within(90, "unkeyed job 1 again", async {
            let (db, script) = db_and_script("a4_again_lost").await;
            let books = Arc::new(Books::default());
            let s = start(&db, &books).await;
            old_running_then_new(&db, &script, &s, &books, None).await;
            wait_until(10, "the new job 1 to start", || async {
                books.has_started("new")
            })
            .await;
            // Its job is gone: the next renewal (every 1.5 s) must find the old lease lost.
            let limit = 2 * LEASE_SECS;
            let told = within(limit + 5, "watching", async {
                let t = tokio::time::Instant::now();
                while t.elapsed() < Duration::from_secs(limit) {
                    if books.reason("old").is_some() {
                        return true;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                false
            })
            .await;
            let old_reason = books.reason("old");
            let new_reason = books.reason("new");
            let lost = s.metrics().counters.leases_lost;
            finish(s, &books, db).await;
            assert!(
                told && old_reason == Some(CancelReason::LeaseLost),
                "{limit} s after its job was dropped, the dropped schema's attempt of job 1 still \
                 runs as if it held a lease (cancel reason {old_reason:?}, leases lost {lost}): \
                 the renewals of the new job 1 (cancel reason {new_reason:?}) confirmed it"
            );
        })
        .await
    });
}

#[test]
fn a_cancel_of_the_new_job_1_does_not_cancel_the_dropped_schemas_attempt_of_job_1() {
    run_in_system(async {
        within(90, "cancel job 1 again", async {
            let (db, script) = db_and_script("a4_again_cancel").await;
            let books = Arc::new(Books::default());
            let s = start(&db, &books).await;
            old_running_then_new(&db, &script, &s, &books, None).await;
            wait_until(10, "the new job 1 to start", || async {
                books.has_started("new")
            })
            .await;
            let fresh = Store::new(db.pool.clone(), &db.schema, StoreOptions::default()).unwrap();
            assert_eq!(
                fresh
                    .cancel(JobId(1), "operator cancels the new job 1")
                    .await
                    .unwrap(),
                leasehold::CancelOutcome::Requested
            );
            wait_until(15, "the new job 1's handler to be told", || async {
                books.reason("new").is_some()
            })
            .await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            let old_reason = books.reason("old");
            let new_reason = books.reason("new");
            let stopped = books.stopped.lock().unwrap().clone();
            finish(s, &books, db).await;
            assert_eq!(new_reason, Some(CancelReason::Cancelled));
            assert_ne!(
                old_reason,
                Some(CancelReason::Cancelled),
                "the operator cancelled the new job 1 only, and the dropped schema's attempt \
                 of job 1 was told it was cancelled too (handlers stopped: {stopped:?})"
            );
        })
        .await
    });
}

/// The control for the two tests above: with no job 1 in the schema created again, the
/// same setup tells the dropped schema's attempt that it lost its lease within a
/// renewal or two.
#[test]
fn the_dropped_schemas_attempt_of_job_1_is_told_it_lost_its_lease_when_the_new_schema_has_no_job_1()
{
    run_in_system(async {
        within(90, "no job 1 again", async {
            let (db, script) = db_and_script("a4_again_none").await;
            let books = Arc::new(Books::default());
            let s = start(&db, &books).await;
            let old = s.enqueue_job(work("old", None)).await.unwrap();
            assert_eq!(old, JobId(1));
            wait_until(10, "the old job 1 to start", || async {
                books.has_started("old")
            })
            .await;
            after_a_renewal(&s).await;
            assert!(create_again_with(&db, &script, vec![]).await.is_empty());
            wait_until(2 * LEASE_SECS, "the old attempt to be told", || async {
                books.reason("old").is_some()
            })
            .await;
            let old_reason = books.reason("old");
            finish(s, &books, db).await;
            assert_eq!(old_reason, Some(CancelReason::LeaseLost));
        })
        .await
    });
}
