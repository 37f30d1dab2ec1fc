//! Periodic jobs by the database's clock: daylight-saving nights (Europe/Berlin,
//! America/New_York, Australia/Lord_Howe's 30-minute shift) fire each local time once,
//! a nonexistent one at the first instant after the gap and a repeated one at its first
//! occurrence; a database clock ahead of or behind the host's by seconds or an hour
//! loses and doubles nothing; the catch-up policies across a restart enqueue what they
//! say; a rollback goes back to the old build's spec. The database's clock is the
//! test's (`common/clock.rs`), set just before the instant under test, so no test waits
//! for a night, and the host's clock stays the real one: every scheduler here runs with
//! its database months or hours away from its host.

#[path = "common/clock.rs"]
mod clock;
mod common;
#[path = "common/periodic.rs"]
mod periodic;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use clock::DbClock;
use common::{within, TestDb};
use leasehold::{CatchUp, Periodic, StoreOptions};
use periodic::{every, every_second, fires, gaps, start_on, stored_spec, tock, Tock};
use worker::{run_in_system, POOL};

fn at(s: &str) -> DateTime<Utc> {
    s.parse().unwrap()
}

fn nightly(expr: &str, tz: Tz) -> Periodic {
    Periodic::cron("nightly", expr, tock("nightly"))
        .unwrap()
        .in_time_zone(tz)
        // Any fire time the catch-up would enqueue twice shows up as a late fire.
        .catch_up(CatchUp::Backfill(10))
}

/// Put the database's clock `lead` before `instant`, run a scheduler with `schedule`
/// until `nightly` has `n` fires in all, and stop it.
async fn run_up_to(
    db: &TestDb,
    clock: &DbClock,
    h: &Tock,
    schedule: Periodic,
    instant: &str,
    n: i64,
) {
    clock
        .set(at(instant) - chrono::Duration::milliseconds(1500))
        .await;
    let s = start_on(db, clock.pool.clone(), h, vec![schedule]).await;
    periodic::wait_for_fires(db, "nightly", n, 15).await;
    s.shutdown().await.unwrap();
}

/// A spring night: `expr` names a local time inside the gap; it fires once, at `end`
/// (the first instant after the gap).
fn spring(test: &'static str, expr: &'static str, tz: Tz, end: &'static str) {
    run_in_system(within(60, test, async move {
        let db = TestDb::with_options(test, StoreOptions::default(), POOL).await;
        let clock = DbClock::install(&db).await;
        let h = Tock::default();
        run_up_to(&db, &clock, &h, nightly(expr, tz), end, 1).await;
        assert_eq!(fires(&db, "nightly").await, [(at(end), false)]);
        clock.drop().await;
        db.drop().await;
    }))
}

/// An autumn night: `expr` names a local time that happens twice, at `first` and
/// `second`; it fires once, at `first`, and next at `next_day`. The scheduler is stopped
/// after the first and started again just before the next day's, so its first look
/// catches up over the repeated hour (with `Backfill(10)`).
fn autumn(
    test: &'static str,
    expr: &'static str,
    tz: Tz,
    first: &'static str,
    second: &'static str,
    next_day: &'static str,
) {
    run_in_system(within(60, test, async move {
        let db = TestDb::with_options(test, StoreOptions::default(), POOL).await;
        let clock = DbClock::install(&db).await;
        let h = Tock::default();
        run_up_to(&db, &clock, &h, nightly(expr, tz), first, 1).await;
        run_up_to(&db, &clock, &h, nightly(expr, tz), next_day, 2).await;
        let f = fires(&db, "nightly").await;
        assert_eq!(
            f,
            [(at(first), false), (at(next_day), false)],
            "{second} fired?"
        );
        clock.drop().await;
        db.drop().await;
    }))
}

#[test]
fn berlin_spring_night_fires_a_time_in_the_gap_once_after_it() {
    // 2027-03-28: 02:00 CET jumps to 03:00 CEST, at 01:00 UTC.
    spring(
        "rt_dst_berlin_spring",
        "0 30 2 * * *",
        chrono_tz::Europe::Berlin,
        "2027-03-28T01:00:00Z",
    );
}

