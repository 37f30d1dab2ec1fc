//! A payment gateway simulator on loopback TCP: the external effect store of the tests
//! and of `examples/payments.rs`.
//!
//! # Behaviour
//! Like real gateways, it deduplicates charges by idempotency key: the same key with the
//! same request returns the original receipt ([`ChargeResult::Duplicate`]) instead of
//! charging again; the same key with another request is refused
//! ([`ChargeResult::Mismatch`]). It can also fence: a request whose fencing token is
//! lower than the highest token it has seen for the account is refused
//! ([`ChargeResult::Fenced`]) before anything else is looked at. Both can be switched
//! off ([`GatewayConfig`]) so a negative control can see what they prevent.
//!
//! # Faults
//! A request can carry a [`Fault`], or a [`FaultSchedule`] picks requests by their
//! reference and occurrence: stall before deciding, apply and then close the connection
//! without answering (the client sees [`GatewayError::DroppedReply`]), or fail without
//! applying.
//!
//! # Log and counts
//! Every charge request is logged with its decision, in decision order
//! ([`Gateway::log`]), and counted ([`Gateway::counts`]): requested, applied,
//! duplicates suppressed, fenced, mismatched, failed, replies dropped.
//!
//! # Protocol
//! One JSON object per line each way, one connection per request (the client's choice;
//! the server answers any number of lines per connection):
//!
//! ```text
//! → {"op":"charge","key":"0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c2a/17/charge","token":8,"request":{"account":"acct-01","amount_cents":1250,"reference":"acct-01/003"},"fault":null}
//! ← {"result":"applied","receipt":{"charge_id":3,"idempotency_key":"0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c2a/17/charge",...}}
//! → {"op":"lookup","key":"0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c2a/17/charge"}
//! ← {"result":"found","receipt":{...}}            (receipt null if never applied)
//! ```
//!
//! # Lifecycle
//! [`Gateway::start`] binds `127.0.0.1:0` and serves on its own thread with its own
//! tokio runtime, so it works the same under actix and under `#[tokio::test]`, and a
//! stalled request never stalls the caller's runtime. Dropping the handle (or
//! [`Gateway::shutdown`]) stops it and drops open connections.

mod client;
mod server;
mod wire;

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::handler::JobError;

pub use client::{GatewayClient, GatewayError, DEFAULT_CLIENT_TIMEOUT};
pub use server::{Gateway, SERVER_IDLE_TIMEOUT};
pub use wire::MAX_LINE_BYTES;

/// What to charge. Two requests are "the same" when all three fields are equal; the
/// fencing token is not part of the request (every attempt carries its own).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChargeRequest {
    /// The account charged; fencing tokens are compared per account.
    pub account: String,
    /// The amount, in cents.
    pub amount_cents: i64,
    /// The caller's reference for this payment (shown in the log; faults match on it).
    pub reference: String,
}

/// Proof of one applied charge.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    /// Unique per applied charge, from 1.
    pub charge_id: u64,
    /// The key the charge was applied under.
    pub idempotency_key: String,
    /// The account charged.
    pub account: String,
    /// The amount charged, in cents.
    pub amount_cents: i64,
    /// The request's reference.
    pub reference: String,
    /// The token of the request that applied it.
    pub fencing_token: Option<u64>,
}

/// The gateway's answer to a charge request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ChargeResult {
    /// This request charged the account.
    Applied(Receipt),
    /// The key was charged before with the same request: its receipt, nothing charged.
    Duplicate(Receipt),
    /// The request's token is older than one already seen for the account: refused,
    /// nothing charged. Whoever sent it has been superseded.
    Fenced {
        /// The highest token the gateway had seen for the account.
        seen: u64,
        /// The request's token.
        got: u64,
    },
    /// The key was charged before with a different request: refused, nothing charged.
    Mismatch,
    /// The gateway failed the request without charging (an injected failure).
    Failed(String),
}

impl ChargeResult {
    /// The receipt of the charge, if the account was (or had been) charged under this key.
    pub fn receipt(&self) -> Option<&Receipt> {
        match self {
            ChargeResult::Applied(r) | ChargeResult::Duplicate(r) => Some(r),
            _ => None,
        }
    }

