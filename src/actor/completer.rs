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
//! Unkeyed completions are written by one statement that never touches a key row;
//! keyed ones in a transaction that locks their key rows first, skipping the key rows a
//! host's open transaction holds. A batch waits at most one turn ([`KEY_TURN`]) for a job
//! row another session holds (a claim passing over it holds it for a moment; a report's
//! `SELECT … FOR UPDATE` for long), and is then written again skipping such rows. The
//! rows skipped are written afterwards, each alone, waiting for its own row in turns on
//! all but one of the writer's connections (the last one writes the other endings), each
//! turn at most [`KEY_TURN`]; one whose turn runs out
//! is tried again by its sender after a pause (it renews its lease meanwhile). So no
//! completion waits behind a row that is not its own for more than a few short turns.
//! Both halves were found by the fault harness, each as a finished job's ending that
//! landed after its lease: with turns of the session's whole `lock_timeout` (250 ms),
//! keys held for long took every turn and a key held for a moment waited behind all of
//! them (2.2 s); when the batch statements waited the whole lock timeout for job rows,
//! every batch that carried a held job's retried ending waited it out (2.5 s, seed
//! 20261207). A turn still waits in the lock's queue, so a key that producers lock again
//! and again for a moment each is completed in order, never starved.
//!
//! # Failure
//! A batch that fails on a lost connection replies the error to each waiter; the
//! executor retries its own completion (the read-back makes that idempotent). A batch
//! the database refused is written again one completion at a time, so one bad row
//! fails only its own job.

use std::sync::Arc;
use std::time::Instant;

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::error::{Error, Result};
use crate::job::{ClaimedJob, CompleteOutcome, Fence, OwnerId};
use crate::metrics::{MailboxMeter, Metrics};
use crate::store::{Chain, KeyedItem, KeyedWait, RowWait, Store};

/// Batches written at once, at most: enough to overlap a slow statement, few enough
/// that batches stay large under load.
pub(crate) const MAX_WRITES_IN_FLIGHT: usize = 2;

/// Completions that wait for a row another session holds at once: all but one of the
/// writer's connections (at least one), so one always writes the other endings.
pub(crate) fn row_waiters(connections: u32) -> usize {
    (connections as usize).saturating_sub(1).max(1)
}

/// The longest a completion waits for its key row or job row in one turn (or
/// `Config::writer_lock_wait`, when shorter): long enough for a producer's enqueue that
/// holds the row for a moment, short enough that turns behind keys held for long pass
/// quickly.
pub(crate) const KEY_TURN: std::time::Duration = std::time::Duration::from_millis(25);

/// One turn of waiting for a row another session holds: [`KEY_TURN`], or
/// `Config::writer_lock_wait` when shorter.
pub(crate) fn turn(config: &crate::Config) -> std::time::Duration {
    config.writer_lock_wait.min(KEY_TURN)
}

/// Complete one job (fenced) and reply on `reply`.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Complete {
    pub fence: Fence,
    /// The job's (queue, key): its completion must leave the key and promote the
    /// successor, in a transaction.
    pub key: Option<(String, String)>,
    /// Claim the key's promoted successor in that transaction too, for the sequencer
    /// that waits on this reply (it runs it with the slot it holds).
    pub chain: bool,
    pub result: Option<serde_json::Value>,
    pub reply: oneshot::Sender<Result<Completed>>,
}

/// The outcome, and the key's successor when one was claimed for the sender, with the
/// moment the claiming statement was sent (its lease counts from then).
pub(crate) struct Completed {
    pub outcome: CompleteOutcome,
    pub successor: Option<(ClaimedJob, Instant)>,
}

pub(crate) struct Completer {
    store: Store,
    owner: OwnerId,
    kinds: Arc<[String]>,
    lease: std::time::Duration,
    batch: usize,
    flush_every: std::time::Duration,
    buffer: Vec<Complete>,
    /// See [`Writer::row_waits`].
    row_waits: Arc<tokio::sync::Semaphore>,
    /// See [`Writer::turn`].
    turn: std::time::Duration,
    /// Batches being written now.
    writing: usize,
    timer: Option<SpawnHandle>,
    meter: Arc<MailboxMeter>,
    metrics: Arc<Metrics>,
    capacity: usize,
}

