//! Attack: retention's floor at its edges, on a database clock the test moves
//! (`common/clock.rs`): the jobs finish on the real clock, then the database "ages" by
//! shifting its clock, and retention passes read the shifted clock.
//!
//! Promise: done and cancelled jobs (and periodic fire records) are deleted once they
//! finished longer ago than the effective retention, the larger of `keep` and
//! `PruneOptions::floor` (default 5 minutes), never earlier; a unique `Period` job counts
//! from the later of its finish and its window's end; dead jobs are never deleted;
//! `Config::retention` below the floor is refused at start, and the reaper keeps the
//! floor.

#[path = "common/clock.rs"]
mod clock;
mod common;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use clock::DbClock;
use common::*;
use leasehold::store::{PruneOptions, DEFAULT_PRUNE_FLOOR};
use leasehold::{
    CompleteOutcome, Config, Error, Failure, JobId, JobState, NewJob, Scheduler, Store,
    StoreOptions, UniqueScope,
};

const FLOOR_SECS: f64 = 300.0;

struct Noop;

impl leasehold::Handler for Noop {
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "noop";

    async fn run(
        &self,
        _: leasehold::JobContext,
        _: serde_json::Value,
    ) -> Result<(), leasehold::JobError> {
        Ok(())
    }
}

struct Aged {
    db: TestDb,
    clock: DbClock,
    /// A store reading the shifted clock.
    store: Store,
}

impl Aged {
    async fn new(name: &str) -> Aged {
        let db = TestDb::new(name).await;
        let clock = DbClock::install(&db).await;
        let store = Store::new(clock.pool.clone(), &db.schema, StoreOptions::default()).unwrap();
        Aged { db, clock, store }
    }

    async fn done_job(&self, job: NewJob) -> JobId {
        let id = self.store.enqueue(job).await.unwrap();
        let w = owner("w");
        let got = self.store.claim(&claim_req(&w, 1)).await.unwrap();
        assert_eq!(got[0].id, id);
        assert_eq!(
            self.store.complete(&got[0].fence(), None).await.unwrap(),
            CompleteOutcome::Completed
        );
        id
    }

    async fn exists(&self, id: JobId) -> bool {
        match self.store.job(id).await {
            Ok(_) => true,
            Err(Error::JobNotFound(_)) => false,
            Err(e) => panic!("{e}"),
        }
    }

    #[allow(dead_code)]
    /// Seconds between the job's finish and now on the (unshifted) clock.
    async fn finished_ago(&self, id: JobId) -> f64 {
        sqlx::query_scalar(&format!(
            "SELECT extract(epoch FROM pg_catalog.clock_timestamp() - finished_at)::float8 FROM {} WHERE id = $1",
            self.db.table("jobs")
        ))
        .bind(id.0)
        .fetch_one(&self.db.owner)
        .await
        .unwrap()
    }