#[test]
fn berlin_autumn_night_fires_the_repeated_time_once() {
    // 2027-10-31: 03:00 CEST falls back to 02:00 CET; 02:30 is 00:30 and 01:30 UTC.
    autumn(
        "rt_dst_berlin_autumn",
        "0 30 2 * * *",
        chrono_tz::Europe::Berlin,
        "2027-10-31T00:30:00Z",
        "2027-10-31T01:30:00Z",
        "2027-11-01T01:30:00Z",
    );
}

#[test]
fn new_york_spring_night_fires_a_time_in_the_gap_once_after_it() {
    // 2027-03-14: 02:00 EST jumps to 03:00 EDT, at 07:00 UTC.
    spring(
        "rt_dst_new_york_spring",
        "0 30 2 * * *",
        chrono_tz::America::New_York,
        "2027-03-14T07:00:00Z",
    );
}

#[test]
fn new_york_autumn_night_fires_the_repeated_time_once() {
    // 2027-11-07: 02:00 EDT falls back to 01:00 EST; 01:30 is 05:30 and 06:30 UTC.
    autumn(
        "rt_dst_new_york_autumn",
        "0 30 1 * * *",
        chrono_tz::America::New_York,
        "2027-11-07T05:30:00Z",
        "2027-11-07T06:30:00Z",
        "2027-11-08T06:30:00Z",
    );
}

#[test]
fn lord_howe_half_hour_spring_gap_fires_once_after_it() {
    // 2027-10-03: 02:00 +10:30 jumps to 02:30 +11, at 15:30 UTC the day before.
    spring(
        "rt_dst_lord_howe_spring",
        "0 15 2 * * *",
        chrono_tz::Australia::Lord_Howe,
        "2027-10-02T15:30:00Z",
    );
}

#[test]
fn lord_howe_half_hour_autumn_overlap_fires_once() {
    // 2027-04-04: 02:00 +11 falls back to 01:30 +10:30; 01:45 is 14:45 and 15:15 UTC.
    autumn(
        "rt_dst_lord_howe_autumn",
        "0 45 1 * * *",
        chrono_tz::Australia::Lord_Howe,
        "2027-04-03T14:45:00Z",
        "2027-04-03T15:15:00Z",
        "2027-04-04T15:15:00Z",
    );
}

/// With the database `secs` ahead of the host (behind if negative), an every-second
/// schedule fires every second, on time, for as long as the scheduler runs.
fn skewed(test: &'static str, secs: f64) {
    run_in_system(within(60, test, async move {
        let db = TestDb::with_options(test, StoreOptions::default(), POOL).await;
        let clock = DbClock::install(&db).await;
        clock.shift(secs).await;
        let h = Tock::default();
        let s = start_on(&db, clock.pool.clone(), &h, vec![every_second("tick")]).await;
        tokio::time::sleep(Duration::from_millis(3500)).await;
        s.shutdown().await.unwrap();
        let f = fires(&db, "tick").await;
        assert!(f.len() >= 3, "{} fires in 3.5 s: {f:?}", f.len());
        assert!(
            gaps(&f).iter().all(|g| *g == 1),
            "a fire time was lost: {f:?}"
        );
        assert!(f.iter().all(|(_, late)| !late), "{f:?}");
        // The fire times are the database's, not the host's.
        let off = (f[0].0 - Utc::now()).num_seconds() as f64;
        assert!(
            (off - secs).abs() < 6.0,
            "fired at {} with the host at {}",
            f[0].0,
            Utc::now()
        );
        clock.drop().await;
        db.drop().await;
    }))
}

#[test]
fn a_database_three_seconds_ahead_of_the_host_loses_no_fire() {
    skewed("rt_skew_db_ahead_3s", 3.0);
}

#[test]
fn a_database_an_hour_ahead_of_the_host_loses_no_fire() {
    skewed("rt_skew_db_ahead_1h", 3600.0);
}

#[test]
fn a_database_three_seconds_behind_the_host_loses_no_fire() {
    skewed("rt_skew_db_behind_3s", -3.0);
}

#[test]
fn a_database_an_hour_behind_the_host_loses_no_fire() {
    skewed("rt_skew_db_behind_1h", -3600.0);
}

