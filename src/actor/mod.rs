//! The actors of a scheduler, one per file.
//!
//! | actor          | arbiter      | does                                                        |
//! |----------------|--------------|-------------------------------------------------------------|
//! | `Claimer`      | host's       | short claim statements; hands keyed jobs to sequencers      |
//! | `Sequencer`    | host's       | one per active key: runs its jobs one at a time, in order   |
//! | `Completer`    | host's       | batches fenced completions into one statement               |
//! | `LeaseRenewer` | maintenance  | extends leases in batches; fires cancellation when lost     |
//! | `Reaper`       | maintenance  | takes back expired leases; applies the retention policy     |
//! | listener task  | maintenance  | LISTEN for wake-ups, reconnecting after a drop              |
//!
//! The maintenance arbiter is its own thread with its own small pool, so a handler that
//! hogs the host's thread cannot starve lease renewal.

pub(crate) mod claimer;
pub(crate) mod completer;
pub(crate) mod dispatch;
pub(crate) mod lease_renewer;
pub(crate) mod listener;
pub(crate) mod pace;
pub(crate) mod periodic;
pub(crate) mod queue_limits;
pub(crate) mod reaper;
pub(crate) mod sequencer;

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

use actix::dev::ToEnvelope;
use actix::prelude::*;

use crate::metrics::MailboxMeter;

/// Stop the actor (shutdown). Sent by the scheduler only.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Stop;

/// Wait until an actor's mailbox has closed (the actor stopped), at most `limit`.
pub(crate) async fn stopped<A: Actor>(addr: &Addr<A>, limit: std::time::Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while addr.connected() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    true
}

/// An actor address that counts what it sends (actix has no mailbox length).
pub(crate) struct Metered<A: Actor> {
    addr: Addr<A>,
    meter: Arc<MailboxMeter>,
}

impl<A: Actor> Clone for Metered<A> {
    fn clone(&self) -> Self {
        Metered {
            addr: self.addr.clone(),
            meter: self.meter.clone(),
        }
    }
}

impl<A: Actor> Metered<A> {
    pub fn new(addr: Addr<A>, meter: Arc<MailboxMeter>) -> Self {
        Metered { addr, meter }
    }

    pub fn addr(&self) -> &Addr<A> {
        &self.addr
    }

    /// Send without waiting. A full mailbox is counted and the message still delivered;
    /// a stopped actor gives the message back.
    pub fn tell<M>(&self, msg: M) -> Result<(), M>
    where
        M: Message + Send + 'static,
        M::Result: Send,
        A: Handler<M>,
        A::Context: ToEnvelope<A, M>,
    {
        match self.addr.try_send(msg) {
            Ok(()) => {
                self.meter.sent();
                Ok(())
            }
            Err(SendError::Full(msg)) => {
                self.meter.overflowed();
                self.meter.sent();
                tracing::warn!(
                    actor = std::any::type_name::<A>(),
                    "mailbox at capacity; delivering anyway"
                );
                self.addr.do_send(msg);
                Ok(())
            }
            Err(SendError::Closed(msg)) => Err(msg),
        }
    }

    /// Send and wait for the reply.
    pub async fn ask<M>(&self, msg: M) -> Result<M::Result, MailboxError>
    where
        M: Message + Send + 'static,
        M::Result: Send,
        A: Handler<M>,
        A::Context: ToEnvelope<A, M>,
    {
        self.meter.sent();
        self.addr.send(msg).await
    }
}

/// Completion batches' worth of jobs that may be finishing at once: the batches the
/// completer writes at once ([`completer::MAX_WRITES_IN_FLIGHT`]) and one filling behind
/// them. With one batch's worth, as before, a second write never started on size (the
/// buffer could not reach a batch while one was in flight) and handlers stopped starting
/// whenever one write was slow; three gave 6% more no-op jobs per second at concurrency
/// 32 and 18% more keyed ones (interleaved runs, `bench -- --only e2e,keyed`).
pub(crate) const FINISHING_BATCHES: usize = completer::MAX_WRITES_IN_FLIGHT + 1;

