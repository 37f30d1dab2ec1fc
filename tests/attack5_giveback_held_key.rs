//! Attack: the give-back of a claimed-ahead job an operator cancelled while it waited,
//! when its key row is held by a producer's open transaction for longer than a lease.
//!
//! The promise (README, "claim-ahead"; `Store::release_many`): the give-back is tried
//! again until it lands, the job's lease renewed meanwhile, so the job is cancelled soon
//! after the key is free and never left to its lease's expiry (no `lease_expiries` row).
//! It is checked here for the three give-backs: a paused queue, a job that waited a
//! lease for a slot, and shutdown.

mod common;
#[path = "common/scripted.rs"]
mod scripted;
#[path = "common/worker.rs"]
mod worker;

use std::time::{Duration, Instant};

use common::{within, TestDb};
use leasehold::{CancelOutcome, Config, JobId, JobState, Scheduler, StoreOptions};
use scripted::{scripted, work, Script, Scripted};
use worker::{config_with_lease, run_in_system, wait_until, POOL};

const LEASE: Duration = Duration::from_secs(2);

fn one_slot_config(db: &TestDb) -> Config {
    let mut config = config_with_lease(&db.schema, LEASE);
    config.concurrency = 1;
    config.claim_ahead = 4;
    config.claim_ahead_window = None;
    config
}

/// One slot taken by a job gated on "finish"; a key's head and its successor enqueued
/// behind it, the head claimed ahead; the head cancelled (Requested).
async fn cancelled_head_waiting(
    db: &TestDb,
    h: &Scripted,
    key: &str,
) -> (Scheduler, JobId, JobId, JobId) {
    let a = Scheduler::builder(db.pool.clone(), one_slot_config(db))
        .register(h.clone())
        .start()
        .await
        .unwrap();
    let running = a
        .enqueue_job(scripted(Script {
            gate: Some("finish".into()),
            ..work("running", 0)
        }))
        .await
        .unwrap();
    h.started("running", 10).await;
    let head = a
        .enqueue_job(scripted(work("head", 0)).with_key(key))
        .await
        .unwrap();
    let next = a
        .enqueue_job(scripted(work("next", 0)).with_key(key))
        .await
        .unwrap();
    wait_until(10, "the key's head to be claimed ahead", || async {
        a.metrics().ready == 1
    })
    .await;
    assert_eq!(db.store.job(head).await.unwrap().state, JobState::Running);
    assert_eq!(
        db.store.cancel(head, "not needed").await.unwrap(),
        CancelOutcome::Requested
    );
    (a, running, head, next)
}

/// A producer's transaction holding the key's row (as an enqueue of the key does until
/// it commits).
async fn hold_key(db: &TestDb, key: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut producer = db.owner.begin().await.unwrap();
    let n = sqlx::query(&format!(
        "SELECT 1 FROM {} WHERE job_key = $1 FOR UPDATE",
        db.table("job_keys")
    ))
    .bind(key)
    .execute(&mut *producer)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 1, "the key row exists");
    producer
}

