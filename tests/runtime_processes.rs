//! Two schedulers in separate OS processes on one schema: every job done exactly once,
//! per-key order held, no two jobs of a key overlapping; and a scheduler process killed
//! mid-run loses nothing.
//!
//! The second process is this test binary, re-executed to run only [`worker_process`]
//! with `LEASEHOLD_WORKER_SCHEMA` set (see `tests/common/worker.rs`).

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::collections::{BTreeMap, HashMap};
use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::{within, TestDb};
use leasehold::{NewJob, OwnerId, StoreOptions};
use worker::{
    config_with_lease, create_run_tables, run_in_system, start_logged, stop_workers, wait_until,
    ChildWorker, Step, POOL,
};

/// The worker entry: a no-op in a normal test run; a scheduler process when re-executed
/// with `LEASEHOLD_WORKER_SCHEMA` set.
#[test]
fn worker_process() {
    worker::worker_main();
}

const WORKER_ENTRY: &str = "worker_process";

/// `keys` keys with `per_key` jobs each, plus `unkeyed` unkeyed jobs, in waves: wave `n`
/// holds the `n`th job of every key and its share of the unkeyed ones, so enqueue order
/// within a key is the wave order.
fn workload(keys: usize, per_key: i64, unkeyed: i64, sleep_ms: u64) -> Vec<Vec<NewJob>> {
    let mut waves = Vec::new();
    let mut u = 0;
    for n in 1..=per_key {
        let mut wave = Vec::new();
        for k in 0..keys {
            wave.push(
                NewJob::new(
                    "logged",
                    &Step {
                        n,
                        sleep_ms,
                        abort: false,
                    },
                )
                .unwrap()
                .with_key(format!("acct-{k:03}")),
            );
            // Unkeyed jobs spread evenly through the waves.
            while (u + 1) * per_key * keys as i64
                <= unkeyed * ((n - 1) * keys as i64 + k as i64 + 1)
            {
                u += 1;
                wave.push(
                    NewJob::new(
                        "logged",
                        &Step {
                            n: u,
                            sleep_ms,
                            abort: false,
                        },
                    )
                    .unwrap(),
                );
            }
        }
        waves.push(wave);
    }
    waves
}

/// Enqueue wave after wave, with a pause between: a key whose previous job is done by
/// then has a claimable head that either process may take, so keys move between
/// processes.
async fn enqueue_waves(db: &TestDb, waves: Vec<Vec<NewJob>>, pause: Duration) {
    for wave in waves {
        db.store.enqueue_many(wave).await.unwrap();
        tokio::time::sleep(pause).await;
    }
}

