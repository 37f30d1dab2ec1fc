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

/// A fencing token for an effect store that fences per resource, where the resource is
/// the job's key (an account): the key's sequence number in the high 32 bits and the
/// generation in the low 32 bits.
///
/// The generation alone only grows within one job; the next payment of the same account
/// starts again at generation 1 and would be refused by a store that has seen
/// generation 2 of the previous payment. Jobs of one key run one at a time in `key_seq`
/// order, so `(key_seq, generation)` only grows across all of the key's attempts. An
/// unkeyed job's token is its generation.
pub fn fencing_token(job: &ClaimedJob) -> u64 {
    let generation = job.generation.0 as u64 & 0xffff_ffff;
    match job.key_seq {
        Some(seq) => ((seq as u64) << 32) | generation,
        None => generation,
    }
}
