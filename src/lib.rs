#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod actor;
#[cfg(feature = "cli")]
pub mod cli;
pub mod config;
pub mod context;
mod env;
pub mod error;
mod executor;
pub mod handler;
pub mod job;
pub mod metrics;
pub mod periodic;
#[cfg(feature = "prometheus")]
pub mod prometheus;
pub mod scheduler;
pub mod store;
#[cfg(feature = "testkit")]
pub mod testkit;
#[cfg(feature = "actix-web")]
pub mod web;

pub use config::{Config, RetryPolicy};
pub use context::{CancelReason, EffectKey, JobContext};
pub use error::{Error, Result};
pub use handler::{Handler, JobError, KindPolicy, RetryDelay};
pub use job::{
    Attempt, ClaimedJob, CompleteOutcome, DeadKeyPolicy, EffectIdentity, Enqueued, FailOutcome,
    Fence, FenceOutcome, Generation, JobEvent, JobId, JobRecord, JobState, NewJob, OwnerId, Unique,
    UniqueScope,
};
pub use metrics::MetricsSnapshot;
pub use periodic::{CatchUp, Periodic};
pub use scheduler::{Scheduler, SchedulerBuilder, ShutdownReport};
pub use store::{Backoff, CancelOutcome, ClaimRequest, Failure, Store, StoreOptions};