/// What the completer needs to write batches, off the actor.
#[derive(Clone)]
struct Writer {
    store: Store,
    /// Completions that must wait for a row (a host's transaction holds their key, a
    /// session their job's row) take turns on all but one of the writer's connections, so
    /// however many rows others hold, one connection of the writer pool stays free for
    /// every other job's ending.
    row_waits: Arc<tokio::sync::Semaphore>,
    /// The longest one waits in its turn: [`KEY_TURN`], or `Config::writer_lock_wait`
    /// when shorter.
    turn: std::time::Duration,
    owner: OwnerId,
    kinds: Arc<[String]>,
    lease: std::time::Duration,
    metrics: Arc<Metrics>,
}

impl Completer {
    pub fn new(
        store: Store,
        owner: OwnerId,
        kinds: Vec<String>,
        config: &crate::Config,
        metrics: Arc<Metrics>,
        row_waits: Arc<tokio::sync::Semaphore>,
    ) -> Self {
        Completer {
            store,
            owner,
            kinds: kinds.into(),
            lease: config.lease,
            batch: config.completion_batch,
            flush_every: config.completion_flush,
            buffer: Vec::new(),
            row_waits,
            turn: turn(config),
            writing: 0,
            timer: None,
            meter: metrics.meter("completer"),
            metrics,
            capacity: config.mailbox_capacity,
        }
    }

