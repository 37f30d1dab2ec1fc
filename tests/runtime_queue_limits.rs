//! Queues with their own limits in one scheduler (`Config::queue_concurrency`): a
//! flooded queue holds at most its limit of jobs, so a trickle queue beside it starts
//! its jobs at once instead of behind the flood's backlog; and a limit is only a cap: a
//! limited queue with nothing to run (empty, paused, only delayed jobs) leaves every
//! slot to the others, and priorities hold across queues within each queue's cap.
//! Asserted on when the handlers ran, by their own clocks.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{within, TestDb};
use leasehold::{Config, Handler, JobContext, JobError, NewJob, Scheduler, StoreOptions};
use worker::{fast_config, run_in_system, wait_until, POOL};

/// (queue, job, start, end) of each run that ended.
type Runs = Arc<Mutex<Vec<(String, i64, Instant, Instant)>>>;
/// (queue, job, start) of each run, as it starts.
type Starts = Arc<Mutex<Vec<(String, i64, Instant)>>>;

/// The handler: sleeps its payload's milliseconds; logs each run when it ends, and its
/// start as it starts.
#[derive(Clone, Default)]
struct Work(Runs, Starts);

impl Work {
    /// (queue, job, start) of every run started so far.
    fn starts(&self) -> Vec<(String, i64, Instant)> {
        self.1.lock().unwrap().clone()
    }
}

/// Each test measures how many handlers overlap and how soon they start, on two cores
/// shared with the other tests: the tests of this file run one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

impl Handler for Work {
    type Payload = u64;
    type Output = ();
    const KIND: &'static str = "work";

    async fn run(&self, ctx: JobContext, ms: u64) -> Result<(), JobError> {
        let start = Instant::now();
        let job = (ctx.queue().to_string(), ctx.job_id().0, start);
        self.1.lock().unwrap().push(job);
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
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
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

// ---------------------------------------------------------------------------
// A limit is a cap on its own queue, never room held against the others.
// ---------------------------------------------------------------------------

/// The handlers' jobs in these tests: long enough that a job left for a later claim
/// round starts visibly late.
const LONG_MS: u64 = 2_000;

/// Started within this of its enqueue: claimed by the first round that could take it.
const PROMPT: Duration = Duration::from_millis(1_200);

/// A scheduler over `queues` with `concurrency` slots and the given limits, running
/// [`Work`].
async fn start(
    db: &TestDb,
    h: &Work,
    queues: &[&str],
    concurrency: usize,
    limits: &[(&str, usize)],
) -> Scheduler {
    start_with(db, h, queues, concurrency, limits, |_| {}).await
}

/// [`start`], with `tweak` applied to the config last.
async fn start_with(
    db: &TestDb,
    h: &Work,
    queues: &[&str],
    concurrency: usize,
    limits: &[(&str, usize)],
    tweak: impl FnOnce(&mut Config),
) -> Scheduler {
    let mut config = fast_config(&db.schema);
    config.queues = queues.iter().map(|q| q.to_string()).collect();
    config.concurrency = concurrency;
    for (q, n) in limits {
        config.queue_concurrency.insert(q.to_string(), *n);
    }
    tweak(&mut config);
    Scheduler::builder(db.pool.clone(), config)
        .register(h.clone())
        .start()
        .await
        .unwrap()
}

fn jobs(queue: &str, n: usize, ms: u64) -> Vec<NewJob> {
    (0..n)
        .map(|_| NewJob::new("work", &ms).unwrap().with_queue(queue))
        .collect()
}

/// Enqueue `jobs` through the scheduler; when they were sent.
async fn enqueue_now(s: &Scheduler, jobs: Vec<NewJob>) -> Instant {
    let sent = Instant::now();
    s.enqueue_many(jobs).await.unwrap();
    sent
}

/// How long after `sent` each run of `queue` started, sorted.
fn start_delays(h: &Work, queue: &str, sent: Instant) -> Vec<Duration> {
    let mut d: Vec<Duration> = h
        .starts()
        .iter()
        .filter(|s| s.0 == queue)
        .map(|s| s.2.saturating_duration_since(sent))
        .collect();
    d.sort();
    d
}

async fn wait_for_runs(h: &Work, queue: &str, n: usize, secs: u64) {
    let what = format!("{n} runs of {queue} to end");
    wait_until(secs, &what, || async {
        h.0.lock().unwrap().iter().filter(|r| r.0 == queue).count() >= n
    })
    .await;
}

#[test]
fn an_empty_limited_queue_leaves_its_room_to_the_other_queues() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    run_in_system(within(60, "an empty limited queue", async {
        let db = TestDb::with_options("rt_qlim_empty", StoreOptions::default(), POOL).await;
        let h = Work::default();
        let s = start(&db, &h, &["webhooks", "default"], 8, &[("webhooks", 4)]).await;
        let sent = enqueue_now(&s, jobs("default", 8, LONG_MS)).await;
        wait_for_runs(&h, "default", 8, 20).await;
        let log = h.0.lock().unwrap().clone();
        assert_eq!(
            most_at_once(&log, "default"),
            8,
            "default jobs running at once, with eight slots and webhooks empty"
        );
        let delays = start_delays(&h, "default", sent);
        assert!(
            delays[7] < PROMPT,
            "every default job starts in the first round while webhooks is empty: {delays:?}"
        );
        s.shutdown().await.unwrap();
        db.drop().await;
    }))
}

/// What the limited queue `webhooks` holds while five `default` jobs wait.
enum Webhooks {
    Empty,
    Paused,
    Delayed,
}

/// Concurrency 4 and a webhooks limit of 4: four default jobs start at once, the
/// fifth as soon as one of them ends, whatever webhooks holds that cannot run.
fn default_jobs_take_every_slot(name: &str, webhooks: Webhooks) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let name = name.to_string();
    run_in_system(within(60, "webhooks cannot run", async move {
        let db = TestDb::with_options(&name, StoreOptions::default(), POOL).await;
        match webhooks {
            Webhooks::Empty => {}
            Webhooks::Paused => {
                db.store
                    .pause_queue("webhooks", Some("test"))
                    .await
                    .unwrap();
                db.store
                    .enqueue_many(jobs("webhooks", 10, 0))
                    .await
                    .unwrap();
            }
            Webhooks::Delayed => {
                let later = jobs("webhooks", 10, 0)
                    .into_iter()
                    .map(|j| j.with_delay(Duration::from_secs(3600)))
                    .collect();
                db.store.enqueue_many(later).await.unwrap();
            }
        }
        let h = Work::default();
        let s = start(&db, &h, &["webhooks", "default"], 4, &[("webhooks", 4)]).await;
        let sent = enqueue_now(&s, jobs("default", 5, LONG_MS)).await;
        wait_until(8, "four default jobs to start", || async {
            h.starts().iter().filter(|r| r.0 == "default").count() >= 4
        })
        .await;
        wait_for_runs(&h, "default", 5, 20).await;
        let log = h.0.lock().unwrap().clone();
        assert_eq!(
            most_at_once(&log, "default"),
            4,
            "default jobs at once, four slots"
        );
        let delays = start_delays(&h, "default", sent);
        assert!(delays[3] < PROMPT, "four start at once: {delays:?}");
        assert!(
            delays[4] < Duration::from_millis(LONG_MS) + PROMPT,
            "the fifth starts when a slot frees: {delays:?}"
        );
        assert!(
            log.iter().all(|r| r.0 != "webhooks"),
            "a webhooks job ran that could not"
        );
        s.shutdown().await.unwrap();
        db.drop().await;
    }))
}

