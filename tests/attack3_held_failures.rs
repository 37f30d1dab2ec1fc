//! Promise 1/2 on the failure and snooze paths: a session holds the rows of jobs whose
//! handlers returned an error (or snoozed), so those endings cannot be written. Only
//! those endings may wait: every other job's ending must land promptly ("the other
//! jobs' endings are written as usual", "only the held job's ending waits").

mod common;
#[path = "common/host_keys.rs"]
mod host_keys;
#[path = "common/scripted.rs"]
mod scripted;
#[path = "common/worker.rs"]
mod worker;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{within, TestDb};
use host_keys::{quick_endings, wait_done};
use leasehold::{Handler, JobContext, JobError, JobId, JobState, NewJob, Scheduler, StoreOptions};
use scripted::Scripted;
use serde::{Deserialize, Serialize};
use sqlx::Connection;
use worker::{config_with_lease, run_in_system, POOL};

const LEASE: Duration = Duration::from_secs(2);

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Ending {
    tag: String,
    /// "fail" or "snooze"
    how: String,
}

/// Waits for its gate, then fails (retry in a minute) or snoozes a minute. Logs each run.
#[derive(Clone, Default)]
struct Ender {
    gate: Arc<AtomicBool>,
    runs: Arc<Mutex<Vec<(String, Instant)>>>,
}

impl Handler for Ender {
    type Payload = Ending;
    type Output = serde_json::Value;
    const KIND: &'static str = "ender";

    async fn run(&self, _ctx: JobContext, e: Ending) -> Result<serde_json::Value, JobError> {
        while !self.gate.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.runs
            .lock()
            .unwrap()
            .push((e.tag.clone(), Instant::now()));
        match e.how.as_str() {
            "snooze" => Err(JobError::snooze(Duration::from_secs(60))),
            _ => Err(JobError::retry_after(
                "failing on purpose",
                Duration::from_secs(60),
            )),
        }
    }
}

async fn start(db: &TestDb, h: &Scripted, e: &Ender) -> Scheduler {
    let mut config = config_with_lease(&db.schema, LEASE);
    // Room for the held jobs and the quick ones.
    config.concurrency = 24;
    Scheduler::builder(db.pool.clone(), config)
        .register(h.clone())
        .register(e.clone())
        .start()
        .await
        .unwrap()
}

async fn held_endings_do_not_delay_others(name: &str, how: &str, n: usize) {
    let db = TestDb::with_options(name, StoreOptions::default(), POOL).await;
    let h = Scripted::new(&db.pool);
    let e = Ender::default();
    let scheduler = start(&db, &h, &e).await;
    let mut held: Vec<JobId> = Vec::new();
    for i in 0..n {
        let job = NewJob::new(
            "ender",
            &Ending {
                tag: format!("held-{i}"),
                how: how.into(),
            },
        )
        .unwrap()
        .with_max_attempts(10);
        held.push(scheduler.enqueue_job(job).await.unwrap());
    }
    within(10, "held jobs running", async {
        loop {
            let mut all = true;
            for id in &held {
                if db.store.job(*id).await.unwrap().state != JobState::Running {
                    all = false;
                }
            }
            if all {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let mut session = db.raw_conn("locker").await;
    let mut tx = session.begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {} WHERE id = ANY($1) FOR UPDATE",
        db.table("jobs")
    ))
    .bind(held.iter().map(|j| j.0).collect::<Vec<_>>())
    .execute(&mut *tx)
    .await
    .unwrap();
    e.gate.store(true, Ordering::SeqCst);
    within(10, "held handlers returned", async {
        while e.runs.lock().unwrap().len() < n {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    // Let their endings start retrying. The session lets go well within the held jobs'
    // leases (renewals cannot reach them meanwhile), so each held ending must land and
    // its job never run again: a lock held past the lease lets the reaper take it first.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let key_of = |i: usize| (i % 2 == 1).then(|| format!("Q{i}"));
    let (quick, waits) = quick_endings(&scheduler, &h, &db, 8, key_of).await;
    for id in &held {
        assert_eq!(db.store.job(*id).await.unwrap().state, JobState::Running);
    }
    tx.rollback().await.unwrap();
    // The held endings land once the session lets go: pending again (failed or snoozed).
    within(20, "held endings written", async {
        loop {
            let mut all = true;
            for id in &held {
                if db.store.job(*id).await.unwrap().state == JobState::Running {
                    all = false;
                }
            }
            if all {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    wait_done(&db, &quick, 20).await;
    let m = scheduler.metrics();
    scheduler.shutdown().await.unwrap();
    for id in &held {
        let job = db.store.job(*id).await.unwrap();
        assert_eq!(job.state, JobState::Pending, "{job:?}");
    }
    assert_eq!(e.runs.lock().unwrap().len(), n, "a held job ran again");
    for id in &quick {
        let job = db.store.job(*id).await.unwrap();
        assert_eq!(
            (job.state, job.generation.0),
            (JobState::Done, 1),
            "{job:?}"
        );
        assert_eq!(h.runs_of(*id).len(), 1);
    }
    let slowest = waits.iter().max().copied().unwrap();
    eprintln!("{how} x{n}: waits {waits:?} {:?}", m.counters);
    assert!(
        slowest < LEASE / 4,
        "a job waited {slowest:?} from its handler's return to done while a session held \
         {n} rows of jobs whose handlers returned ({how}); all: {waits:?}; {:?}",
        m.counters
    );
    h.assert_keys_serial();
    db.drop().await;
}

#[test]
fn held_rows_of_failed_jobs_do_not_delay_other_jobs_endings() {
    run_in_system(within(120, "held failures", async {
        held_endings_do_not_delay_others("a3_heldfail", "fail", 12).await;
    }))
}

#[test]
fn held_rows_of_snoozed_jobs_do_not_delay_other_jobs_endings() {
    run_in_system(within(120, "held snoozes", async {
        held_endings_do_not_delay_others("a3_heldsnooze", "snooze", 12).await;
    }))
}