    fn writer(&self) -> Writer {
        Writer {
            store: self.store.clone(),
            row_waits: self.row_waits.clone(),
            turn: self.turn,
            owner: self.owner.clone(),
            kinds: self.kinds.clone(),
            lease: self.lease,
            metrics: self.metrics.clone(),
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
        self.metrics.incr(|c| &c.completion_batches);
        let writer = self.writer();
        ctx.spawn(
            async move { writer.write(batch).await }
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

impl Writer {
    /// Write a batch: the unkeyed completions in one statement that touches no key row,
    /// the keyed ones in a transaction alongside it. Completions whose key row or job row
    /// another session holds are written afterwards, each waiting in a transaction of its
    /// own, so the rest of the batch never waits behind them.
    async fn write(self, batch: Vec<Complete>) {
        let (keyed, unkeyed): (Vec<Complete>, Vec<Complete>) =
            batch.into_iter().partition(|c| c.key.is_some());
        let (busy_unkeyed, busy_keyed) = futures_util::future::join(
            self.write_unkeyed(unkeyed, false),
            self.write_keyed(keyed, false),
        )
        .await;
        // Each alone, each taking its own turns: a statement for all of them would wait
        // on the first row held and, timed out, write them one by one all the same,
        // replying to the last only after every turn before it.
        for (c, keyed) in busy_unkeyed
            .into_iter()
            .map(|c| (c, false))
            .chain(busy_keyed.into_iter().map(|c| (c, true)))
        {
            let writer = self.clone();
            tokio::spawn(async move {
                let left = match keyed {
                    true => writer.write_keyed(vec![c], true).await,
                    false => writer.write_unkeyed(vec![c], true).await,
                };
                debug_assert!(left.is_empty(), "a waiting write leaves nothing behind");
            });
        }
    }

    /// Returns the completions whose job row another session held (only when `wait` is
    /// false).
    async fn write_unkeyed(&self, batch: Vec<Complete>, wait: bool) -> Vec<Complete> {
        if batch.is_empty() {
            return batch;
        }
        let items: Vec<_> = batch
            .iter()
            .map(|c| (c.fence.attempt(), c.result.clone()))
            .collect();
        let written = match wait {
            true => {
                let _turn = self.row_waits.acquire().await.expect("never closed");
                let rows = RowWait::AtMost(self.turn);
                self.store.complete_unkeyed(&self.owner, &items, rows).await
            }
            false => {
                self.skipping_after_a_turn(|rows| {
                    self.store.complete_unkeyed(&self.owner, &items, rows)
                })
                .await
            }
        };
        match written {
            Ok(outcomes) => {
                let mut busy = Vec::new();
                for (c, outcome) in batch.into_iter().zip(outcomes) {
                    match outcome {
                        None => busy.push(c),
                        Some(outcome) => {
                            let _ = c.reply.send(Ok(Completed {
                                outcome,
                                successor: None,
                            }));
                        }
                    }
                }
                busy
            }
            Err(e) => {
                self.failed(batch, e, false).await;
                Vec::new()
            }
        }
    }

    /// A batch's write: it waits a turn for the job rows other sessions hold, and when
    /// the turn runs out it is written again skipping them (they come back busy). Not
    /// skipping at once: a claim's scan holds for a moment every row it passes over,
    /// running jobs' rows among them, so a batch that skipped at once found a tenth of its
    /// rows busy under load and wrote them again alone (measured: a tenth of the
    /// throughput). A row held for longer than a turn (a report's `SELECT … FOR UPDATE`)
    /// costs its batch one turn, not the writer's whole `lock_timeout`.
    async fn skipping_after_a_turn<T, F, Fut>(&self, write: F) -> Result<T>
    where
        F: Fn(RowWait) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        match write(RowWait::AtMost(self.turn)).await {
            Err(e) if e.is_lock_wait() => {
                tracing::debug!(error = %e, "leasehold completion batch met a held row; written again skipping held rows");
                write(RowWait::Skip).await
            }
            other => other,
        }
    }

    /// Returns the completions whose key row or job row another session held (only when
    /// `wait` is false).
    async fn write_keyed(&self, batch: Vec<Complete>, wait: bool) -> Vec<Complete> {
        if batch.is_empty() {
            return batch;
        }
        let items: Vec<KeyedItem> = batch
            .iter()
            .map(|c| KeyedItem {
                item: (c.fence.attempt(), c.result.clone()),
                key: c.key.clone().expect("keyed completions have a key"),
                chain: c.chain,
            })
            .collect();
        let chain = Chain {
            owner: &self.owner,
            kinds: &self.kinds,
            lease: self.lease,
        };
        let written = match wait {
            // The permit is let go before a failed wait is written again one by one
            // (which waits again).
            true => {
                let _turn = self.row_waits.acquire().await.expect("never closed");
                let turn = RowWait::AtMost(self.turn);
                let wait = KeyedWait {
                    keys: turn,
                    rows: turn,
                };
                self.store
                    .complete_keyed(&self.owner, &items, Some(&chain), wait)
                    .await
            }
            false => {
                self.skipping_after_a_turn(|rows| {
                    let wait = KeyedWait {
                        keys: RowWait::Skip,
                        rows,
                    };
                    self.store
                        .complete_keyed(&self.owner, &items, Some(&chain), wait)
                })
                .await
            }
        };
        match written {
            Ok(outcomes) => {
                let mut busy = Vec::new();
                for (c, (outcome, next)) in batch.into_iter().zip(outcomes) {
                    match outcome {
                        None => busy.push(c),
                        Some(outcome) => self.reply(c, outcome, next).await,
                    }
                }
                busy
            }
            Err(e) => {
                self.failed(batch, e, true).await;
                Vec::new()
            }
        }
    }

    async fn reply(
        &self,
        c: Complete,
        outcome: CompleteOutcome,
        successor: Option<(ClaimedJob, Instant)>,
    ) {
        if let Err(Ok(Completed {
            successor: Some((next, _)),
            ..
        })) = c.reply.send(Ok(Completed { outcome, successor }))
        {
            // Its sequencer is gone: give the successor back at once.
            let held = [next.attempt()];
            let _ = self
                .store
                .release_many(&self.owner, &held, "chained successor had no taker")
                .await;
        }
    }

    /// A batch statement failed. On an error that may pass (a lost connection, a
    /// deadlock) every sender retries its own write. Any other error is a statement the database refused: write each completion
    /// alone, so whatever caused it fails only its own job, never its neighbours.
    ///
    /// A lock wait that timed out (a host's transaction holds a row or a key of the
    /// batch) is written one completion at a time too, so only the completion whose row
    /// is held waits; that one gets the database's error itself, and its sender tries
    /// again after a pause (see `executor::with_retries`).
    async fn failed(&self, mut batch: Vec<Complete>, e: Error, keyed: bool) {
        self.metrics.incr(|c| &c.db_errors);
        if e.is_lock_wait() {
            tracing::debug!(error = %e, n = batch.len(), "leasehold completion waited too long for a lock");
            if batch.len() == 1 {
                let c = batch.pop().expect("one completion");
                let _ = c.reply.send(Err(e));
                return;
            }
        } else {
            tracing::warn!(error = %e, n = batch.len(), "leasehold completion batch failed");
        }
        if (e.is_transient() && !e.is_lock_wait()) || batch.len() == 1 {
            let reason = e.to_string();
            let transient = e.is_transient();
            for c in batch {
                let _ = c.reply.send(Err(Error::Batch {
                    reason: reason.clone(),
                    transient,
                }));
            }
            return;
        }
        for c in batch {
            if keyed {
                let left = Box::pin(self.write_keyed(vec![c], true)).await;
                debug_assert!(left.is_empty());
            } else {
                let left = Box::pin(self.write_unkeyed(vec![c], true)).await;
                debug_assert!(left.is_empty());
            }
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
