//! Attack: a schema dropped and created again under a running scheduler (a neighbour in
//! time). Job ids restart at 1 and the scheduler's owner and a first attempt's
//! generation are the same as before, so an attempt of the dropped schema's job 1 that
//! is still running holds the same (job, owner, generation) fence as the new schema's
//! job 1. The new job 1 has an effect identity of its own: the old attempt must not end
//! it, and the new job must charge its own payment.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use leasehold::testkit::gateway::{
    ChargeRequest, Decision, Gateway, GatewayClient, GatewayConfig, Receipt,
};
use leasehold::{
    Handler, JobContext, JobError, JobId, JobState, NewJob, Scheduler, Store, StoreOptions,
};
use tokio::sync::Semaphore;
use worker::{fast_config, run_in_system, wait_until};

struct Pay {
    gw: GatewayClient,
    /// Charges of reference "old" wait for a permit here, "new" ones there.
    old_gate: Arc<Semaphore>,
    new_gate: Arc<Semaphore>,
    old_returned: Arc<std::sync::atomic::AtomicBool>,
}

impl Handler for Pay {
    type Payload = ChargeRequest;
    type Output = Receipt;
    const KIND: &'static str = "pay";

    async fn run(&self, ctx: JobContext, req: ChargeRequest) -> Result<Receipt, JobError> {
        let gate = if req.reference == "old" {
            &self.old_gate
        } else {
            &self.new_gate
        };
        let (gw, r, token) = (&self.gw, &req, ctx.fencing_token());
        let got = ctx
            .once("charge", &req, |key| async move {
                let _p = gate.acquire().await.unwrap();
                gw.charge(key.as_str(), Some(token), r)
                    .await?
                    .into_job_result()
            })
            .await;
        if req.reference == "old" {
            self.old_returned
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
        got
    }
}

#[test]
fn a_job_of_a_schema_created_again_is_not_ended_by_an_attempt_of_the_dropped_schemas_job() {
    run_in_system(async {
        within(90, "schema created again", async {
            let db = TestDb::with_options("again_fence", StoreOptions::default(), 4).await;
            let gw = Gateway::start(GatewayConfig::default()).unwrap();
            let old_gate = Arc::new(Semaphore::new(0));
            let new_gate = Arc::new(Semaphore::new(0));
            let old_returned = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let s = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
                .register(Pay {
                    gw: gw.client().with_timeout(Duration::from_secs(5)),
                    old_gate: old_gate.clone(),
                    new_gate: new_gate.clone(),
                    old_returned: old_returned.clone(),
                })
                .start()
                .await
                .unwrap();
            let old = ChargeRequest {
                account: "acct-old".into(),
                amount_cents: 111,
                reference: "old".into(),
            };
            let new = ChargeRequest {
                account: "acct-new".into(),
                amount_cents: 222,
                reference: "new".into(),
            };
            let id = s
                .enqueue_job(NewJob::new("pay", &old).unwrap())
                .await
                .unwrap();
            assert_eq!(id, JobId(1));
            wait_until(10, "the old payment to run", || async {
                db.store.job(id).await.unwrap().state == JobState::Running
            })
            .await;
            // Past the ledger lookup, the old attempt is at the gateway (waiting for
            // its permit). The schema is dropped and created again; the new job 1 runs.
            tokio::time::sleep(Duration::from_millis(300)).await;
            create_schema_again(&db).await;
            let fresh = Store::new(db.pool.clone(), &db.schema, StoreOptions::default()).unwrap();
            let new_id = fresh
                .enqueue(NewJob::new("pay", &new).unwrap())
                .await
                .unwrap();
            assert_eq!(new_id, JobId(1), "ids restart at 1");
            wait_until(20, "the new payment to run", || async {
                fresh
                    .job(new_id)
                    .await
                    .map(|r| r.state == JobState::Running)
                    .unwrap_or(false)
            })
            .await;
            // The old attempt's charge goes through and it returns; then the new one's.
            old_gate.add_permits(1);
            wait_until(10, "the old attempt to return", || async {
                old_returned.load(std::sync::atomic::Ordering::SeqCst)
            })
            .await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            new_gate.add_permits(1);
            wait_until(20, "the new payment to end", || async {
                matches!(
                    fresh.job(new_id).await.unwrap().state,
                    JobState::Done | JobState::Dead
                )
            })
            .await;
            s.shutdown().await.unwrap();
            let rec = fresh.job(new_id).await.unwrap();
            let applied: Vec<String> = gw
                .log()
                .into_iter()
                .filter(|e| e.decision == Decision::Applied)
                .map(|e| e.request.account)
                .collect();
            let receipt: Option<Receipt> = rec
                .result
                .clone()
                .and_then(|v| serde_json::from_value(v).ok());
            assert_eq!(rec.state, JobState::Done, "{:?}", rec.last_error);
            assert!(
                applied.contains(&"acct-new".to_string())
                    && receipt.as_ref().map(|r| r.account.as_str()) == Some("acct-new"),
                "the new job 1 ended without its own charge: gateway applied {applied:?}, \
                 its result is {receipt:?}"
            );
            db.drop().await;
        })
        .await
    });
}