#[test]
fn catch_up_across_a_restart_enqueues_what_each_policy_says() {
    run_in_system(within(60, "periodic catch-up across a restart", async {
        let db = TestDb::with_options("rt_periodic_restart_catchup", StoreOptions::default(), POOL)
            .await;
        let clock = DbClock::install(&db).await;
        let h = Tock::default();
        let schedules = || {
            vec![
                every("skip", 60),
                every("once", 60).catch_up(CatchUp::RunOnce),
                every("three", 60).catch_up(CatchUp::Backfill(3)),
                every("all", 60).catch_up(CatchUp::Backfill(100)),
            ]
        };
        // Running at 10:01: each schedule fires 10:01 on time. Then every process stops
        // for ten minutes and one starts at 10:11:00.5: 10:11 is within the grace, and
        // 10:02 to 10:10 (nine) were missed.
        clock.set(at("2027-01-04T10:00:58.5Z")).await;
        let a = start_on(&db, clock.pool.clone(), &h, schedules()).await;
        for name in ["skip", "once", "three", "all"] {
            periodic::wait_for_fires(&db, name, 1, 15).await;
        }
        a.shutdown().await.unwrap();
        clock.set(at("2027-01-04T10:11:00.5Z")).await;
        let b = start_on(&db, clock.pool.clone(), &h, schedules()).await;
        for name in ["skip", "once", "three", "all"] {
            worker::wait_until(15, &format!("{name} fires 10:11"), || async {
                let cond = format!("name = '{name}' AND fire_at = '2027-01-04T10:11:00Z'");
                db.count_where("periodic_fires", &cond).await == 1
            })
            .await;
        }
        b.shutdown().await.unwrap();
        let minute = |m: u32| at(&format!("2027-01-04T10:{m:02}:00Z"));
        let late = |ms: std::ops::RangeInclusive<u32>| ms.map(|m| (minute(m), true));
        let on_time = |m: u32| (minute(m), false);
        assert_eq!(fires(&db, "skip").await, [on_time(1), on_time(11)]);
        let once: Vec<_> = [on_time(1)]
            .into_iter()
            .chain(late(10..=10))
            .chain([on_time(11)])
            .collect();
        assert_eq!(fires(&db, "once").await, once);
        let three: Vec<_> = [on_time(1)]
            .into_iter()
            .chain(late(8..=10))
            .chain([on_time(11)])
            .collect();
        assert_eq!(fires(&db, "three").await, three);
        let all: Vec<_> = [on_time(1)]
            .into_iter()
            .chain(late(2..=10))
            .chain([on_time(11)])
            .collect();
        assert_eq!(fires(&db, "all").await, all);
        clock.drop().await;
        db.drop().await;
    }))
}

#[test]
fn a_rollback_goes_back_to_the_old_spec_once_the_new_build_is_gone() {
    run_in_system(within(60, "periodic rollback", async {
        let db = TestDb::with_options("rt_periodic_rollback", StoreOptions::default(), POOL).await;
        let clock = DbClock::install(&db).await;
        let h = Tock::default();
        let old = start_on(&db, clock.pool.clone(), &h, vec![every_second("tick")]).await;
        let new = start_on(&db, clock.pool.clone(), &h, vec![every("tick", 2)]).await;
        worker::wait_until(15, "the new spec stored", || async {
            stored_spec(&db, "tick").await.1 == 2
        })
        .await;
        // The new build goes (a rollback); its spec counts as kept for 30 s after its
        // last look: move the database's clock past that instead of waiting.
        new.shutdown().await.unwrap();
        let now = clock.now().await;
        clock.set(now + chrono::Duration::seconds(31)).await;
        worker::wait_until(15, "the old spec stored again", || async {
            stored_spec(&db, "tick").await == ("every 1s".into(), 1)
        })
        .await;
        let back: DateTime<Utc> = clock.now().await;
        tokio::time::sleep(Duration::from_millis(2500)).await;
        old.shutdown().await.unwrap();
        let f: Vec<_> = fires(&db, "tick")
            .await
            .into_iter()
            .filter(|(t, _)| *t > back)
            .collect();
        assert!(f.len() >= 2, "{f:?}");
        assert!(
            gaps(&f).iter().all(|g| *g == 1),
            "every second again: {f:?}"
        );
        clock.drop().await;
        db.drop().await;
    }))
}
