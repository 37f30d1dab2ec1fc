//! Cancelling a running job is a request: its handler is told at once, and its key
//! moves on only when that attempt has ended. Two schedulers serve the key, so a key
//! that moved on too early would run its next job on the other one while the cancelled
//! handler still runs; the execution log would show the overlap.

mod common;
#[path = "common/scripted.rs"]
mod scripted;
#[path = "common/worker.rs"]
mod worker;

use std::time::{Duration, Instant};

use common::{within, TestDb};
use leasehold::{CancelOutcome, CancelReason, JobId, JobState, Scheduler, StoreOptions};
use scripted::{scripted, work, OnCancel, Script, Scripted};
use worker::{config_with_lease, run_in_system, wait_until, POOL};

const LEASE: Duration = Duration::from_secs(2);

/// Two schedulers sharing one execution log, and a keyed head whose handler reacts to a
/// cancel with `on_cancel`, followed by two more jobs of the key.
struct Setup {
    db: TestDb,
    h: Scripted,
    a: Scheduler,
    b: Scheduler,
    head: JobId,
    rest: Vec<JobId>,
}

async fn setup(test: &str, on_cancel: OnCancel) -> Setup {
    let db = TestDb::with_options(test, StoreOptions::default(), POOL).await;
    let h = Scripted::new(&db.pool);
    let mut schedulers = Vec::new();
    for _ in 0..2 {
        schedulers.push(
            Scheduler::builder(db.pool.clone(), config_with_lease(&db.schema, LEASE))
                .register(h.clone())
                .start()
                .await
                .unwrap(),
        );
    }
    let b = schedulers.pop().unwrap();
    let a = schedulers.pop().unwrap();
    let head = a
        .enqueue_job(
            scripted(Script {
                on_cancel,
                ..work("head", 20_000)
            })
            .with_key("acct"),
        )
        .await
        .unwrap();
    let mut rest = Vec::new();
    for tag in ["second", "third"] {
        rest.push(
            a.enqueue_job(scripted(work(tag, 50)).with_key("acct"))
                .await
                .unwrap(),
        );
    }
    h.started("head", 10).await;
    Setup {
        db,
        h,
        a,
        b,
        head,
        rest,
    }
}

impl Setup {
    /// Cancel the running head; returns when the request was made.
    async fn cancel_head(&self) -> Instant {
        let asked = Instant::now();
        assert_eq!(
            self.db.store.cancel(self.head, "operator").await.unwrap(),
            CancelOutcome::Requested
        );
        asked
    }

    async fn finish(self) -> (TestDb, Scripted) {
        let ids: Vec<JobId> = std::iter::once(self.head)
            .chain(self.rest.clone())
            .collect();
        wait_until(30, "the key's jobs to end", || async {
            for id in &ids {
                if !self.db.store.job(*id).await.unwrap().state.is_terminal() {
                    return false;
                }
            }
            true
        })
        .await;
        self.a.shutdown().await.unwrap();
        self.b.shutdown().await.unwrap();
        // Whatever happened, one attempt of the key at a time, in key_seq order.
        self.h.assert_keys_serial();
        for id in &self.rest {
            assert_eq!(self.db.store.job(*id).await.unwrap().state, JobState::Done);
        }
        (self.db, self.h)
    }
}

#[test]
fn a_cancelled_head_that_stops_at_once_ends_cancelled_and_its_key_moves_on() {
    run_in_system(within(60, "cancel: stop at once", async {
        let s = setup("rt_cancel_stop", OnCancel::Stop).await;
        let asked = s.cancel_head().await;
        let head = s.h.ended("head", 10).await;
        let (reason, told) = head.cancel.expect("the head was told");
        assert_eq!(reason, CancelReason::Cancelled);
        // Told by NOTIFY at once, not at the next renewal.
        assert!(
            told.duration_since(asked) < Duration::from_millis(400),
            "told {:?} after the cancel",
            told.duration_since(asked)
        );
        let head_id = s.head;
        let (db, _) = s.finish().await;
        let job = db.store.job(head_id).await.unwrap();
        assert_eq!(job.state, JobState::Cancelled, "{job:?}");
        let events: Vec<String> = db
            .store
            .history(head_id)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.event)
            .collect();
        assert!(
            events.contains(&"cancel_requested".to_string()),
            "{events:?}"
        );
        assert!(events.contains(&"cancelled".to_string()), "{events:?}");
        db.drop().await;
    }))
}

#[test]
fn the_key_waits_while_a_cancelled_head_takes_its_time_to_stop() {
    run_in_system(within(60, "cancel: stop late", async {
        // Stops 300 ms after being told: within the grace (a renew interval, 500 ms).
        let s = setup("rt_cancel_late", OnCancel::StopAfter(300)).await;
        s.cancel_head().await;
        // The head keeps running for a while; the key's next job must not start.
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert!(
            s.h.runs_tagged("second").is_empty(),
            "the key moved on while its head ran"
        );
        assert_eq!(
            s.db.store.job(s.head).await.unwrap().state,
            JobState::Running
        );
        let head_id = s.head;
        let (db, h) = s.finish().await;
        assert_eq!(
            db.store.job(head_id).await.unwrap().state,
            JobState::Cancelled
        );
        let head = &h.runs_tagged("head")[0];
        assert!(h.runs_tagged("second")[0].start >= head.end.unwrap());
        db.drop().await;
    }))
}