/// Whether the job's lease in the row has passed by the database's clock.
async fn lease_passed(db: &TestDb, id: JobId) -> bool {
    sqlx::query_scalar(&format!(
        "SELECT coalesce(lease_until < clock_timestamp(), false) FROM {} WHERE id = $1",
        db.table("jobs")
    ))
    .bind(id.0)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

async fn expiries_of(db: &TestDb, id: JobId) -> i64 {
    db.count_where("lease_expiries", &format!("job_id = {}", id.0))
        .await
}

/// Hold the key for three leases while the give-back retries; sample whether the
/// job's lease stays renewed meanwhile. Returns whether it ever passed.
async fn hold_for_three_leases(db: &TestDb, head: JobId) -> bool {
    let until = Instant::now() + LEASE * 3;
    let mut passed = false;
    while Instant::now() < until {
        if db.store.job(head).await.unwrap().state == JobState::Running
            && lease_passed(db, head).await
        {
            passed = true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    passed
}

#[test]
fn a_paused_queue_gives_back_a_cancelled_job_whose_key_is_held_longer_than_a_lease_without_leaving_it_to_its_lease_expiry(
) {
    run_in_system(within(
        60,
        "pause give-back behind a key held 3 leases",
        async {
            let db = TestDb::with_options("a5_gb_pause_long", StoreOptions::default(), POOL).await;
            let h = Scripted::new(&db.pool);
            let (a, running, head, next) = cancelled_head_waiting(&db, &h, "acct-long").await;
            let producer = hold_key(&db, "acct-long").await;
            db.store.pause_queue("default", None).await.unwrap();
            wait_until(5, "the give-back", || async { a.metrics().ready == 0 }).await;
            let lease_passed_while_held = hold_for_three_leases(&db, head).await;
            producer.rollback().await.unwrap();
            let freed = Instant::now();
            wait_until(
                10,
                "the head to be cancelled once its key is free",
                || async { db.store.job(head).await.unwrap().state == JobState::Cancelled },
            )
            .await;
            let took = freed.elapsed();
            let expiries = expiries_of(&db, head).await;
            let history: Vec<String> = db
                .store
                .history(head)
                .await
                .unwrap()
                .into_iter()
                .map(|e| format!("{}: {}", e.event, e.detail.unwrap_or_default()))
                .collect();
            assert!(h.runs_of(head).is_empty(), "a cancelled job never ran");
            assert!(
            !lease_passed_while_held && expiries == 0,
            "the give-back must keep retrying with the lease renewed until the key frees: \
             lease passed while the key was held = {lease_passed_while_held}, \
             lease_expiries rows = {expiries}, cancelled {took:?} after the key freed; history {history:?}"
        );
            db.store.resume_queue("default").await.unwrap();
            h.open("finish");
            wait_until(10, "the key's next job to run", || async {
                db.store.job(next).await.unwrap().state == JobState::Done
                    && db.store.job(running).await.unwrap().state == JobState::Done
            })
            .await;
            a.shutdown().await.unwrap();
            db.drop().await;
        },
    ))
}

#[test]
fn a_cancelled_job_that_waited_a_lease_for_a_slot_is_given_back_while_its_key_is_held_longer_than_a_lease_without_a_lease_expiry(
) {
    run_in_system(within(
        60,
        "waited-a-lease give-back behind a held key",
        async {
            let db = TestDb::with_options("a5_gb_waited_long", StoreOptions::default(), POOL).await;
            let h = Scripted::new(&db.pool);
            let (a, running, head, next) = cancelled_head_waiting(&db, &h, "acct-wait").await;
            let producer = hold_key(&db, "acct-wait").await;
            // No pause: the job waits a lease for the slot (still taken), then is given back.
            wait_until(
                LEASE.as_secs() * 3,
                "the give-back after a lease",
                || async { a.metrics().ready == 0 },
            )
            .await;
            let lease_passed_while_held = hold_for_three_leases(&db, head).await;
            producer.rollback().await.unwrap();
            wait_until(
                10,
                "the head to be cancelled once its key is free",
                || async { db.store.job(head).await.unwrap().state == JobState::Cancelled },
            )
            .await;
            let expiries = expiries_of(&db, head).await;
            assert!(h.runs_of(head).is_empty(), "a cancelled job never ran");
            assert!(
                !lease_passed_while_held && expiries == 0,
                "lease passed while the key was held = {lease_passed_while_held}, \
             lease_expiries rows = {expiries} (the give-back was dropped to the lease's expiry)"
            );
            h.open("finish");
            wait_until(10, "the key's next job to run", || async {
                db.store.job(next).await.unwrap().state == JobState::Done
                    && db.store.job(running).await.unwrap().state == JobState::Done
            })
            .await;
            a.shutdown().await.unwrap();
            db.drop().await;
        },
    ))
}

#[test]
fn shutdown_cancels_a_cancelled_claimed_ahead_job_once_its_key_frees_within_the_shutdown_instead_of_leaving_it_running(
) {
    run_in_system(within(60, "shutdown give-back behind a held key", async {
        let db = TestDb::with_options("a5_gb_shutdown", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let (a, running, head, next) = cancelled_head_waiting(&db, &h, "acct-stop").await;
        let producer = hold_key(&db, "acct-stop").await;
        // The running job stays gated (its slot never frees, so the head stays in the
        // ready queue): the shutdown releases it after its grace.
        let started = Instant::now();
        let stopping = {
            let a = a.clone();
            actix::spawn(async move {
                let report = a.shutdown().await;
                (report, Instant::now())
            })
        };
        // The key is held for two leases, far inside the shutdown's own bounds (grace
        // 2 s, then 10 s plus a lease for releases).
        tokio::time::sleep(LEASE * 2).await;
        let state_while_held = db.store.job(head).await.unwrap().state;
        producer.rollback().await.unwrap();
        let (report, returned_at) = within(30, "shutdown", stopping).await.unwrap();
        let report = report.unwrap();
        let shutdown_took = returned_at - started;
        // Nothing runs any more in this schema: what the shutdown left is what it is.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let after = db.store.job(head).await.unwrap();
        assert!(h.runs_of(head).is_empty(), "a cancelled job never ran");
        assert_eq!(state_while_held, JobState::Running);
        assert_eq!(
            after.state,
            JobState::Cancelled,
            "the shutdown returned {shutdown_took:?} after it began (drained {}, cancelled {}, \
             released {}), while the key was held until {:?} into it: the cancelled \
             claimed-ahead job was left {:?} under a lease nobody renews (lease_until {:?}), \
             to be cancelled only by its lease's expiry",
            report.drained,
            report.cancelled,
            report.metrics.counters.released,
            LEASE * 2,
            after.state,
            after.lease_until
        );
        assert_eq!(expiries_of(&db, head).await, 0);
        let _ = (next, running);
        db.drop().await;
    }))
}

#[test]
fn shutdown_cancels_a_cancelled_claimed_ahead_job_whose_key_is_held_for_less_than_a_lease() {
    run_in_system(within(
        60,
        "shutdown give-back behind a key held briefly",
        async {
            let db =
                TestDb::with_options("a5_gb_shutdown_short", StoreOptions::default(), POOL).await;
            let h = Scripted::new(&db.pool);
            let (a, _running, head, _next) = cancelled_head_waiting(&db, &h, "acct-brief").await;
            let producer = hold_key(&db, "acct-brief").await;
            let stopping = {
                let a = a.clone();
                actix::spawn(async move { a.shutdown().await })
            };
            tokio::time::sleep(LEASE / 2).await;
            producer.rollback().await.unwrap();
            within(30, "shutdown", stopping).await.unwrap().unwrap();
            let after = db.store.job(head).await.unwrap();
            assert!(h.runs_of(head).is_empty());
            assert_eq!(
                (after.state, after.attempts),
                (JobState::Cancelled, 0),
                "{after:?}"
            );
            assert_eq!(expiries_of(&db, head).await, 0);
            db.drop().await;
        },
    ))
}

#[test]
fn a_cancelled_claimed_ahead_job_given_a_slot_while_its_key_is_held_longer_than_a_lease_is_cancelled_once_the_key_frees_without_a_lease_expiry(
) {
    run_in_system(within(
        60,
        "slot for a cancelled job behind a held key",
        async {
            let db = TestDb::with_options("a5_gb_slot_held", StoreOptions::default(), POOL).await;
            let h = Scripted::new(&db.pool);
            let (a, running, head, next) = cancelled_head_waiting(&db, &h, "acct-slot").await;
            // Let the waiting attempt learn of the cancel, then free the slot.
            tokio::time::sleep(Duration::from_millis(1000)).await;
            let producer = hold_key(&db, "acct-slot").await;
            h.open("finish");
            wait_until(10, "the running job's completion", || async {
                db.store.job(running).await.unwrap().state == JobState::Done
            })
            .await;
            let lease_passed_while_held = hold_for_three_leases(&db, head).await;
            producer.rollback().await.unwrap();
            wait_until(
                10,
                "the head to be cancelled once its key is free",
                || async { db.store.job(head).await.unwrap().state == JobState::Cancelled },
            )
            .await;
            assert!(h.runs_of(head).is_empty(), "a cancelled job never ran");
            assert!(!lease_passed_while_held);
            assert_eq!(expiries_of(&db, head).await, 0);
            wait_until(10, "the key's next job to run", || async {
                db.store.job(next).await.unwrap().state == JobState::Done
            })
            .await;
            a.shutdown().await.unwrap();
            db.drop().await;
        },
    ))
}
