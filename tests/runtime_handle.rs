//! The scheduler handle as an application holds it: cloned into request handlers,
//! stopped from any clone (twice is fine), dropped without a shutdown, enqueueing into
//! the queue it serves; its own connections named so an operator can tell whose they
//! are.

mod common;
#[path = "common/scripted.rs"]
mod scripted;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::within;
use leasehold::{Error, JobState, NewJob, Scheduler};
use scripted::{scripted, work, Scripted};
use worker::{fast_config, run_in_system, wait_until, OwnDb};

#[test]
fn a_cloned_handle_shuts_down_once_and_every_clone_gets_the_report() {
    run_in_system(within(60, "clone and shutdown test", async {
        let own = OwnDb::new("handle_clone").await;
        let db = &own.db;
        let h = Scripted::new(&db.pool);
        let scheduler = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
            .register(h.clone())
            .start()
            .await
            .unwrap();
        let other = scheduler.clone();
        let id = other.enqueue_job(scripted(work("one", 10))).await.unwrap();
        wait_until(10, "the job to finish", || async {
            db.store.job(id).await.unwrap().state == JobState::Done
        })
        .await;
        let (a, b) = tokio::join!(scheduler.shutdown(), other.shutdown());
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a, b, "both callers get the one shutdown's report");
        assert_eq!(a.metrics.in_flight, 0);
        // A third call returns at once with the same report.
        assert_eq!(
            within(2, "third shutdown", scheduler.shutdown())
                .await
                .unwrap(),
            a
        );
        assert!(matches!(
            other.enqueue_job(scripted(work("late", 0))).await,
            Err(Error::ShuttingDown)
        ));
        wait_until(10, "the scheduler's connections to close", || async {
            own.scheduler_backends().await == 0
        })
        .await;
        own.drop().await;
    }))
}

#[test]
fn a_scheduler_dropped_without_shutdown_stops_claiming_and_releases_its_jobs() {
    run_in_system(within(60, "drop test", async {
        let own = OwnDb::new("handle_drop").await;
        let db = &own.db;
        let h = Scripted::new(&db.pool);
        let scheduler = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
            .register(h.clone())
            .start()
            .await
            .unwrap();
        let id = scheduler
            .enqueue_job(scripted(work("long", 60_000)))
            .await
            .unwrap();
        h.started("long", 10).await;
        drop(scheduler);
        // Released within the grace period (2 s) and a moment, not after its lease.
        wait_until(8, "the job to be released", || async {
            db.store.job(id).await.unwrap().state == JobState::Pending
        })
        .await;
        let job = db.store.job(id).await.unwrap();
        assert_eq!(
            job.attempts, 0,
            "a release does not count the attempt: {job:?}"
        );
        assert!(h.runs_of(id)[0].end.is_some(), "the handler was stopped");
        // Nothing claims it again, and the scheduler's connections close.
        let later = db.store.enqueue(scripted(work("later", 0))).await.unwrap();
        wait_until(10, "the scheduler's connections to close", || async {
            own.scheduler_backends().await == 0
        })
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(db.store.job(later).await.unwrap().state, JobState::Pending);
        assert_eq!(h.runs_of(id).len(), 1);
        own.drop().await;
    }))
}

#[test]
fn jobs_enqueued_through_a_scheduler_go_to_a_queue_it_serves() {
    run_in_system(within(60, "queue test", async {
        let own = OwnDb::new("handle_queue").await;
        let db = &own.db;
        let h = Scripted::new(&db.pool);
        let mut config = fast_config(&db.schema);
        config.queues = vec!["payments".into()];
        let scheduler = Scheduler::builder(db.pool.clone(), config)
            .register(h.clone())
            .start()
            .await
            .unwrap();
        // No queue named: the scheduler's own, so the job runs.
        let id = scheduler
            .enqueue_job(scripted(work("mine", 0)))
            .await
            .unwrap();
        wait_until(10, "the job to run", || async {
            db.store.job(id).await.unwrap().state == JobState::Done
        })
        .await;
        assert_eq!(db.store.job(id).await.unwrap().queue, "payments");
        // A queue nobody here serves is refused, naming the field; nothing is written.
        let before = db.job_count().await;
        let err = scheduler
            .enqueue_job(scripted(work("elsewhere", 0)).with_queue("emails"))
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::InvalidInput { field: "queue", .. }),
            "{err}"
        );
        assert_eq!(db.job_count().await, before);
        // Through a Store, a job without a queue goes to "default", as documented.
        let stored = db
            .store
            .enqueue(NewJob::from_json("other", serde_json::json!({})))
            .await
            .unwrap();
        assert_eq!(db.store.job(stored).await.unwrap().queue, "default");
        scheduler.shutdown().await.unwrap();
        own.drop().await;
    }))
}

#[test]
fn the_schedulers_own_connections_carry_its_owner_id() {
    run_in_system(within(60, "connection names test", async {
        let own = OwnDb::new("handle_names").await;
        let db = &own.db;
        let h = Scripted::new(&db.pool);
        let scheduler = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
            .register(h.clone())
            .start()
            .await
            .unwrap();
        // A running job makes the renewer connect; the claimer and listener already do.
        let id = scheduler
            .enqueue_job(scripted(work("long", 1_500)))
            .await
            .unwrap();
        h.started("long", 10).await;
        let short = scheduler.owner().short().to_string();
        assert!(scheduler.owner().as_str().ends_with(&short));
        for role in ["listener", "claimer", "renewer"] {
            let name = format!("leasehold-{role} {short}");
            wait_until(10, &format!("a backend named {name}"), || async {
                own.backends_named(&name).await >= 1
            })
            .await;
        }
        wait_until(10, "the job to finish", || async {
            db.store.job(id).await.unwrap().state == JobState::Done
        })
        .await;
        scheduler.shutdown().await.unwrap();
        own.drop().await;
    }))
}
