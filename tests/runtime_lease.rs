//! Leases at runtime: renewal keeps a long handler's job; a lost lease cancels the
//! handler and its completion is refused.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{far_future, fixed_backoff, owner, within, TestDb};
use leasehold::{CancelReason, Handler, JobContext, JobError, JobId, JobState, Scheduler};
use leasehold::{NewJob, StoreOptions};
use tokio::sync::mpsc;
use worker::{config_with_lease, run_in_system, wait_until, POOL};

/// Works for `secs` seconds, then reports whether it was ever cancelled.
struct Long {
    secs: f64,
}

impl Handler for Long {
    type Payload = ();
    type Output = String;
    const KIND: &'static str = "long";

    async fn run(&self, ctx: JobContext, _: ()) -> Result<String, JobError> {
        tokio::time::sleep(Duration::from_secs_f64(self.secs)).await;
        Ok(format!("finished; cancelled: {}", ctx.is_cancelled()))
    }
}

#[test]
fn a_handler_running_five_leases_long_keeps_its_job() {
    run_in_system(within(60, "long handler test", async {
        let db = TestDb::with_options("rt_renewal", StoreOptions::default(), POOL).await;
        let lease = Duration::from_secs(1);
        let config = config_with_lease(&db.schema, lease);
        let scheduler = Scheduler::builder(db.pool.clone(), config)
            .register(Long {
                secs: 5.0 * lease.as_secs_f64(),
            })
            .start()
            .await
            .unwrap();
        let id = scheduler.enqueue::<Long>(&()).await.unwrap();
        // Until it ends, or until a second claim shows the renewal failed.
        wait_until(30, "the long job to finish", || async {
            let job = db.store.job(id).await.unwrap();
            job.state.is_terminal() || job.generation.0 > 1
        })
        .await;
        let m = scheduler.metrics();
        scheduler.shutdown().await.unwrap();

        let job = db.store.job(id).await.unwrap();
        assert_eq!(job.state, JobState::Done, "{job:?}");
        assert_eq!(
            job.result,
            Some(serde_json::json!("finished; cancelled: false"))
        );
        assert_eq!(
            (job.generation.0, job.attempts),
            (1, 1),
            "claimed twice: {job:?}"
        );
        assert_eq!(db.count_where("lease_expiries", "true").await, 0);
        let claims = db
            .store
            .history(id)
            .await
            .unwrap()
            .iter()
            .filter(|e| e.event == "claimed")
            .count();
        assert_eq!(claims, 1);
        // Renewed several times, never lost.
        assert!(m.counters.leases_renewed >= 3, "{:?}", m.counters);
        assert_eq!(m.counters.leases_lost, 0);
        assert_eq!(m.counters.stale_completions, 0);
        db.drop().await;
    }))
}

/// Waits for cancellation (at most 20 s), reports the reason, then returns Ok — so the
/// scheduler tries to complete the job with the lost fence.
struct Cancellable {
    started: mpsc::UnboundedSender<JobId>,
    seen: Arc<Mutex<Option<CancelReason>>>,
}

impl Handler for Cancellable {
    type Payload = ();
    type Output = ();
    const KIND: &'static str = "cancellable";

    async fn run(&self, ctx: JobContext, _: ()) -> Result<(), JobError> {
        let _ = self.started.send(ctx.job_id());
        let _ = tokio::time::timeout(Duration::from_secs(20), ctx.cancelled()).await;
        *self.seen.lock().unwrap() = ctx.cancel_reason();
        Ok(())
    }
}

struct LostLease {
    db: TestDb,
    scheduler: Scheduler,
    id: JobId,
    seen: Arc<Mutex<Option<CancelReason>>>,
}

