//! Periodic: fires this scheduler's periodic schedules (see [`crate::periodic`]).
//!
//! # Lifecycle
//! Started with the scheduler when it has schedules, on the scheduler's arbiter,
//! writing through the scheduler's writer pool. Every [`TICK`] it looks at each schedule whose
//! wait has passed, in one short transaction per schedule (`Store::fire_due`); a
//! schedule another process is firing is looked at again at the next tick. Stops on
//! [`super::Stop`].
//!
//! # Clocks
//! The look decides by the database's clock and answers how long until the next fire
//! time; the runner waits that long on the monotonic clock. It never compares a fire
//! time with the host's wall clock, so a host clock ahead of or behind the database's
//! changes nothing.
//!
//! # Failure
//! A failed look is counted and retried at the next tick: the fire times stay due, and
//! their rows make a retry enqueue each of them once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;

use crate::metrics::Metrics;
use crate::periodic::Periodic;
use crate::store::Store;

/// How often the schedules are looked at: a fire time is enqueued at most about this
/// long after it passed.
pub(crate) const TICK: Duration = Duration::from_millis(200);

struct Slot {
    periodic: Periodic,
    /// When to look next, on the monotonic clock; `None`: at the next tick.
    next: Option<Instant>,
    looking: bool,
    /// This process's last look at the schedule (database time): see `plan`.
    looked: Option<chrono::DateTime<chrono::Utc>>,
}

pub(crate) struct PeriodicRunner {
    store: Store,
    slots: Vec<Slot>,
    metrics: Arc<Metrics>,
}

impl PeriodicRunner {
    pub fn new(store: Store, schedules: Vec<Periodic>, metrics: Arc<Metrics>) -> Self {
        PeriodicRunner {
            store,
            slots: schedules
                .into_iter()
                .map(|periodic| Slot {
                    periodic,
                    next: None,
                    looking: false,
                    looked: None,
                })
                .collect(),
            metrics,
        }
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        let now = Instant::now();
        for i in 0..self.slots.len() {
            let slot = &mut self.slots[i];
            if slot.looking || slot.next.is_some_and(|t| t > now) {
                continue;
            }
            slot.looking = true;
            let (store, periodic, looked) =
                (self.store.clone(), slot.periodic.clone(), slot.looked);
            ctx.spawn(
                async move { store.fire_due(&periodic, looked).await }
                    .into_actor(self)
                    .map(move |res, act, _| {
                        let slot = &mut act.slots[i];
                        slot.looking = false;
                        match res {
                            Ok(fired) => {
                                slot.next = fired.wait.map(|w| Instant::now() + w);
                                if fired.now.is_some() {
                                    slot.looked = fired.now;
                                }
                                act.metrics
                                    .add(|c| &c.periodic_enqueued, fired.enqueued.len() as u64);
                                for (at, job, late) in fired.enqueued {
                                    tracing::debug!(name = slot.periodic.name(), %at, job = %job, late, "leasehold periodic job enqueued");
                                }
                            }
                            Err(e) => {
                                slot.next = None;
                                act.metrics.incr(|c| &c.db_errors);
                                tracing::warn!(name = slot.periodic.name(), error = %e, "leasehold periodic schedule could not fire; retrying");
                            }
                        }
                    }),
            );
        }
    }
}

impl Actor for PeriodicRunner {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.tick(ctx);
        ctx.run_interval(TICK, |act, ctx| act.tick(ctx));
    }
}

impl Handler<super::Stop> for PeriodicRunner {
    type Result = ();
    fn handle(&mut self, _: super::Stop, ctx: &mut Self::Context) {
        ctx.stop();
    }
}
