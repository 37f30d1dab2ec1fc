//! "A queue's limit is a cap, never a reservation" (never more than the cap held,
//! keyed successors and claim-ahead included; an empty or paused capped queue leaves
//! every slot to the others; priority across queues) and "shutdown() runs once, whoever
//! stops waiting for it" (concurrent callers, a caller that times out, a handler that
//! calls it on its own scheduler, drop of the last handle).

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use common::*;
use leasehold::{Handler, JobContext, JobError, JobState, NewJob, Scheduler};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use worker::{fast_config, run_in_system, wait_until, POOL};

#[derive(Serialize, Deserialize, Clone)]
struct Sleep {
    ms: u64,
}

/// Logs start/end of each run in `runs` (database clock).
struct Timed {
    pool: PgPool,
    schema: String,
}

impl Handler for Timed {
    type Payload = Sleep;
    type Output = ();
    const KIND: &'static str = "timed";

    async fn run(&self, ctx: JobContext, s: Sleep) -> Result<(), JobError> {
        let run: i64 = sqlx::query_scalar(&format!(
            "INSERT INTO \"{}\".runs (job_id, queue) VALUES ($1, $2) RETURNING run_id",
            self.schema
        ))
        .bind(ctx.job_id().0)
        .bind(&ctx.job().queue)
        .fetch_one(&self.pool)
        .await?;
        tokio::time::sleep(Duration::from_millis(s.ms)).await;
        sqlx::query(&format!(
            "UPDATE \"{}\".runs SET ended = clock_timestamp() WHERE run_id = $1",
            self.schema
        ))
        .bind(run)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}

async fn runs_table(db: &TestDb) {
    sqlx::query(&format!(
        "CREATE TABLE {} (run_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, job_id bigint, queue text,
          started timestamptz NOT NULL DEFAULT clock_timestamp(), ended timestamptz)",
        db.table("runs")
    ))
    .execute(&db.owner)
    .await
    .unwrap();
}

