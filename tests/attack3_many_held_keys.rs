//! Promise 1, "however many": hosts' open transactions hold many keys whose heads have
//! finished. A head whose own key is let go must complete soon, however many other keys
//! stay held.

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
const HELD: usize = 30;

#[test]
fn a_head_completes_soon_after_its_key_is_free_while_thirty_other_keys_stay_held() {
    run_in_system(within(120, "many held keys", async {
        let db = TestDb::with_options("a3_manykeys", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let mut config = config_with_lease(&db.schema, LEASE);
        config.concurrency = HELD + 8;
        let scheduler = Scheduler::builder(db.pool.clone(), config)
            .register(h.clone())
            .start()
            .await
            .unwrap();
        let mut heads = Vec::new();
        for i in 0..=HELD {
            heads.push(
                scheduler
                    .enqueue_job(
                        scripted(Script {
                            gate: Some("finish".into()),
                            ..work(&format!("head-{i}"), 0)
                        })
                        .with_key(format!("K{i}")),
                    )
                    .await
                    .unwrap(),
            );
        }
        for i in 0..=HELD {
            h.started(&format!("head-{i}"), 10).await;
        }
        // One host holds keys K0..K29 (it enqueued their next jobs, still open); another
        // holds K30 alone.
        let mut many = db.pool.begin().await.unwrap();
        let mut nexts = Vec::new();
        for i in 0..HELD {
            nexts.push(
                scheduler
                    .enqueue_in(
                        &mut many,
                        scripted(work(&format!("next-{i}"), 0)).with_key(format!("K{i}")),
                    )
                    .await
                    .unwrap(),
            );
        }
        let mut one = db.pool.begin().await.unwrap();
        nexts.push(
            scheduler
                .enqueue_in(
                    &mut one,
                    scripted(work("next-last", 0)).with_key(format!("K{HELD}")),
                )
                .await
                .unwrap(),
        );
        h.open("finish");
        for i in 0..=HELD {
            h.ended(&format!("head-{i}"), 10).await;
        }
        // Let every held completion settle into its retries.
        tokio::time::sleep(Duration::from_millis(800)).await;
        for id in &heads {
            assert_eq!(db.store.job(*id).await.unwrap().state, JobState::Running);
        }
        one.commit().await.unwrap();
        let freed = Instant::now();
        let last = heads[HELD];
        within(20, "the freed head done", async {
            while db.store.job(last).await.unwrap().state != JobState::Done {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        let after = freed.elapsed();
        many.commit().await.unwrap();
        let all: Vec<_> = heads.iter().chain(&nexts).copied().collect();
        wait_done(&db, &all, 30).await;
        let m = scheduler.metrics();
        scheduler.shutdown().await.unwrap();
        eprintln!(
            "freed head done {after:?} after its key was let go; {:?}",
            m.counters
        );
        for id in &all {
            let job = db.store.job(*id).await.unwrap();
            assert_eq!(
                (job.state, job.generation.0),
                (JobState::Done, 1),
                "{job:?}"
            );
            assert_eq!(h.runs_of(*id).len(), 1);
        }
        assert!(
            after < LEASE / 4,
            "the head of the freed key completed {after:?} after its key was let go, while \
             {HELD} other keys stayed held"
        );
        h.assert_keys_serial();
        db.drop().await;
    }))
}
