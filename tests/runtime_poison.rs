//! One bad row never poisons a batch: a result the database cannot store, or a stored
//! payload that cannot be read back, fails its own job (dead, with the reason) while the
//! jobs claimed and completed alongside it run once and finish.

mod common;
#[path = "common/scripted.rs"]
mod scripted;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::{within, TestDb};
use leasehold::{JobId, JobState, Scheduler, StoreOptions};
use scripted::{scripted, work, Output, Script, Scripted};
use worker::{config_with_lease, run_in_system, wait_until, POOL};

async fn all_ended(db: &TestDb, ids: &[JobId]) {
    wait_until(30, "every job to end", || async {
        for id in ids {
            if !db.store.job(*id).await.unwrap().state.is_terminal() {
                return false;
            }
        }
        true
    })
    .await;
}

#[test]
fn a_result_that_cannot_be_stored_fails_its_own_job_and_never_its_batch() {
    run_in_system(within(60, "poison result test", async {
        let db = TestDb::with_options("rt_poison_result", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let mut config = config_with_lease(&db.schema, Duration::from_secs(2));
        config.concurrency = 12;
        let scheduler = Scheduler::builder(db.pool.clone(), config)
            .register(h.clone())
            .start()
            .await
            .unwrap();
        // All wait on one gate, so they finish together and share completion batches.
        let gated = |tag: &str, result: Output| {
            scripted(Script {
                gate: Some("go".into()),
                result,
                ..work(tag, 0)
            })
        };
        let mut jobs = vec![
            gated("nul", Output::WithNul),
            gated("huge", Output::Huge(2 * 1024 * 1024)),
        ];
        for i in 0..10 {
            jobs.push(gated("fine", Output::Text(format!("ok {i}"))));
        }
        let ids = scheduler.enqueue_many(jobs).await.unwrap();
        wait_until(10, "all twelve to start", || async { h.log().len() == 12 }).await;
        h.open("go");
        all_ended(&db, &ids).await;
        let m = scheduler.metrics();
        scheduler.shutdown().await.unwrap();

        let nul = db.store.job(ids[0]).await.unwrap();
        assert_eq!(nul.state, JobState::Dead, "{nul:?}");
        assert!(
            nul.last_error.as_deref().unwrap().contains("NUL"),
            "{nul:?}"
        );
        let huge = db.store.job(ids[1]).await.unwrap();
        assert_eq!(huge.state, JobState::Dead, "{huge:?}");
        assert!(
            huge.last_error
                .as_deref()
                .unwrap()
                .contains("exceeds the limit"),
            "{huge:?}"
        );
        for (i, id) in ids[2..].iter().enumerate() {
            let job = db.store.job(*id).await.unwrap();
            assert_eq!(job.state, JobState::Done, "{job:?}");
            assert_eq!(job.result, Some(serde_json::json!(format!("ok {i}"))));
        }
        for id in &ids {
            assert_eq!(h.runs_of(*id).len(), 1, "job {id} ran more than once");
        }
        assert_eq!(m.counters.results_refused, 2, "{:?}", m.counters);
        assert_eq!(db.count_where("lease_expiries", "true").await, 0);
        db.drop().await;
    }))
}

#[test]
fn a_stored_payload_nested_too_deep_to_read_is_dead_alone_and_its_batch_runs() {
    run_in_system(within(60, "poison payload test", async {
        let db = TestDb::with_options("rt_poison_payload", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        // Written around the enqueue checks (an older version, or another writer):
        // jsonb stores any depth, serde_json reads 128 levels at most.
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        let poison: i64 = sqlx::query_scalar(&format!(
            "INSERT INTO {} (queue, kind, state, payload, payload_bytes, max_attempts)
             VALUES ('default', 'scripted', 'pending', $1::jsonb, 400, 25) RETURNING id",
            db.table("jobs")
        ))
        .bind(&deep)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        let mut ids = vec![JobId(poison)];
        for i in 0..6 {
            ids.push(
                db.store
                    .enqueue(scripted(work(&format!("fine{i}"), 0)))
                    .await
                    .unwrap(),
            );
        }
        // One scheduler claims them all in one statement.
        let scheduler = Scheduler::builder(
            db.pool.clone(),
            config_with_lease(&db.schema, Duration::from_secs(2)),
        )
        .register(h.clone())
        .start()
        .await
        .unwrap();
        all_ended(&db, &ids).await;
        let m = scheduler.metrics();
        scheduler.shutdown().await.unwrap();

        let job = db.store.job(ids[0]).await.unwrap();
        assert_eq!(job.state, JobState::Dead, "{job:?}");
        assert!(
            job.last_error
                .as_deref()
                .unwrap()
                .contains("payload cannot be decoded"),
            "{job:?}"
        );
        assert!(
            job.payload_error.is_some(),
            "the operator's view says why: {job:?}"
        );
        assert_eq!(job.attempts, 1, "dead at once: {job:?}");
        for id in &ids[1..] {
            assert_eq!(db.store.job(*id).await.unwrap().state, JobState::Done);
            assert_eq!(h.runs_of(*id).len(), 1, "job {id} ran more than once");
        }
        assert!(h.runs_of(ids[0]).is_empty());
        assert_eq!(m.counters.decode_failures, 1, "{:?}", m.counters);
        assert_eq!(db.count_where("lease_expiries", "true").await, 0);
        db.drop().await;
    }))
}