async fn count(db: &TestDb, sql: &str) -> i64 {
    sqlx::query_scalar(&sql.replace("{s}", &format!("\"{}\"", db.schema)))
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// (job, generation) pairs that `sql` selects for `owner` (its `$1`).
async fn runs_of(db: &TestDb, sql: &str, owner: &str) -> Vec<(i64, i64)> {
    sqlx::query_as(&sql.replace("{s}", &format!("\"{}\"", db.schema)))
        .bind(owner)
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

/// The events of these jobs, for a failure message.
async fn history_of(db: &TestDb, jobs: &[&(i64, i64)]) -> Vec<(i64, i64, String, Option<String>)> {
    let ids: Vec<i64> = jobs.iter().map(|j| j.0).collect();
    sqlx::query_as(&format!(
        "SELECT job_id, generation, event, owner FROM {} WHERE job_id = ANY($1) ORDER BY id",
        db.table("job_events")
    ))
    .bind(&ids)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

async fn wait_all_done(db: &TestDb, total: i64, secs: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let done = db.count_where("jobs", "state = 'done'").await;
        if done == total {
            return;
        }
        if tokio::time::Instant::now() > deadline {
            let by_state: Vec<(String, i64)> = sqlx::query_as(&format!(
                "SELECT state, count(*) FROM {} GROUP BY state",
                db.table("jobs")
            ))
            .fetch_all(&db.pool)
            .await
            .unwrap();
            panic!("only {done} of {total} jobs done after {secs}s: {by_state:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One finished run of a keyed job, from the run log.
#[derive(Debug, sqlx::FromRow)]
struct Run {
    job: i64,
    key: String,
    key_seq: i64,
    n: i64,
    generation: i64,
    worker: String,
    started: DateTime<Utc>,
    ended: DateTime<Utc>,
}

/// Finished runs of keyed jobs by key, each key's runs in start order.
async fn finished_runs_by_key(db: &TestDb) -> BTreeMap<String, Vec<Run>> {
    let runs: Vec<Run> = sqlx::query_as(&format!(
        "SELECT job_id AS job, job_key AS key, key_seq, n, generation, worker, started, ended
         FROM {} WHERE job_key IS NOT NULL AND ended IS NOT NULL
         ORDER BY job_key, started, run_id",
        db.table("run_log")
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let mut by_key: BTreeMap<String, Vec<Run>> = BTreeMap::new();
    for run in runs {
        by_key.entry(run.key.clone()).or_default().push(run);
    }
    by_key
}

/// Per key: runs never overlap, key_seq never goes back, and the completing runs (the
/// run whose generation is the job's final one) follow enqueue order exactly.
fn assert_key_order(
    by_key: &BTreeMap<String, Vec<Run>>,
    final_generation: &HashMap<i64, i64>,
    per_key: i64,
) {
    for (key, runs) in by_key {
        for pair in runs.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            assert!(a.ended <= b.started, "{key}: runs overlap: {a:?} and {b:?}");
            assert!(
                a.key_seq <= b.key_seq,
                "{key}: ran out of order: {a:?} before {b:?}"
            );
        }
        let completing: Vec<&Run> = runs
            .iter()
            .filter(|r| final_generation.get(&r.job) == Some(&r.generation))
            .collect();
        let ns: Vec<i64> = completing.iter().map(|r| r.n).collect();
        assert_eq!(
            ns,
            (1..=per_key).collect::<Vec<_>>(),
            "{key}: completing runs not in enqueue order"
        );
        assert!(
            completing.windows(2).all(|p| p[0].key_seq < p[1].key_seq),
            "{key}: completing runs not in key_seq order"
        );
    }
}

async fn final_generations(db: &TestDb) -> HashMap<i64, i64> {
    sqlx::query_as::<_, (i64, i64)>(&format!("SELECT id, generation FROM {}", db.table("jobs")))
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

#[test]
fn two_processes_run_every_job_exactly_once_in_key_order() {
    run_in_system(within(240, "two-process end-to-end test", async {
        let db = TestDb::with_options("rt_two_processes", StoreOptions::default(), POOL).await;
        create_run_tables(&db).await;
        // A longer lease than the other runtime tests: "exactly once" below holds only
        // while no lease expires, and a loaded 2-core machine must not turn a legitimate
        // at-least-once rerun into a failure. The test asserts that none expired.
        let lease = Duration::from_secs(5);
        let mut child = ChildWorker::spawn(WORKER_ENTRY, &db.schema, "child", lease);
        let local = start_logged(&db.pool, config_with_lease(&db.schema, lease), "parent").await;
        child.ready(&db).await;

        let (keys, per_key, unkeyed) = (100, 27, 300);
        let waves = workload(keys, per_key, unkeyed, 2);
        let total = waves.iter().map(Vec::len).sum::<usize>() as i64;
        assert_eq!(total, 3000);
        enqueue_waves(&db, waves, Duration::from_millis(40)).await;
        wait_all_done(&db, total, 150).await;

        stop_workers(&db).await;
        let status = child.exited(Duration::from_secs(30)).await;
        assert!(
            status.success(),
            "worker failed: {status}\n{}",
            child.output()
        );
        local.shutdown().await.unwrap();

        // Every job done by its first and only claim; no lease expired.
        assert_eq!(count(&db, "SELECT count(*) FROM {s}.jobs").await, total);
        assert_eq!(
            db.count_where(
                "jobs",
                "state <> 'done' OR attempts <> 1 OR generation <> 1"
            )
            .await,
            0
        );
        assert_eq!(db.count_where("lease_expiries", "true").await, 0);
        // Each job ran exactly once, and its run finished.
        assert_eq!(db.count_where("run_log", "true").await, total);
        assert_eq!(
            count(&db, "SELECT count(DISTINCT job_id) FROM {s}.run_log").await,
            total
        );
        assert_eq!(db.count_where("run_log", "ended IS NULL").await, 0);
        // The run log agrees with the job rows.
        assert_eq!(
            count(
                &db,
                "SELECT count(*) FROM {s}.run_log r JOIN {s}.jobs j ON j.id = r.job_id
                 WHERE r.job_key IS NOT DISTINCT FROM j.job_key
                   AND r.key_seq IS NOT DISTINCT FROM j.key_seq AND r.generation = j.generation"
            )
            .await,
            total
        );
        // Both processes did work.
        let per_worker: Vec<(String, i64)> = sqlx::query_as(&format!(
            "SELECT worker, count(*) FROM {} GROUP BY worker ORDER BY worker",
            db.table("run_log")
        ))
        .fetch_all(&db.pool)
        .await
        .unwrap();
        eprintln!("runs per process: {per_worker:?}");
        assert_eq!(per_worker.len(), 2, "{per_worker:?}");
        assert!(per_worker.iter().all(|(_, n)| *n > 0), "{per_worker:?}");

        // Per key: one at a time, in enqueue order.
        let by_key = finished_runs_by_key(&db).await;
        assert_eq!(by_key.len(), keys);
        assert!(by_key.values().all(|r| r.len() == per_key as usize));
        assert_key_order(&by_key, &final_generations(&db).await, per_key);
        // Keys moved between processes (the order held across them, not just within one).
        let crossed = by_key
            .values()
            .filter(|runs| runs.windows(2).any(|p| p[0].worker != p[1].worker))
            .count();
        eprintln!("keys that ran in both processes: {crossed}");
        assert!(crossed > 0, "no key ever moved between the processes");

        db.drop().await;
    }))
}

#[test]
fn a_killed_scheduler_process_loses_nothing_and_keys_stay_in_order() {
    run_in_system(within(180, "kill-a-process test", async {
        let db = TestDb::with_options("rt_killed_process", StoreOptions::default(), POOL).await;
        create_run_tables(&db).await;
        let lease = Duration::from_secs(2);
        let mut victim = ChildWorker::spawn(WORKER_ENTRY, &db.schema, "victim", lease);
        let victim_owner = victim.ready(&db).await;
        let local = start_logged(&db.pool, config_with_lease(&db.schema, lease), "survivor").await;

        let (keys, per_key, unkeyed) = (40, 10, 100);
        let waves = workload(keys, per_key, unkeyed, 40);
        let total = waves.iter().map(Vec::len).sum::<usize>() as i64;
        db.store
            .enqueue_many(waves.into_iter().flatten().collect())
            .await
            .unwrap();

        // Kill the victim while it has runs in flight, after it finished some.
        wait_until(60, "the victim to be mid-run", || async {
            db.count_where("run_log", "worker = 'victim' AND ended IS NOT NULL")
                .await
                >= 30
                && db
                    .count_where("run_log", "worker = 'victim' AND ended IS NULL")
                    .await
                    >= 1
        })
        .await;
        let status = victim.kill();
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}");
        // A COMMIT the victim sent just before dying may still land (a completion from
        // its writer, a claim from its claimer); count what it held once all its
        // backends are gone: the worker's own pool and the scheduler's
        // `leasehold-<role> <pid>:<nonce>` sessions.
        let victim_app = format!("lh-{}-victim", db.schema);
        let victim_sessions = format!(
            "leasehold-% {}",
            OwnerId::named(victim_owner.clone()).short()
        );
        wait_until(30, "the victim's backends to end", || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE application_name = $1 OR application_name LIKE $2",
            )
            .bind(&victim_app)
            .bind(&victim_sessions)
            .fetch_one(&db.pool)
            .await
            .unwrap()
                == 0
        })
        .await;
        let held = runs_of(
            &db,
            "SELECT id, generation FROM {s}.jobs WHERE state = 'running' AND owner = $1",
            &victim_owner,
        )
        .await;
        let held_at_kill = held.len();
        eprintln!("the victim held {held_at_kill} running jobs when killed");

        // The survivor reaps the victim's leases and finishes everything.
        wait_all_done(&db, total, 60).await;
        let m = local.metrics();
        local.shutdown().await.unwrap();

        assert_eq!(count(&db, "SELECT count(*) FROM {s}.jobs").await, total);
        // Each run the victim held when it died was taken back by a reap of exactly
        // that generation (nothing else may end a dead owner's run).
        let reaped = runs_of(
            &db,
            "SELECT job_id, generation FROM {s}.lease_expiries WHERE owner = $1",
            &victim_owner,
        )
        .await;
        assert!(!reaped.is_empty(), "no lease of the victim expired");
        let not_reaped: Vec<_> = held.iter().filter(|h| !reaped.contains(h)).collect();
        assert!(
            not_reaped.is_empty(),
            "runs the victim held at its death that no reap took back (job, generation): \
             {not_reaped:?} of {held_at_kill}; their history: {:?}",
            history_of(&db, &not_reaped).await
        );
        assert!(m.counters.reaped >= 1, "{:?}", m.counters);
        // A survivor lease expiring (a loaded machine) would be a legitimate rerun, not a
        // failure; say so if it happened.
        let survivor_expiries = db
            .count_where("lease_expiries", &format!("owner <> '{victim_owner}'"))
            .await;
        eprintln!("survivor leases that expired: {survivor_expiries}");
        // Every job has exactly one run of its final generation, and that run finished.
        assert_eq!(
            count(
                &db,
                "SELECT count(*) FROM {s}.run_log r JOIN {s}.jobs j
                   ON j.id = r.job_id AND j.generation = r.generation
                 WHERE r.ended IS NOT NULL"
            )
            .await,
            total
        );
        // Runs cut short by the kill were all the victim's.
        assert_eq!(
            db.count_where("run_log", "ended IS NULL AND worker <> 'victim'")
                .await,
            0
        );
        let reruns = count(
            &db,
            "SELECT count(*) FROM (SELECT job_id FROM {s}.run_log GROUP BY job_id HAVING count(*) > 1) x",
        )
        .await;
        eprintln!("jobs run more than once: {reruns}");

        // Finished runs per key (the victim's unfinished ones left out): one at a time,
        // key_seq never going back, completions in enqueue order.
        let by_key = finished_runs_by_key(&db).await;
        assert_eq!(by_key.len(), keys);
        assert_key_order(&by_key, &final_generations(&db).await, per_key);

        db.drop().await;
    }))
}
