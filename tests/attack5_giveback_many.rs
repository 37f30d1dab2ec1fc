//! Attack: operators' cancels racing a pause's give-back of many claimed-ahead jobs at
//! once, across several keys, some key rows held by a producer meanwhile; then a second
//! scheduler on the same schema runs what is left.
//!
//! Promises: each cancelled job ends cancelled, never runs, and its key moves on; no job
//! is left to its lease's expiry (no `lease_expiries` row); every other job runs exactly
//! once, with one counted attempt; a key's jobs run one at a time, in enqueue order.

mod common;
#[path = "common/scripted.rs"]
mod scripted;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::{within, TestDb};
use leasehold::{JobId, JobState, Scheduler, StoreOptions};
use scripted::{scripted, work, Script, Scripted};
use worker::{config_with_lease, run_in_system, wait_until, POOL};

const KEYS: usize = 10;
const PER_KEY: usize = 3;
const UNKEYED: usize = 5;

#[test]
fn cancels_racing_a_pause_give_back_of_many_jobs_across_keys_lose_no_job_and_keep_every_key_in_order(
) {
    run_in_system(within(90, "cancels racing a pause give-back", async {
        let db = TestDb::with_options("a5_gb_many", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let mut config = config_with_lease(&db.schema, Duration::from_secs(20));
        config.concurrency = 1;
        config.claim_ahead = 40;
        config.claim_ahead_window = None;
        let a = Scheduler::builder(db.pool.clone(), config)
            .register(h.clone())
            .start()
            .await
            .unwrap();
        let running = a
            .enqueue_job(scripted(Script {
                gate: Some("finish".into()),
                ..work("running", 0)
            }))
            .await
            .unwrap();
        h.started("running", 10).await;
        let mut jobs = Vec::new();
        for k in 0..KEYS {
            for n in 0..PER_KEY {
                jobs.push(scripted(work(&format!("k{k}-{n}"), 0)).with_key(format!("k{k}")));
            }
        }
        for u in 0..UNKEYED {
            jobs.push(scripted(work(&format!("u{u}"), 0)));
        }
        let ids = a.enqueue_many(jobs).await.unwrap();
        let key_jobs = |k: usize| -> Vec<JobId> { ids[k * PER_KEY..(k + 1) * PER_KEY].to_vec() };
        let unkeyed: Vec<JobId> = ids[KEYS * PER_KEY..].to_vec();
        wait_until(
            10,
            "every head and unkeyed job to be claimed ahead",
            || async { a.metrics().ready == (KEYS + UNKEYED) as u64 },
        )
        .await;

        // Three keys' heads are cancelled first (Requested: they are claimed), then a
        // producer holds those keys' rows across the give-back.
        let mut cancelled: Vec<JobId> = (0..3).map(|k| key_jobs(k)[0]).collect();
        for id in &cancelled {
            assert_eq!(
                db.store.cancel(*id, "before the pause").await.unwrap(),
                leasehold::CancelOutcome::Requested
            );
        }
        let mut producer = db.owner.begin().await.unwrap();
        sqlx::query(&format!(
            "SELECT 1 FROM {} WHERE job_key = ANY($1) ORDER BY job_key FOR UPDATE",
            db.table("job_keys")
        ))
        .bind(vec!["k0", "k1", "k2"])
        .execute(&mut *producer)
        .await
        .unwrap();

        // Three more keys' heads and two unkeyed jobs are cancelled while the queue is
        // paused.
        let racing: Vec<JobId> = (3..6)
            .map(|k| key_jobs(k)[0])
            .chain(unkeyed[..2].iter().copied())
            .collect();
        cancelled.extend(&racing);
        let cancels = futures_util::future::join_all(racing.iter().map(|id| {
            let store = db.store.clone();
            let id = *id;
            async move { store.cancel(id, "racing the pause").await.unwrap() }
        }));
        let pause = db.store.pause_queue("default", Some("test"));
        let (_outcomes, paused) = futures_util::future::join(cancels, pause).await;
        assert!(paused.unwrap());
        wait_until(5, "the give-back of every job claimed ahead", || async {
            a.metrics().ready == 0
        })
        .await;
        tokio::time::sleep(Duration::from_millis(1000)).await;
        producer.rollback().await.unwrap();
        wait_until(5, "every cancelled job to be cancelled", || async {
            for id in &cancelled {
                if db.store.job(*id).await.unwrap().state != JobState::Cancelled {
                    return false;
                }
            }
            true
        })
        .await;

        // A second scheduler on the same schema, then the resume.
        let mut config_b = config_with_lease(&db.schema, Duration::from_secs(20));
        config_b.concurrency = 4;
        let b = Scheduler::builder(db.pool.clone(), config_b)
            .register(h.clone())
            .start()
            .await
            .unwrap();
        db.store.resume_queue("default").await.unwrap();
        h.open("finish");
        let others: Vec<JobId> = ids
            .iter()
            .copied()
            .filter(|id| !cancelled.contains(id))
            .chain([running])
            .collect();
        wait_until(30, "every job not cancelled to be done", || async {
            db.count_where("jobs", "state = 'done'").await == others.len() as i64
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;

        for id in &cancelled {
            let job = db.store.job(*id).await.unwrap();
            assert!(h.runs_of(*id).is_empty(), "cancelled job {id} ran");
            assert_eq!(
                (job.state, job.attempts),
                (JobState::Cancelled, 0),
                "{job:?}"
            );
        }
        for id in &others {
            let job = db.store.job(*id).await.unwrap();
            assert_eq!(h.runs_of(*id).len(), 1, "job {id} ran {:?}", h.runs_of(*id));
            assert_eq!((job.state, job.attempts), (JobState::Done, 1), "{job:?}");
        }
        assert_eq!(db.count_where("lease_expiries", "true").await, 0);
        h.assert_keys_serial();
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
        db.drop().await;
    }))
}
