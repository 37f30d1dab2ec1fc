//! A session holds the row of a key's *waiting* successor (a report's `SELECT … FOR
//! UPDATE` on a job that has not run yet) while the key's head completes. The head's
//! completion must promote the successor, so it may wait; no other job's ending may
//! wait with it, and the head must complete soon after the session lets go.

mod common;
#[path = "common/host_keys.rs"]
mod host_keys;
#[path = "common/scripted.rs"]
mod scripted;
#[path = "common/worker.rs"]
mod worker;

use std::time::{Duration, Instant};

use common::{within, TestDb};
use host_keys::{quick_endings, wait_done};
use leasehold::{JobState, Scheduler, StoreOptions};
use scripted::{scripted, work, Script, Scripted};
use sqlx::Connection;
use worker::{config_with_lease, run_in_system, POOL};

const LEASE: Duration = Duration::from_secs(2);

async fn start(db: &TestDb, h: &Scripted) -> Scheduler {
    Scheduler::builder(db.pool.clone(), config_with_lease(&db.schema, LEASE))
        .register(h.clone())
        .start()
        .await
        .unwrap()
}

#[test]
fn a_held_successor_row_delays_only_its_heads_ending() {
    run_in_system(within(120, "held successor", async {
        let db = TestDb::with_options("a3_heldsucc", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let scheduler = start(&db, &h).await;
        let head = scheduler
            .enqueue_job(
                scripted(Script {
                    gate: Some("finish-head".into()),
                    ..work("head", 0)
                })
                .with_key("S"),
            )
            .await
            .unwrap();
        let next = scheduler
            .enqueue_job(scripted(work("next", 0)).with_key("S"))
            .await
            .unwrap();
        h.started("head", 10).await;
        assert_eq!(db.store.job(next).await.unwrap().state, JobState::Waiting);
        let mut session = db.raw_conn("locker").await;
        let mut tx = session.begin().await.unwrap();
        sqlx::query(&format!(
            "SELECT 1 FROM {} WHERE id = $1 FOR UPDATE",
            db.table("jobs")
        ))
        .bind(next.0)
        .execute(&mut *tx)
        .await
        .unwrap();
        h.open("finish-head");
        h.ended("head", 10).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Keyed and unkeyed jobs now, one every 100 ms, while the head's ending waits.
        let key_of = |i: usize| (i % 2 == 1).then(|| format!("Q{i}"));
        let (quick, waits) = quick_endings(&scheduler, &h, &db, 16, key_of).await;
        let head_state = db.store.job(head).await.unwrap().state;
        let released = Instant::now();
        tx.rollback().await.unwrap();
        wait_done(&db, &[head], 20).await;
        let head_after = released.elapsed();
        wait_done(&db, &[next], 20).await;
        wait_done(&db, &quick, 20).await;
        let m = scheduler.metrics();
        scheduler.shutdown().await.unwrap();
        eprintln!("held successor: head {head_state:?} then done {head_after:?} after release; waits {waits:?}; {:?}", m.counters);
        for id in quick.iter().chain([&head, &next]) {
            let job = db.store.job(*id).await.unwrap();
            assert_eq!(
                (job.state, job.generation.0),
                (JobState::Done, 1),
                "{job:?}"
            );
            assert_eq!(h.runs_of(*id).len(), 1, "job {id} ran more than once");
        }
        let slowest = waits.iter().max().copied().unwrap();
        assert!(
            slowest < LEASE / 4,
            "a job waited {slowest:?} from its handler's return to done while a session \
             held the row of a key's waiting successor; all: {waits:?}"
        );
        assert!(
            head_after < LEASE / 2,
            "the head completed {head_after:?} after the successor's row was let go"
        );
        h.assert_keys_serial();
        db.drop().await;
    }))
}
