//! Pausing a queue holds in every process: two schedulers claim nothing of a paused
//! queue (its other queues run on), a job running at the pause finishes, jobs claimed
//! ahead are given back without an attempt, a key's successor is not chained into a
//! paused queue, and a resume starts everything within a second. Asserted on what the
//! handlers ran, and on the rows.

mod common;
#[path = "common/scripted.rs"]
mod scripted;
#[path = "common/worker.rs"]
mod worker;

use std::time::{Duration, Instant};

use common::{within, TestDb};
use leasehold::{Config, JobState, Scheduler, StoreOptions};
use scripted::{scripted, work, Script, Scripted};
use worker::{config_with_lease, fast_config, run_in_system, wait_until, POOL};

fn both_queues(db: &TestDb) -> Config {
    let mut c = fast_config(&db.schema);
    c.queues = vec!["payouts".into(), "emails".into()];
    c
}

async fn start(db: &TestDb, h: &Scripted, config: Config) -> Scheduler {
    Scheduler::builder(db.pool.clone(), config)
        .register(h.clone())
        .start()
        .await
        .unwrap()
}

/// A scheduler with one slot, taken by a job gated on "finish", holding jobs ahead
/// whatever the pace (a gated job makes the pace nil). A long lease (20 s): a
/// give-back after a lease's wait, or an expiry, comes long after any test's bound.
async fn one_slot_taken(db: &TestDb, h: &Scripted) -> (Scheduler, leasehold::JobId) {
    let mut config = config_with_lease(&db.schema, Duration::from_secs(20));
    config.concurrency = 1;
    config.claim_ahead = 4;
    config.claim_ahead_window = None;
    let a = start(db, h, config).await;
    let running = a
        .enqueue_job(scripted(Script {
            gate: Some("finish".into()),
            ..work("running", 0)
        }))
        .await
        .unwrap();
    h.started("running", 10).await;
    (a, running)
}

#[test]
fn two_schedulers_claim_nothing_of_a_paused_queue_until_it_is_resumed() {
    run_in_system(within(60, "pause across schedulers", async {
        let db = TestDb::with_options("rt_pause_two", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let a = start(&db, &h, both_queues(&db)).await;
        let b = start(&db, &h, both_queues(&db)).await;
        assert!(db.store.pause_queue("payouts", Some("test")).await.unwrap());
        assert!(
            !db.store
                .pause_queue("payouts", Some("again"))
                .await
                .unwrap(),
            "a second pause changes nothing"
        );
        let paused = db.store.paused_queues().await.unwrap();
        assert_eq!(paused.len(), 1);
        assert_eq!(paused[0].paused_by.as_deref(), Some("test"));

        let payouts = a
            .enqueue_many(
                (0..6)
                    .map(|i| scripted(work(&format!("payout{i}"), 0)).with_queue("payouts"))
                    .collect(),
            )
            .await
            .unwrap();
        let emails = b
            .enqueue_many(
                (0..6)
                    .map(|i| scripted(work(&format!("email{i}"), 0)).with_queue("emails"))
                    .collect(),
            )
            .await
            .unwrap();
        wait_until(10, "the other queue's jobs to run", || async {
            db.count_where("jobs", "queue = 'emails' AND state = 'done'")
                .await
                == 6
        })
        .await;
        // Both schedulers polled and were woken meanwhile; give them a second more.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        for id in &payouts {
            assert_eq!(h.runs_of(*id).len(), 0, "a paused queue's job ran");
            let job = db.store.job(*id).await.unwrap();
            assert_eq!((job.state, job.attempts), (JobState::Pending, 0), "{job:?}");
        }
        let stats = db.store.queue_stats().await.unwrap();
        let q = stats.iter().find(|q| q.queue == "payouts").unwrap();
        assert!(q.paused, "{q:?}");
        assert_eq!(q.by_state.get("pending"), Some(&6));
        // The other queue has no open job left, so it is not listed; it is not paused.
        assert!(
            stats.iter().all(|q| q.queue == "payouts" || !q.paused),
            "{stats:?}"
        );

        let resumed = Instant::now();
        assert!(db.store.resume_queue("payouts").await.unwrap());
        assert!(!db.store.resume_queue("payouts").await.unwrap());
        wait_until(10, "the resumed queue's jobs to run", || async {
            db.count_where("jobs", "queue = 'payouts' AND state = 'done'")
                .await
                == 6
        })
        .await;
        assert!(
            resumed.elapsed() < Duration::from_secs(2),
            "the resume took {:?} to reach the schedulers",
            resumed.elapsed()
        );
        for id in payouts.iter().chain(&emails) {
            assert_eq!(h.runs_of(*id).len(), 1);
        }
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
        db.drop().await;
    }))
}