/// A scheduler running one `Cancellable` job.
async fn running_cancellable(test: &str) -> LostLease {
    let db = TestDb::with_options(test, StoreOptions::default(), POOL).await;
    let (tx, mut started) = mpsc::unbounded_channel();
    let seen = Arc::new(Mutex::new(None));
    let scheduler = Scheduler::builder(
        db.pool.clone(),
        config_with_lease(&db.schema, Duration::from_secs(2)),
    )
    .register(Cancellable {
        started: tx,
        seen: seen.clone(),
    })
    .start()
    .await
    .unwrap();
    let id = scheduler
        .enqueue_job(NewJob::from_json("cancellable", serde_json::json!(null)))
        .await
        .unwrap();
    let got = within(10, "the handler to start", started.recv())
        .await
        .unwrap();
    assert_eq!(got, id);
    // The renewer records the start soon after it: an expiry counts as an attempt then.
    wait_until(10, "the start to be recorded", || async {
        db.count_where(
            "jobs",
            &format!("id = {} AND started_generation = generation", id.0),
        )
        .await
            == 1
    })
    .await;
    LostLease {
        db,
        scheduler,
        id,
        seen,
    }
}

impl LostLease {
    /// The handler saw `LeaseLost`, and the completion was refused and counted.
    async fn assert_cancelled_and_refused(&self) {
        wait_until(10, "the handler to be cancelled", || async {
            self.seen.lock().unwrap().is_some()
        })
        .await;
        assert_eq!(*self.seen.lock().unwrap(), Some(CancelReason::LeaseLost));
        wait_until(10, "the stale completion to be refused", || async {
            self.scheduler.metrics().counters.stale_completions >= 1
        })
        .await;
        let c = self.scheduler.metrics().counters;
        assert!(c.leases_lost >= 1, "{c:?}");
        assert_eq!(c.completed, 0, "{c:?}");
        assert_eq!(self.scheduler.metrics().in_flight, 0);
    }
}

#[test]
fn a_generation_bumped_from_outside_cancels_the_handler_and_refuses_its_completion() {
    run_in_system(within(60, "outsider generation test", async {
        let t = running_cancellable("rt_lost_to_outsider").await;
        // An outsider takes the job over: a newer generation, its own owner and lease.
        let bumped = sqlx::query(&format!(
            "UPDATE {} SET generation = generation + 1, owner = 'outsider',
                 lease_until = now() + interval '1 hour'
             WHERE id = $1 AND state = 'running' AND generation = 1",
            t.db.table("jobs")
        ))
        .bind(t.id.0)
        .execute(&t.db.pool)
        .await
        .unwrap()
        .rows_affected();
        assert_eq!(bumped, 1);

        t.assert_cancelled_and_refused().await;
        // The stale worker wrote nothing: the outsider's generation is untouched.
        let job = t.db.store.job(t.id).await.unwrap();
        assert_eq!(job.state, JobState::Running, "{job:?}");
        assert_eq!(job.generation.0, 2);
        assert_eq!(job.owner.as_deref(), Some("outsider"));
        assert_eq!(job.attempts, 1);
        assert_eq!(job.result, None);
        assert!(job.lease_until.unwrap() > chrono::Utc::now() + chrono::Duration::minutes(50));
        let events: Vec<String> =
            t.db.store
                .history(t.id)
                .await
                .unwrap()
                .into_iter()
                .map(|e| e.event)
                .collect();
        assert!(!events.iter().any(|e| e == "completed"), "{events:?}");

        t.scheduler.shutdown().await.unwrap();
        // Shutdown released nothing it did not own.
        assert_eq!(
            t.db.store.job(t.id).await.unwrap().owner.as_deref(),
            Some("outsider")
        );
        t.db.drop().await;
    }))
}

#[test]
fn a_lease_reaped_from_outside_cancels_the_handler_and_refuses_its_completion() {
    run_in_system(within(60, "outside reap test", async {
        let t = running_cancellable("rt_lost_to_reaper").await;
        // Another process's reaper, with a clock far ahead, takes the lease back; the
        // retry is due far in the future, so nobody claims it meanwhile.
        let report =
            t.db.store
                .reap(
                    &owner("outside-reaper"),
                    &fixed_backoff(3600),
                    10,
                    Some(far_future()),
                )
                .await
                .unwrap();
        assert_eq!(report.retried, vec![t.id]);

        t.assert_cancelled_and_refused().await;
        let job = t.db.store.job(t.id).await.unwrap();
        assert_eq!(job.state, JobState::Pending, "{job:?}");
        assert_eq!((job.generation.0, job.attempts), (1, 1));
        assert_eq!(job.result, None);
        assert!(job.available_at > far_future());
        assert_eq!(
            t.db.count_where("lease_expiries", "generation = 1").await,
            1
        );
        t.scheduler.shutdown().await.unwrap();
        assert_eq!(t.db.state_of(t.id).await, "pending");
        t.db.drop().await;
    }))
}

