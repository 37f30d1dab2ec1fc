//! Attack: a scheduler running throughout, but its looks held up for a few seconds
//! across the fire time: another transaction holding `periodic_schedules` in ACCESS
//! EXCLUSIVE mode (what an `ALTER TABLE` of a newer build's migration, or an
//! operator's `VACUUM FULL`, takes). No process was stopped, so nothing was "missed":
//! the nightly settlement should still fire once, under the default catch-up.

#[path = "common/clock.rs"]
mod clock;
mod common;
#[path = "common/periodic.rs"]
mod periodic;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use chrono::{DateTime, Utc};
use clock::DbClock;
use common::{within, TestDb};
use leasehold::{Periodic, StoreOptions};
use periodic::{fires, start_on, tock, Tock};
use worker::{run_in_system, POOL};

fn at(s: &str) -> DateTime<Utc> {
    s.parse().unwrap()
}

#[test]
fn a_nightly_time_whose_look_waited_five_seconds_on_a_table_lock_still_fires_once() {
    run_in_system(within(60, "look held by a lock", async {
        let db = TestDb::with_options("atk_plock_nightly", StoreOptions::default(), POOL).await;
        let clock = DbClock::install(&db).await;
        let h = Tock::default();
        clock.set(at("2027-01-05T02:29:57Z")).await;
        let nightly = Periodic::cron("nightly", "0 30 2 * * *", tock("nightly")).unwrap();
        let s = start_on(&db, clock.pool.clone(), &h, vec![nightly]).await;
        worker::wait_until(10, "the schedule registered", || async {
            db.count_where("periodic_schedules", "name = 'nightly'")
                .await
                == 1
        })
        .await;
        // From about 02:29:58 to 02:30:03 (database clock) the table is locked.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut tx = db.owner.begin().await.unwrap();
        sqlx::query(&format!(
            "LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
            db.table("periodic_schedules")
        ))
        .execute(&mut *tx)
        .await
        .unwrap();
        let locked_at = clock.now().await;
        assert!(
            locked_at < at("2027-01-05T02:30:00Z"),
            "set-up too slow: {locked_at}"
        );
        tokio::time::sleep(Duration::from_millis(5000)).await;
        tx.commit().await.unwrap();
        tokio::time::sleep(Duration::from_millis(3000)).await;
        s.shutdown().await.unwrap();
        let f = fires(&db, "nightly").await;
        clock.drop().await;
        db.drop().await;
        assert_eq!(
            f.iter().map(|x| x.0).collect::<Vec<_>>(),
            [at("2027-01-05T02:30:00Z")],
            "the 02:30 settlement, the scheduler running throughout: {f:?}"
        );
    }))
}