#[test]
fn an_empty_limited_queue_holds_no_slot_even_when_its_limit_is_every_slot() {
    default_jobs_take_every_slot("rt_qlim_empty4", Webhooks::Empty);
}

#[test]
fn a_paused_limited_queue_holds_no_slot() {
    default_jobs_take_every_slot("rt_qlim_paused", Webhooks::Paused);
}

#[test]
fn a_limited_queue_with_only_delayed_jobs_holds_no_slot() {
    default_jobs_take_every_slot("rt_qlim_delayed", Webhooks::Delayed);
}

/// Webhooks (limit 4) has forty jobs, emails (limit 2) none, default four long ones,
/// with eight slots: webhooks runs four at once, never more, and default the other four.
fn a_busy_and_an_idle_limited_queue(name: &str, claim_ahead: usize) {
    let name = name.to_string();
    run_in_system(within(60, "a busy and an idle limited queue", async move {
        let db = TestDb::with_options(&name, StoreOptions::default(), POOL).await;
        let h = Work::default();
        let queues = ["webhooks", "emails", "default"];
        let limits = [("webhooks", 4), ("emails", 2)];
        let s = start_with(&db, &h, &queues, 8, &limits, |c| {
            c.claim_ahead = claim_ahead
        })
        .await;
        // Webhooks first: older, so it is first in line for every slot it has room for.
        s.enqueue_many(jobs("webhooks", 40, 200)).await.unwrap();
        let sent = enqueue_now(&s, jobs("default", 4, LONG_MS)).await;
        wait_for_runs(&h, "webhooks", 40, 30).await;
        wait_for_runs(&h, "default", 4, 10).await;
        let log = h.0.lock().unwrap().clone();
        assert_eq!(
            most_at_once(&log, "webhooks"),
            4,
            "claim_ahead {claim_ahead}: webhooks runs at its cap of 4 with 40 jobs waiting, never past it"
        );
        assert_eq!(
            most_at_once(&log, "default"),
            4,
            "claim_ahead {claim_ahead}: default takes the four slots webhooks may not (emails is empty)"
        );
        let delays = start_delays(&h, "default", sent);
        assert!(
            delays[3] < PROMPT,
            "claim_ahead {claim_ahead}: default waited for slots: {delays:?}"
        );
        s.shutdown().await.unwrap();
        db.drop().await;
    }))
}

