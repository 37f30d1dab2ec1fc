//! Per-queue limits (`Config::queue_concurrency`): a queue with a limit never holds
//! more than that many jobs in this scheduler (running, waiting for a slot, or queued
//! behind their key), so a flooded queue cannot take the slots of the others.
//!
//! Counted where every claimed job passes: [`crate::env::Env::track`] and `untrack`.
//! A claim for a limited queue first reserves its room (`pending`), so two claims in
//! flight (the claimer's, a sequencer's fetch of its key's next job) cannot both take
//! the last place. Queues without a limit share what the limited ones leave.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

#[derive(Default)]
struct Count {
    limit: usize,
    /// Jobs of the queue this scheduler tracks now.
    held: usize,
    /// Places reserved by claims in flight.
    pending: usize,
}

impl Count {
    fn room(&self) -> usize {
        self.limit.saturating_sub(self.held + self.pending)
    }
}

/// The limited queues' counts; empty when no queue has a limit.
#[derive(Default)]
pub(crate) struct QueueLimits {
    counts: Mutex<HashMap<String, Count>>,
}

/// One claim statement of a claim round: these queues, at most this many jobs.
pub(crate) type ClaimPart = (Vec<String>, usize);

impl QueueLimits {
    pub fn new(limits: &BTreeMap<String, usize>) -> Self {
        QueueLimits {
            counts: Mutex::new(
                limits
                    .iter()
                    .map(|(q, &limit)| {
                        (
                            q.clone(),
                            Count {
                                limit,
                                ..Count::default()
                            },
                        )
                    })
                    .collect(),
            ),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Count>> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Split a claim of `want` jobs over `queues`: each limited queue gets a statement
    /// of its own for at most its room (reserved now, released by [`Self::settle`]),
    /// the unlimited ones one statement for the rest. No limits: one statement for all.
    pub fn plan(&self, queues: &[String], want: usize) -> Vec<ClaimPart> {
        let mut counts = self.lock();
        if counts.is_empty() {
            return vec![(queues.to_vec(), want)];
        }
        let mut left = want;
        let mut parts = Vec::new();
        let mut free: Vec<String> = Vec::new();
        for q in queues {
            match counts.get_mut(q) {
                Some(c) => {
                    let n = c.room().min(left);
                    if n > 0 {
                        c.pending += n;
                        left -= n;
                        parts.push((vec![q.clone()], n));
                    }
                }
                None => free.push(q.clone()),
            }
        }
        if left > 0 && !free.is_empty() {
            parts.push((free, left));
        }
        parts
    }

    /// The claims of `parts` returned: their reservations end (the jobs they took are
    /// counted by `track`).
    pub fn settle(&self, parts: &[ClaimPart]) {
        let mut counts = self.lock();
        for (queues, n) in parts {
            if let [q] = &queues[..] {
                if let Some(c) = counts.get_mut(q) {
                    c.pending = c.pending.saturating_sub(*n);
                }
            }
        }
    }

    /// Reserve one place in `queue` for a claim of its key's next job; false when the
    /// queue is at its limit. Settle with [`Self::settle_one`].
    pub fn reserve_one(&self, queue: &str) -> bool {
        match self.lock().get_mut(queue) {
            None => true,
            Some(c) if c.room() > 0 => {
                c.pending += 1;
                true
            }
            Some(_) => false,
        }
    }

    pub fn settle_one(&self, queue: &str) {
        if let Some(c) = self.lock().get_mut(queue) {
            c.pending = c.pending.saturating_sub(1);
        }
    }

    /// A job of `queue` is tracked (`+1`) or no longer (`-1`).
    pub fn held(&self, queue: &str, up: bool) {
        if let Some(c) = self.lock().get_mut(queue) {
            if up {
                c.held += 1;
            } else {
                c.held = c.held.saturating_sub(1);
            }
        }
    }

    /// Jobs of `queue` held now (tests and metrics); `None` for a queue without a limit.
    #[cfg(test)]
    pub fn held_of(&self, queue: &str) -> Option<usize> {
        self.lock().get(queue).map(|c| c.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(pairs: &[(&str, usize)]) -> QueueLimits {
        QueueLimits::new(&pairs.iter().map(|(q, n)| (q.to_string(), *n)).collect())
    }

    #[test]
    fn a_full_queue_gets_no_statement_and_the_others_take_the_rest() {
        let l = limits(&[("flood", 2)]);
        let queues = vec!["flood".to_string(), "trickle".to_string()];
        let plan = l.plan(&queues, 8);
        assert_eq!(
            plan,
            vec![(vec!["flood".into()], 2), (vec!["trickle".into()], 6)]
        );
        // Reserved until settled: a second plan finds the flood queue full.
        assert_eq!(l.plan(&queues, 8), vec![(vec!["trickle".into()], 8)]);
        l.settle(&plan);
        l.held("flood", true);
        l.held("flood", true);
        assert_eq!(l.held_of("flood"), Some(2));
        assert!(!l.reserve_one("flood"));
        assert!(l.reserve_one("trickle"));
        l.held("flood", false);
        assert!(l.reserve_one("flood"));
        assert_eq!(l.plan(&queues, 3), vec![(vec!["trickle".into()], 3)]);
    }

    #[test]
    fn without_limits_one_statement_claims_for_every_queue() {
        let l = QueueLimits::default();
        let queues = vec!["a".to_string(), "b".to_string()];
        assert_eq!(l.plan(&queues, 5), vec![(queues.clone(), 5)]);
    }
}
