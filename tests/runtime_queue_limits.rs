//! Queues with their own limits in one scheduler (`Config::queue_concurrency`): a
//! flooded queue holds at most its limit of jobs, so a trickle queue beside it starts
//! its jobs at once instead of behind the flood's backlog. Asserted on when the handlers
//! ran.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{within, TestDb};
use leasehold::{Handler, JobContext, JobError, NewJob, Scheduler, StoreOptions};
use worker::{fast_config, run_in_system, wait_until, POOL};

/// (queue, job, start, end) of each run.
type Log = Arc<Mutex<Vec<(String, i64, Instant, Instant)>>>;

#[derive(Clone, Default)]
struct Work(Log);

impl Handler for Work {
    type Payload = u64;
    type Output = ();
    const KIND: &'static str = "work";

    async fn run(&self, ctx: JobContext, ms: u64) -> Result<(), JobError> {
        let start = Instant::now();
        tokio::time::sleep(Duration::from_millis(ms)).await;
        let run = (
            ctx.queue().to_string(),
            ctx.job_id().0,
            start,
            Instant::now(),
        );
        self.0.lock().unwrap().push(run);
        Ok(())
    }
}

/// The most runs of `queue` that overlapped at any moment.
fn most_at_once(log: &[(String, i64, Instant, Instant)], queue: &str) -> usize {
    let runs: Vec<_> = log.iter().filter(|r| r.0 == queue).collect();
    runs.iter()
        .map(|a| runs.iter().filter(|b| b.2 <= a.2 && a.2 < b.3).count())
        .max()
        .unwrap_or(0)
}

#[test]
fn a_flooded_queue_cannot_take_the_slots_of_a_trickle_queue_beside_it() {
    run_in_system(within(90, "queue limits", async {
        let db = TestDb::with_options("rt_queue_limits", StoreOptions::default(), POOL).await;
        let h = Work::default();
        let mut config = fast_config(&db.schema);
        config.queues = vec!["flood".into(), "trickle".into()];
        config.concurrency = 4;
        config.queue_concurrency.insert("flood".into(), 2);
        let s = Scheduler::builder(db.pool.clone(), config)
            .register(h.clone())
            .start()
            .await
            .unwrap();
        s.enqueue_many(
            (0..60)
                .map(|_| NewJob::new("work", &150u64).unwrap().with_queue("flood"))
                .collect(),
        )
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut sent = HashMap::new();
        for _ in 0..10 {
            let t = Instant::now();
            let id = s
                .enqueue_job(NewJob::new("work", &0u64).unwrap().with_queue("trickle"))
                .await
                .unwrap();
            sent.insert(id.0, t);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        wait_until(30, "the trickle jobs to run", || async {
            h.0.lock()
                .unwrap()
                .iter()
                .filter(|r| r.0 == "trickle")
                .count()
                == 10
        })
        .await;
        let log = h.0.lock().unwrap().clone();
        let mut waits: Vec<Duration> = log
            .iter()
            .filter(|r| r.0 == "trickle")
            .map(|r| r.2 - sent[&r.1])
            .collect();
        waits.sort();
        // Behind the flood's backlog (four slots, 32 claimed ahead, 150 ms each) a
        // trickle job would wait over a second.
        assert!(
            waits[5] < Duration::from_millis(250),
            "median wait {:?}: {waits:?}",
            waits[5]
        );
        assert!(
            waits[9] < Duration::from_millis(800),
            "longest wait: {waits:?}"
        );
        assert!(
            most_at_once(&log, "flood") <= 2,
            "the flood ran past its limit"
        );
        assert_eq!(
            most_at_once(&log, "flood"),
            2,
            "the flood used its two places"
        );
        s.shutdown().await.unwrap();
        db.drop().await;
    }))
}

#[test]
fn a_limit_for_a_queue_the_scheduler_does_not_serve_is_refused() {
    let mut config = leasehold::Config::default();
    config.queue_concurrency.insert("elsewhere".into(), 2);
    let err = config.validate().unwrap_err();
    assert!(err.to_string().contains("elsewhere"), "{err}");
    let mut config = leasehold::Config::default();
    config.set("queue_concurrency.default", "4").unwrap();
    assert_eq!(config.queue_concurrency["default"], 4);
    config.set("queue_concurrency.default", "0").unwrap();
    assert!(
        config.validate().is_err(),
        "a limit of 0 would starve the queue"
    );
}
