//! Test and example support: not part of the scheduler, and nothing in leasehold uses it.
//!
//! The tests and `examples/payments.rs` need an external effect store that behaves like
//! a real one, and a way to drive the effect helpers of [`JobContext`] from a job
//! claimed through the [`Store`] directly (without the actor runtime, so a test can
//! stop time between two steps).
//!
//! - [`gateway`]: a payment gateway simulator on loopback TCP, with idempotency keys,
//!   fencing tokens per account, injected faults, and a log of every decision.
//! - [`attempt_context`]: the [`JobContext`] the scheduler would hand the handler of
//!   a claimed job.
//! - [`fencing_token`]: a token for an effect store that fences per account.
//! - [`clock`]: a database clock a test shifts (daylight-saving nights, skew).

pub mod clock;
pub mod gateway;

use crate::config::DEFAULT_EFFECT_KEEP;
use crate::context::JobContext;
use crate::job::ClaimedJob;
use crate::store::Store;

/// The context the scheduler would give the handler of `job`, for a test or tool that
/// claimed it with [`Store::claim`] itself. Effects are recorded through `store` with
/// the default ledger retention. Nothing cancels it: there is no lease renewer, and its
/// local lease deadline lies a year ahead.
pub fn attempt_context(job: ClaimedJob, store: Store) -> JobContext {
    let far = std::time::Instant::now() + std::time::Duration::from_secs(365 * 24 * 3600);
    JobContext::new(job, store, DEFAULT_EFFECT_KEEP, far)
}

/// The fencing token of `job`'s attempt; see [`ClaimedJob::fencing_token`].
pub fn fencing_token(job: &ClaimedJob) -> u64 {
    job.fencing_token()
}
