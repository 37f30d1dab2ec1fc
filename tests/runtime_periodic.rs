//! Periodic jobs: every fire time of a schedule is enqueued exactly once however many
//! schedulers keep it, a restart loses and duplicates none, the catch-up policies after
//! a stop enqueue exactly what they say, and a changed schedule takes effect at its
//! next fire time. Asserted on the jobs and the fire rows, and on what the handler ran.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::{within, TestDb};
use leasehold::{
    CatchUp, Handler, JobContext, JobError, NewJob, Periodic, Scheduler, StoreOptions,
};
use worker::{fast_config, run_in_system, wait_until, POOL};

#[derive(Clone, Default)]
struct Tock(Arc<AtomicU64>);

impl Handler for Tock {
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "tock";

    async fn run(&self, _: JobContext, _: serde_json::Value) -> Result<(), JobError> {
        self.0.fetch_add(1, SeqCst);
        Ok(())
    }
}

fn every_second(name: &str) -> Periodic {
    Periodic::every(
        name,
        Duration::from_secs(1),
        NewJob::from_json("tock", serde_json::json!({ "schedule": name })),
    )
    .unwrap()
}

async fn start(db: &TestDb, h: &Tock, schedules: Vec<Periodic>) -> Scheduler {
    let mut b = Scheduler::builder(db.pool.clone(), fast_config(&db.schema)).register(h.clone());
    for p in schedules {
        b = b.periodic(p);
    }
    b.start().await.unwrap()
}

/// A schedule's fire rows: (fire time, late), oldest first; and checks that each has
/// exactly one job, whose run-at time is the fire time.
async fn fires(db: &TestDb, name: &str) -> Vec<(DateTime<Utc>, bool)> {
    let rows: Vec<(DateTime<Utc>, bool, Option<DateTime<Utc>>)> = sqlx::query_as(&format!(
        "SELECT f.fire_at, f.late, j.available_at FROM {} f LEFT JOIN {} j ON j.id = f.job_id
          WHERE f.name = $1 ORDER BY f.fire_at",
        db.table("periodic_fires"),
        db.table("jobs")
    ))
    .bind(name)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    for (at, _, job_at) in &rows {
        assert_eq!(
            Some(*at),
            *job_at,
            "each fire has its job, due at the fire time"
        );
        assert_eq!(
            at.timestamp_subsec_nanos(),
            0,
            "fire times are whole seconds"
        );
    }
    let jobs = db
        .count_where("jobs", &format!("payload->>'schedule' = '{name}'"))
        .await;
    assert_eq!(jobs as usize, rows.len(), "one job per fire time of {name}");
    rows.into_iter().map(|(at, late, _)| (at, late)).collect()
}

/// Whole seconds between consecutive fire times.
fn gaps(fires: &[(DateTime<Utc>, bool)]) -> Vec<i64> {
    fires
        .windows(2)
        .map(|w| (w[1].0 - w[0].0).num_seconds())
        .collect()
}

