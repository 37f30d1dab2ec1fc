//! A keyed job's ending waits only for its own key: while hosts' open transactions hold
//! other keys' rows for long, the head of a key held only for a moment completes soon
//! after its key is free, whether it ends together with the other keys' heads (their
//! first waits not over yet) or after them (their completions already waiting in turns),
//! with six or twelve keys held. (The attack that found the first case, twelve keys:
//! 2.7 s; the fault harness's `ending_late` on seed 88001: 2.2 s past the handler's
//! return, over a 2 s lease.)

mod common;
#[path = "common/host_keys.rs"]
mod host_keys;
#[path = "common/scripted.rs"]
mod scripted;
#[path = "common/worker.rs"]
mod worker;

use std::time::{Duration, Instant};

use common::{within, TestDb};
use host_keys::wait_done;
use leasehold::{JobState, Scheduler, StoreOptions};
use scripted::{scripted, work, Script, Scripted};
use worker::{config_with_lease, run_in_system, POOL};

const LEASE: Duration = Duration::from_secs(2);

/// When the brief key's head ends.
#[derive(Clone, Copy, PartialEq)]
enum BriefEnds {
    /// At the same moment as the stalled keys' heads.
    WithThem,
    /// Half a lease after them, their completions already taking turns.
    After,
}

fn brief_key_behind(stalled: usize, ends: BriefEnds, test: &'static str) {
    run_in_system(within(120, "keyed endings at once", async move {
        let db = TestDb::with_options(test, StoreOptions::default(), POOL).await;
        let hosts_pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(stalled as u32 + 2)
            .connect_with(common::runtime_options().database(&common::test_db_name()))
            .await
            .unwrap();
        let h = Scripted::new(&db.pool);
        let mut config = config_with_lease(&db.schema, LEASE);
        config.concurrency = stalled + 2;
        let scheduler = Scheduler::builder(db.pool.clone(), config)
            .register(h.clone())
            .start()
            .await
            .unwrap();
        let brief_head = |h: Scheduler| async move {
            h.enqueue_job(
                scripted(Script {
                    gate: Some("finish-B".into()),
                    ..work("head-B", 0)
                })
                .with_key("B"),
            )
            .await
            .unwrap()
        };
        let mut heads = Vec::new();
        for i in 0..stalled {
            heads.push(
                scheduler
                    .enqueue_job(
                        scripted(Script {
                            gate: Some(format!("finish-S{i}")),
                            ..work(&format!("head-S{i}"), 0)
                        })
                        .with_key(format!("S{i}")),
                    )
                    .await
                    .unwrap(),
            );
            h.started(&format!("head-S{i}"), 10).await;
        }
        let mut b = None;
        if ends == BriefEnds::WithThem {
            b = Some(brief_head(scheduler.clone()).await);
            h.started("head-B", 10).await;
        }
        let mut hosts = Vec::new();
        for i in 0..stalled {
            let mut host = hosts_pool.begin().await.unwrap();
            scheduler
                .enqueue_in(
                    &mut host,
                    scripted(work(&format!("next-S{i}"), 0)).with_key(format!("S{i}")),
                )
                .await
                .unwrap();
            hosts.push(host);
        }
        for i in 0..stalled {
            h.open(&format!("finish-S{i}"));
        }
        if ends == BriefEnds::After {
            for i in 0..stalled {
                h.ended(&format!("head-S{i}"), 10).await;
            }
            tokio::time::sleep(LEASE / 2).await;
            b = Some(brief_head(scheduler.clone()).await);
            h.started("head-B", 10).await;
        }
        let b = b.expect("the brief key's head was enqueued");
        let mut host_b = hosts_pool.begin().await.unwrap();
        scheduler
            .enqueue_in(&mut host_b, scripted(work("next-B", 0)).with_key("B"))
            .await
            .unwrap();
        h.open("finish-B");
        h.ended("head-B", 10).await;
        tokio::time::sleep(Duration::from_millis(150)).await;
        host_b.commit().await.unwrap();
        let committed = Instant::now();
        while db.store.job(b).await.unwrap().state != JobState::Done {
            assert!(
                committed.elapsed() < Duration::from_secs(10),
                "B's head never completed"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let waited = committed.elapsed();
        for host in hosts {
            host.commit().await.unwrap();
        }
        wait_done(&db, &heads, 20).await;
        let m = scheduler.metrics();
        scheduler.shutdown().await.unwrap();
        assert!(
            waited < LEASE / 4,
            "B's head completed {waited:?} after its key was let go, while {stalled} other \
             keys' heads waited for theirs (lease {LEASE:?})"
        );
        assert_eq!(m.counters.leases_lost, 0, "{:?}", m.counters);
        hosts_pool.close().await;
        db.drop().await;
    }))
}

#[test]
fn a_brief_keys_head_ending_with_six_stalled_keys_heads_completes_soon_after_its_key_is_free() {
    brief_key_behind(6, BriefEnds::WithThem, "rt_keywait_six_at_once");
}

#[test]
fn a_brief_keys_head_ending_with_twelve_stalled_keys_heads_completes_soon_after_its_key_is_free() {
    brief_key_behind(12, BriefEnds::WithThem, "rt_keywait_twelve_at_once");
}

#[test]
fn a_brief_keys_head_ending_after_six_stalled_keys_heads_completes_soon_after_its_key_is_free() {
    brief_key_behind(6, BriefEnds::After, "rt_keywait_six_after");
}