/// Generation 1 ignores cancellation for `first_secs` (noting whether it was told its
/// lease is lost); later generations work for `later_secs`, then finish.
struct Stubborn {
    first_secs: f64,
    later_secs: f64,
    first_told: Arc<Mutex<Option<CancelReason>>>,
    started: mpsc::UnboundedSender<i64>,
}

impl Handler for Stubborn {
    type Payload = ();
    type Output = i64;
    const KIND: &'static str = "stubborn";

    async fn run(&self, ctx: JobContext, _: ()) -> Result<i64, JobError> {
        let generation = ctx.generation().0;
        let _ = self.started.send(generation);
        if generation == 1 {
            let until = tokio::time::Instant::now() + Duration::from_secs_f64(self.first_secs);
            while tokio::time::Instant::now() < until {
                if let Some(reason) = ctx.cancel_reason() {
                    *self.first_told.lock().unwrap() = Some(reason);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        } else {
            tokio::time::sleep(Duration::from_secs_f64(self.later_secs)).await;
        }
        Ok(generation)
    }
}

#[test]
fn a_process_that_claims_its_own_job_again_keeps_renewing_the_new_generation() {
    run_in_system(within(60, "own re-claim test", async {
        let db = TestDb::with_options("rt_own_reclaim", StoreOptions::default(), POOL).await;
        let lease = Duration::from_secs(1);
        let (tx, mut started) = mpsc::unbounded_channel();
        let first_told = Arc::new(Mutex::new(None));
        let scheduler = Scheduler::builder(db.pool.clone(), config_with_lease(&db.schema, lease))
            .register(Stubborn {
                // Both attempts stay in this process's registry for several renewals.
                first_secs: 3.0 * lease.as_secs_f64(),
                later_secs: 4.0 * lease.as_secs_f64(),
                first_told: first_told.clone(),
                started: tx,
            })
            .start()
            .await
            .unwrap();
        let id = scheduler.enqueue::<Stubborn>(&()).await.unwrap();
        assert_eq!(
            within(10, "generation 1 to start", started.recv()).await,
            Some(1)
        );
        // Another process's reaper (clock ahead) takes the lease back and makes the job
        // due now; this same scheduler claims it again as generation 2.
        sqlx::query(&format!(
            "UPDATE {} SET state = 'pending', owner = NULL, lease_until = NULL, available_at = now() WHERE id = $1",
            db.table("jobs")
        ))
        .bind(id.0)
        .execute(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            within(10, "generation 2 to start", started.recv()).await,
            Some(2)
        );

        wait_until(30, "the job to finish", || async {
            let job = db.store.job(id).await.unwrap();
            job.state.is_terminal() || job.generation.0 > 2
        })
        .await;
        let m = scheduler.metrics();
        scheduler.shutdown().await.unwrap();
        // Generation 2 kept its lease for four leases: the end of generation 1 in the same
        // process (abandoned after it ignored the loss) did not stop its renewal. (Ending
        // attempts by job id alone fails here: generation 2 expires and is claimed again.)
        let job = db.store.job(id).await.unwrap();
        assert_eq!(job.state, JobState::Done, "{job:?}");
        assert_eq!((job.generation.0, job.attempts), (2, 2), "{job:?}");
        assert_eq!(job.result, Some(serde_json::json!(2)));
        assert_eq!(db.count_where("lease_expiries", "true").await, 0);
        // Generation 1 was told its lease is gone, and counted once.
        assert_eq!(*first_told.lock().unwrap(), Some(CancelReason::LeaseLost));
        assert_eq!(m.counters.leases_lost, 1, "{:?}", m.counters);
        db.drop().await;
    }))
}
