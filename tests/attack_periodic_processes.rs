//! Attack: many processes starting at once after every process was down (a cluster
//! restart), each catching up: the catch-up is enqueued once, not once per process.

#[path = "common/clock.rs"]
mod clock;
mod common;
#[path = "common/periodic.rs"]
mod periodic;
#[path = "common/worker.rs"]
mod worker;

use chrono::{DateTime, Utc};
use clock::DbClock;
use common::{within, TestDb};
use leasehold::{CatchUp, StoreOptions};
use periodic::{every, fires, start_on, Tock};
use worker::{run_in_system, POOL};

fn at(s: &str) -> DateTime<Utc> {
    s.parse().unwrap()
}

/// Another process's pool on the test's database clock (`common/clock.rs`'s schema).
async fn clock_pool(db: &TestDb) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(std::time::Duration::from_secs(10))
        .connect_with(
            common::runtime_options()
                .database(&common::test_db_name())
                .options([("search_path", format!("{}_clock,pg_catalog", db.schema))]),
        )
        .await
        .unwrap()
}

#[test]
fn four_processes_restarting_together_after_ten_missed_minutes_catch_up_once_between_them() {
    run_in_system(within(90, "cluster restart", async {
        let db = TestDb::with_options("atk_pproc_cluster", StoreOptions::default(), POOL).await;
        let clock = DbClock::install(&db).await;
        let h = Tock::default();
        let schedules = || {
            vec![
                every("once", 60).catch_up(CatchUp::RunOnce),
                every("three", 60).catch_up(CatchUp::Backfill(3)),
            ]
        };
        clock.set(at("2027-01-04T10:00:58.5Z")).await;
        let a = start_on(&db, clock.pool.clone(), &h, schedules()).await;
        periodic::wait_for_fires(&db, "once", 1, 15).await;
        periodic::wait_for_fires(&db, "three", 1, 15).await;
        a.shutdown().await.unwrap();
        // Ten minutes with nothing running; then four processes at once, a second before 10:11.
        clock.set(at("2027-01-04T10:10:59Z")).await;
        let (p1, p2, p3) = (
            clock_pool(&db).await,
            clock_pool(&db).await,
            clock_pool(&db).await,
        );
        let (b, c, d, e) = tokio::join!(
            start_on(&db, clock.pool.clone(), &h, schedules()),
            start_on(&db, p1, &h, schedules()),
            start_on(&db, p2, &h, schedules()),
            start_on(&db, p3, &h, schedules()),
        );
        periodic::wait_for_fires(&db, "once", 3, 15).await;
        periodic::wait_for_fires(&db, "three", 5, 15).await;
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        for s in [b, c, d, e] {
            s.shutdown().await.unwrap();
        }
        let minute = |m: u32| at(&format!("2027-01-04T10:{m:02}:00Z"));
        assert_eq!(
            fires(&db, "once").await,
            [(minute(1), false), (minute(10), true), (minute(11), false)]
        );
        assert_eq!(
            fires(&db, "three").await,
            [
                (minute(1), false),
                (minute(8), true),
                (minute(9), true),
                (minute(10), true),
                (minute(11), false)
            ]
        );
        clock.drop().await;
        db.drop().await;
    }))
}
