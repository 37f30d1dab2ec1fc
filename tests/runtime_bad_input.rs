//! Bad input at runtime: undecodable payloads, panics, permanent errors, timeouts and
//! unknown kinds end clearly, and the scheduler keeps running everything else.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::{job, within, TestDb};
use leasehold::{Error, Handler, JobContext, JobError, JobId, JobState, NewJob, Scheduler};
use leasehold::{JobRecord, StoreOptions};
use serde::{Deserialize, Serialize};
use worker::{fast_config, run_in_system, wait_until, POOL};

#[derive(Serialize, Deserialize)]
struct Charge {
    amount: u64,
}

struct Typed;

impl Handler for Typed {
    type Payload = Charge;
    type Output = u64;
    const KIND: &'static str = "typed_charge";

    async fn run(&self, _: JobContext, c: Charge) -> Result<u64, JobError> {
        Ok(c.amount)
    }
}

const BOOM: &str = "boom in the handler";

/// The expected panic would print a backtrace note on every attempt; keep it quiet.
fn quiet_expected_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().downcast_ref::<&str>() != Some(&BOOM) {
            default(info)
        }
    }));
}

struct Panics;

impl Handler for Panics {
    type Payload = ();
    type Output = ();
    const KIND: &'static str = "panics";

    async fn run(&self, _: JobContext, _: ()) -> Result<(), JobError> {
        panic!("boom in the handler");
    }
}

struct Permanent;

impl Handler for Permanent {
    type Payload = ();
    type Output = ();
    const KIND: &'static str = "permanent";

    async fn run(&self, _: JobContext, _: ()) -> Result<(), JobError> {
        Err(JobError::permanent("account closed"))
    }
}

/// Sleeps far past the maximum run time, ignoring cancellation.
struct Slow;

impl Handler for Slow {
    type Payload = ();
    type Output = ();
    const KIND: &'static str = "slow";

    async fn run(&self, _: JobContext, _: ()) -> Result<(), JobError> {
        tokio::time::sleep(Duration::from_secs(60)).await;
        Ok(())
    }
}

struct Fine;

impl Handler for Fine {
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "fine";

    async fn run(&self, _: JobContext, _: serde_json::Value) -> Result<(), JobError> {
        tokio::time::sleep(Duration::from_millis(5)).await;
        Ok(())
    }
}

async fn ended(db: &TestDb, id: JobId) -> JobRecord {
    wait_until(20, "the job to end", || async {
        let s = db.state_of(id).await;
        s == "done" || s == "dead"
    })
    .await;
    db.store.job(id).await.unwrap()
}

async fn events(db: &TestDb, id: JobId) -> Vec<(String, Option<String>)> {
    db.store
        .history(id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.event, e.detail))
        .collect()
}

#[test]
fn bad_input_ends_clearly_and_the_scheduler_keeps_going() {
    quiet_expected_panics();
    run_in_system(within(90, "bad input test", async {
        let db = TestDb::with_options("rt_bad_input", StoreOptions::default(), POOL).await;
        let mut config = fast_config(&db.schema);
        config.max_run_time = Duration::from_millis(400);
        let scheduler = Scheduler::builder(db.pool.clone(), config)
            .register(Typed)
            .register(Panics)
            .register(Permanent)
            .register(Slow)
            .register(Fine)
            .start()
            .await
            .unwrap();

        // An unregistered kind through the scheduler: refused, nothing written.
        let before = db.job_count().await;
        match scheduler.enqueue_job(job("nobody_handles_this")).await {
            Err(Error::UnknownKind(kind)) => assert_eq!(kind, "nobody_handles_this"),
            other => panic!("expected UnknownKind, got {other:?}"),
        }
        assert_eq!(db.job_count().await, before);
        // A kind some other process handles, enqueued through the store: never claimed
        // here.
        let foreign = db.store.enqueue(job("other_service_kind")).await.unwrap();

        let undecodable = scheduler
            .enqueue_job(NewJob::from_json(
                "typed_charge",
                serde_json::json!({ "amount": "lots" }),
            ))
            .await
            .unwrap();
        let panics = scheduler
            .enqueue_job(NewJob::new("panics", &()).unwrap().with_max_attempts(2))
            .await
            .unwrap();
        let permanent = scheduler
            .enqueue_job(NewJob::new("permanent", &()).unwrap().with_max_attempts(5))
            .await
            .unwrap();
        let slow = scheduler
            .enqueue_job(NewJob::new("slow", &()).unwrap().with_max_attempts(2))
            .await
            .unwrap();
        let fine: Vec<NewJob> = (0..30)
            .map(|i| {
                let j = NewJob::from_json("fine", serde_json::json!({ "i": i }));
                if i % 2 == 0 {
                    j.with_key(format!("k{}", i % 3))
                } else {
                    j
                }
            })
            .collect();
        let fine = scheduler.enqueue_many(fine).await.unwrap();
        let good = scheduler
            .enqueue::<Typed>(&Charge { amount: 7 })
            .await
            .unwrap();

        // Undecodable: dead at once, the reason names the kind.
        let j = ended(&db, undecodable).await;
        assert_eq!((j.state, j.attempts), (JobState::Dead, 1), "{j:?}");
        let reason = j.last_error.unwrap();
        assert!(reason.contains("typed_charge"), "{reason}");

        // Panic: each attempt fails with the panic recorded; dead after the last.
        let j = ended(&db, panics).await;
        assert_eq!((j.state, j.attempts), (JobState::Dead, 2), "{j:?}");
        assert!(j.last_error.unwrap().contains("panicked"));
        let ev = events(&db, panics).await;
        assert!(
            ev.iter().any(|(e, d)| e == "failed"
                && d.as_deref()
                    .is_some_and(|d| d.contains("panicked") && d.contains("boom in the handler"))),
            "{ev:?}"
        );

        // Permanent: dead on the first attempt, whatever attempts remain.
        let j = ended(&db, permanent).await;
        assert_eq!((j.state, j.attempts), (JobState::Dead, 1), "{j:?}");
        assert_eq!(j.last_error.as_deref(), Some("account closed"));

        // Timeout: the attempt fails with a timeout reason (and is retried).
        let j = ended(&db, slow).await;
        assert_eq!((j.state, j.attempts), (JobState::Dead, 2), "{j:?}");
        let ev = events(&db, slow).await;
        assert!(
            ev.iter().any(|(e, d)| e == "failed"
                && d.as_deref()
                    .is_some_and(|d| d.contains("exceeded the maximum run time"))),
            "{ev:?}"
        );

        // Everything else ran.
        for id in fine.iter().chain([&good]) {
            assert_eq!(ended(&db, *id).await.state, JobState::Done);
        }
        assert_eq!(
            db.store.job(good).await.unwrap().result,
            Some(serde_json::json!(7))
        );

        // The foreign job, after many more polls, was never touched.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let j = db.store.job(foreign).await.unwrap();
        assert_eq!(
            (j.state, j.attempts, j.generation.0, j.owner.as_deref()),
            (JobState::Pending, 0, 0, None),
            "{j:?}"
        );

        let m = scheduler.metrics();
        scheduler.shutdown().await.unwrap();
        let c = &m.counters;
        assert_eq!(c.decode_failures, 1, "{c:?}");
        assert_eq!(c.panics, 2, "{c:?}");
        assert_eq!(c.timeouts, 2, "{c:?}");
        assert_eq!(c.dead, 4, "{c:?}");
        assert_eq!(c.completed, 31, "{c:?}");
        db.drop().await;
    }))
}
