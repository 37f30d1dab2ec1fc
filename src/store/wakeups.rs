//! Enqueue wake-ups that do not serialize the commits of concurrent producers.
//!
//! A transaction that sent a NOTIFY holds a cluster-wide lock from queueing the
//! notification until its commit is flushed, so such commits cannot share a WAL flush:
//! measured here (`bench --only notify`), eight producers committing one job per
//! transaction lose about half their throughput to a NOTIFY in each transaction.
//!
//! So an enqueue in the store's own transaction carries its NOTIFY only when no other
//! enqueue of this store is in flight (one producer: one round trip and one flush, as
//! before). When others are, it commits without one and then asks for a wake-up here:
//! the queues to wake are collected, and one caller at a time sends a single NOTIFY per
//! queue for everything collected so far. Every job is announced after its commit: a
//! caller adds its queues after committing, and whoever takes them sends the NOTIFY
//! after taking them, before letting the next caller in. An enqueue inside the caller's
//! own transaction (`enqueue_in`) always carries its NOTIFY, delivered at the host's
//! commit. A wake-up that cannot be sent is logged and the queues kept for the next one;
//! schedulers poll anyway (`Config::poll_interval_max`), so it is late, never lost.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Mutex;

use super::Store;

#[derive(Default)]
pub(crate) struct Wakeups {
    /// Enqueues of this store in flight in their own transactions.
    in_flight: AtomicUsize,
    /// Queues whose jobs committed without a NOTIFY, to announce.
    queues: Mutex<BTreeSet<String>>,
    /// One sender at a time.
    sending: tokio::sync::Mutex<()>,
}

/// Marks an enqueue in flight for as long as it lives.
pub(crate) struct InFlight<'a>(&'a Wakeups);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, SeqCst);
    }
}

impl Wakeups {
    /// Register an enqueue about to run in its own transaction; `true` when it is alone
    /// and should carry its own NOTIFY.
    pub(crate) fn begin(&self) -> (InFlight<'_>, bool) {
        let before = self.in_flight.fetch_add(1, SeqCst);
        (InFlight(self), before == 0)
    }
}

impl Store {
    /// Announce `queues` (jobs there committed without a NOTIFY), coalesced with the
    /// other producers' wake-ups (see the module docs). Never fails: the jobs are
    /// committed, so an error here must not look like a failed enqueue.
    pub(crate) async fn wake_after_commit(&self, queues: impl IntoIterator<Item = String>) {
        let w = self.wakeups();
        lock(&w.queues).extend(queues);
        let _turn = w.sending.lock().await;
        let take: Vec<String> = std::mem::take(&mut *lock(&w.queues)).into_iter().collect();
        if take.is_empty() {
            // Taken by a sender that has finished sending: announced after our commit.
            return;
        }
        let sent = sqlx::query(&self.sql().enqueue_copy_notify)
            .bind(self.schema().channel())
            .bind(&take)
            .execute(self.db())
            .await;
        if let Err(e) = sent {
            tracing::warn!(error = %e, "leasehold could not send an enqueue wake-up; schedulers will find the jobs by polling");
            lock(&w.queues).extend(take);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
