//! A crash never dead-letters a job whose handler never started, and a handler that
//! kills its process still reaches dead within a bounded number of runs.
//!
//! The process under test is this test binary re-executed (see `tests/common/worker.rs`),
//! killed with SIGKILL or aborting from inside a handler; what is asserted is what the
//! handlers logged (`run_log`) and the jobs' ends.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::{fixed_backoff, owner, within, TestDb};
use leasehold::store::UNSTARTED_EXPIRIES_MAX;
use leasehold::{JobId, JobState, NewJob, StoreOptions};
use worker::{create_run_tables, run_in_system, wait_until, ChildWorker, Step, POOL};

#[test]
fn worker_process() {
    worker::worker_main();
}

const WORKER_ENTRY: &str = "worker_process";
const LEASE: Duration = Duration::from_secs(2);

fn step(n: i64, sleep_ms: u64, abort: bool) -> NewJob {
    NewJob::new("logged", &Step { n, sleep_ms, abort })
        .unwrap()
        .with_max_attempts(1)
}

async fn runs_of(db: &TestDb, id: JobId) -> i64 {
    db.count_where("run_log", &format!("job_id = {}", id.0))
        .await
}

#[test]
fn a_sigkill_never_dead_letters_the_jobs_claimed_ahead_and_spends_the_started_ones() {
    run_in_system(within(90, "crash with jobs claimed ahead", async {
        let db = TestDb::with_options("rt_crash_ahead", StoreOptions::default(), POOL).await;
        create_run_tables(&db).await;
        // One slot and a stream of 10 ms jobs: the claimer paces its claims ahead by
        // the rate jobs end (`Config::claim_ahead_window` of them), so soon jobs wait in
        // the process for the slot.
        let ids: Vec<JobId> = db
            .store
            .enqueue_many((0..600).map(|n| step(n, 10, false)).collect())
            .await
            .unwrap();
        let mut child = ChildWorker::spawn_with(WORKER_ENTRY, &db.schema, "victim", LEASE, Some(1));
        child.ready(&db).await;
        wait_until(30, "jobs to be claimed ahead of the slot", || async {
            db.count_where("jobs", "state = 'running'").await >= 3
        })
        .await;
        child.kill();
        let held: Vec<(i64, i64)> = sqlx::query_as(&format!(
            "SELECT id, generation FROM {} WHERE state = 'running' ORDER BY id",
            db.table("jobs")
        ))
        .fetch_all(&db.pool)
        .await
        .unwrap();

        // Any reaper, once the leases passed.
        tokio::time::sleep(LEASE + Duration::from_millis(200)).await;
        let report = db
            .store
            .reap(&owner("reaper"), &fixed_backoff(1), 100, None)
            .await
            .unwrap();
        let mut never_ran = 0;
        for (id, generation) in &held {
            let ran = db
                .count_where(
                    "run_log",
                    &format!("job_id = {id} AND generation = {generation}"),
                )
                .await
                > 0;
            let job = db.store.job(JobId(*id)).await.unwrap();
            if ran {
                // Started: dead (its one attempt spent), or given back if its start was
                // not recorded yet when the process died.
                assert!(
                    job.state == JobState::Dead || report.unstarted.contains(&JobId(*id)),
                    "{job:?}"
                );
            } else {
                never_ran += 1;
                assert_eq!(job.state, JobState::Pending, "never started: {job:?}");
                assert_eq!(job.attempts, 0, "never started: {job:?}");
                assert!(report.unstarted.contains(&JobId(*id)), "{report:?}");
            }
        }
        assert!(
            never_ran >= 1,
            "the victim held no job claimed ahead: {held:?}"
        );

        // Another process then runs every job that is not dead, once.
        let dead = db.count_where("jobs", "state = 'dead'").await;
        let mut rescuer =
            ChildWorker::spawn_with(WORKER_ENTRY, &db.schema, "rescuer", LEASE, Some(8));
        rescuer.ready(&db).await;
        wait_until(60, "every other job to be done", || async {
            db.count_where("jobs", "state = 'done'").await == ids.len() as i64 - dead
        })
        .await;
        let never_ran_dead = format!(
            "state = 'dead' AND id NOT IN (SELECT job_id FROM {})",
            db.table("run_log")
        );
        assert_eq!(
            db.count_where("jobs", &never_ran_dead).await,
            0,
            "a job that never ran is dead"
        );
        worker::stop_workers(&db).await;
        rescuer.exited(Duration::from_secs(20)).await;
        db.drop().await;
    }))
}

#[test]
fn a_handler_that_kills_its_process_reaches_dead_within_a_bounded_number_of_runs() {
    run_in_system(within(120, "a process-killing handler", async {
        let db = TestDb::with_options("rt_crash_poison", StoreOptions::default(), POOL).await;
        create_run_tables(&db).await;
        let poison = db.store.enqueue(step(0, 0, true)).await.unwrap();
        let bound = 1 + UNSTARTED_EXPIRIES_MAX as i64;
        for round in 1..=bound + 1 {
            let state = db.store.job(poison).await.unwrap().state;
            if state == JobState::Dead {
                break;
            }
            assert!(
                round <= bound,
                "still {state:?} after {} runs",
                runs_of(&db, poison).await
            );
            let mut child = ChildWorker::spawn_with(
                WORKER_ENTRY,
                &db.schema,
                &format!("w{round}"),
                LEASE,
                Some(1),
            );
            child.ready(&db).await;
            // The handler aborts the process.
            child.exited(Duration::from_secs(30)).await;
            wait_until(10, "its lease to be reaped", || async {
                !db.store
                    .reap(&owner("reaper"), &fixed_backoff(0), 100, None)
                    .await
                    .unwrap()
                    .is_empty()
            })
            .await;
        }
        let job = db.store.job(poison).await.unwrap();
        assert_eq!(job.state, JobState::Dead, "{job:?}");
        let runs = runs_of(&db, poison).await;
        assert!(
            (1..=bound).contains(&runs),
            "{runs} runs for a job of one attempt"
        );
        db.drop().await;
    }))
}
