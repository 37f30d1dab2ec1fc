//! Held job rows of finished jobs: the finished work is kept while the row is held
//! within the lease (promise 4), the job ends exactly once when the row is held past
//! the lease (promise 3), and the writer's bound holds with `writer_lock_wait` below a
//! turn and with one writer connection (promise 2).

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
use leasehold::{Config, JobId, JobState, Scheduler, StoreOptions};
use scripted::{scripted, work, Script, Scripted};
use sqlx::Connection;
use worker::{config_with_lease, run_in_system, POOL};

const LEASE: Duration = Duration::from_secs(2);

async fn start_with(db: &TestDb, h: &Scripted, tweak: impl FnOnce(&mut Config)) -> Scheduler {
    let mut config = config_with_lease(&db.schema, LEASE);
    tweak(&mut config);
    Scheduler::builder(db.pool.clone(), config)
        .register(h.clone())
        .start()
        .await
        .unwrap()
}

/// Run `n` gated jobs (keyed ones with `key_of`), lock their rows, let them return, and
/// hold the rows for `hold`. Returns the ids and the moment the rows were let go.
async fn hold_finished(
    db: &TestDb,
    h: &Scripted,
    scheduler: &Scheduler,
    keys: &[Option<&str>],
    hold: Duration,
) -> (Vec<JobId>, Instant) {
    let mut held = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let job = scripted(Script {
            gate: Some("finish-held".into()),
            ..work(&format!("held-{i}"), 0)
        });
        let job = match key {
            Some(k) => job.with_key(*k),
            None => job,
        };
        held.push(scheduler.enqueue_job(job).await.unwrap());
    }
    for i in 0..held.len() {
        h.started(&format!("held-{i}"), 10).await;
    }
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
    h.open("finish-held");
    for i in 0..held.len() {
        h.ended(&format!("held-{i}"), 10).await;
    }
    tokio::time::sleep(hold).await;
    for id in &held {
        assert_eq!(db.store.job(*id).await.unwrap().state, JobState::Running);
    }
    tx.rollback().await.unwrap();
    (held, Instant::now())
}