#[test]
fn three_schedulers_enqueue_each_fire_time_of_a_one_second_schedule_exactly_once() {
    run_in_system(within(90, "periodic across three schedulers", async {
        let db = TestDb::with_options("rt_periodic_three", StoreOptions::default(), POOL).await;
        let h = Tock::default();
        let mut all = Vec::new();
        for _ in 0..3 {
            all.push(start(&db, &h, vec![every_second("tick")]).await);
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
        for s in &all {
            s.shutdown().await.unwrap();
        }
        let f = fires(&db, "tick").await;
        assert!(
            (9..=11).contains(&f.len()),
            "{} fire times in 10 s: {f:?}",
            f.len()
        );
        assert!(
            gaps(&f).iter().all(|g| *g == 1),
            "a fire time was lost: {f:?}"
        );
        assert!(f.iter().all(|(_, late)| !late));
        let enqueued: u64 = all
            .iter()
            .map(|s| s.metrics().counters.periodic_enqueued)
            .sum();
        assert_eq!(
            enqueued as usize,
            f.len(),
            "counted once, by whichever fired it"
        );
        assert!(h.0.load(SeqCst) <= f.len() as u64);
        db.drop().await;
    }))
}

#[test]
fn a_restart_in_the_middle_loses_and_duplicates_no_fire_time() {
    run_in_system(within(90, "periodic across a restart", async {
        let db = TestDb::with_options("rt_periodic_restart", StoreOptions::default(), POOL).await;
        let h = Tock::default();
        let a = start(&db, &h, vec![every_second("tick")]).await;
        tokio::time::sleep(Duration::from_millis(3200)).await;
        a.shutdown().await.unwrap();
        let b = start(&db, &h, vec![every_second("tick")]).await;
        tokio::time::sleep(Duration::from_millis(3200)).await;
        b.shutdown().await.unwrap();
        let f = fires(&db, "tick").await;
        assert!(f.len() >= 5, "{f:?}");
        assert!(
            gaps(&f).iter().all(|g| *g == 1),
            "lost across the restart: {f:?}"
        );
        assert!(f.iter().all(|(_, late)| !late), "{f:?}");
        wait_until(10, "every periodic job to run", || async {
            db.count_where("jobs", "state = 'done'").await as usize == f.len()
        })
        .await;
        // Retention prunes the fire records (and the done jobs); the schedule's own
        // position keeps those times from firing again.
        db.store.prune(Duration::ZERO, 1000).await.unwrap();
        assert_eq!(db.count_where("periodic_fires", "true").await, 0);
        let c = start(&db, &h, vec![every_second("tick")]).await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        c.shutdown().await.unwrap();
        let again = fires(&db, "tick").await;
        assert!(!again.is_empty());
        assert!(
            again.iter().all(|(t, _)| *t > f.last().unwrap().0),
            "{again:?}"
        );
        db.drop().await;
    }))
}

#[test]
fn after_a_five_second_stop_each_catch_up_policy_enqueues_what_it_says() {
    run_in_system(within(90, "periodic catch-up", async {
        let db = TestDb::with_options("rt_periodic_catchup", StoreOptions::default(), POOL).await;
        let h = Tock::default();
        let schedules = || {
            vec![
                every_second("skip").catch_up(CatchUp::Skip),
                every_second("once").catch_up(CatchUp::RunOnce),
                every_second("backfill").catch_up(CatchUp::Backfill(2)),
            ]
        };
        let a = start(&db, &h, schedules()).await;
        tokio::time::sleep(Duration::from_millis(2500)).await;
        a.shutdown().await.unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        let b = start(&db, &h, schedules()).await;
        tokio::time::sleep(Duration::from_millis(2500)).await;
        b.shutdown().await.unwrap();
        // Missed: the fire times more than the 2 s grace old at the restart (about
        // three of the five); the ones within the grace fire on time.
        for (name, late) in [("skip", 0), ("once", 1), ("backfill", 2)] {
            let f = fires(&db, name).await;
            let n = f.iter().filter(|(_, l)| *l).count();
            assert_eq!(n, late, "{name}: {f:?}");
            let g = gaps(&f);
            let hole: i64 = g.iter().map(|g| g - 1).sum();
            assert!(
                hole >= 3 - late as i64 - 1,
                "{name}: the stop left no gap? {f:?}"
            );
        }
        // RunOnce and Backfill enqueue the latest missed fire times.
        let once = fires(&db, "once").await;
        let back = fires(&db, "backfill").await;
        let once_late = once.iter().find(|(_, l)| *l).unwrap().0;
        let back_late: Vec<_> = back.iter().filter(|(_, l)| *l).map(|(t, _)| *t).collect();
        assert_eq!(back_late[1], once_late, "the latest missed fire time");
        assert_eq!((back_late[1] - back_late[0]).num_seconds(), 1);
        db.drop().await;
    }))
}

#[test]
fn a_changed_schedule_takes_effect_at_its_next_fire_time() {
    run_in_system(within(90, "periodic schedule change", async {
        let db = TestDb::with_options("rt_periodic_change", StoreOptions::default(), POOL).await;
        let h = Tock::default();
        let a = start(&db, &h, vec![every_second("tick")]).await;
        tokio::time::sleep(Duration::from_millis(2200)).await;
        a.shutdown().await.unwrap();
        let before = fires(&db, "tick").await.len();
        let every_two = Periodic::every(
            "tick",
            Duration::from_secs(2),
            NewJob::from_json("tock", serde_json::json!({ "schedule": "tick" })),
        )
        .unwrap()
        .catch_up(CatchUp::Backfill(10));
        let b = start(&db, &h, vec![every_two]).await;
        tokio::time::sleep(Duration::from_millis(4500)).await;
        b.shutdown().await.unwrap();
        let f = fires(&db, "tick").await;
        let after = &f[before..];
        assert!(!after.is_empty(), "{f:?}");
        assert!(
            after
                .iter()
                .all(|(t, late)| t.timestamp() % 2 == 0 && !late),
            "{f:?}"
        );
        // Two schedules may not share a name.
        let err = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
            .register(h.clone())
            .periodic(every_second("dup"))
            .periodic(every_second("dup"))
            .start()
            .await
            .err()
            .expect("a duplicate schedule name is refused");
        assert!(err.to_string().contains("dup"), "{err}");
        db.drop().await;
    }))
}
