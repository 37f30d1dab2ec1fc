//! Jobs claimed ahead of a free slot (`Config::claim_ahead`) are held by this process
//! only as long as that is harmless: renewed while they wait, given back to the queue
//! once they have waited a lease (even when no slot frees and no wake-up comes), and
//! released at shutdown, never charged an attempt for the wait; and sized to the
//! scheduler's pace, so slow jobs are not hoarded by one process while another could
//! run them. A key's successor claimed by its predecessor's completion while every slot
//! is busy waits within the same paced bound. Asserted on what the handlers ran and on
//! the jobs' rows.

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

const LEASE: Duration = Duration::from_secs(1);

/// One slot, four jobs ahead: a gated job takes the slot, and `n` quick jobs are then
/// claimed ahead of it. Returns the scheduler and the quick jobs.
async fn one_slot_full_and_jobs_ahead(
    db: &TestDb,
    h: &Scripted,
    n: usize,
) -> (Scheduler, Vec<JobId>) {
    let mut config = config_with_lease(&db.schema, LEASE);
    config.concurrency = 1;
    config.claim_ahead = 4;
    // Held ahead whatever the pace (a gated job makes the pace nil).
    config.claim_ahead_window = None;
    let a = Scheduler::builder(db.pool.clone(), config)
        .register(h.clone())
        .start()
        .await
        .unwrap();
    a.enqueue_job(scripted(Script {
        gate: Some("slot-busy".into()),
        ..work("block", 0)
    }))
    .await
    .unwrap();
    h.started("block", 10).await;
    // In one statement, so one claim takes them all (the queue is topped up in steps).
    let ahead = a
        .enqueue_many(
            (0..n)
                .map(|i| scripted(work(&format!("ahead{i}"), 0)))
                .collect(),
        )
        .await
        .unwrap();
    wait_until(10, "the jobs to be claimed ahead", || async {
        a.metrics().ready == n as u64
    })
    .await;
    for id in &ahead {
        assert_eq!(db.store.job(*id).await.unwrap().state, JobState::Running);
    }
    assert!(a.metrics().counters.claimed_ahead >= n as u64);
    (a, ahead)
}

#[test]
fn jobs_claimed_ahead_are_given_back_after_a_lease_though_no_slot_frees() {
    run_in_system(within(60, "claim-ahead give-back test", async {
        let db = TestDb::with_options("rt_ahead_back", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let (a, ahead) = one_slot_full_and_jobs_ahead(&db, &h, 3).await;
        // A second process with free slots. It can run the jobs only once the first
        // gives them back: nothing frees the first one's slot, and no wake-up comes.
        let mut config = config_with_lease(&db.schema, LEASE);
        config.concurrency = 4;
        config.claim_ahead = 0;
        let b = Scheduler::builder(db.pool.clone(), config)
            .register(h.clone())
            .start()
            .await
            .unwrap();
        wait_until(
            4 * LEASE.as_secs(),
            "the jobs claimed ahead to run elsewhere",
            || async {
                for id in &ahead {
                    if db.store.job(*id).await.unwrap().state != JobState::Done {
                        return false;
                    }
                }
                true
            },
        )
        .await;
        assert!(
            h.runs_tagged("block")[0].end.is_none(),
            "the slot was still busy: the jobs went back without one freeing"
        );
        for id in &ahead {
            let job = db.store.job(*id).await.unwrap();
            assert_eq!(job.attempts, 1, "the wait was charged an attempt: {job:?}");
            assert_eq!(h.runs_of(*id).len(), 1, "ran more than once");
        }
        assert_eq!(db.count_where("lease_expiries", "true").await, 0);
        assert_eq!(a.metrics().ready, 0);
        h.open("slot-busy");
        h.ended("block", 10).await;
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
        db.drop().await;
    }))
}

#[test]
fn jobs_claimed_ahead_are_released_at_shutdown_without_an_attempt() {
    run_in_system(within(60, "claim-ahead shutdown test", async {
        let db = TestDb::with_options("rt_ahead_stop", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let (a, ahead) = one_slot_full_and_jobs_ahead(&db, &h, 4).await;
        let opener = {
            let h = h.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                h.open("slot-busy");
            })
        };
        // The running job finishes within the grace; the waiting ones never start.
        let report = a.shutdown().await.unwrap();
        opener.await.unwrap();
        assert_eq!(report.metrics.ready, 0);
        for id in &ahead {
            let job = db.store.job(*id).await.unwrap();
            assert_eq!((job.state, job.attempts), (JobState::Pending, 0), "{job:?}");
            assert!(h.runs_of(*id).is_empty(), "a job waiting at shutdown ran");
        }
        assert!(
            report.metrics.counters.released >= 4,
            "{:?}",
            report.metrics.counters
        );
        db.drop().await;
    }))
}