#[test]
fn a_busy_limited_queue_keeps_to_its_cap_and_an_idle_one_beside_it_gives_its_room_away() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    // Without claim-ahead every job a round takes must fit in the free slots; with it,
    // jobs claimed ahead count against their queue's cap too.
    a_busy_and_an_idle_limited_queue("rt_qlim_busy", 0);
    a_busy_and_an_idle_limited_queue("rt_qlim_busy_ahead", leasehold::config::DEFAULT_CLAIM_AHEAD);
}

/// Start four `webhooks` and four `default` jobs at the given priorities with four slots
/// and a webhooks limit of 2; the queues of the first four jobs to start.
async fn first_four(name: &str, webhooks_priority: i16, default_priority: i16) -> Vec<String> {
    let db = TestDb::with_options(name, StoreOptions::default(), POOL).await;
    // Enqueued before the scheduler starts, webhooks first (older), so its first claim
    // sees them all.
    for (queue, priority) in [
        ("webhooks", webhooks_priority),
        ("default", default_priority),
    ] {
        let js = jobs(queue, 4, 400)
            .into_iter()
            .map(|j| j.with_priority(priority))
            .collect();
        db.store.enqueue_many(js).await.unwrap();
    }
    let h = Work::default();
    let s = start(&db, &h, &["webhooks", "default"], 4, &[("webhooks", 2)]).await;
    wait_for_runs(&h, "webhooks", 4, 20).await;
    wait_for_runs(&h, "default", 4, 20).await;
    let mut starts = h.starts();
    starts.sort_by_key(|s| s.2);
    s.shutdown().await.unwrap();
    db.drop().await;
    let mut first: Vec<String> = starts.into_iter().take(4).map(|s| s.0).collect();
    first.sort();
    first
}

#[test]
fn priorities_hold_across_queues_within_each_queues_cap() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    run_in_system(within(60, "priorities across queues", async {
        // Default's jobs come first (lower number): webhooks has room but waits.
        let first = first_four("rt_qlim_pri_default", 5, 0).await;
        assert_eq!(
            first,
            vec!["default"; 4],
            "the higher-priority default jobs are claimed before the webhooks ones"
        );
        // Webhooks' jobs come first, but only two of them may run: default gets the rest.
        let first = first_four("rt_qlim_pri_webhooks", 0, 5).await;
        assert_eq!(
            first,
            vec!["default", "default", "webhooks", "webhooks"],
            "webhooks first, within its cap of 2"
        );
    }))
}

#[test]
fn a_limited_queue_at_its_cap_refills_each_place_as_it_frees_not_at_the_next_poll() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    run_in_system(within(60, "a limited queue at its cap", async {
        let db = TestDb::with_options("rt_qlim_refill", StoreOptions::default(), POOL).await;
        let h = Work::default();
        // The default polling: after a few empty claims of default, the next poll is up
        // to two seconds away.
        let defaults = Config::default();
        let s = start_with(
            &db,
            &h,
            &["webhooks", "default"],
            8,
            &[("webhooks", 4)],
            |c| {
                c.poll_interval_min = defaults.poll_interval_min;
                c.poll_interval_max = defaults.poll_interval_max;
            },
        )
        .await;
        s.enqueue_many(jobs("webhooks", 12, 1_000)).await.unwrap();
        wait_for_runs(&h, "webhooks", 12, 30).await;
        let log = h.0.lock().unwrap().clone();
        assert_eq!(
            most_at_once(&log, "webhooks"),
            4,
            "at its cap, never past it"
        );
        let first = log.iter().map(|r| r.2).min().unwrap();
        // Every run after the first four takes the place of one that ended just before.
        let mut waits: Vec<Duration> = log
            .iter()
            .filter(|r| r.2 > first + Duration::from_millis(500))
            .map(|r| {
                let freed = log.iter().map(|e| e.3).filter(|&e| e <= r.2).max().unwrap();
                r.2 - freed
            })
            .collect();
        waits.sort();
        assert_eq!(waits.len(), 8);
        assert!(
            waits[7] < Duration::from_millis(300),
            "a place of webhooks stayed empty with its jobs waiting: {waits:?}"
        );
        s.shutdown().await.unwrap();
        db.drop().await;
    }))
}
