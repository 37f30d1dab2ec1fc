//! The scheduler embeds in any host and stops in any order: started from plain tokio
//! (no actix `System`), stopped after the host's `System` itself has stopped, stopped
//! from another thread, and with handlers on threads of their own.

mod common;
#[path = "common/scripted.rs"]
mod scripted;
#[path = "common/worker.rs"]
mod worker;

use std::time::{Duration, Instant};

use common::{runtime_options, test_db_name, within, TestDb};
use leasehold::{JobState, Scheduler, StoreOptions};
use scripted::{scripted, work, Scripted};
use worker::{fast_config, wait_until, OwnDb, POOL};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_tokio_host_runs_jobs_and_stops_cleanly() {
    within(60, "tokio host", async {
        let own = OwnDb::new("embed_tokio").await;
        let db = &own.db;
        let h = Scripted::new(&db.pool);
        let scheduler = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
            .register(h.clone())
            .start()
            .await
            .expect("no actix System needed");
        let mut ids = Vec::new();
        for i in 0..20 {
            let job = scripted(work(&format!("j{i}"), 5));
            ids.push(
                scheduler
                    .enqueue_job(if i % 2 == 0 { job.with_key("k") } else { job })
                    .await
                    .unwrap(),
            );
        }
        wait_until(20, "every job to be done", || async {
            db.count_where("jobs", "state = 'done'").await == 20
        })
        .await;
        let report = scheduler.shutdown().await.unwrap();
        assert_eq!(report.metrics.in_flight, 0);
        h.assert_keys_serial();
        assert_eq!(h.log().len(), 20);
        wait_until(10, "the scheduler's connections to close", || async {
            own.scheduler_backends().await == 0
        })
        .await;
        own.drop().await;
    })
    .await
}

#[test]
fn shutdown_works_after_the_hosts_system_stopped_and_from_another_thread() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let db = runtime.block_on(TestDb::with_options(
        "embed_stopped",
        StoreOptions::default(),
        POOL,
    ));
    let h = Scripted::new(&db.pool);
    let (pool, schema, h2) = (db.pool.clone(), db.schema.clone(), h.clone());
    // The host: an actix System on its own thread, which starts the scheduler, runs a
    // long job, and then stops (as actix-web's signal handling stops a System).
    let host = std::thread::spawn(move || {
        let system = actix::System::new();
        system.block_on(async move {
            let scheduler = Scheduler::builder(pool, fast_config(&schema))
                .register(h2.clone())
                .start()
                .await
                .unwrap();
            scheduler
                .enqueue_job(scripted(work("long", 60_000)))
                .await
                .unwrap();
            h2.started("long", 10).await;
            actix::System::current().stop();
            scheduler
        })
    });
    let scheduler = host.join().expect("the host thread");
    // The host's runtime is gone; the handler it ran was dropped with it. Shut down
    // from yet another thread, on a runtime of its own.
    let t0 = Instant::now();
    let report = std::thread::spawn(move || {
        tokio::runtime::Runtime::new()
            .unwrap()
            .block_on(async move { scheduler.shutdown().await })
    })
    .join()
    .unwrap()
    .expect("a report");
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    assert_eq!(report.metrics.in_flight, 0, "{report:?}");
    runtime.block_on(async {
        // A pool of this runtime's own: the test's pool lent connections to the host's
        // runtime, which is gone, and a connection opened there cannot be used here.
        let check = db.other_store_sized("check", 1).await;
        let job: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {} WHERE state = 'pending' AND attempts = 0",
            db.table("jobs")
        ))
        .fetch_one(check.pool())
        .await
        .unwrap();
        assert_eq!(
            job, 1,
            "the interrupted job was released, not left to its lease"
        );
        assert!(
            h.runs_tagged("long")[0].end.is_some(),
            "the handler was stopped"
        );
        db.drop().await;
    });
}

/// Hashes for `ms` milliseconds of CPU time, without yielding.
struct Burn;

impl leasehold::Handler for Burn {
    type Payload = u64;
    type Output = u64;
    const KIND: &'static str = "burn";

    async fn run(&self, _: leasehold::JobContext, ms: u64) -> Result<u64, leasehold::JobError> {
        let until = Instant::now() + Duration::from_millis(ms);
        let mut x: u64 = 1;
        while Instant::now() < until {
            for _ in 0..1000 {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
            }
        }
        Ok(x)
    }
}

#[test]
fn handlers_on_threads_of_their_own_leave_the_host_thread_free() {
    worker::run_in_system(within(60, "handler threads", async {
        let db = TestDb::with_options("embed_handler_threads", StoreOptions::default(), POOL).await;
        let mut config = fast_config(&db.schema);
        config.handler_threads = Some(2);
        let scheduler = Scheduler::builder(db.pool.clone(), config)
            .register(Burn)
            .start()
            .await
            .unwrap();
        for _ in 0..4 {
            scheduler
                .enqueue_job(leasehold::NewJob::new("burn", &800u64).unwrap())
                .await
                .unwrap();
        }
        // While CPU-bound handlers run, the host's own thread keeps its pace.
        let mut worst = Duration::ZERO;
        let t0 = Instant::now();
        while db.count_where("jobs", "state = 'done'").await < 4 {
            let tick = Instant::now();
            tokio::time::sleep(Duration::from_millis(10)).await;
            worst = worst.max(tick.elapsed());
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the jobs did not finish"
            );
        }
        scheduler.shutdown().await.unwrap();
        assert!(
            worst < Duration::from_millis(400),
            "the host thread stalled for {worst:?}"
        );
        let done = db.count_where("jobs", "state = 'done'").await;
        assert_eq!(done, 4);
        assert_eq!(
            db.store.job(leasehold::JobId(1)).await.unwrap().state,
            JobState::Done
        );
        db.drop().await;
    }))
}

