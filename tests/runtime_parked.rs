//! A keyed successor claimed by its predecessor's completion while every slot is busy
//! waits parked for a slot, for longer than a lease. It is renewed from the moment of its
//! claim, so it runs once, as the generation that was claimed, in its key's order.

mod common;
#[path = "common/scripted.rs"]
mod scripted;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::{within, TestDb};
use leasehold::{JobState, Scheduler, StoreOptions};
use scripted::{scripted, work, Script, Scripted};
use worker::{config_with_lease, run_in_system, wait_until, POOL};

const LEASE: Duration = Duration::from_secs(2);

#[test]
fn a_successor_parked_for_a_slot_longer_than_a_lease_keeps_its_lease_and_runs_once() {
    run_in_system(within(90, "parked successor test", async {
        let db = TestDb::with_options("rt_parked", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let mut config = config_with_lease(&db.schema, LEASE);
        config.concurrency = 3;
        let scheduler = Scheduler::builder(db.pool.clone(), config)
            .register(h.clone())
            .start()
            .await
            .unwrap();
        let long_ms = 4 * LEASE.as_millis() as u64;
        let u1 = scheduler
            .enqueue_job(scripted(work("u1", long_ms)))
            .await
            .unwrap();
        let head = scheduler
            .enqueue_job(
                scripted(Script {
                    gate: Some("host-holds-k".into()),
                    ..work("head", 0)
                })
                .with_key("K"),
            )
            .await
            .unwrap();
        h.started("u1", 10).await;
        h.started("head", 10).await;
        // A host transaction enqueues the successor and keeps K's key row locked, so the
        // head's completion (which claims the successor) waits for it.
        let mut host = db.pool.begin().await.unwrap();
        let next = scheduler
            .enqueue_in(&mut host, scripted(work("next", 0)).with_key("K"))
            .await
            .unwrap();
        h.open("host-holds-k");
        h.ended("head", 10).await;
        // Meanwhile long jobs take every slot.
        let u2 = scheduler
            .enqueue_job(scripted(work("u2", long_ms)))
            .await
            .unwrap();
        let u3 = scheduler
            .enqueue_job(scripted(work("u3", long_ms)))
            .await
            .unwrap();
        h.started("u2", 10).await;
        h.started("u3", 10).await;
        // The completion now claims the successor, which finds no free slot.
        host.commit().await.unwrap();
        wait_until(10, "the successor to be claimed", || async {
            db.store.job(next).await.unwrap().state == JobState::Running
        })
        .await;
        assert!(h.runs_tagged("next").is_empty(), "no slot was free");
        let ids = [u1, head, next, u2, u3];
        wait_until(40, "every job to end", || async {
            for id in &ids {
                if !db.store.job(*id).await.unwrap().state.is_terminal() {
                    return false;
                }
            }
            true
        })
        .await;
        let m = scheduler.metrics();
        scheduler.shutdown().await.unwrap();

        // Renewed while parked: its lease never expired. After waiting a lease it may
        // have been given back (released, its attempt not counted) for another process
        // to take; either way it ran once, in its key's order.
        let job = db.store.job(next).await.unwrap();
        assert_eq!((job.state, job.attempts), (JobState::Done, 1), "{job:?}");
        let events: Vec<String> = db
            .store
            .history(next)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.event)
            .collect();
        assert!(!events.contains(&"reaped".to_string()), "{events:?}");
        let runs = h.runs_of(next);
        assert_eq!(
            runs.len(),
            1,
            "the parked successor ran more than once: {runs:?}"
        );
        assert!(runs[0].cancel.is_none());
        assert_eq!(db.count_where("lease_expiries", "true").await, 0);
        assert_eq!(m.counters.leases_lost, 0, "{:?}", m.counters);
        h.assert_keys_serial();
        db.drop().await;
    }))
}
