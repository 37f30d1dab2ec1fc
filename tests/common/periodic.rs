//! Periodic test support: a counting handler, schedules, a scheduler started over any
//! pool (the test's, or a `DbClock`'s), and the fire rows read back with the checks
//! every periodic test makes (one job per fire time, due at it).
//!
//! Include it next to `common` and `worker` with
//! `#[path = "common/periodic.rs"] mod periodic;`.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use leasehold::{Handler, JobContext, JobError, NewJob, Periodic, Scheduler};
use sqlx::PgPool;

use crate::common::TestDb;
use crate::worker;

#[derive(Clone, Default)]
pub struct Tock(pub Arc<AtomicU64>);

impl Tock {
    pub fn runs(&self) -> u64 {
        self.0.load(SeqCst)
    }
}

impl Handler for Tock {
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "tock";

    async fn run(&self, _: JobContext, _: serde_json::Value) -> Result<(), JobError> {
        self.0.fetch_add(1, SeqCst);
        Ok(())
    }
}

/// The job of schedule `name`: a `tock` whose payload names the schedule.
pub fn tock(name: &str) -> NewJob {
    NewJob::from_json("tock", serde_json::json!({ "schedule": name }))
}

pub fn every(name: &str, secs: u64) -> Periodic {
    Periodic::every(name, Duration::from_secs(secs), tock(name)).unwrap()
}

pub fn every_second(name: &str) -> Periodic {
    every(name, 1)
}

/// A scheduler over the test's pool with the `tock` handler and `schedules`.
pub async fn start(db: &TestDb, h: &Tock, schedules: Vec<Periodic>) -> Scheduler {
    start_on(db, db.pool.clone(), h, schedules).await
}

/// [`start`] over `pool` (e.g. one reading a shifted database clock).
pub async fn start_on(db: &TestDb, pool: PgPool, h: &Tock, schedules: Vec<Periodic>) -> Scheduler {
    let mut b = Scheduler::builder(pool, worker::fast_config(&db.schema)).register(h.clone());
    for p in schedules {
        b = b.periodic(p);
    }
    b.start().await.unwrap()
}

/// A schedule's fire rows: (fire time, late), oldest first; and checks that each has
/// exactly one job, whose run-at time is the fire time.
pub async fn fires(db: &TestDb, name: &str) -> Vec<(DateTime<Utc>, bool)> {
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
pub fn gaps(fires: &[(DateTime<Utc>, bool)]) -> Vec<i64> {
    fires
        .windows(2)
        .map(|w| (w[1].0 - w[0].0).num_seconds())
        .collect()
}

/// The schedule's stored spec and its version (`("", 0)` before its first look).
pub async fn stored_spec(db: &TestDb, name: &str) -> (String, i64) {
    sqlx::query_as(&format!(
        "SELECT spec, version FROM {} WHERE name = $1",
        db.table("periodic_schedules")
    ))
    .bind(name)
    .fetch_optional(&db.pool)
    .await
    .unwrap()
    .unwrap_or_default()
}

/// Wait (at most `secs`) until schedule `name` has at least `n` fire rows.
pub async fn wait_for_fires(db: &TestDb, name: &str, n: i64, secs: u64) {
    worker::wait_until(secs, &format!("{n} fires of {name}"), || async {
        db.count_where("periodic_fires", &format!("name = '{name}'"))
            .await
            >= n
    })
    .await
}
