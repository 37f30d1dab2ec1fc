//! Two edges of per-key order a real service meets: a host transaction holding one key's
//! row must not hold up the completions of unkeyed jobs or of other keys, and a keyed
//! head stopped by its max run time must have really ended before its successor starts,
//! even when its handler ignores the cancellation. Asserted on the handlers' execution
//! log and the jobs' rows.

mod common;
#[path = "common/scripted.rs"]
mod scripted;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::{within, TestDb};
use leasehold::{DeadKeyPolicy, JobId, JobState, Scheduler, StoreOptions};
use scripted::{scripted, work, OnCancel, Script, Scripted};
use worker::{config_with_lease, run_in_system, wait_until, POOL};

const LEASE: Duration = Duration::from_secs(2);

async fn state(db: &TestDb, id: JobId) -> JobState {
    db.store.job(id).await.unwrap().state
}

#[test]
fn completions_of_unkeyed_jobs_and_other_keys_go_through_while_a_host_transaction_holds_a_key() {
    run_in_system(within(60, "held key test", async {
        let db = TestDb::with_options("rt_key_edges_held", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let scheduler = Scheduler::builder(db.pool.clone(), config_with_lease(&db.schema, LEASE))
            .register(h.clone())
            .start()
            .await
            .unwrap();
        let head = scheduler
            .enqueue_job(
                scripted(Script {
                    gate: Some("k-held".into()),
                    ..work("head-k", 0)
                })
                .with_key("K"),
            )
            .await
            .unwrap();
        h.started("head-k", 10).await;
        // The host's transaction enqueues into K and stays open: K's key row is locked.
        let mut host = db.pool.begin().await.unwrap();
        let next = scheduler
            .enqueue_in(&mut host, scripted(work("next-k", 0)).with_key("K"))
            .await
            .unwrap();
        h.open("k-held");
        h.ended("head-k", 10).await;
        // K's head cannot leave its key yet; everything else must still complete.
        let others = scheduler
            .enqueue_many(vec![
                scripted(work("unkeyed-1", 0)),
                scripted(work("unkeyed-2", 0)),
                scripted(work("head-l", 0)).with_key("L"),
            ])
            .await
            .unwrap();
        wait_until(3, "the other jobs to complete while K is held", || async {
            for id in &others {
                if state(&db, *id).await != JobState::Done {
                    return false;
                }
            }
            true
        })
        .await;
        assert_eq!(
            state(&db, head).await,
            JobState::Running,
            "K's row is still held"
        );
        host.commit().await.unwrap();
        wait_until(10, "K's head and successor to complete", || async {
            state(&db, head).await == JobState::Done && state(&db, next).await == JobState::Done
        })
        .await;
        let m = scheduler.metrics();
        scheduler.shutdown().await.unwrap();
        assert_eq!(h.runs_of(head).len(), 1, "the head ran again");
        assert_eq!(m.counters.leases_lost, 0, "{:?}", m.counters);
        assert_eq!(db.count_where("lease_expiries", "true").await, 0);
        h.assert_keys_serial();
        db.drop().await;
    }))
}

#[test]
fn a_keyed_head_stopped_by_its_max_run_time_ends_before_its_successor_starts() {
    run_in_system(within(60, "keyed timeout test", async {
        let db = TestDb::with_options("rt_key_edges_timeout", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let mut config = config_with_lease(&db.schema, LEASE);
        config.max_run_time = Duration::from_millis(400);
        config.retry.max_attempts = 1;
        let scheduler = Scheduler::builder(db.pool.clone(), config)
            .register(h.clone())
            .start()
            .await
            .unwrap();
        // The head works 3 s and ignores cancellation: only an abort stops it. Its one
        // attempt ends it dead, and its key goes on (DeadKeyPolicy::Continue).
        let ids = scheduler
            .enqueue_many(vec![
                scripted(Script {
                    on_cancel: OnCancel::Ignore,
                    ..work("head", 3_000)
                })
                .with_key("K")
                .with_dead_key_policy(DeadKeyPolicy::Continue),
                scripted(work("next", 0)).with_key("K"),
            ])
            .await
            .unwrap();
        wait_until(20, "the successor to complete", || async {
            state(&db, ids[1]).await == JobState::Done
        })
        .await;
        scheduler.shutdown().await.unwrap();
        assert_eq!(state(&db, ids[0]).await, JobState::Dead);
        let head = &h.runs_of(ids[0])[0];
        assert!(head.cancel.is_some(), "the head was told to stop: {head:?}");
        // The key moved on only once the head's handler had really stopped.
        h.assert_keys_serial();
        db.drop().await;
    }))
}
