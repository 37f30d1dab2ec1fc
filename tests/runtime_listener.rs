//! A dropped LISTEN connection does not stall work: polling covers the gap, and the
//! listener comes back and wakes the claimer again.
//!
//! These tests terminate backends named `leasehold-listener`, so each runs in a
//! database of its own (see `OwnDb`): other tests' listeners are left alone.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::within;
use leasehold::{Handler, JobContext, JobError, JobId, NewJob, Scheduler};
use worker::{fast_config, run_in_system, wait_until, OwnDb};

const LISTENER: &str = "leasehold-listener";

struct Noop;

impl Handler for Noop {
    type Payload = ();
    type Output = ();
    const KIND: &'static str = "noop";

    async fn run(&self, _: JobContext, _: ()) -> Result<(), JobError> {
        Ok(())
    }
}

/// Seconds from the moment the job became claimable to its claim (database clock).
async fn start_delay(own: &OwnDb, id: JobId) -> Option<f64> {
    sqlx::query_scalar(&format!(
        "SELECT extract(epoch FROM claimed_at - greatest(created_at, available_at))::float8
         FROM {} WHERE id = $1 AND claimed_at IS NOT NULL",
        own.db.table("jobs")
    ))
    .bind(id.0)
    .fetch_optional(&own.db.pool)
    .await
    .unwrap()
}

async fn wait_started(own: &OwnDb, id: JobId, secs: u64) -> f64 {
    within(secs, "the job to start", async {
        loop {
            if let Some(delay) = start_delay(own, id).await {
                return delay;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

/// The listener's connection is up and its LISTEN has run: see
/// `OwnDb::listening_backends_named` (CI saw round 1 wait for a reconnect that a kill
/// before the LISTEN never made, 1 run in 10).
async fn listener_connected(own: &OwnDb) {
    wait_until(10, "the listener to listen", || async {
        own.listening_backends_named(LISTENER).await == 1
    })
    .await;
}

#[test]
fn jobs_enqueued_after_the_listener_is_killed_start_within_the_poll_bound() {
    run_in_system(within(60, "listener drop test", async {
        let own = OwnDb::new("listener_drop").await;
        let config = fast_config(&own.db.schema);
        let poll_max = config.poll_interval_max;
        let scheduler = Scheduler::builder(own.db.pool.clone(), config)
            .register(Noop)
            .start()
            .await
            .unwrap();
        listener_connected(&own).await;
        assert_eq!(own.terminate(LISTENER).await, 1);

        // Right after the kill: notifications of these may be lost; they must start
        // all the same. The delayed ones are never announced when due, so only
        // polling can find them.
        let mut ids = Vec::new();
        for i in 0..10 {
            let mut job = NewJob::from_json("noop", serde_json::json!(null));
            if i % 2 == 1 {
                job = job.with_delay(Duration::from_millis(300));
            }
            ids.push(scheduler.enqueue_job(job).await.unwrap());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut worst = 0.0f64;
        for id in &ids {
            worst = worst.max(wait_started(&own, *id, 10).await);
        }
        eprintln!("longest wait from claimable to claimed: {worst:.3}s (poll max {poll_max:?})");
        // The poll bound plus a generous allowance for a loaded machine: a stall would
        // be unbounded.
        assert!(
            worst < poll_max.as_secs_f64() + 2.0,
            "a job waited {worst:.3}s with a poll bound of {poll_max:?}"
        );

        wait_until(10, "the listener to reconnect", || async {
            scheduler.metrics().counters.listener_reconnects >= 1
        })
        .await;
        listener_connected(&own).await;
        wait_until(10, "every job to finish", || async {
            own.db.count_where("jobs", "state = 'done'").await == ids.len() as i64
        })
        .await;
        scheduler.shutdown().await.unwrap();
        own.drop().await;
    }))
}

#[test]
fn after_a_reconnect_notifications_wake_the_claimer_long_before_the_poll() {
    run_in_system(within(90, "listener reconnect test", async {
        let own = OwnDb::new("listener_back").await;
        let mut config = fast_config(&own.db.schema);
        // Polling alone would take up to 10 s to find a job.
        config.poll_interval_min = Duration::from_secs(10);
        config.poll_interval_max = Duration::from_secs(10);
        let scheduler = Scheduler::builder(own.db.pool.clone(), config)
            .register(Noop)
            .start()
            .await
            .unwrap();
        listener_connected(&own).await;
        for round in 1..=2 {
            assert_eq!(own.terminate(LISTENER).await, 1);
            wait_until(10, "the listener to reconnect", || async {
                scheduler.metrics().counters.listener_reconnects >= round
            })
            .await;
            listener_connected(&own).await;

            for _ in 0..3 {
                let before = scheduler.metrics().counters.notifications;
                let id = scheduler
                    .enqueue_job(NewJob::from_json("noop", serde_json::json!(null)))
                    .await
                    .unwrap();
                let waited = wait_started(&own, id, 15).await;
                let after = scheduler.metrics().counters.notifications;
                eprintln!(
                    "round {round}: started after {waited:.3}s; notifications {before} -> {after}"
                );
                assert!(
                    after > before,
                    "no notification arrived after the reconnect"
                );
                assert!(
                    waited < 3.0,
                    "a job waited {waited:.3}s: picked up by the 10 s poll, not by a notification"
                );
            }
        }
        scheduler.shutdown().await.unwrap();
        own.drop().await;
    }))
}