/// Records the thread each attempt ran on and reads through the host's pool.
#[derive(Clone)]
struct WhereAmI {
    pool: sqlx::PgPool,
    seen: std::sync::Arc<std::sync::Mutex<Vec<(String, i64)>>>,
}

impl leasehold::Handler for WhereAmI {
    type Payload = u64;
    type Output = i64;
    const KIND: &'static str = "where";

    async fn run(&self, ctx: leasehold::JobContext, n: u64) -> Result<i64, leasehold::JobError> {
        let thread = std::thread::current().name().unwrap_or("").to_string();
        // The host's pool, made on the host's runtime, from the scheduler's thread.
        let read: i64 = sqlx::query_scalar("SELECT $1::bigint + 1")
            .bind(n as i64)
            .fetch_one(&self.pool)
            .await
            .map_err(leasehold::JobError::retry)?;
        tokio::time::sleep(Duration::from_millis(2)).await;
        // The effect ledger, through the context's store.
        let charged: i64 = ctx
            .once("charge", &n, |_key| async move { Ok(read * 10) })
            .await?;
        self.seen.lock().unwrap().push((thread, ctx.job_id().0));
        Ok(charged / 10)
    }
}

/// `handler_threads = Some(0)`: handlers run on the scheduler's own thread (named
/// `leasehold <owner>`), not the host's; they reach the host's pool across threads,
/// keep a key's order, and shutdown still stops one that runs.
#[test]
fn handlers_on_the_scheduler_thread_run_there_and_reach_the_hosts_pool() {
    worker::run_in_system(within(60, "scheduler-thread handlers", async {
        let db = TestDb::with_options("embed_sched_thread", StoreOptions::default(), POOL).await;
        let mut config = fast_config(&db.schema);
        config.handler_threads = Some(0);
        config
            .validate()
            .expect("zero threads of their own is a choice");
        let seen: std::sync::Arc<std::sync::Mutex<Vec<(String, i64)>>> = Default::default();
        // The host's pool, opening no connection until asked: those the handlers open
        // are opened on the scheduler's thread, and so belong to that thread's runtime.
        let host_pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(3)
            .connect_lazy_with(
                runtime_options()
                    .database(&test_db_name())
                    .application_name(&format!("{}-host", db.app_name)),
            );
        let h = WhereAmI {
            pool: host_pool.clone(),
            seen: seen.clone(),
        };
        let scheduler = Scheduler::builder(host_pool.clone(), config)
            .register(h)
            .start()
            .await
            .unwrap();
        let mut ids = Vec::new();
        for i in 0..30u64 {
            let job = leasehold::NewJob::new("where", &i).unwrap();
            let job = if i % 3 == 0 {
                job.with_key("acct")
            } else {
                job
            };
            ids.push(scheduler.enqueue_job(job).await.unwrap());
        }
        wait_until(30, "every job to be done", || async {
            db.count_where("jobs", "state = 'done'").await == 30
        })
        .await;
        let host = std::thread::current().name().unwrap_or("").to_string();
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 30);
        for (thread, id) in &seen {
            assert!(
                thread.starts_with("leasehold ") && *thread != host,
                "job {id} ran on {thread:?} (host thread {host:?})"
            );
        }
        // The key's jobs ran in enqueue order.
        let keyed: Vec<i64> = ids.iter().step_by(3).map(|id| id.0).collect();
        let ran: Vec<i64> = seen
            .iter()
            .map(|(_, id)| *id)
            .filter(|id| keyed.contains(id))
            .collect();
        assert_eq!(ran, keyed);
        // Results came back through the host's pool; each effect was recorded once,
        // through the scheduler's own handler connections (not the host's pool, whose
        // connections must not belong to a runtime that stops with the scheduler).
        let job = db.store.job(ids[5]).await.unwrap();
        assert_eq!(job.result, Some(serde_json::json!(6)));
        assert_eq!(db.count_where("effects", "true").await, 30);
        let handler_conns: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'leasehold-handlers %'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert!(
            handler_conns >= 1,
            "the ledger went through the handlers' pool"
        );
        let opened = host_pool.size();
        assert!(
            opened >= 1,
            "the handlers opened the host pool's connections"
        );
        scheduler.shutdown().await.unwrap();
        // The host's pool still works right after the shutdown returns, on every one of
        // its connections at once: the scheduler's thread still drives the sockets of
        // those its handlers opened, until the host closes the pool.
        let reads = (0..3).map(|i| {
            sqlx::query_scalar::<_, i64>("SELECT $1::bigint")
                .bind(i)
                .fetch_one(&host_pool)
        });
        for (i, read) in futures_util::future::join_all(reads)
            .await
            .into_iter()
            .enumerate()
        {
            assert_eq!(read.expect("the host's pool after the shutdown"), i as i64);
        }
        assert_eq!(db.count_where("jobs", "state = 'done'").await, 30);
        host_pool.close().await;
        db.drop().await;
    }))
}
