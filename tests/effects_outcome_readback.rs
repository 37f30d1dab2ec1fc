//! An effect's outcome is recorded so that a retry reads it back instead of acting
//! again. An outcome JSON cannot carry as the same value (a NaN, which JSON writes as
//! null; an integer past what JSON reads back exactly) was recorded all the same, and
//! every retry failed to decode it (or decoded another value): the handler's effect ran
//! once and the job could never finish. Such an outcome is now refused before anything
//! is recorded, and the job stops at once for an operator to reconcile the effect by its
//! key: the effect ran once, no retry acts again. And an attempt that no longer runs its
//! job (its lease was taken back) is stopped by the ledger lookup before it acts.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::sync::Arc;

use common::*;
use leasehold::testkit::attempt_context;
use leasehold::{Handler, JobContext, JobError, JobState, NewJob, Scheduler};
use serde::{Deserialize, Serialize};
use worker::{fast_config, run_in_system, wait_until};

/// A refund whose outcome carries a rate: NaN when the provider sends none.
#[derive(Debug, Serialize, Deserialize)]
struct Quote {
    rate: f64,
}

/// A transfer whose outcome carries an amount in a provider's minor units, past u64.
#[derive(Debug, Serialize, Deserialize)]
struct Wide {
    units: u128,
}

/// Runs effect "convert" once per attempt, counting the times it really acted, and
/// returns `make()` as the outcome.
struct Convert<T> {
    acted: Arc<AtomicU32>,
    make: fn() -> T,
}

impl<T> Handler for Convert<T>
where
    T: Serialize + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "convert";

    async fn run(&self, ctx: JobContext, req: serde_json::Value) -> Result<(), JobError> {
        let acted = self.acted.clone();
        let make = self.make;
        ctx.once("convert", &req, |_key| async move {
            acted.fetch_add(1, SeqCst);
            Ok(make())
        })
        .await
        .map(|_: T| ())
    }
}

/// Enqueue one job (3 attempts) for a scheduler running `Convert { make }`, wait for it
/// to end, and return (times the effect acted, the job's final state, its last error,
/// the ledger rows it left).
fn run_convert<T>(test: &'static str, make: fn() -> T) -> (u32, JobState, String, usize)
where
    T: Serialize + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    let out = Arc::new(std::sync::Mutex::new(None));
    let slot = out.clone();
    run_in_system(async move {
        within(60, test, async {
            let db = TestDb::new(test).await;
            let acted = Arc::new(AtomicU32::new(0));
            let s = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
                .register(Convert::<T> {
                    acted: acted.clone(),
                    make,
                })
                .start()
                .await
                .unwrap();
            let id = s
                .enqueue_job(
                    NewJob::new("convert", &serde_json::json!({"order": 7}))
                        .unwrap()
                        .with_max_attempts(3),
                )
                .await
                .unwrap();
            wait_until(20, "the job to end", || async {
                matches!(
                    db.store.job(id).await.unwrap().state,
                    JobState::Done | JobState::Dead
                )
            })
            .await;
            s.shutdown().await.unwrap();
            let rec = db.store.job(id).await.unwrap();
            let ledger = db.store.job_effects(id).await.unwrap().len();
            *slot.lock().unwrap() = Some((
                acted.load(SeqCst),
                rec.state,
                rec.last_error.unwrap_or_default(),
                ledger,
            ));
            db.drop().await;
        })
        .await
    });
    let got = out.lock().unwrap().take().unwrap();
    got
}

fn assert_stopped_after_one_effect((acted, state, error, ledger): (u32, JobState, String, usize)) {
    assert_eq!(
        acted, 1,
        "the effect ran {acted} times; last error: {error}"
    );
    assert_eq!(state, JobState::Dead, "{error}");
    assert!(
        error.contains("happened") && error.contains("reconcile"),
        "the reason says the effect happened and what to do: {error}"
    );
    assert_eq!(ledger, 0, "nothing unreadable was recorded");
}

#[test]
fn an_effect_whose_outcome_is_nan_runs_once_and_stops_for_an_operator() {
    assert_stopped_after_one_effect(run_convert("readback_nan", || Quote { rate: f64::NAN }));
}

#[test]
fn an_effect_whose_outcome_is_an_integer_past_u64_runs_once_and_stops_for_an_operator() {
    assert_stopped_after_one_effect(run_convert("readback_u128", || Wide {
        units: u128::from(u64::MAX) * 16,
    }));
}

#[test]
fn an_effect_whose_outcome_reads_back_is_recorded_and_the_job_is_done() {
    let (acted, state, error, ledger) = run_convert("readback_plain", || Quote { rate: 0.1 });
    assert_eq!((acted, state, ledger), (1, JobState::Done, 1), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_whose_lease_was_taken_back_is_stopped_before_it_acts() {
    bounded(async {
        let db = TestDb::new("readback_stale").await;
        let id = db
            .store
            .enqueue(NewJob::new("convert", &serde_json::json!({})).unwrap())
            .await
            .unwrap();
        let a = db
            .store
            .claim(&claim_req(&owner("a"), 1))
            .await
            .unwrap()
            .remove(0);
        // A's lease passes and the job goes to B, while A is still running.
        let at = a.lease_until + chrono::Duration::seconds(60);
        let renewed = db
            .store
            .renew(
                &owner("a"),
                &[a.attempt()],
                std::time::Duration::from_secs(1),
            )
            .await;
        assert!(renewed.is_ok());
        let report = db
            .store
            .reap(&owner("reaper"), &fixed_backoff(1), 10, Some(at))
            .await
            .unwrap();
        assert_eq!(report.retried, vec![id]);
        let b = db
            .store
            .claim(&claim_at(&owner("b"), 1, at + chrono::Duration::seconds(2)))
            .await
            .unwrap()
            .remove(0);
        assert_eq!(b.id, id);
        let acted = AtomicU32::new(0);
        let got = attempt_context(a, db.store.clone())
            .once("convert", &1, |_key| async {
                acted.fetch_add(1, SeqCst);
                Ok(1)
            })
            .await;
        let err = got.expect_err("a stale attempt's effect is refused");
        assert!(
            !err.is_permanent() && err.message().contains("no longer runs"),
            "{err}"
        );
        assert_eq!(acted.load(SeqCst), 0, "the stale attempt did not act");
        db.drop().await;
    })
    .await
}