/// Execution slots and the in-flight byte budget, shared by the claimer and the
/// sequencers (a sequencer's fetch-next reuses the slot of the job that just ended).
///
/// An unkeyed job gives its slot back when its handler returns, and then counts as
/// *finishing* until its ending is written, so the next claim overlaps the completion
/// write. At most `max(concurrency, FINISHING_BATCHES × completion_batch)` jobs may be
/// finishing: past that, claims wait for the completion writes (backpressure). Handlers
/// running at once never exceed `concurrency`.
#[derive(Debug)]
pub(crate) struct Slots {
    free: AtomicUsize,
    finishing: AtomicUsize,
    finishing_max: usize,
    bytes_in_use: AtomicI64,
    byte_budget: i64,
}

impl Slots {
    /// `completion_batch`: sizes the finishing jobs allowed beyond `concurrency` (see
    /// [`FINISHING_BATCHES`]).
    pub fn new(concurrency: usize, completion_batch: usize, byte_budget: usize) -> Self {
        Slots {
            free: AtomicUsize::new(concurrency),
            finishing: AtomicUsize::new(0),
            finishing_max: concurrency.max(completion_batch.saturating_mul(FINISHING_BATCHES)),
            bytes_in_use: AtomicI64::new(0),
            // usize::MAX would wrap to -1 and throttle every claim to one job.
            byte_budget: i64::try_from(byte_budget).unwrap_or(i64::MAX),
        }
    }

    /// Reserve up to `want` slots; returns how many were reserved.
    pub fn take(&self, want: usize) -> usize {
        let room = self
            .finishing_max
            .saturating_sub(self.finishing.load(SeqCst));
        let want = want.min(room);
        let mut cur = self.free.load(SeqCst);
        loop {
            let n = cur.min(want);
            if n == 0 {
                return 0;
            }
            match self.free.compare_exchange(cur, cur - n, SeqCst, SeqCst) {
                Ok(_) => return n,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Slots free now.
    pub fn free(&self) -> usize {
        self.free.load(SeqCst)
    }

    /// A handler returned: its slot is free, its ending still to be written.
    pub fn finishing(&self) {
        self.finishing.fetch_add(1, SeqCst);
        self.give_back(1);
    }

    /// A finishing job's ending was written. True when claims were held back for it.
    pub fn finished(&self) -> bool {
        self.finishing.fetch_sub(1, SeqCst) >= self.finishing_max
    }

    pub fn give_back(&self, n: usize) {
        self.free.fetch_add(n, SeqCst);
    }

    /// Bytes the next claim may still take.
    pub fn byte_room(&self) -> i64 {
        (self.byte_budget - self.bytes_in_use.load(SeqCst)).max(0)
    }

    /// Payload bytes of the jobs held now.
    pub fn bytes_in_use(&self) -> i64 {
        self.bytes_in_use.load(SeqCst)
    }

    pub fn hold_bytes(&self, n: i32) {
        self.bytes_in_use.fetch_add(n as i64, SeqCst);
    }

    pub fn release_bytes(&self, n: i32) {
        self.bytes_in_use.fetch_sub(n as i64, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::Slots;

    #[test]
    fn an_unbounded_byte_budget_never_throttles_claims() {
        let slots = Slots::new(8, 8, usize::MAX);
        slots.hold_bytes(1_000_000);
        assert!(slots.byte_room() > i64::MAX / 2, "{}", slots.byte_room());
        assert_eq!(slots.take(8), 8);
    }

    /// Two batches being written and one filling may be finishing; past that no slot is
    /// handed out until an ending is written, however many are free.
    #[test]
    fn slots_wait_once_three_batches_of_endings_are_unwritten() {
        let slots = Slots::new(1, 2, usize::MAX);
        for _ in 0..6 {
            assert_eq!(slots.take(1), 1, "room for another finishing job");
            slots.finishing();
        }
        assert_eq!(slots.free(), 1);
        assert_eq!(slots.take(1), 0, "six endings unwritten: the slot waits");
        assert!(
            slots.finished(),
            "the claimer is told when the bound is left"
        );
        assert_eq!(slots.take(1), 1);
    }

    #[test]
    fn a_spent_byte_budget_leaves_no_room() {
        let slots = Slots::new(8, 8, 100);
        slots.hold_bytes(150);
        assert_eq!(slots.byte_room(), 0);
        slots.release_bytes(150);
        assert_eq!(slots.byte_room(), 100);
    }
}