    /// The usual handler mapping: a receipt is success; a fenced request means this
    /// attempt was superseded and a failure is transient (both retryable: a retry finds
    /// the outcome by its effect key); a mismatch is a bug no retry can fix (permanent).
    pub fn into_job_result(self) -> Result<Receipt, JobError> {
        match self {
            ChargeResult::Applied(r) | ChargeResult::Duplicate(r) => Ok(r),
            ChargeResult::Fenced { seen, got } => Err(JobError::retry(format!(
                "gateway refused fencing token {got}: it has seen {seen} for this account"
            ))),
            ChargeResult::Mismatch => Err(JobError::permanent(
                "gateway refused the charge: its idempotency key was used for a different request",
            )),
            ChargeResult::Failed(reason) => Err(JobError::retry(format!(
                "gateway failed the charge: {reason}"
            ))),
        }
    }
}

/// A fault to inject into one charge request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// Wait this long before deciding (a slow gateway; the client may time out first).
    Stall(Duration),
    /// Decide (and apply, if the request is applicable), then close the connection
    /// without replying.
    DropReply,
    /// Answer [`ChargeResult::Failed`] without applying.
    Fail(String),
}

/// Faults picked by request: the `occurrence`-th charge request (from 1) carrying
/// `reference`. Matching on the reference, not the idempotency key, keeps a schedule
/// the same whatever keys the client derives.
#[derive(Clone, Debug, Default)]
pub struct FaultSchedule {
    rules: Vec<FaultRule>,
}

#[derive(Clone, Debug)]
struct FaultRule {
    reference: String,
    occurrence: u32,
    fault: Fault,
}

impl FaultSchedule {
    /// No faults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Inject `fault` into the `occurrence`-th request (from 1) for `reference`.
    pub fn on(mut self, reference: impl Into<String>, occurrence: u32, fault: Fault) -> Self {
        self.rules.push(FaultRule {
            reference: reference.into(),
            occurrence,
            fault,
        });
        self
    }

    /// Faults scheduled.
    pub fn len(&self) -> usize {
        self.rules.len()
    }

    /// True when no fault is scheduled.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    fn pick(&self, reference: &str, occurrence: u32) -> Option<Fault> {
        self.rules
            .iter()
            .find(|r| r.reference == reference && r.occurrence == occurrence)
            .map(|r| r.fault.clone())
    }
}

/// What the gateway enforces.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Deduplicate by idempotency key. Default true. Off, every request that passes the
    /// fencing check is applied (lookups still work): the negative control.
    pub idempotency: bool,
    /// Refuse tokens lower than the highest seen for the account. Default true.
    /// Requests without a token are never fenced.
    pub fencing: bool,
    /// Injected faults. Default none.
    pub faults: FaultSchedule,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            idempotency: true,
            fencing: true,
            faults: FaultSchedule::default(),
        }
    }
}

/// The gateway's decision about one charge request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Decision {
    /// Charged ([`ChargeResult::Applied`]).
    Applied,
    /// Answered with the earlier receipt of the same key and request
    /// ([`ChargeResult::Duplicate`]).
    Duplicate,
    /// Refused for an old fencing token ([`ChargeResult::Fenced`]).
    Fenced,
    /// Refused: the key was used with another request ([`ChargeResult::Mismatch`]).
    Mismatch,
    /// Failed by an injected fault, nothing charged ([`ChargeResult::Failed`]).
    Failed,
}

/// One charge request as the gateway decided it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogEntry {
    /// Position in decision order, from 1.
    pub n: u64,
    /// The request's idempotency key.
    pub idempotency_key: String,
    /// What was asked.
    pub request: ChargeRequest,
    /// The request's fencing token; `None` if it carried none (never fenced).
    pub fencing_token: Option<u64>,
    /// What the gateway decided.
    pub decision: Decision,
    /// The charge applied, or the one a duplicate returned.
    pub charge_id: Option<u64>,
    /// The injected fault, if any.
    pub fault: Option<Fault>,
}

/// The gateway's own figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GatewayCounts {
    /// Charge requests received (every decision below, and those still stalled).
    pub requested: u64,
    /// Charges applied: money moved.
    pub applied: u64,
    /// Requests answered with an earlier receipt (same key, same request).
    pub duplicates: u64,
    /// Requests refused for an old fencing token.
    pub fenced: u64,
    /// Requests refused for reusing a key with another request.
    pub mismatches: u64,
    /// Requests failed by an injected fault.
    pub failed: u64,
    /// Replies dropped by an injected fault (the request was decided first).
    pub replies_dropped: u64,
    /// Requests stalled by an injected fault.
    pub stalled: u64,
}
