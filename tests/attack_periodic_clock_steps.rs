//! Attack: the database's clock is stepped (an NTP correction, a failover to a replica
//! whose clock differs) while a scheduler runs. A fire time the database clock steps
//! over while a process is running was not "missed because every process was stopped":
//! it should fire once; a step back must refire nothing and lose nothing after.

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
use periodic::{every_second, fires, gaps, start_on, tock, Tock};
use worker::{run_in_system, POOL};

fn at(s: &str) -> DateTime<Utc> {
    s.parse().unwrap()
}

/// A nightly settlement at 02:30 UTC, default catch-up (`Skip`), a scheduler running
/// since 02:29:57 by the database; 0.5 s later the database clock steps forward `step`
/// seconds (to 02:29:57.5 + step), over 02:30:00. The settlement should fire once.
async fn stepped_over(test: &str, step: i64) -> Vec<(DateTime<Utc>, bool)> {
    let db = TestDb::with_options(test, StoreOptions::default(), POOL).await;
    let clock = DbClock::install(&db).await;
    let h = Tock::default();
    clock.set(at("2027-01-05T02:29:57Z")).await;
    let nightly = Periodic::cron("nightly", "0 30 2 * * *", tock("nightly")).unwrap();
    let s = start_on(&db, clock.pool.clone(), &h, vec![nightly]).await;
    // The first look (registration) has happened once the row exists.
    worker::wait_until(10, "the schedule registered", || async {
        db.count_where("periodic_schedules", "name = 'nightly'")
            .await
            == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let now = clock.now().await;
    assert!(now < at("2027-01-05T02:30:00Z"), "set-up too slow: {now}");
    clock.set(now + chrono::Duration::seconds(step)).await;
    // Well past the next look (at most LOOK_AT_LEAST_EVERY = 5 s).
    tokio::time::sleep(Duration::from_millis(6500)).await;
    s.shutdown().await.unwrap();
    let f = fires(&db, "nightly").await;
    clock.drop().await;
    db.drop().await;
    f
}

#[test]
fn a_database_clock_stepped_forward_five_seconds_over_the_nightly_time_still_fires_it_once() {
    run_in_system(within(60, "stepped forward 5 s", async {
        let f = stepped_over("atk_step_fwd_5s", 5).await;
        assert_eq!(
            f.iter().map(|x| x.0).collect::<Vec<_>>(),
            [at("2027-01-05T02:30:00Z")],
            "the 02:30 settlement, with a scheduler running throughout: {f:?}"
        );
    }))
}

#[test]
fn a_database_clock_stepped_forward_an_hour_over_the_nightly_time_still_fires_it_once() {
    run_in_system(within(60, "stepped forward 1 h", async {
        let f = stepped_over("atk_step_fwd_1h", 3600).await;
        assert_eq!(
            f.iter().map(|x| x.0).collect::<Vec<_>>(),
            [at("2027-01-05T02:30:00Z")],
            "the 02:30 settlement, with a scheduler running throughout: {f:?}"
        );
    }))
}

#[test]
fn a_database_clock_stepped_back_refires_nothing_and_goes_on_every_second_once_it_catches_up() {
    run_in_system(within(60, "stepped back", async {
        let db = TestDb::with_options("atk_step_back", StoreOptions::default(), POOL).await;
        let clock = DbClock::install(&db).await;
        let h = Tock::default();
        clock.set(at("2027-01-05T10:00:00.3Z")).await;
        let s = start_on(&db, clock.pool.clone(), &h, vec![every_second("tick")]).await;
        periodic::wait_for_fires(&db, "tick", 3, 15).await;
        let before = fires(&db, "tick").await;
        let last = before.last().unwrap().0;
        // Back 4 s: the times up to `last` fired already.
        let now = clock.now().await;
        clock.set(now - chrono::Duration::seconds(4)).await;
        // 4 s to get back to `last`, then at least 3 more fire times.
        tokio::time::sleep(Duration::from_millis(8000)).await;
        s.shutdown().await.unwrap();
        let f = fires(&db, "tick").await;
        assert!(
            f.iter().filter(|(t, _)| *t > last).count() >= 2,
            "fires resume once the clock is back past {last}: {f:?}"
        );
        assert!(gaps(&f).iter().all(|g| *g == 1), "a time lost: {f:?}");
        assert!(f.iter().all(|(_, late)| !late), "{f:?}");
        clock.drop().await;
        db.drop().await;
    }))
}
