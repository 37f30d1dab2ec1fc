//! Shutdown: start and stop many times with jobs in flight without leaking actors,
//! tasks, threads or connections; a job released at shutdown is claimable at once; the
//! shutdown runs once, to its end, whichever callers stop waiting for it, and every
//! caller gets its one report; a start whose caller stopped waiting leaves nothing
//! running.
//!
//! The tests count the scheduler's own connections by name, so each runs in a database
//! of its own (see `OwnDb`).

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::sync::atomic::{AtomicI64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use common::within;
use leasehold::{Handler, JobContext, JobError, JobState, NewJob, Scheduler};
use serde::{Deserialize, Serialize};
use worker::{fast_config, run_in_system, wait_until, OwnDb};

/// Counts live handler futures: +1 when a run starts, -1 when its future is dropped
/// (finished, or aborted at shutdown).
struct Live(Arc<AtomicI64>);

impl Drop for Live {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

#[derive(Serialize, Deserialize)]
struct Work {
    ms: u64,
}

struct Worker {
    live: Arc<AtomicI64>,
    /// Cap every job at 5 ms (the last scheduler, which drains the queue).
    fast: bool,
}

impl Handler for Worker {
    type Payload = Work;
    type Output = ();
    const KIND: &'static str = "work";

    async fn run(&self, _: JobContext, w: Work) -> Result<(), JobError> {
        self.live.fetch_add(1, SeqCst);
        let _live = Live(self.live.clone());
        // Ignores cancellation on purpose: the long ones outlive the grace period.
        let ms = if self.fast { w.ms.min(5) } else { w.ms };
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok(())
    }
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

#[test]
fn starting_and_stopping_twenty_times_with_jobs_in_flight_leaks_nothing() {
    run_in_system(within(150, "start/stop loop", async {
        let own = OwnDb::new("shutdown_loop").await;
        let db = &own.db;
        let live = Arc::new(AtomicI64::new(0));
        let mut config = fast_config(&db.schema);
        config.shutdown_grace = Duration::from_millis(200);
        let mut threads_after_first = 0;
        let mut enqueued = 0i64;
        let mut released = 0u64;
        for round in 0..20 {
            let scheduler = Scheduler::builder(db.pool.clone(), config.clone())
                .register(Worker {
                    live: live.clone(),
                    fast: false,
                })
                .start()
                .await
                .unwrap();
            // Short jobs that drain, long ones that are cancelled and released.
            let mut jobs = Vec::new();
            for i in 0..12i64 {
                let ms = if i % 4 == 0 {
                    5_000
                } else {
                    5 + (i as u64 % 3) * 20
                };
                let job = NewJob::new("work", &Work { ms }).unwrap();
                jobs.push(if i % 3 == 0 {
                    job
                } else {
                    job.with_key(format!("k{}", i % 4))
                });
            }
            enqueued += jobs.len() as i64;
            scheduler.enqueue_many(jobs).await.unwrap();
            wait_until(10, "jobs to be in flight", || async {
                scheduler.metrics().in_flight > 0
            })
            .await;
            // Every connection of the scheduler's own is open before it stops.
            scheduler.renew_now().await.unwrap();
            scheduler.reap_now().await.unwrap();
            // Renewer, reaper, listener, the claimer's one or two (it has claimed), and the
            // writer pool's one to three (it has written endings).
            wait_until(10, "the listener to connect", || async {
                (5..=8).contains(&own.scheduler_backends().await)
            })
            .await;
            let report = scheduler.shutdown().await.unwrap();
            // Every actor stopped: no attempt and no sequencer is left.
            assert_eq!(report.metrics.in_flight, 0, "round {round}: {report:?}");
            assert_eq!(report.metrics.sequencers, 0, "round {round}: {report:?}");
            released += report.metrics.counters.released;

            // Every attempt ended or was released; nothing is left running.
            assert_eq!(
                db.count_where("jobs", "state = 'running'").await,
                0,
                "round {round}"
            );
            // Every handler future is gone (an aborted one is dropped right after).
            wait_until(5, "handler futures to be dropped", || async {
                live.load(SeqCst) == 0
            })
            .await;
            // The scheduler's own connections are closed; the host's pool is the only one.
            wait_until(5, "the scheduler's connections to close", || async {
                own.scheduler_backends().await == 0
            })
            .await;
            if round == 0 {
                threads_after_first = threads();
            }
        }
        let threads_at_end = threads();
        eprintln!(
            "threads after the first round: {threads_after_first}, after the last: {threads_at_end}; released at shutdown: {released}"
        );
        // One maintenance thread per start would show here; a few pooled blocking
        // threads may come and go.
        assert!(
            threads_at_end <= threads_after_first + 4,
            "threads grew from {threads_after_first} to {threads_at_end}"
        );
        assert!(released > 0, "no round released a job at shutdown");
        assert_eq!(
            db.count_where("job_events", "event = 'released'").await,
            released as i64
        );

        // Nothing was lost or left to the reaper: a last scheduler finishes every job.
        let scheduler = Scheduler::builder(db.pool.clone(), config.clone())
            .register(Worker {
                live: live.clone(),
                fast: true,
            })
            .start()
            .await
            .unwrap();
        wait_until(60, "every job to finish", || async {
            db.count_where("jobs", "state = 'done'").await == enqueued
        })
        .await;
        scheduler.shutdown().await.unwrap();
        assert_eq!(db.count_where("lease_expiries", "true").await, 0);
        assert_eq!(
            db.count_where("jobs", "attempts <> 1").await,
            0,
            "a released attempt was counted"
        );
        own.drop().await;
    }))
}

/// Blocks (ignoring cancellation) on its first generation; completes on later ones.
struct Stubborn {
    live: Arc<AtomicI64>,
}

impl Handler for Stubborn {
    type Payload = ();
    type Output = ();
    const KIND: &'static str = "stubborn";

    async fn run(&self, ctx: JobContext, _: ()) -> Result<(), JobError> {
        if ctx.generation().0 >= 2 {
            return Ok(());
        }
        self.live.fetch_add(1, SeqCst);
        let _live = Live(self.live.clone());
        tokio::time::sleep(Duration::from_secs(3600)).await;
        Ok(())
    }
}

#[test]
fn a_job_released_at_shutdown_is_claimed_at_once_by_another_scheduler() {
    run_in_system(within(60, "release at shutdown test", async {
        let own = OwnDb::new("shutdown_release").await;
        let db = &own.db;
        let live = Arc::new(AtomicI64::new(0));
        let mut config = fast_config(&db.schema);
        // A lease far longer than the test: the job must not come back by expiry.
        config.lease = Duration::from_secs(60);
        config.renew_interval = Duration::from_secs(5);
        config.shutdown_grace = Duration::from_millis(300);

        let first = Scheduler::builder(db.pool.clone(), config.clone())
            .register(Stubborn { live: live.clone() })
            .start()
            .await
            .unwrap();
        let id = first.enqueue::<Stubborn>(&()).await.unwrap();
        wait_until(10, "the job to run", || async { live.load(SeqCst) == 1 }).await;
        let report = first.shutdown().await.unwrap();
        assert_eq!((report.drained, report.cancelled), (0, 1), "{report:?}");
        wait_until(5, "the handler to be dropped", || async {
            live.load(SeqCst) == 0
        })
        .await;

        // Released: pending, due now, the attempt not counted, no lease.
        let job = db.store.job(id).await.unwrap();
        assert_eq!(job.state, JobState::Pending, "{job:?}");
        assert_eq!((job.attempts, job.generation.0), (0, 1), "{job:?}");
        assert_eq!(job.lease_until, None);
        let due: bool = sqlx::query_scalar(&format!(
            "SELECT available_at <= now() FROM {} WHERE id = $1",
            db.table("jobs")
        ))
        .bind(id.0)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert!(due, "released job not due at once: {job:?}");
        let events: Vec<String> = db
            .store
            .history(id)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.event)
            .collect();
        assert!(events.iter().any(|e| e == "released"), "{events:?}");

        // A second scheduler completes it well within the 60 s lease.
        let second = Scheduler::builder(db.pool.clone(), config)
            .register(Stubborn { live: live.clone() })
            .start()
            .await
            .unwrap();
        wait_until(10, "the second scheduler to complete the job", || async {
            db.state_of(id).await == "done"
        })
        .await;
        second.shutdown().await.unwrap();
        let job = db.store.job(id).await.unwrap();
        assert_eq!((job.attempts, job.generation.0), (1, 2), "{job:?}");
        assert_eq!(db.count_where("lease_expiries", "true").await, 0);
        own.drop().await;
    }))
}

#[test]
fn a_draining_scheduler_claims_nothing_new_and_leaves_nothing_claimed() {
    run_in_system(within(90, "drain test", async {
        let own = OwnDb::new("shutdown_drain").await;
        let db = &own.db;
        let live = Arc::new(AtomicI64::new(0));
        let mut config = fast_config(&db.schema);
        config.shutdown_grace = Duration::from_secs(2);
        // A hot key with a long backlog of short jobs: its sequencer fetches the next
        // job the moment one completes, so shutdown always meets a fetch.
        let jobs: Vec<NewJob> = (0..500)
            .map(|_| {
                NewJob::new("work", &Work { ms: 20 })
                    .unwrap()
                    .with_key("hot")
            })
            .collect();
        db.store.enqueue_many(jobs).await.unwrap();
        for round in 0..8 {
            let scheduler = Scheduler::builder(db.pool.clone(), config.clone())
                .register(Worker {
                    live: live.clone(),
                    fast: false,
                })
                .start()
                .await
                .unwrap();
            let done = db.count_where("jobs", "state = 'done'").await;
            wait_until(10, "the key to get going", || async {
                db.count_where("jobs", "state = 'done'").await >= done + 3
            })
            .await;
            let claimed_before = scheduler.metrics().counters.claimed;
            let report = scheduler.shutdown().await.unwrap();
            let claimed_during = report.metrics.counters.claimed - claimed_before;
            // At most the job a fetch already in flight returns.
            assert!(
                claimed_during <= 1,
                "round {round}: {claimed_during} jobs claimed after shutdown began"
            );
            // And that one was run or released, not left claimed until its lease ends.
            assert_eq!(
                db.count_where("jobs", "state = 'running'").await,
                0,
                "round {round}: a job was left claimed; {report:?}"
            );
            assert_eq!(report.metrics.sequencers, 0);
        }
        assert_eq!(db.count_where("lease_expiries", "true").await, 0);
        own.drop().await;
    }))
}

/// Stops as soon as it is asked to, with an error (as a handler that checks its
/// cancellation should).
struct Obliging;

impl Handler for Obliging {
    type Payload = ();
    type Output = ();
    const KIND: &'static str = "obliging";

    async fn run(&self, ctx: JobContext, _: ()) -> Result<(), JobError> {
        ctx.cancelled().await;
        Err(JobError::retry("asked to stop"))
    }
}

/// Handlers told to stop at shutdown that return an error at once: each job is released
/// (pending, due now, the attempt not counted), never failed with a backoff. Whether the
/// handler's error or the shutdown is seen first must not matter: a job near its
/// attempt limit would otherwise go dead for a deploy.
#[test]
fn handlers_that_stop_when_asked_at_shutdown_have_their_jobs_released_not_failed() {
    run_in_system(within(60, "obliging shutdown test", async {
        let own = OwnDb::new("shutdown_obliging").await;
        let db = &own.db;
        let mut config = fast_config(&db.schema);
        config.concurrency = 16;
        config.lease = Duration::from_secs(60);
        config.renew_interval = Duration::from_secs(5);
        config.shutdown_grace = Duration::from_millis(200);
        // Handlers on threads of their own, so a handler's error can be in before the
        // scheduler looks at why it was stopped.
        config.handler_threads = Some(2);
        let s = Scheduler::builder(db.pool.clone(), config)
            .register(Obliging)
            .start()
            .await
            .unwrap();
        let ids = s
            .enqueue_many(
                (0..16)
                    .map(|_| NewJob::new(Obliging::KIND, &()).unwrap())
                    .collect(),
            )
            .await
            .unwrap();
        wait_until(10, "all sixteen running", || async {
            db.count_where("jobs", "state = 'running'").await == 16
        })
        .await;
        let report = s.shutdown().await.unwrap();
        assert_eq!(report.cancelled, 16, "{report:?}");
        let mut failed = Vec::new();
        for id in ids {
            let job = db.store.job(id).await.unwrap();
            if (job.state, job.attempts) != (JobState::Pending, 0) {
                failed.push(format!("{job:?}"));
            }
        }
        assert!(
            failed.is_empty(),
            "counted as failed at shutdown: {failed:#?}"
        );
        let late = db
            .count_where(
                "jobs",
                "available_at > now() OR last_error LIKE '%asked to stop%'",
            )
            .await;
        assert_eq!(late, 0, "jobs given a backoff or a failure at shutdown");
        own.drop().await;
    }))
}

/// Job ids' `released` events: how many times each was given back.
async fn released_events(db: &common::TestDb, id: leasehold::JobId) -> usize {
    db.store
        .history(id)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.event == "released")
        .count()
}

/// Issue 30, item 8: the first caller gives up on `shutdown()` after 200 ms (a
/// `tokio::time::timeout` dropping its future) while a handler that ignores
/// cancellation still runs. The shutdown goes on to its end regardless, and later calls
/// get its one true report: the attempt cancelled after the grace period and released.
#[test]
fn a_shutdown_whose_first_caller_gave_up_runs_to_its_end_and_later_calls_get_its_report() {
    run_in_system(within(60, "timed-out shutdown test", async {
        let own = OwnDb::new("shutdown_gave_up").await;
        let db = &own.db;
        let live = Arc::new(AtomicI64::new(0));
        let mut config = fast_config(&db.schema);
        config.lease = Duration::from_secs(60);
        config.renew_interval = Duration::from_secs(5);
        config.shutdown_grace = Duration::from_secs(1);
        let s = Scheduler::builder(db.pool.clone(), config)
            .register(Stubborn { live: live.clone() })
            .start()
            .await
            .unwrap();
        let id = s.enqueue::<Stubborn>(&()).await.unwrap();
        wait_until(10, "the job to run", || async { live.load(SeqCst) == 1 }).await;

        let gave_up = tokio::time::timeout(Duration::from_millis(200), s.shutdown()).await;
        assert!(
            gave_up.is_err(),
            "the first shutdown ended within 200 ms: {gave_up:?}"
        );
        let report = within(30, "the second shutdown", s.shutdown())
            .await
            .unwrap();
        assert_eq!((report.drained, report.cancelled), (0, 1), "{report:?}");
        assert_eq!(report.metrics.counters.released, 1, "{report:?}");
        assert_eq!(report.metrics.in_flight, 0, "{report:?}");
        // Every later call returns the same report, the metrics taken once included.
        assert_eq!(s.shutdown().await.unwrap(), report);

        // The job was released once, by the one shutdown.
        let job = db.store.job(id).await.unwrap();
        assert_eq!(job.state, JobState::Pending, "{job:?}");
        assert_eq!((job.attempts, job.lease_until), (0, None), "{job:?}");
        assert_eq!(released_events(db, id).await, 1);
        wait_until(5, "the handler to be dropped", || async {
            live.load(SeqCst) == 0
        })
        .await;
        wait_until(5, "the scheduler's connections to close", || async {
            own.scheduler_backends().await == 0
        })
        .await;
        own.drop().await;
    }))
}

/// Callers from several tasks and another thread's runtime, one of them giving up after
/// 200 ms, while one attempt drains and one outlives the grace period: every caller
/// that waits gets the same report (its metrics snapshot included, so it was taken by
/// one run), with one drained and one cancelled, and the job given back once.
#[test]
fn concurrent_shutdowns_one_giving_up_all_get_the_one_report() {
    run_in_system(within(60, "concurrent shutdown test", async {
        let own = OwnDb::new("shutdown_concurrent").await;
        let db = &own.db;
        let live = Arc::new(AtomicI64::new(0));
        let mut config = fast_config(&db.schema);
        config.lease = Duration::from_secs(60);
        config.renew_interval = Duration::from_secs(5);
        config.shutdown_grace = Duration::from_millis(1500);
        let s = Scheduler::builder(db.pool.clone(), config)
            .register(Stubborn { live: live.clone() })
            .register(Worker {
                live: live.clone(),
                fast: false,
            })
            .start()
            .await
            .unwrap();
        let stubborn = s.enqueue::<Stubborn>(&()).await.unwrap();
        let drains = s.enqueue::<Worker>(&Work { ms: 700 }).await.unwrap();
        wait_until(10, "both jobs to run", || async { live.load(SeqCst) == 2 }).await;

        let gave_up = {
            let s = s.clone();
            actix::spawn(async move {
                tokio::time::timeout(Duration::from_millis(200), s.shutdown())
                    .await
                    .is_err()
            })
        };
        let mut waiting = Vec::new();
        for _ in 0..4 {
            let s = s.clone();
            waiting.push(actix::spawn(async move { s.shutdown().await.unwrap() }));
        }
        let elsewhere = {
            let s = s.clone();
            std::thread::spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap()
                    .block_on(s.shutdown())
                    .unwrap()
            })
        };
        assert!(gave_up.await.unwrap(), "a caller gave up after 200 ms");
        let mut reports = Vec::new();
        for w in waiting {
            reports.push(w.await.unwrap());
        }
        reports.push(
            tokio::task::spawn_blocking(move || elsewhere.join().unwrap())
                .await
                .unwrap(),
        );
        reports.push(s.shutdown().await.unwrap());
        let first = reports[0].clone();
        assert_eq!((first.drained, first.cancelled), (1, 1), "{first:?}");
        assert_eq!(first.metrics.counters.released, 1, "{first:?}");
        assert_eq!(first.metrics.counters.completed, 1, "{first:?}");
        for (i, r) in reports.iter().enumerate() {
            assert_eq!(r, &first, "caller {i} got another report");
        }
        assert_eq!(db.state_of(drains).await, "done");
        assert_eq!(db.state_of(stubborn).await, "pending");
        assert_eq!(released_events(db, stubborn).await, 1);
        wait_until(5, "the scheduler's connections to close", || async {
            own.scheduler_backends().await == 0
        })
        .await;
        own.drop().await;
    }))
}