    async fn drop(self) {
        self.clock.drop().await;
        self.db.drop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_floor_keeps_a_done_job_until_five_minutes_after_its_finish_and_then_prunes_it()
{
    bounded(async {
        let t = Aged::new("a5_rf_default").await;
        let id = t.done_job(job("k")).await;
        t.clock.shift(FLOOR_SECS - 5.0).await;
        let r = t.store.prune(Duration::ZERO, 100).await.unwrap();
        assert_eq!(r.jobs, 0, "{r:?}");
        assert!(
            t.exists(id).await,
            "finished under 5 minutes ago by the database's clock"
        );
        let mut o = PruneOptions::new(Duration::ZERO);
        o.floor = DEFAULT_PRUNE_FLOOR;
        assert_eq!(t.store.prune_with(&o).await.unwrap().jobs, 0);
        t.clock.shift(FLOOR_SECS + 5.0).await;
        let r = t.store.prune(Duration::ZERO, 100).await.unwrap();
        assert_eq!(r.jobs, 1, "{r:?}");
        assert!(!t.exists(id).await);
        t.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keep_longer_than_the_floor_is_the_retention() {
    bounded(async {
        let t = Aged::new("a5_rf_keep").await;
        let id = t.done_job(job("k")).await;
        let o = PruneOptions::new(Duration::from_secs(600));
        t.clock.shift(590.0).await;
        assert_eq!(t.store.prune_with(&o).await.unwrap().jobs, 0);
        assert!(t.exists(id).await);
        t.clock.shift(610.0).await;
        assert_eq!(t.store.prune_with(&o).await.unwrap().jobs, 1);
        assert!(!t.exists(id).await);
        t.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_floor_above_the_default_and_a_floor_of_zero_are_both_honoured() {
    bounded(async {
        let t = Aged::new("a5_rf_floors").await;
        let a = t.done_job(job("k")).await;
        let mut high = PruneOptions::new(Duration::ZERO);
        high.floor = Duration::from_secs(900);
        t.clock.shift(600.0).await;
        assert_eq!(t.store.prune_with(&high).await.unwrap().jobs, 0);
        assert!(
            t.exists(a).await,
            "a floor of 15 minutes keeps a 10-minute-old job"
        );
        t.clock.shift(0.0).await;
        let b = t.done_job(job("k")).await;
        let mut zero = PruneOptions::new(Duration::from_secs(60));
        zero.floor = Duration::ZERO;
        t.clock.shift(30.0).await;
        assert_eq!(t.store.prune_with(&zero).await.unwrap().jobs, 0);
        assert!(
            t.exists(b).await,
            "keep 60 s with floor 0 keeps a 30 s old job"
        );
        t.clock.shift(90.0).await;
        assert_eq!(t.store.prune_with(&zero).await.unwrap().jobs, 2);
        t.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_job_is_kept_for_the_floor_and_a_dead_one_for_ever() {
    bounded(async {
        let t = Aged::new("a5_rf_cancel_dead").await;
        let cancelled = t.store.enqueue(job("k")).await.unwrap();
        t.store.cancel(cancelled, "stop").await.unwrap();
        let dead = t.store.enqueue(job("k")).await.unwrap();
        let w = owner("w");
        let got = t.store.claim(&claim_req(&w, 1)).await.unwrap();
        assert_eq!(got[0].id, dead);
        let failure = Failure {
            reason: "boom".into(),
            permanent: true,
            retry_after: None,
        };
        t.store
            .fail(&got[0].fence(), &failure, &fixed_backoff(1))
            .await
            .unwrap();
        t.clock.shift(FLOOR_SECS - 5.0).await;
        assert_eq!(t.store.prune(Duration::ZERO, 100).await.unwrap().jobs, 0);
        assert!(t.exists(cancelled).await);
        t.clock.shift(FLOOR_SECS + 5.0).await;
        assert_eq!(t.store.prune(Duration::ZERO, 100).await.unwrap().jobs, 1);
        assert!(!t.exists(cancelled).await);
        let mut zero = PruneOptions::new(Duration::ZERO);
        zero.floor = Duration::ZERO;
        t.clock.shift(10.0 * 86400.0).await;
        assert_eq!(t.store.prune_with(&zero).await.unwrap().jobs, 0);
        assert_eq!(t.store.job(dead).await.unwrap().state, JobState::Dead);
        t.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_period_unique_job_is_kept_until_the_floor_after_its_window_ends() {
    bounded(async {
        let t = Aged::new("a5_rf_unique").await;
        let id = t
            .done_job(job("k").unique("u", UniqueScope::Period(Duration::from_secs(3600))))
            .await;
        let window_left: f64 = sqlx::query_scalar(&format!(
            "SELECT extract(epoch FROM unique_until - pg_catalog.clock_timestamp())::float8 FROM {} WHERE id = $1",
            t.db.table("jobs")
        ))
        .bind(id.0)
        .fetch_one(&t.db.owner)
        .await
        .unwrap();
        assert!(window_left > 0.0 && window_left <= 3600.0, "{window_left}");
        t.clock.shift(window_left + FLOOR_SECS - 10.0).await;
        assert_eq!(t.store.prune(Duration::ZERO, 100).await.unwrap().jobs, 0);
        assert!(t.exists(id).await);
        t.clock.shift(window_left + FLOOR_SECS + 10.0).await;
        assert_eq!(t.store.prune(Duration::ZERO, 100).await.unwrap().jobs, 1);
        t.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn periodic_fire_records_are_kept_for_the_larger_of_keep_and_the_floor() {
    bounded(async {
        let t = Aged::new("a5_rf_fires").await;
        sqlx::query(&format!(
            "INSERT INTO {} (name, fire_at) VALUES ('every', clock_timestamp())",
            t.db.table("periodic_fires")
        ))
        .execute(&t.db.owner)
        .await
        .unwrap();
        t.clock.shift(FLOOR_SECS - 5.0).await;
        assert_eq!(t.store.prune(Duration::ZERO, 100).await.unwrap().fires, 0);
        t.clock.shift(FLOOR_SECS + 5.0).await;
        let keep = PruneOptions::new(Duration::from_secs(600));
        assert_eq!(t.store.prune_with(&keep).await.unwrap().fires, 0);
        assert_eq!(t.store.prune(Duration::ZERO, 100).await.unwrap().fires, 1);
        t.drop().await;
    })
    .await
}

#[test]
fn the_reaper_keeps_the_floor_and_a_retention_below_it_is_refused_at_start() {
    worker::run_in_system(within(60, "reaper retention at the floor", async {
        let t = Aged::new("a5_rf_reaper").await;
        let mut short = worker::fast_config(&t.db.schema);
        short.retention = Some(DEFAULT_PRUNE_FLOOR - Duration::from_millis(1));
        match Scheduler::builder(t.clock.pool.clone(), short)
            .register(Noop)
            .start()
            .await
        {
            Err(Error::Config { field, .. }) => assert_eq!(field, "retention"),
            Err(e) => panic!("refused for another reason: {e}"),
            Ok(_) => panic!("a retention under the floor started"),
        }
        let id = t.done_job(job("k")).await;
        let mut config: Config = worker::fast_config(&t.db.schema);
        config.retention = Some(DEFAULT_PRUNE_FLOOR);
        let s = Scheduler::builder(t.clock.pool.clone(), config)
            .register(Noop)
            .start()
            .await
            .unwrap();
        t.clock.shift(FLOOR_SECS - 5.0).await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(
            t.exists(id).await,
            "the reaper deleted a job inside the floor"
        );
        t.clock.shift(FLOOR_SECS + 5.0).await;
        worker::wait_until(10, "the reaper to prune the job", || async {
            !t.exists(id).await
        })
        .await;
        s.shutdown().await.unwrap();
        t.drop().await;
    }))
}