/// Promise 4: rows held for half a lease after the handlers returned (keyed and not):
/// the finished work is written once the rows are free, and no handler runs again.
#[test]
fn finished_work_is_kept_while_its_row_is_held_for_half_a_lease() {
    run_in_system(within(90, "half-lease hold", async {
        let db = TestDb::with_options("a3_fin_holdhalf", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let scheduler = start_with(&db, &h, |_| {}).await;
        let keys = [None, Some("A"), None, Some("B")];
        let (held, freed) = hold_finished(&db, &h, &scheduler, &keys, LEASE / 2).await;
        wait_done(&db, &held, 20).await;
        let after = freed.elapsed();
        let m = scheduler.metrics();
        scheduler.shutdown().await.unwrap();
        for id in &held {
            let job = db.store.job(*id).await.unwrap();
            assert_eq!(
                (job.state, job.generation.0),
                (JobState::Done, 1),
                "{job:?}"
            );
            assert_eq!(h.runs_of(*id).len(), 1, "job {id} ran again");
        }
        assert!(
            after < LEASE / 2,
            "done {after:?} after the rows were let go"
        );
        assert_eq!(db.count_where("lease_expiries", "true").await, 0);
        assert_eq!(m.counters.stale_completions, 0, "{:?}", m.counters);
        db.drop().await;
    }))
}

/// Promise 3: rows held for a lease and a half after the handlers returned. Whatever
/// happens to the attempts (kept, or expired and run again), every job ends done exactly
/// once, by one attempt, and a key's jobs never overlap.
#[test]
fn a_row_held_past_the_lease_still_ends_its_job_exactly_once() {
    run_in_system(within(90, "held past lease", async {
        let db = TestDb::with_options("a3_fin_holdpast", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let scheduler = start_with(&db, &h, |_| {}).await;
        let keys = [None, Some("A"), Some("A2")];
        let (held, _) = hold_finished(&db, &h, &scheduler, &keys, LEASE * 3 / 2).await;
        wait_done(&db, &held, 30).await;
        tokio::time::sleep(LEASE).await;
        let m = scheduler.metrics();
        scheduler.shutdown().await.unwrap();
        for id in &held {
            let job = db.store.job(*id).await.unwrap();
            assert_eq!(job.state, JobState::Done, "{job:?}");
            let runs = h.runs_of(*id);
            assert_eq!(
                job.generation.0 as usize,
                runs.len(),
                "job {id}: generation {} but {} runs: {runs:?}",
                job.generation.0,
                runs.len()
            );
            let completed: i64 = db
                .count_where(
                    "job_events",
                    &format!("job_id = {} AND event = 'completed'", id.0),
                )
                .await;
            assert!(completed <= 1, "job {id} completed {completed} times");
        }
        eprintln!("held past lease: {:?}", m.counters);
        h.assert_keys_serial();
        db.drop().await;
    }))
}

async fn other_endings_prompt(name: &str, tweak: impl FnOnce(&mut Config)) {
    let db = TestDb::with_options(name, StoreOptions::default(), POOL).await;
    let h = Scripted::new(&db.pool);
    let scheduler = start_with(&db, &h, tweak).await;
    let mut held = Vec::new();
    for (i, key) in [None, Some("H1"), None, None, Some("H2"), None]
        .into_iter()
        .enumerate()
    {
        let job = scripted(Script {
            gate: Some("finish-held".into()),
            ..work(&format!("held-{i}"), 0)
        });
        let job = match key {
            Some(k) => job.with_key(k),
            None => job,
        };
        held.push(scheduler.enqueue_job(job).await.unwrap());
    }
    for i in 0..held.len() {
        h.started(&format!("held-{i}"), 10).await;
    }
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
    h.open("finish-held");
    for i in 0..held.len() {
        h.ended(&format!("held-{i}"), 10).await;
    }
    let key_of = |i: usize| (i % 2 == 1).then(|| format!("Q{i}"));
    let (quick, waits) = quick_endings(&scheduler, &h, &db, 16, key_of).await;
    for id in &held {
        assert_eq!(db.store.job(*id).await.unwrap().state, JobState::Running);
    }
    let freed = Instant::now();
    tx.rollback().await.unwrap();
    wait_done(&db, &held, 20).await;
    let after = freed.elapsed();
    wait_done(&db, &quick, 20).await;
    let m = scheduler.metrics();
    scheduler.shutdown().await.unwrap();
    eprintln!(
        "{name}: waits {waits:?}, held done {after:?} after release; {:?}",
        m.counters
    );
    let slowest = waits.iter().max().copied().unwrap();
    assert!(
        slowest < LEASE / 4,
        "{name}: a job waited {slowest:?} from its handler's return to done while a session \
         held six finished jobs' rows; all: {waits:?}"
    );
    assert!(
        after < LEASE / 2,
        "{name}: held jobs done {after:?} after release"
    );
    for id in held.iter().chain(&quick) {
        let job = db.store.job(*id).await.unwrap();
        assert_eq!(
            (job.state, job.generation.0),
            (JobState::Done, 1),
            "{job:?}"
        );
        assert_eq!(h.runs_of(*id).len(), 1);
    }
    h.assert_keys_serial();
    db.drop().await;
}

#[test]
fn held_finished_rows_with_a_1ms_writer_lock_wait_do_not_delay_other_endings() {
    run_in_system(within(120, "1ms lock wait", async {
        other_endings_prompt("a3_fin_held1ms", |c| {
            c.writer_lock_wait = Duration::from_millis(1)
        })
        .await;
    }))
}

#[test]
fn held_finished_rows_with_one_writer_connection_do_not_delay_other_endings() {
    run_in_system(within(120, "one connection", async {
        other_endings_prompt("a3_fin_held1conn", |c| c.connections = 1).await;
    }))
}