/// A `start()` whose caller stops waiting (a timeout drops its future) at any point
/// leaves no scheduler running without a handle: one whose actors already ran when the
/// caller went away shuts itself down, so it claims nothing and keeps no connection.
/// The timeouts step through the whole start, so some fall after the scheduler's thread
/// was started and before `start()` returned.
#[test]
fn a_start_whose_caller_gave_up_leaves_no_scheduler_running() {
    run_in_system(within(150, "abandoned start test", async {
        let own = OwnDb::new("shutdown_abandoned_start").await;
        let db = &own.db;
        let live = Arc::new(AtomicI64::new(0));
        let config = fast_config(&db.schema);
        let start = || {
            Scheduler::builder(db.pool.clone(), config.clone())
                .register(Worker {
                    live: live.clone(),
                    fast: true,
                })
                .start()
        };
        // One whole start sets the steps: 120 of them from nothing to one and a half.
        let began = std::time::Instant::now();
        let s = start().await.unwrap();
        let step = began.elapsed().mul_f64(1.5) / 120;
        s.shutdown().await.unwrap();
        let (mut abandoned, mut started) = (0, 0);
        for i in 0..120u32 {
            match tokio::time::timeout(step * i, start()).await {
                Ok(s) => {
                    started += 1;
                    s.unwrap().shutdown().await.unwrap();
                }
                Err(_) => abandoned += 1,
            }
        }
        eprintln!("starts abandoned: {abandoned}, completed: {started}");
        assert!(abandoned > 0 && started > 0, "{abandoned} / {started}");
        // Nothing of an abandoned start is left: no connection of a scheduler's own, and
        // a job enqueued now is taken by nobody.
        wait_until(20, "every scheduler's connections to close", || async {
            own.scheduler_backends().await == 0
        })
        .await;
        let id = db
            .store
            .enqueue(NewJob::new("work", &Work { ms: 1 }).unwrap())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            db.state_of(id).await,
            "pending",
            "a scheduler without a handle took it"
        );
        assert_eq!(own.scheduler_backends().await, 0);
        own.drop().await;
    }))
}
