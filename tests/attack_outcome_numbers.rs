//! Attack: "An effect outcome that cannot be recorded or would not read back as the same
//! value ... stops the job before anything is recorded; ... a retry gets the recorded
//! outcome."
//!
//! The check reads the outcome back through serde_json's own text, but the ledger stores
//! it as jsonb, whose numbers are PostgreSQL numerics: `1e16` comes back as
//! `10000000000000000` (an integer to serde_json) and `-0.0` as `0.0`. Here the effect
//! runs on attempt 1, the handler then fails retryably, and attempt 2 gets the recorded
//! outcome: it must be the value attempt 1 got (or the job must stop for an operator).

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::fmt::Debug;
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use common::*;
use leasehold::{Handler, JobContext, JobError, JobState, NewJob, Scheduler};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use worker::{fast_config, run_in_system, wait_until};

/// A provider's amount: whole units when integral, else fractional.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
enum Amount {
    Units(u64),
    Fractional(f64),
}

#[derive(Debug, Serialize, Deserialize)]
struct Rate {
    delta: f64,
}

struct Effect<T> {
    acted: Arc<AtomicU32>,
    seen: Arc<Mutex<Vec<String>>>,
    make: fn() -> T,
}

impl<T> Handler for Effect<T>
where
    T: Debug + Serialize + DeserializeOwned + Send + Sync + 'static,
{
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "fx";

    async fn run(&self, ctx: JobContext, req: serde_json::Value) -> Result<(), JobError> {
        let acted = self.acted.clone();
        let make = self.make;
        let got: T = ctx
            .once("quote", &req, |_key| async move {
                acted.fetch_add(1, SeqCst);
                Ok(make())
            })
            .await?;
        self.seen.lock().unwrap().push(format!("{got:?}"));
        if ctx.attempt() == 1 {
            return Err(JobError::retry("the next step failed; try again"));
        }
        Ok(())
    }
}

/// (times the effect acted, what each attempt's `once` returned, final state, error).
fn run<T>(test: &'static str, make: fn() -> T) -> (u32, Vec<String>, JobState, String)
where
    T: Debug + Serialize + DeserializeOwned + Send + Sync + 'static,
{
    let out = Arc::new(Mutex::new(None));
    let slot = out.clone();
    run_in_system(async move {
        within(60, test, async {
            let db = TestDb::new(test).await;
            let acted = Arc::new(AtomicU32::new(0));
            let seen = Arc::new(Mutex::new(Vec::new()));
            let s = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
                .register(Effect::<T> {
                    acted: acted.clone(),
                    seen: seen.clone(),
                    make,
                })
                .start()
                .await
                .unwrap();
            let id = s
                .enqueue_job(
                    NewJob::new("fx", &serde_json::json!({"pair": "EURUSD"}))
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
            *slot.lock().unwrap() = Some((
                acted.load(SeqCst),
                seen.lock().unwrap().clone(),
                rec.state,
                rec.last_error.unwrap_or_default(),
            ));
            db.drop().await;
        })
        .await
    });
    let got = out.lock().unwrap().take().unwrap();
    got
}

fn assert_retry_reads_the_same((acted, seen, state, error): (u32, Vec<String>, JobState, String)) {
    assert_eq!(acted, 1, "the effect ran {acted} times: {error}");
    if state == JobState::Dead {
        // Refused as unreadable before recording: acceptable.
        assert!(error.contains("reconcile"), "{error}");
        return;
    }
    assert_eq!(state, JobState::Done, "{error}");
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(
        seen[1], seen[0],
        "the retry got another value from the ledger than the effect returned"
    );
}

#[test]
fn a_retry_reads_back_an_untagged_fractional_amount_of_1e16_as_the_same_variant() {
    assert_retry_reads_the_same(run("num_untagged", || Amount::Fractional(1e16)));
}

#[test]
fn a_retry_reads_back_a_json_value_outcome_holding_1e16_as_the_same_value() {
    assert_retry_reads_the_same(run("num_value", || serde_json::json!({ "rate": 1e16 })));
}

#[test]
fn a_retry_reads_back_a_negative_zero_outcome_as_negative_zero() {
    assert_retry_reads_the_same(run("num_negzero", || Rate { delta: -0.0 }));
}

#[test]
fn a_retry_reads_back_a_fractional_outcome_as_the_same_value() {
    assert_retry_reads_the_same(run("num_plain", || Amount::Fractional(0.25)));
}

/// A handler whose output is an untagged amount.
struct Price;

impl Handler for Price {
    type Payload = serde_json::Value;
    type Output = Amount;
    const KIND: &'static str = "price";

    async fn run(&self, _ctx: JobContext, _req: serde_json::Value) -> Result<Amount, JobError> {
        Ok(Amount::Fractional(1e16))
    }
}

/// "Whatever is accepted reads back everywhere": the job's result, read through
/// `Store::job` and decoded as the handler's output type, is what the handler returned.
#[ignore = "documented (README, bad input): results come back as PostgreSQL's jsonb prints numbers (1e16 as 10000000000000000), so an untagged enum can decode another variant"]
#[test]
fn a_job_result_of_an_untagged_fractional_1e16_reads_back_from_the_store_as_the_same_variant() {
    run_in_system(async {
        within(60, "result readback", async {
            let db = TestDb::new("num_result").await;
            let s = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
                .register(Price)
                .start()
                .await
                .unwrap();
            let id = s
                .enqueue_job(NewJob::new("price", &serde_json::json!({})).unwrap())
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
            assert_eq!(rec.state, JobState::Done, "{:?}", rec.last_error);
            let back: Amount = serde_json::from_value(rec.result.clone().unwrap()).unwrap();
            assert_eq!(
                back,
                Amount::Fractional(1e16),
                "stored result reads back as {:?}",
                rec.result
            );
            db.drop().await;
        })
        .await
    });
}
