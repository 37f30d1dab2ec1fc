//! Mailbox metrics: every actor's mailbox is counted, and an overflow is visible while
//! nothing is dropped.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::{within, TestDb};
use leasehold::{Config, StoreOptions};
use leasehold::{Handler, JobContext, JobError, MetricsSnapshot, NewJob, Scheduler};
use worker::{fast_config, run_in_system, wait_until, POOL};

struct Quick;

impl Handler for Quick {
    type Payload = i64;
    type Output = ();
    const KIND: &'static str = "quick";

    async fn run(&self, _: JobContext, _: i64) -> Result<(), JobError> {
        tokio::time::sleep(Duration::from_millis(1)).await;
        Ok(())
    }
}

/// `n` jobs, a third of them spread over 5 keys.
fn burst(n: i64) -> Vec<NewJob> {
    (0..n)
        .map(|i| {
            let j = NewJob::new("quick", &i).unwrap();
            if i % 3 == 0 {
                j.with_key(format!("k{}", i % 5))
            } else {
                j
            }
        })
        .collect()
}

/// Run `n` jobs to completion on a scheduler with `config`; the metrics at the end.
async fn run_burst(db: &TestDb, config: Config, n: i64) -> MetricsSnapshot {
    let scheduler = Scheduler::builder(db.pool.clone(), config)
        .register(Quick)
        .start()
        .await
        .unwrap();
    scheduler.enqueue_many(burst(n)).await.unwrap();
    wait_until(60, "every job to finish", || async {
        db.count_where("jobs", "state = 'done'").await == n
    })
    .await;
    // Renewals happen on their own tick; one pass makes sure the renewer handled one.
    let _ = scheduler.renew_now().await.unwrap();
    // The figures after every actor stopped: whatever was sent was handled by then.
    let m = scheduler.shutdown().await.unwrap().metrics;
    assert_eq!(db.count_where("jobs", "true").await, n);
    m
}

/// Every message counted as sent was handled: none was dropped.
fn assert_all_handled(m: &MetricsSnapshot) {
    for mb in &m.mailboxes {
        assert_eq!(mb.depth, 0, "{}: messages never handled: {mb:?}", mb.actor);
    }
}

#[test]
fn every_actor_mailbox_is_counted() {
    run_in_system(within(90, "mailbox metrics test", async {
        let db = TestDb::with_options("rt_mailboxes", StoreOptions::default(), POOL).await;
        let m = run_burst(&db, fast_config(&db.schema), 300).await;
        for actor in ["claimer", "completer", "lease_renewer", "sequencer"] {
            let mb = m
                .mailbox(actor)
                .unwrap_or_else(|| panic!("no mailbox figures for {actor}: {m:?}"));
            assert!(mb.handled > 0, "{actor}: {mb:?}");
            assert!(mb.high_water >= 1, "{actor}: {mb:?}");
            assert_eq!(mb.overflows, 0, "{actor}: {mb:?}");
        }
        assert_all_handled(&m);
        assert_eq!(m.counters.completed, 300, "{:?}", m.counters);
        assert_eq!(m.counters.claimed, 300, "{:?}", m.counters);
        assert_eq!(m.in_flight, 0);
        assert!(m.claim_latency.count > 0 && m.enqueue_to_start.count == 300);
        db.drop().await;
    }))
}

#[test]
fn a_mailbox_overflow_is_counted_and_nothing_is_dropped() {
    run_in_system(within(90, "mailbox overflow test", async {
        let db = TestDb::with_options("rt_overflow", StoreOptions::default(), POOL).await;
        let mut config = fast_config(&db.schema);
        config.mailbox_capacity = 1;
        config.concurrency = 32;
        let n = 600;
        let m = run_burst(&db, config, n).await;
        let overflows: u64 = m.mailboxes.iter().map(|mb| mb.overflows).sum();
        eprintln!(
            "overflows by actor: {:?}",
            m.mailboxes
                .iter()
                .map(|mb| (mb.actor.as_str(), mb.overflows, mb.high_water))
                .collect::<Vec<_>>()
        );
        assert!(overflows > 0, "no overflow with a mailbox of 1: {m:?}");
        // Delivered anyway: every message was handled, every job completed once.
        assert_all_handled(&m);
        assert_eq!(m.counters.completed, n as u64, "{:?}", m.counters);
        assert_eq!(
            db.count_where("jobs", "state = 'done' AND attempts = 1")
                .await,
            n
        );
        assert_eq!(db.count_where("lease_expiries", "true").await, 0);
        db.drop().await;
    }))
}