#[test]
fn a_cancelled_head_that_ignores_the_cancel_is_stopped_before_its_key_moves_on() {
    run_in_system(within(60, "cancel: ignored", async {
        let s = setup("rt_cancel_ignored", OnCancel::Ignore).await;
        let asked = s.cancel_head().await;
        // Stopped (aborted) after a renew interval of grace, not after its 20 s of work.
        let head = s.h.ended("head", 10).await;
        assert!(
            head.end.unwrap().duration_since(asked) < Duration::from_secs(3),
            "the ignoring handler ran on for {:?}",
            head.end.unwrap().duration_since(asked)
        );
        let head_id = s.head;
        let (db, _) = s.finish().await;
        let job = db.store.job(head_id).await.unwrap();
        assert_eq!(job.state, JobState::Cancelled, "{job:?}");
        assert!(
            job.last_error
                .as_deref()
                .unwrap_or("")
                .contains("cancelled by operator"),
            "{job:?}"
        );
        db.drop().await;
    }))
}

#[test]
fn a_cancelled_head_whose_owner_is_gone_is_cancelled_when_its_lease_expires() {
    run_in_system(within(60, "cancel: owner gone", async {
        let db = TestDb::with_options("rt_cancel_ownergone", StoreOptions::default(), POOL).await;
        // The head is claimed by an owner that then vanishes (no renewals, no ending).
        let head = db
            .store
            .enqueue(scripted(work("head", 0)).with_key("acct"))
            .await
            .unwrap();
        let next = db
            .store
            .enqueue(scripted(work("next", 0)).with_key("acct"))
            .await
            .unwrap();
        sqlx::query(&format!(
            "UPDATE {} SET state = 'running', owner = 'gone', generation = 1, attempts = 1,
                 lease_until = now() + interval '1 second' WHERE id = $1",
            db.table("jobs")
        ))
        .bind(head.0)
        .execute(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            db.store.cancel(head, "owner vanished").await.unwrap(),
            CancelOutcome::Requested
        );
        let h = Scripted::new(&db.pool);
        let survivor = Scheduler::builder(db.pool.clone(), config_with_lease(&db.schema, LEASE))
            .register(h.clone())
            .start()
            .await
            .unwrap();
        wait_until(20, "the next job to run", || async {
            db.store.job(next).await.unwrap().state == JobState::Done
        })
        .await;
        survivor.shutdown().await.unwrap();
        let job = db.store.job(head).await.unwrap();
        assert_eq!(job.state, JobState::Cancelled, "{job:?}");
        assert_eq!(
            db.count_where("lease_expiries", "new_state = 'cancelled'")
                .await,
            1
        );
        assert!(h.runs_tagged("head").is_empty());
        db.drop().await;
    }))
}

#[test]
fn a_cancelled_head_that_finishes_its_work_is_done() {
    run_in_system(within(60, "cancel: finishes", async {
        let db = TestDb::with_options("rt_cancel_finishes", StoreOptions::default(), POOL).await;
        let h = Scripted::new(&db.pool);
        let s = Scheduler::builder(db.pool.clone(), config_with_lease(&db.schema, LEASE))
            .register(h.clone())
            .start()
            .await
            .unwrap();
        // It ignores the cancel but finishes within the grace: the work happened.
        let id = s
            .enqueue_job(scripted(Script {
                on_cancel: OnCancel::Ignore,
                ..work("head", 300)
            }))
            .await
            .unwrap();
        h.started("head", 10).await;
        assert_eq!(
            db.store.cancel(id, "too late").await.unwrap(),
            CancelOutcome::Requested
        );
        wait_until(10, "the job to end", || async {
            db.store.job(id).await.unwrap().state.is_terminal()
        })
        .await;
        s.shutdown().await.unwrap();
        assert_eq!(db.store.job(id).await.unwrap().state, JobState::Done);
        db.drop().await;
    }))
}

/// A notification is a hint, never a fact: an enqueue into a schema named
/// `cancel_<schema>` (whose wake-up channel was once this schema's cancel channel) and
/// a bare NOTIFY on this schema's own cancel channel, with no cancel recorded on the
/// row, must both leave the running head alone; the real cancel afterwards still
/// reaches it at once.
#[test]
fn a_cancel_notification_without_a_recorded_cancel_never_stops_a_handler() {
    run_in_system(within(60, "cancel: hint only", async {
        let s = setup("rt_cancel_hint", OnCancel::Stop).await;
        let neighbour_schema = format!("cancel_{}", s.db.schema);
        let neighbour = leasehold::Store::new(
            s.db.owner.clone(),
            &neighbour_schema,
            StoreOptions::default(),
        )
        .unwrap();
        neighbour.migrate().await.unwrap();
        // The neighbour's queue is named like the head's id: its wake-up payload.
        neighbour
            .enqueue(
                leasehold::NewJob::from_json("anything", serde_json::json!({}))
                    .with_queue(s.head.0.to_string()),
            )
            .await
            .unwrap();
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(s.db.store.schema().cancel_channel())
            .bind(s.head.0.to_string())
            .execute(&s.db.pool)
            .await
            .unwrap();
        // Two renew intervals: a renewal prompted by the hint has read the row by then.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let runs = s.h.runs_tagged("head");
        assert!(
            runs[0].cancel.is_none() && runs[0].end.is_none(),
            "the head was stopped without a recorded cancel: {:?}",
            runs[0]
        );
        assert_eq!(
            s.db.store.job(s.head).await.unwrap().state,
            JobState::Running
        );
        let asked = s.cancel_head().await;
        let head = s.h.ended("head", 10).await;
        let (reason, told) = head.cancel.expect("the real cancel reached the head");
        assert_eq!(reason, CancelReason::Cancelled);
        assert!(
            told.duration_since(asked) < Duration::from_millis(400),
            "told {:?} after the cancel",
            told.duration_since(asked)
        );
        let (db, _) = s.finish().await;
        let _ = sqlx::query(&format!("DROP SCHEMA \"{neighbour_schema}\" CASCADE"))
            .execute(&db.owner)
            .await;
        db.drop().await;
    }))
}
