//! Per-queue limits (`Config::queue_concurrency`): a queue with a limit never holds
//! more than that many jobs in this scheduler (running, waiting for a slot, or queued
//! behind their key), so a flooded queue cannot take the slots of the others.
//!
//! A limit is a cap, not a share set aside: every claim round is one statement over all
//! the queues, in priority order, which takes at most its room of each limited queue;
//! what a limited queue does not use (it is empty, paused, or has nothing due) goes to
//! the others in the same statement.
//!
//! Counted where every claimed job passes: [`crate::env::Env::track`] and `untrack`.
//! A claim first reserves each limited queue's room (`pending`), so two claims in
//! flight (the claimer's, a sequencer's fetch of its key's next job) cannot both take
//! the last place; the reservation only holds that queue's own places, and ends when
//! the claim returns.
//!
//! A queue at its limit with more jobs waiting has its places refilled as they free:
//! the ending of one of its jobs is written after its slot was handed on (when the
//! claimer looked, the queue was still full), so [`QueueLimits::place_freed`] tells the
//! claimer then. Otherwise its next job would wait for the next poll (up to
//! `poll_interval_max`), since a claim that took a capped queue's whole cap and nothing
//! else looks like a claim that found the queues drained.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use crate::job::ClaimedJob;

#[derive(Default)]
struct Count {
    limit: usize,
    /// Jobs of the queue this scheduler tracks now.
    held: usize,
    /// Places reserved by claims in flight.
    pending: usize,
    /// More of the queue's jobs are probably waiting: the latest claim that included
    /// the queue took its whole cap of it, or a claim left it out at its limit.
    more: bool,
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
    /// A place freed in a queue with more waiting.
    freed: tokio::sync::Notify,
}

