//! The payment job, its handler, the fault injector and the fault plan.

use std::collections::HashMap;
use std::error::Error;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold::testkit::gateway::{
    ChargeRequest, ChargeResult, Fault, FaultSchedule, GatewayClient, Receipt,
};
use leasehold::{Backoff, Generation, Handler, JobContext, JobError, JobId, OwnerId, Store};
use serde::{Deserialize, Serialize};

use crate::{GATEWAY_STALL, SIMULATED_CRASH};

/// One payment: the job's payload.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Payment {
    pub(crate) account: String,
    pub(crate) seq: u32,
    pub(crate) amount_cents: i64,
}

impl Payment {
    pub(crate) fn reference(&self) -> String {
        reference(&self.account, self.seq)
    }

    fn charge_request(&self) -> ChargeRequest {
        ChargeRequest {
            account: self.account.clone(),
            amount_cents: self.amount_cents,
            reference: self.reference(),
        }
    }
}

pub(crate) fn account(i: u32) -> String {
    format!("acct-{i:02}")
}

pub(crate) fn reference(account: &str, seq: u32) -> String {
    format!("{account}/{seq:03}")
}

/// How the handler names its charge step, and so the idempotency key it sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KeyScheme {
    /// leasehold's way: `<schema identity>/<job id>/charge`, the same for every attempt.
    Stable,
    /// The mistake the design rules out: `<schema identity>/<job id>/charge-g<generation>`.
    PerAttempt,
}

impl KeyScheme {
    pub(crate) fn label(self) -> &'static str {
        match self {
            KeyScheme::Stable => "leasehold",
            KeyScheme::PerAttempt => "per_attempt",
        }
    }
}

/// Faults the worker side injects into the first attempt of a payment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WorkerFault {
    /// Right after charging, the worker stalls (a long GC pause, a frozen VM) until its
    /// lease has expired, the job was reaped, and its lease renewal noticed.
    StallPastLease,
    /// Right after charging, before anything is recorded, the worker crashes.
    CrashAfterCharge,
}

#[derive(Clone)]
pub(crate) struct PaymentHandler {
    pub(crate) gateway: GatewayClient,
    pub(crate) keys: KeyScheme,
    pub(crate) worker_faults: Arc<HashMap<String, WorkerFault>>,
    pub(crate) injector: Injector,
    /// What stalled workers saw when they woke up.
    pub(crate) wake_ups: Arc<Mutex<Vec<WakeUp>>>,
}

/// A stalled worker's view after its lease was lost.
pub(crate) struct WakeUp {
    pub(crate) reference: String,
    pub(crate) generation: Generation,
    pub(crate) owner: OwnerId,
    pub(crate) error: String,
}

impl Handler for PaymentHandler {
    type Payload = Payment;
    type Output = Receipt;
    const KIND: &'static str = "payment";

    async fn run(&self, ctx: JobContext, payment: Payment) -> Result<Receipt, JobError> {
        let request = payment.charge_request();
        let step = match self.keys {
            KeyScheme::Stable => "charge".to_string(),
            KeyScheme::PerAttempt => format!("charge-g{}", ctx.generation()),
        };
        let token = ctx.fencing_token();
        let fault = match ctx.attempt() {
            1 => self.worker_faults.get(&request.reference).copied(),
            _ => None,
        };
        let (ctx_ref, req) = (&ctx, &request);
        // At most once per effect key: a retry that finds the receipt in the ledger gets
        // it back without calling the gateway; one that does not presents the same key,
        // and the gateway returns the original charge instead of charging again.
        let outcome = ctx
            .once(&step, &request, |key| async move {
                let receipt = match self.gateway.charge(key.as_str(), Some(token), req).await? {
                    ChargeResult::Applied(r) | ChargeResult::Duplicate(r) => r,
                    ChargeResult::Fenced { seen, got } => {
                        return Err(JobError::retry(format!(
                            "superseded: the gateway has seen token {seen:#x}, ours is {got:#x}"
                        )))
                    }
                    ChargeResult::Mismatch => {
                        return Err(JobError::permanent(format!(
                            "idempotency key {key} was used for another request"
                        )))
                    }
                    ChargeResult::Failed(reason) => {
                        return Err(JobError::retry(format!("gateway failed: {reason}")))
                    }
                };
                match fault {
                    Some(WorkerFault::StallPastLease) => {
                        self.injector.stall_past_lease(ctx_ref).await
                    }
                    Some(WorkerFault::CrashAfterCharge) => {
                        panic!("{SIMULATED_CRASH} after charging {}", req.reference)
                    }
                    None => {}
                }
                Ok(receipt)
            })
            .await;
        if let (Some(WorkerFault::StallPastLease), Err(e)) = (fault, &outcome) {
            let job = ctx.job();
            let note = WakeUp {
                reference: request.reference.clone(),
                generation: job.generation,
                owner: job.owner.clone(),
                error: e.to_string(),
            };
            self.wake_ups.lock().unwrap().push(note);
        }
        outcome
    }
}

