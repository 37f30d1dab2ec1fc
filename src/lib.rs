#![doc = include_str!("../README.md")]

pub mod config;
pub mod error;
pub mod job;
pub mod store;

pub use config::{Config, RetryPolicy};
pub use error::{Error, Result};
pub use job::{
    ClaimedJob, CompleteOutcome, DeadKeyPolicy, FailOutcome, Fence, FenceOutcome, Generation,
    JobEvent, JobId, JobRecord, JobState, NewJob, OwnerId,
};
pub use store::{Backoff, ClaimRequest, Failure, Store, StoreOptions};