/// The claim statement of a claim round: these queues, at most `limit` jobs in all, and
/// at most `caps[q]` of each limited queue `q` (its room, reserved until
/// [`QueueLimits::settle`]). A limited queue at its limit is left out.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct ClaimPlan {
    pub queues: Vec<String>,
    pub limit: usize,
    pub caps: BTreeMap<String, usize>,
}

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
            freed: tokio::sync::Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Count>> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Plan a claim of `want` jobs over `queues`: one statement for all of them, each
    /// limited queue capped at its room (reserved now, released by [`Self::settle`]). The
    /// limit is `want`, or the rooms' sum when every queue has a limit and they add up to
    /// less. No limits: `queues` and `want` as they are.
    pub fn plan(&self, queues: &[String], want: usize) -> ClaimPlan {
        let mut counts = self.lock();
        if counts.is_empty() {
            return ClaimPlan {
                queues: queues.to_vec(),
                limit: want,
                caps: BTreeMap::new(),
            };
        }
        let mut plan = ClaimPlan::default();
        let mut unlimited = false;
        for q in queues {
            // A queue named twice is claimed (and its room reserved) once.
            if plan.queues.contains(q) {
                continue;
            }
            match counts.get_mut(q) {
                Some(c) => {
                    let n = c.room().min(want);
                    if n > 0 {
                        c.pending += n;
                        plan.queues.push(q.clone());
                        plan.caps.insert(q.clone(), n);
                    } else {
                        c.more = true;
                    }
                }
                None => {
                    unlimited = true;
                    plan.queues.push(q.clone());
                }
            }
        }
        plan.limit = if unlimited {
            want
        } else {
            plan.caps.values().sum::<usize>().min(want)
        };
        plan
    }

    /// The claim of a plan returned: the reservations of its `caps` end (the jobs it
    /// took are counted by `track`). `claimed`: what it took, `None` if it failed.
    pub fn settle(&self, caps: &BTreeMap<String, usize>, claimed: Option<&[ClaimedJob]>) {
        if caps.is_empty() {
            return;
        }
        let mut counts = self.lock();
        for (q, n) in caps {
            if let Some(c) = counts.get_mut(q) {
                c.pending = c.pending.saturating_sub(*n);
                if let Some(jobs) = claimed {
                    c.more = jobs.iter().filter(|j| j.queue == *q).count() >= *n;
                }
            }
        }
    }

    /// Wait until a place frees in a queue with more jobs waiting (see the module docs).
    pub async fn place_freed(&self) {
        self.freed.notified().await
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
                if c.more {
                    self.freed.notify_one();
                }
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

    fn names(qs: &[&str]) -> Vec<String> {
        qs.iter().map(|q| q.to_string()).collect()
    }

    fn caps(pairs: &[(&str, usize)]) -> BTreeMap<String, usize> {
        pairs.iter().map(|(q, n)| (q.to_string(), *n)).collect()
    }

    #[test]
    fn a_limit_caps_its_queue_in_the_one_statement_and_keeps_nothing_from_the_others() {
        let l = limits(&[("flood", 2)]);
        let queues = names(&["flood", "trickle"]);
        let plan = l.plan(&queues, 8);
        assert_eq!(
            plan,
            ClaimPlan {
                queues: queues.clone(),
                limit: 8,
                caps: caps(&[("flood", 2)]),
            },
            "the whole batch is open to the trickle queue, whatever the flood takes"
        );
        // Reserved until settled: a second plan finds the flood queue full.
        let second = l.plan(&queues, 8);
        assert_eq!(second.queues, names(&["trickle"]));
        assert_eq!(second.limit, 8);
        assert!(second.caps.is_empty());
        l.settle(&plan.caps, Some(&[]));
        l.settle(&second.caps, Some(&[]));
        l.held("flood", true);
        l.held("flood", true);
        assert_eq!(l.held_of("flood"), Some(2));
        assert!(!l.reserve_one("flood"));
        assert!(l.reserve_one("trickle"));
        l.held("flood", false);
        assert!(l.reserve_one("flood"));
        assert_eq!(l.plan(&queues, 3).queues, names(&["trickle"]));
    }

    #[test]
    fn a_round_of_limited_queues_only_is_bounded_by_their_rooms() {
        let l = limits(&[("a", 2), ("b", 3)]);
        let plan = l.plan(&names(&["a", "b"]), 8);
        assert_eq!(plan.limit, 5);
        assert_eq!(plan.caps, caps(&[("a", 2), ("b", 3)]));
        let meanwhile = l.plan(&names(&["a", "b"]), 8);
        assert_eq!(
            meanwhile.limit, 0,
            "both full while the first claim is in flight"
        );
        l.settle(&plan.caps, Some(&[]));
        // A cap is at most the batch: no queue reserves more than one claim may take.
        let one = l.plan(&names(&["a", "b"]), 1);
        assert_eq!((one.limit, one.caps), (1, caps(&[("a", 1), ("b", 1)])));
    }

    #[test]
    fn a_place_freed_in_a_full_queue_with_more_waiting_is_announced() {
        use futures_util::FutureExt;
        let l = limits(&[("flood", 1)]);
        let queues = names(&["flood", "trickle"]);
        let plan = l.plan(&queues, 4);
        l.settle(&plan.caps, Some(&[]));
        l.held("flood", true);
        l.held("flood", false);
        assert!(
            l.place_freed().now_or_never().is_none(),
            "its claim took less than its cap: drained, nothing to announce"
        );
        l.held("flood", true);
        // Full: left out of the next claim, which may have come for its jobs.
        assert_eq!(l.plan(&queues, 4).queues, names(&["trickle"]));
        l.held("flood", false);
        assert!(l.place_freed().now_or_never().is_some());
    }

    #[test]
    fn without_limits_one_statement_claims_for_every_queue() {
        let l = QueueLimits::default();
        let queues = names(&["a", "b"]);
        assert_eq!(
            l.plan(&queues, 5),
            ClaimPlan {
                queues: queues.clone(),
                limit: 5,
                caps: BTreeMap::new(),
            }
        );
    }
}
