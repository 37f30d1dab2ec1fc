//! Completer: batches fenced completions into one statement.
//!
//! # Messages
//! - [`Complete`]: a finished attempt's result; the reply comes on its oneshot.
//! - [`super::Stop`]: write what is buffered and stop (shutdown).
//!
//! # Lifecycle
//! Group commit: when no batch is being written, a completion is written at once
//! (waiting would only add latency); completions that arrive while a batch is in flight
//! are buffered and written together as soon as it returns, so batches grow with the
//! load by themselves. A further batch starts alongside (at most
//! [`MAX_WRITES_IN_FLIGHT`]) when `completion_batch` completions are buffered, or when the
//! oldest has waited `completion_flush` for a slow write.
//!
//! # Failure
//! A failed batch replies the error to each waiter; the executor retries its own
//! completion directly (the read-back makes that idempotent).

use std::sync::Arc;

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::error::{Error, Result};
use crate::job::{ClaimedJob, CompleteOutcome, Fence, OwnerId};
use crate::metrics::{MailboxMeter, Metrics};
use crate::store::{Chain, Store};

/// Batches written at once, at most: enough to overlap a slow statement, few enough
/// that batches stay large under load.
pub(crate) const MAX_WRITES_IN_FLIGHT: usize = 2;

/// Complete one job (fenced) and reply on `reply`.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Complete {
    pub fence: Fence,
    /// The job has a key: its completion must promote the successor, in a transaction.
    pub keyed: bool,
    /// Claim the key's promoted successor in that transaction too, for the sequencer
    /// that waits on this reply (it runs it with the slot it holds).
    pub chain: bool,
    pub result: Option<serde_json::Value>,
    pub reply: oneshot::Sender<Result<Completed>>,
}

/// The outcome, and the key's successor when one was claimed for the sender.
pub(crate) type Completed = (CompleteOutcome, Option<ClaimedJob>);

pub(crate) struct Completer {
    store: Store,
    owner: OwnerId,
    kinds: Arc<[String]>,
    lease: std::time::Duration,
    batch: usize,
    flush_every: std::time::Duration,
    buffer: Vec<Complete>,
    /// Batches being written now.
    writing: usize,
    timer: Option<SpawnHandle>,
    meter: Arc<MailboxMeter>,
    metrics: Arc<Metrics>,
    capacity: usize,
}

impl Completer {
    pub fn new(
        store: Store,
        owner: OwnerId,
        kinds: Vec<String>,
        config: &crate::Config,
        metrics: Arc<Metrics>,
    ) -> Self {
        Completer {
            store,
            owner,
            kinds: kinds.into(),
            lease: config.lease,
            batch: config.completion_batch,
            flush_every: config.completion_flush,
            buffer: Vec::new(),
            writing: 0,
            timer: None,
            meter: metrics.meter("completer"),
            metrics,
            capacity: config.mailbox_capacity,
        }
    }

    /// Write a batch if the batcher is idle, a full batch is buffered, or `forced` (the
    /// flush timer fired), within [`MAX_WRITES_IN_FLIGHT`].
    fn write(&mut self, ctx: &mut Context<Self>, forced: bool) {
        if self.buffer.is_empty() {
            return;
        }
        let may = self.writing == 0
            || (self.writing < MAX_WRITES_IN_FLIGHT && (forced || self.buffer.len() >= self.batch));
        if !may {
            self.arm_timer(ctx);
            return;
        }
        if let Some(t) = self.timer.take() {
            ctx.cancel_future(t);
        }
        self.writing += 1;
        let take = self.buffer.len().min(self.batch);
        let batch: Vec<Complete> = self.buffer.drain(..take).collect();
        let items: Vec<_> = batch
            .iter()
            .map(|c| (c.fence.job, c.fence.generation, c.result.clone()))
            .collect();
        let keyed = batch.iter().any(|c| c.keyed);
        let chain_wanted: Vec<bool> = batch.iter().map(|c| c.chain).collect();
        let store = self.store.clone();
        let owner = self.owner.clone();
        let kinds = self.kinds.clone();
        let lease = self.lease;
        let metrics = self.metrics.clone();
        self.metrics.incr(|c| &c.completion_batches);
        ctx.spawn(
            async move {
                let written = if keyed {
                    let chain = Chain {
                        owner: &owner,
                        kinds: &kinds,
                        lease,
                    };
                    store
                        .complete_many_chained(&owner, &items, &chain_wanted, Some(&chain))
                        .await
                } else {
                    store
                        .complete_unkeyed(&owner, &items)
                        .await
                        .map(|o| o.into_iter().map(|o| (o, None)).collect())
                };
                match written {
                    Ok(outcomes) => {
                        for (c, o) in batch.into_iter().zip(outcomes) {
                            if let Err(Ok((_, Some(next)))) = c.reply.send(Ok(o)) {
                                // Its sequencer is gone: give the successor back at once.
                                let held = [(next.id, next.generation)];
                                let _ = store.release_many(&owner, &held, "chained successor had no taker").await;
                            }
                        }
                    }
                    Err(e) => {
                        metrics.incr(|c| &c.db_errors);
                        tracing::warn!(error = %e, n = batch.len(), "leasehold completion batch failed");
                        let text = e.to_string();
                        for c in batch {
                            let _ = c.reply.send(Err(Error::Database(sqlx::Error::Protocol(text.clone()))));
                        }
                    }
                }
            }
            .into_actor(self)
            .map(|_, act, ctx| {
                act.writing -= 1;
                act.write(ctx, false);
            }),
        );
        if !self.buffer.is_empty() {
            self.write(ctx, false);
        }
    }

    /// While a batch is in flight, what is buffered waits at most `completion_flush`.
    fn arm_timer(&mut self, ctx: &mut Context<Self>) {
        if self.timer.is_none() {
            self.timer = Some(ctx.run_later(self.flush_every, |act, ctx| {
                act.timer = None;
                act.write(ctx, true);
            }));
        }
    }
}

impl Actor for Completer {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.capacity);
    }
}

impl Handler<Complete> for Completer {
    type Result = ();

    fn handle(&mut self, msg: Complete, ctx: &mut Self::Context) {
        let _m = self.meter.handling();
        self.buffer.push(msg);
        self.write(ctx, false);
    }
}

impl Handler<super::Stop> for Completer {
    type Result = ();

    fn handle(&mut self, _: super::Stop, ctx: &mut Self::Context) {
        let _m = self.meter.handling();
        // Executions await their replies, so by shutdown the buffer is empty; write
        // anything left before stopping all the same.
        self.write(ctx, true);
        ctx.stop();
    }
}