/// Makes a stalled worker's lease really pass: the demo moves the job's `lease_until`
/// into the past and reaps it, as if the stall had outlasted the lease. (Renewal runs on
/// its own thread and would otherwise keep the lease alive; that is its job.)
#[derive(Clone)]
pub(crate) struct Injector {
    pub(crate) store: Store,
    pub(crate) owner: OwnerId,
    pub(crate) backoff: Backoff,
}

impl Injector {
    async fn stall_past_lease(&self, ctx: &JobContext) {
        if let Err(e) = self.expire(ctx.job_id(), ctx.generation()).await {
            eprintln!("fault injector: could not expire job {}: {e}", ctx.job_id());
            return;
        }
        // Stalled until the worker's lease renewal finds the lease gone and cancels us.
        let _ = tokio::time::timeout(Duration::from_secs(5), ctx.cancelled()).await;
    }

    async fn expire(&self, job: JobId, generation: Generation) -> Result<(), Box<dyn Error>> {
        let jobs = format!("{}.jobs", self.store.schema().quoted());
        let expiries = format!("{}.lease_expiries", self.store.schema().quoted());
        // A renewal may slip in between the two statements; then try again.
        for _ in 0..100 {
            sqlx::query(&format!(
                "UPDATE {jobs} SET lease_until = now() - interval '1 second' \
                 WHERE id = $1 AND generation = $2 AND state = 'running'"
            ))
            .bind(job.0)
            .bind(generation.0)
            .execute(self.store.pool())
            .await?;
            self.store
                .reap(&self.owner, &self.backoff, 100, None)
                .await?;
            let reaped: bool = sqlx::query_scalar(&format!(
                "SELECT EXISTS (SELECT 1 FROM {expiries} WHERE job_id = $1 AND generation = $2)"
            ))
            .bind(job.0)
            .bind(generation.0)
            .fetch_one(self.store.pool())
            .await?;
            if reaped {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err("the lease kept being renewed".into())
    }
}

// ---------------------------------------------------------------------------------
// The fault plan: the same in both runs.
// ---------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Injected {
    StallPastLease,
    CrashAfterCharge,
    DropReply,
    GatewayFail,
    GatewayStall,
}

impl Injected {
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Injected::StallPastLease => "worker stalls past its lease right after charging",
            Injected::CrashAfterCharge => "worker crashes after charging, before recording",
            Injected::DropReply => "gateway applies the charge and drops the reply",
            Injected::GatewayFail => "gateway fails the request (nothing charged)",
            Injected::GatewayStall => "gateway stalls past the client's 500ms timeout",
        }
    }
}

/// (account, payment seq, fault): spread over accounts and positions.
pub(crate) fn fault_plan() -> Vec<(u32, u32, Injected)> {
    use Injected::*;
    vec![
        (2, 3, StallPastLease),
        (7, 6, StallPastLease),
        (15, 9, StallPastLease),
        (4, 2, CrashAfterCharge),
        (11, 5, CrashAfterCharge),
        (18, 8, CrashAfterCharge),
        (1, 4, DropReply),
        (9, 7, DropReply),
        (13, 1, DropReply),
        (5, 5, GatewayFail),
        (17, 2, GatewayFail),
        (6, 3, GatewayStall),
        (12, 10, GatewayStall),
    ]
}

pub(crate) fn worker_faults() -> HashMap<String, WorkerFault> {
    fault_plan()
        .into_iter()
        .filter_map(|(a, s, f)| {
            let fault = match f {
                Injected::StallPastLease => WorkerFault::StallPastLease,
                Injected::CrashAfterCharge => WorkerFault::CrashAfterCharge,
                _ => return None,
            };
            Some((reference(&account(a), s), fault))
        })
        .collect()
}

pub(crate) fn gateway_faults() -> FaultSchedule {
    fault_plan()
        .into_iter()
        .fold(FaultSchedule::new(), |schedule, (a, s, f)| {
            let fault = match f {
                Injected::DropReply => Fault::DropReply,
                Injected::GatewayFail => Fault::Fail("card network unavailable".into()),
                Injected::GatewayStall => Fault::Stall(GATEWAY_STALL),
                _ => return schedule,
            };
            schedule.on(reference(&account(a), s), 1, fault)
        })
}
