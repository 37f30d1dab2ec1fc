//! Completer: batches fenced completions into one statement.
//!
//! # Messages
//! - [`Complete`]: a finished attempt's result; the reply comes on its oneshot.
//! - [`super::Stop`]: write what is buffered and stop (shutdown).
//!
//! # Lifecycle
//! A completion waits at most `completion_flush` (or until `completion_batch` are
//! buffered). One batch is written at a time; what arrives meanwhile goes in the next.
//!
//! # Failure
//! A failed batch replies the error to each waiter; the executor retries its own
//! completion directly (the read-back makes that idempotent).

use std::sync::Arc;

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::error::{Error, Result};
use crate::job::{CompleteOutcome, Fence, OwnerId};
use crate::metrics::{MailboxMeter, Metrics};
use crate::store::Store;

/// Complete one job (fenced) and reply on `reply`.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Complete {
    pub fence: Fence,
    pub result: Option<serde_json::Value>,
    pub reply: oneshot::Sender<Result<CompleteOutcome>>,
}

pub(crate) struct Completer {
    store: Store,
    owner: OwnerId,
    batch: usize,
    flush_every: std::time::Duration,
    buffer: Vec<Complete>,
    writing: bool,
    timer: Option<SpawnHandle>,
    meter: Arc<MailboxMeter>,
    metrics: Arc<Metrics>,
    capacity: usize,
}

impl Completer {
    pub fn new(
        store: Store,
        owner: OwnerId,
        config: &crate::Config,
        metrics: Arc<Metrics>,
    ) -> Self {
        Completer {
            store,
            owner,
            batch: config.completion_batch,
            flush_every: config.completion_flush,
            buffer: Vec::new(),
            writing: false,
            timer: None,
            meter: metrics.meter("completer"),
            metrics,
            capacity: config.mailbox_capacity,
        }
    }

    fn write(&mut self, ctx: &mut Context<Self>) {
        if self.writing || self.buffer.is_empty() {
            return;
        }
        if let Some(t) = self.timer.take() {
            ctx.cancel_future(t);
        }
        self.writing = true;
        let take = self.buffer.len().min(self.batch);
        let batch: Vec<Complete> = self.buffer.drain(..take).collect();
        let items: Vec<_> = batch
            .iter()
            .map(|c| (c.fence.job, c.fence.generation, c.result.clone()))
            .collect();
        let store = self.store.clone();
        let owner = self.owner.clone();
        let metrics = self.metrics.clone();
        ctx.spawn(
            async move {
                match store.complete_many(&owner, &items).await {
                    Ok(outcomes) => {
                        for (c, o) in batch.into_iter().zip(outcomes) {
                            let _ = c.reply.send(Ok(o));
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
                act.writing = false;
                if act.buffer.len() >= act.batch {
                    act.write(ctx);
                } else if !act.buffer.is_empty() {
                    act.arm_timer(ctx);
                }
            }),
        );
    }

    fn arm_timer(&mut self, ctx: &mut Context<Self>) {
        if self.timer.is_none() {
            self.timer = Some(ctx.run_later(self.flush_every, |act, ctx| {
                act.timer = None;
                act.write(ctx);
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
        if self.buffer.len() >= self.batch {
            self.write(ctx);
        } else {
            self.arm_timer(ctx);
        }
    }
}

impl Handler<super::Stop> for Completer {
    type Result = ();

    fn handle(&mut self, _: super::Stop, ctx: &mut Self::Context) {
        let _m = self.meter.handling();
        // Executions await their replies, so by shutdown the buffer is empty; write
        // anything left before stopping all the same.
        self.write(ctx);
        ctx.stop();
    }
}