/// Two schedulers of two slots each, 24 jobs of 300 ms, the default claim-ahead (up to
/// 100, paced): the first to start does not take the queue, so the second runs jobs
/// from its start. With the pace ignored (`claim_ahead_window = None`) the first held
/// all 24 and the second ran none until they had waited a lease.
#[test]
fn slow_jobs_are_not_hoarded_by_the_first_scheduler() {
    run_in_system(within(60, "paced claim-ahead test", async {
        let db = TestDb::with_options("rt_ahead_paced", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let mut config = config_with_lease(&db.schema, Duration::from_secs(30));
        config.concurrency = 2;
        assert_eq!(config.claim_ahead, 300, "the default");
        let a = Scheduler::builder(db.pool.clone(), config.clone())
            .register(h.clone())
            .start()
            .await
            .unwrap();
        a.enqueue_many(
            (0..24)
                .map(|i| scripted(work(&format!("slow{i}"), 300)))
                .collect(),
        )
        .await
        .unwrap();
        h.started("slow0", 10).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let b = Scheduler::builder(db.pool.clone(), config)
            .register(h.clone())
            .start()
            .await
            .unwrap();
        wait_until(30, "all 24 done", || async {
            db.count_where("jobs", "state = 'done'").await == 24
        })
        .await;
        let (a_ran, b_ran) = (
            a.metrics().counters.completed,
            b.metrics().counters.completed,
        );
        assert_eq!(a_ran + b_ran, 24);
        assert!(
            b_ran >= 8,
            "the second scheduler ran {b_ran} of 24: the first hoarded them \
             ({} claimed ahead)",
            a.metrics().counters.claimed_ahead
        );
        for e in h.log() {
            assert!(e.end.is_some(), "{e:?}");
        }
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
        db.drop().await;
    }))
}

/// Run `n` jobs of `work_ms` each, all of one key, on one slot and the default (paced)
/// claim-ahead; returns the scheduler's counters and the execution log.
async fn one_key_on_one_slot(
    name: &str,
    n: i64,
    work_ms: u64,
) -> (leasehold::metrics::CounterSnapshot, Vec<scripted::Exec>) {
    let db = TestDb::with_options(name, StoreOptions::default(), POOL).await;
    let h = Scripted::new(&db.pool);
    let mut config = config_with_lease(&db.schema, Duration::from_secs(30));
    config.concurrency = 1;
    let a = Scheduler::builder(db.pool.clone(), config)
        .register(h.clone())
        .start()
        .await
        .unwrap();
    a.enqueue_many(
        (0..n)
            .map(|i| scripted(work(&format!("{name}{i}"), work_ms)).with_key("account-1"))
            .collect(),
    )
    .await
    .unwrap();
    wait_until(30, "the key's jobs done", || async {
        db.count_where("jobs", "state = 'done'").await == n
    })
    .await;
    let counters = a.metrics().counters;
    a.shutdown().await.unwrap();
    db.drop().await;
    (counters, h.log())
}

/// One slot, one key with 300 quick jobs: every completion finds the slot still its
/// own, so before a successor could be chained only with a spare slot, each of them was
/// promoted to pending and claimed by a claim statement of its own. Now, while fewer
/// jobs wait than the paced claim-ahead target, the completion claims it (counted in
/// `chained_ahead`) and the key's jobs still run one at a time, in order, once each.
#[test]
fn a_keys_successor_is_chained_into_the_claim_ahead_room_when_every_slot_is_busy() {
    run_in_system(within(60, "chained successor test", async {
        let n = 300;
        let (c, log) = one_key_on_one_slot("rt_ahead_chain", n, 0).await;
        eprintln!(
            "chained with the slot busy: {}, claim statements: {} ({} empty)",
            c.chained_ahead, c.claims, c.empty_claims
        );
        assert!(
            c.chained_ahead >= n as u64 / 2 && c.claims < n as u64 / 2,
            "successors chained with the slot busy: {} of {n}; claim statements: {}",
            c.chained_ahead,
            c.claims
        );
        assert_eq!(log.len(), n as usize, "each job ran once");
        for pair in log.windows(2) {
            assert!(pair[0].key_seq < pair[1].key_seq, "out of order: {pair:?}");
            assert!(
                pair[0].end.is_some_and(|end| end <= pair[1].start),
                "overlap: {pair:?}"
            );
        }
    }))
}

/// The same key of slow jobs (the pace earns no claim-ahead): with the slot busy a
/// successor is not chained to wait here, so another process could take the key's next
/// job. (The pace rises at once, so one job ending just after a short sample can read as
/// a pace worth one job ahead for a moment: at most two of the seven are allowed, where
/// chaining regardless of the pace chains all seven.)
#[test]
fn a_slow_keys_successor_is_not_chained_to_wait_for_a_busy_slot() {
    run_in_system(within(60, "slow chained successor test", async {
        let n = 8;
        let (c, log) = one_key_on_one_slot("rt_ahead_chain_slow", n, 300).await;
        assert!(c.chained_ahead <= 2, "{c:?}");
        assert_eq!(log.len(), n as usize);
    }))
}

/// How many handlers ran at once, at most (by their recorded start and end).
fn most_at_once(log: &[scripted::Exec]) -> usize {
    log.iter()
        .map(|a| {
            log.iter()
                .filter(|b| b.start <= a.start && b.end.is_none_or(|end| a.start < end))
                .count()
        })
        .max()
        .unwrap_or(0)
}

/// Three slots, handlers on three threads of their own, 600 short jobs claimed ahead.
/// A handler's task that returns starts the next waiting job itself, so here slots are
/// handed on from several threads at once, beside the claimer: never more handlers run
/// than slots, each job runs once, and a shutdown in the middle leaves every job done
/// (having run once) or pending (having never run), none running.
#[test]
fn slots_handed_on_by_returning_handlers_on_many_threads_stay_within_the_slots() {
    run_in_system(within(90, "hand-on test", async {
        let db = TestDb::with_options("rt_ahead_hand_on", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let ids = db
            .store
            .enqueue_many(
                (0..600)
                    .map(|i| scripted(work(&format!("j{i}"), 2 + i % 3)))
                    .collect(),
            )
            .await
            .unwrap();
        let mut config = config_with_lease(&db.schema, Duration::from_secs(5));
        config.concurrency = 3;
        config.handler_threads = Some(3);
        config.claim_ahead_window = None;
        let a = Scheduler::builder(db.pool.clone(), config)
            .register(h.clone())
            .start()
            .await
            .unwrap();
        wait_until(30, "half of the jobs to run", || async {
            h.log().len() >= ids.len() / 2
        })
        .await;
        let report = a.shutdown().await.unwrap();
        assert_eq!((report.metrics.ready, report.metrics.in_flight), (0, 0));
        assert!(
            report.metrics.counters.claimed_ahead > 0,
            "{:?}",
            report.metrics.counters
        );

        let log = h.log();
        assert!(
            log.iter().all(|e| e.end.is_some()),
            "a handler outlived the shutdown"
        );
        let most = most_at_once(&log);
        assert!(most <= 3, "{most} handlers ran at once on 3 slots");
        let (mut done, mut pending) = (0, 0);
        for id in &ids {
            let job = db.store.job(*id).await.unwrap();
            let runs = h.runs_of(*id).len();
            match job.state {
                JobState::Done => {
                    assert_eq!(runs, 1, "a done job ran {runs} times: {job:?}");
                    done += 1;
                }
                JobState::Pending => {
                    assert_eq!((runs, job.attempts), (0, 0), "{job:?}");
                    pending += 1;
                }
                other => panic!("job {id} left {other:?} by the shutdown: {job:?}"),
            }
        }
        assert!(
            done >= ids.len() / 2 && pending > 0,
            "{done} done, {pending} pending"
        );
        db.drop().await;
    }))
}