#[test]
fn a_pause_lets_the_running_job_finish_and_gives_back_the_jobs_claimed_ahead() {
    run_in_system(within(60, "pause with jobs claimed ahead", async {
        let db = TestDb::with_options("rt_pause_ahead", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let (a, running) = one_slot_taken(&db, &h).await;
        let ahead = a
            .enqueue_many(
                (0..3)
                    .map(|i| scripted(work(&format!("ahead{i}"), 0)))
                    .collect(),
            )
            .await
            .unwrap();
        wait_until(10, "the jobs to be claimed ahead", || async {
            a.metrics().ready == 3
        })
        .await;

        db.store.pause_queue("default", None).await.unwrap();
        // The pause is announced: the jobs claimed ahead go back at once (well within a
        // lease).
        wait_until(2, "the claimed-ahead jobs to be given back", || async {
            let mut back = 0;
            for id in &ahead {
                if db.store.job(*id).await.unwrap().state == JobState::Pending {
                    back += 1;
                }
            }
            back == ahead.len()
        })
        .await;
        assert_eq!(a.metrics().ready, 0);
        h.open("finish");
        h.ended("running", 10).await;
        wait_until(5, "the running job's completion", || async {
            db.store.job(running).await.unwrap().state == JobState::Done
        })
        .await;
        // Its slot is free now, and nothing of the paused queue starts in it.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        for id in &ahead {
            assert!(
                h.runs_of(*id).is_empty(),
                "a job of the paused queue started"
            );
            let job = db.store.job(*id).await.unwrap();
            assert_eq!((job.state, job.attempts), (JobState::Pending, 0), "{job:?}");
        }
        db.store.resume_queue("default").await.unwrap();
        wait_until(10, "the jobs to run after the resume", || async {
            db.count_where("jobs", "state = 'done'").await == 4
        })
        .await;
        for id in &ahead {
            assert_eq!(h.runs_of(*id).len(), 1);
            assert_eq!(db.store.job(*id).await.unwrap().attempts, 1);
        }
        a.shutdown().await.unwrap();
        db.drop().await;
    }))
}