/// Most runs of `queue` (any queue: None) overlapping at one instant.
async fn max_overlap(db: &TestDb, queue: Option<&str>) -> i64 {
    let cond = match queue {
        Some(q) => format!("WHERE queue = '{q}'"),
        None => String::new(),
    };
    sqlx::query_scalar(&format!(
        "WITH r AS (SELECT * FROM {t} {cond})
         SELECT coalesce(max(n), 0) FROM (
           SELECT (SELECT count(*) FROM r r2 WHERE r2.started <= r1.started
                     AND coalesce(r2.ended, 'infinity') > r1.started) AS n
           FROM r r1) x",
        t = db.table("runs")
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

fn sleep_job(queue: &str, ms: u64) -> NewJob {
    NewJob::new("timed", &Sleep { ms })
        .unwrap()
        .with_queue(queue)
}

#[test]
fn a_capped_queue_never_runs_more_than_its_cap_keyed_and_unkeyed() {
    run_in_system(within(90, "caps", async {
        let db = TestDb::with_options("atk_caps", Default::default(), POOL).await;
        runs_table(&db).await;
        let mut jobs = Vec::new();
        for n in 0..30 {
            jobs.push(sleep_job("webhooks", 150));
            jobs.push(sleep_job("webhooks", 100).with_key(format!("k{}", n % 6)));
            jobs.push(sleep_job("default", 100));
        }
        db.store.enqueue_many(jobs).await.unwrap();
        let mut c = fast_config(&db.schema);
        c.concurrency = 6;
        c.queues = vec!["default".into(), "webhooks".into()];
        c.queue_concurrency.insert("webhooks".into(), 2);
        let s = Scheduler::builder(db.pool.clone(), c)
            .register(Timed {
                pool: db.pool.clone(),
                schema: db.schema.clone(),
            })
            .start()
            .await
            .unwrap();
        wait_until(60, "every job done", || async {
            db.count_where("jobs", "state = 'done'").await == 90
        })
        .await;
        s.shutdown().await.unwrap();
        let w = max_overlap(&db, Some("webhooks")).await;
        let all = max_overlap(&db, None).await;
        assert!(w <= 2, "webhooks (cap 2) ran {w} at once");
        assert!(all <= 6, "{all} at once at concurrency 6");
        db.drop().await;
    }))
}

#[test]
fn an_empty_capped_queue_reserves_nothing_even_when_its_cap_is_the_whole_concurrency() {
    run_in_system(within(60, "no reservation", async {
        let db = TestDb::with_options("atk_caps_res", Default::default(), POOL).await;
        runs_table(&db).await;
        db.store
            .enqueue_many((0..8).map(|_| sleep_job("default", 1500)).collect())
            .await
            .unwrap();
        // A paused capped queue with jobs, and an empty one.
        db.store
            .enqueue_many((0..4).map(|_| sleep_job("webhooks", 10)).collect())
            .await
            .unwrap();
        db.store
            .pause_queue("webhooks", Some("test"))
            .await
            .unwrap();
        let mut c = fast_config(&db.schema);
        c.concurrency = 4;
        c.queues = vec!["webhooks".into(), "empty".into(), "default".into()];
        c.queue_concurrency.insert("webhooks".into(), 4);
        c.queue_concurrency.insert("empty".into(), 4);
        let s = Scheduler::builder(db.pool.clone(), c)
            .register(Timed {
                pool: db.pool.clone(),
                schema: db.schema.clone(),
            })
            .start()
            .await
            .unwrap();
        wait_until(10, "four default jobs running at once", || async {
            db.count_where("runs", "ended IS NULL AND queue = 'default'")
                .await
                == 4
        })
        .await;
        s.shutdown().await.unwrap();
        db.drop().await;
    }))
}

#[test]
fn priority_holds_across_a_capped_and_an_uncapped_queue() {
    run_in_system(within(60, "priority", async {
        let db = TestDb::with_options("atk_caps_prio", Default::default(), POOL).await;
        runs_table(&db).await;
        // Urgent default jobs (priority -5), then low-priority capped ones, enqueued first.
        let mut jobs: Vec<NewJob> = (0..4)
            .map(|_| sleep_job("webhooks", 300).with_priority(5))
            .collect();
        jobs.extend((0..4).map(|_| sleep_job("default", 300).with_priority(-5)));
        db.store.enqueue_many(jobs).await.unwrap();
        let mut c = fast_config(&db.schema);
        c.concurrency = 2;
        c.claim_ahead = 0;
        c.queues = vec!["webhooks".into(), "default".into()];
        c.queue_concurrency.insert("webhooks".into(), 2);
        let s = Scheduler::builder(db.pool.clone(), c)
            .register(Timed {
                pool: db.pool.clone(),
                schema: db.schema.clone(),
            })
            .start()
            .await
            .unwrap();
        wait_until(30, "all done", || async {
            db.count_where("jobs", "state = 'done'").await == 8
        })
        .await;
        s.shutdown().await.unwrap();
        let order: Vec<String> = sqlx::query_scalar(&format!(
            "SELECT queue FROM {} ORDER BY started LIMIT 4",
            db.table("runs")
        ))
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            order,
            vec!["default"; 4],
            "priority -5 jobs must start first"
        );
        db.drop().await;
    }))
}

// ---------------------------------------------------------------------------
// Shutdown.
// ---------------------------------------------------------------------------

/// Ignores cancellation: runs `ms`.
struct Stubborn;

impl Handler for Stubborn {
    type Payload = Sleep;
    type Output = ();
    const KIND: &'static str = "stubborn";

    async fn run(&self, _ctx: JobContext, s: Sleep) -> Result<(), JobError> {
        tokio::time::sleep(Duration::from_millis(s.ms)).await;
        Ok(())
    }
}

#[test]
fn concurrent_and_timed_out_shutdown_callers_all_get_the_one_report() {
    run_in_system(within(60, "concurrent shutdown", async {
        let db = TestDb::with_options("atk_shut_conc", Default::default(), POOL).await;
        let id = db
            .store
            .enqueue(NewJob::new("stubborn", &Sleep { ms: 30_000 }).unwrap())
            .await
            .unwrap();
        let mut c = fast_config(&db.schema);
        c.shutdown_grace = Duration::from_millis(800);
        let s = Scheduler::builder(db.pool.clone(), c)
            .register(Stubborn)
            .start()
            .await
            .unwrap();
        wait_until(10, "running", || async {
            db.state_of(id).await == "running"
        })
        .await;
        // A first caller gives up at once, then three at once, then one more.
        let gave_up = tokio::time::timeout(Duration::from_millis(50), s.shutdown()).await;
        assert!(gave_up.is_err());
        let s2 = s.clone();
        let (a, b, c2) = tokio::join!(s.shutdown(), s2.shutdown(), async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            s.shutdown().await
        });
        let (a, b, c2) = (a.unwrap(), b.unwrap(), c2.unwrap());
        for r in [&a, &b, &c2] {
            assert_eq!(
                (r.drained, r.cancelled),
                (0, 1),
                "report: drained {} cancelled {}",
                r.drained,
                r.cancelled
            );
        }
        let late = s.shutdown().await.unwrap();
        assert_eq!((late.drained, late.cancelled), (0, 1));
        let j = db.store.job(id).await.unwrap();
        assert_eq!(j.state, JobState::Pending, "released at shutdown: {j:?}");
        db.drop().await;
    }))
}

/// A handler that shuts its own scheduler down (a "stop" job, a fatal condition): the
/// shutdown must end within the grace, and the job must not be left running.
struct StopMe {
    handle: Arc<OnceLock<Scheduler>>,
    report: Arc<Mutex<Option<String>>>,
}

impl Handler for StopMe {
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "stop_me";

    async fn run(&self, _ctx: JobContext, _p: serde_json::Value) -> Result<(), JobError> {
        let s = self.handle.get().expect("handle set").clone();
        let r = s.shutdown().await;
        *self.report.lock().unwrap() = Some(format!("{:?}", r.map(|r| (r.drained, r.cancelled))));
        Ok(())
    }
}

#[test]
fn a_handler_calling_shutdown_on_its_own_scheduler_does_not_hang_it() {
    run_in_system(within(60, "self shutdown", async {
        let db = TestDb::with_options("atk_shut_self", Default::default(), POOL).await;
        let id = db
            .store
            .enqueue(NewJob::from_json("stop_me", serde_json::json!({})))
            .await
            .unwrap();
        let handle = Arc::new(OnceLock::new());
        let report = Arc::new(Mutex::new(None));
        let mut c = fast_config(&db.schema);
        c.shutdown_grace = Duration::from_millis(1000);
        let s = Scheduler::builder(db.pool.clone(), c)
            .register(StopMe {
                handle: handle.clone(),
                report: report.clone(),
            })
            .start()
            .await
            .unwrap();
        let _ = handle.set(s.clone());
        let r = tokio::time::timeout(Duration::from_secs(15), async {
            wait_until(10, "the job to run", || async {
                db.state_of(id).await != "pending"
            })
            .await;
            s.shutdown().await
        })
        .await;
        assert!(
            r.is_ok(),
            "shutdown called from a handler hung the scheduler's shutdown"
        );
        let j = db.store.job(id).await.unwrap();
        assert_ne!(j.state, JobState::Running, "{j:?}");
        db.drop().await;
    }))
}