#[test]
fn a_keys_successor_is_not_chained_into_a_paused_queue() {
    run_in_system(within(60, "pause and key succession", async {
        let db = TestDb::with_options("rt_pause_keyed", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let a = start(&db, &h, fast_config(&db.schema)).await;
        let head = a
            .enqueue_job(
                scripted(Script {
                    gate: Some("head".into()),
                    ..work("head", 0)
                })
                .with_key("acct-1"),
            )
            .await
            .unwrap();
        let next = a
            .enqueue_job(scripted(work("next", 0)).with_key("acct-1"))
            .await
            .unwrap();
        h.started("head", 10).await;
        db.store.pause_queue("default", Some("test")).await.unwrap();
        h.open("head");
        wait_until(5, "the head's completion", || async {
            db.store.job(head).await.unwrap().state == JobState::Done
        })
        .await;
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert!(
            h.runs_of(next).is_empty(),
            "the successor ran in a paused queue"
        );
        let job = db.store.job(next).await.unwrap();
        assert_eq!((job.state, job.attempts), (JobState::Pending, 0), "{job:?}");
        db.store.resume_queue("default").await.unwrap();
        wait_until(5, "the successor after the resume", || async {
            db.store.job(next).await.unwrap().state == JobState::Done
        })
        .await;
        h.assert_keys_serial();
        a.shutdown().await.unwrap();
        db.drop().await;
    }))
}

#[test]
fn a_pause_holds_for_a_scheduler_that_starts_later_and_is_refused_for_a_bad_name() {
    run_in_system(within(60, "pause before start", async {
        let db = TestDb::with_options("rt_pause_later", StoreOptions::default(), POOL).await;
        db.store.pause_queue("default", None).await.unwrap();
        assert!(db.store.pause_queue("", None).await.is_err());
        assert!(db.store.resume_queue("a\0b").await.is_err());
        let h = Scripted::new(&db.pool);
        let a = start(&db, &h, fast_config(&db.schema)).await;
        let id = a.enqueue_job(scripted(work("later", 0))).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert!(h.runs_of(id).is_empty());
        // A paused queue shows in the statistics even with nothing in it but this job,
        // and in the Prometheus-style gauges through queue_gauges.
        assert!(db.store.queue_gauges().await.unwrap()[0].paused);
        db.store.resume_queue("default").await.unwrap();
        wait_until(5, "the job after the resume", || async {
            db.store.job(id).await.unwrap().state == JobState::Done
        })
        .await;
        a.shutdown().await.unwrap();
        db.drop().await;
    }))
}

/// A job claimed ahead and cancelled while it waits is cancelled when it is given back,
/// even if its key row is held at that moment (a producer's transaction): the give-back
/// tries again once the key is free, instead of dropping the job to its lease's expiry
/// (the fault harness found a give-back that raced a cancel so: the key waited a lease).
#[test]
fn a_cancelled_job_given_back_while_its_key_is_held_is_cancelled_when_the_key_frees_not_at_its_lease_expiry(
) {
    run_in_system(within(
        60,
        "give-back of a cancelled job behind a held key",
        async {
            let db =
                TestDb::with_options("rt_pause_cancel_held", StoreOptions::default(), POOL).await;
            let h = Scripted::new(&db.pool);
            let (a, running) = one_slot_taken(&db, &h).await;
            let head = a
                .enqueue_job(scripted(work("head", 0)).with_key("acct-held"))
                .await
                .unwrap();
            let next = a
                .enqueue_job(scripted(work("next", 0)).with_key("acct-held"))
                .await
                .unwrap();
            wait_until(10, "the key's head to be claimed ahead", || async {
                a.metrics().ready == 1
            })
            .await;
            assert_eq!(
                db.store.cancel(head, "not needed").await.unwrap(),
                leasehold::CancelOutcome::Requested
            );
            // A producer's transaction holds the key row while the queue is paused.
            let mut producer = db.owner.begin().await.unwrap();
            sqlx::query(&format!(
                "SELECT 1 FROM {} WHERE job_key = 'acct-held' FOR UPDATE",
                db.table("job_keys")
            ))
            .execute(&mut *producer)
            .await
            .unwrap();
            db.store.pause_queue("default", None).await.unwrap();
            wait_until(5, "the give-back", || async { a.metrics().ready == 0 }).await;
            tokio::time::sleep(Duration::from_millis(800)).await;
            assert_eq!(
                db.store.job(head).await.unwrap().state,
                JobState::Running,
                "the key row is held: nothing can cancel the head yet"
            );
            producer.rollback().await.unwrap();
            let freed = Instant::now();
            wait_until(
                5,
                "the head to be cancelled once its key is free",
                || async { db.store.job(head).await.unwrap().state == JobState::Cancelled },
            )
            .await;
            assert!(freed.elapsed() < Duration::from_secs(5));
            assert_eq!(
                db.count_where("lease_expiries", &format!("job_id = {}", head.0))
                    .await,
                0,
                "the head was cancelled by the give-back, not by its lease's expiry"
            );
            assert!(h.runs_of(head).is_empty(), "a cancelled job never ran");
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
