//! Attack: bad periodic input is refused with a clear error at build and nothing is
//! written; good input is not refused. "Never fires again" depends on the schedule's
//! zone, not on UTC.

mod common;
#[path = "common/periodic.rs"]
mod periodic;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use chrono::{Datelike, Timelike, Utc};
use common::{within, TestDb};
use leasehold::{Periodic, Scheduler, StoreOptions};
use periodic::{tock, Tock};
use worker::{fast_config, run_in_system, POOL};

/// A one-off expression (every field fixed, the year too) for the local wall-clock time
/// `naive`.
fn one_off(naive: chrono::NaiveDateTime) -> String {
    format!(
        "{} {} {} {} {} * {}",
        naive.second(),
        naive.minute(),
        naive.hour(),
        naive.day(),
        naive.month(),
        naive.year()
    )
}

/// Build a scheduler with `schedules`; returns the error (if any) and how many schedule
/// rows exist afterwards. A scheduler that started is shut down.
async fn build(db: &TestDb, schedules: Vec<Periodic>) -> (Option<String>, i64) {
    let mut b =
        Scheduler::builder(db.pool.clone(), fast_config(&db.schema)).register(Tock::default());
    for p in schedules {
        b = b.periodic(p);
    }
    let res = b.start().await;
    let err = match res {
        Ok(s) => {
            // Let it look once, as a running build would.
            tokio::time::sleep(Duration::from_millis(600)).await;
            s.shutdown().await.unwrap();
            None
        }
        Err(e) => Some(e.to_string()),
    };
    let rows = db.count_where("periodic_schedules", "true").await;
    (err, rows)
}

#[test]
fn an_expression_whose_only_fire_time_is_past_in_its_zone_is_refused_at_build_and_nothing_written()
{
    run_in_system(within(60, "never fires in its zone", async {
        let db = TestDb::with_options("atk_pbad_never_zone", StoreOptions::default(), POOL).await;
        // Three hours from now in UTC wall-clock terms; in Pacific/Kiritimati (UTC+14)
        // that wall-clock time was 11 hours ago, and the year is fixed: no fire time left.
        let naive = (Utc::now() + chrono::Duration::hours(3)).naive_utc();
        let expr = one_off(naive);
        let built = Periodic::cron("one-off", &expr, tock("one-off"))
            .and_then(|p| p.in_time_zone_named("Pacific/Kiritimati"));
        let (err, rows) = match built {
            Err(e) => (Some(e.to_string()), 0),
            Ok(p) => build(&db, vec![p]).await,
        };
        db.drop().await;
        assert!(
            err.is_some(),
            "{expr:?} in Pacific/Kiritimati has no fire time left, but it was accepted \
             ({rows} schedule rows written)"
        );
        assert_eq!(rows, 0, "refused, nothing written: {err:?}");
    }))
}

#[test]
fn a_one_off_expression_still_ahead_in_its_zone_is_accepted() {
    run_in_system(within(60, "one-off ahead in its zone", async {
        // One hour ago in UTC wall-clock terms: in America/Los_Angeles (UTC-8 or -7)
        // that wall-clock time is six or seven hours ahead.
        let naive = (Utc::now() - chrono::Duration::hours(1)).naive_utc();
        let expr = one_off(naive);
        let built = Periodic::cron("one-off", &expr, tock("one-off"))
            .and_then(|p| p.in_time_zone_named("America/Los_Angeles"));
        assert!(
            built.is_ok(),
            "{expr:?} in America/Los_Angeles fires in hours, refused: {}",
            built.err().unwrap()
        );
    }))
}

#[test]
fn each_bad_schedule_is_refused_with_its_reason_and_nothing_written() {
    run_in_system(within(60, "bad schedules", async {
        // Unix five-field cron (no seconds), nonsense, an impossible date.
        for (expr, says) in [
            ("*/5 * * * *", "cron expression"),
            ("every night", "cron expression"),
            ("0 0 0 31 2 *", "cron expression"),
        ] {
            let err = Periodic::cron("bad", expr, tock("bad")).err();
            assert!(
                err.as_ref().is_some_and(|e| e.to_string().contains(says)),
                "{expr:?}: {err:?}"
            );
        }
        let p = Periodic::cron("zone", "0 0 9 * * *", tock("zone")).unwrap();
        for zone in ["Europe/Atlantis", "CEST", "UTC+2", ""] {
            let err = p.clone().in_time_zone_named(zone).err();
            assert!(
                err.as_ref()
                    .is_some_and(|e| e.to_string().contains("time zone")),
                "{zone:?}: {err:?}"
            );
        }
        for interval in [
            Duration::from_millis(1500),
            Duration::from_millis(999),
            Duration::ZERO,
            Duration::from_nanos(60_000_000_001),
        ] {
            let err = Periodic::every("i", interval, tock("i")).err();
            assert!(
                err.as_ref()
                    .is_some_and(|e| e.to_string().contains("interval")),
                "{interval:?}: {err:?}"
            );
        }
        // At build: two schedules with one name, an empty name.
        let db = TestDb::with_options("atk_pbad_build", StoreOptions::default(), POOL).await;
        let (err, rows) = build(
            &db,
            vec![
                Periodic::every("twice", Duration::from_secs(1), tock("twice")).unwrap(),
                Periodic::every("twice", Duration::from_secs(2), tock("twice")).unwrap(),
            ],
        )
        .await;
        assert!(
            err.as_deref().is_some_and(|e| e.contains("twice")),
            "{err:?}"
        );
        assert_eq!(rows, 0);
        let (err, rows) = build(
            &db,
            vec![Periodic::every("", Duration::from_secs(1), tock("")).unwrap()],
        )
        .await;
        assert!(err.is_some(), "an empty schedule name was accepted");
        assert_eq!(rows, 0);
        db.drop().await;
    }))
}

/// Build with `schedule` (an every-second one); returns the error at build, or the
/// number of fire rows after 2.5 s of running.
async fn fires_or_refusal(db: &TestDb, schedule: Periodic) -> Result<i64, String> {
    let b = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
        .register(Tock::default())
        .periodic(schedule);
    match b.start().await {
        Err(e) => Err(e.to_string()),
        Ok(s) => {
            tokio::time::sleep(Duration::from_millis(2500)).await;
            s.shutdown().await.unwrap();
            Ok(db.count_where("periodic_fires", "true").await)
        }
    }
}

#[test]
fn a_schedule_whose_job_every_enqueue_refuses_is_refused_at_build() {
    run_in_system(within(60, "unenqueueable periodic job", async {
        let db = TestDb::with_options("atk_pbad_job", StoreOptions::default(), POOL).await;
        // `with_max_attempts(0)`: every enqueue refuses it ("must be at least 1").
        let p = Periodic::every(
            "nightly",
            Duration::from_secs(1),
            tock("nightly").with_max_attempts(0),
        )
        .unwrap();
        let got = fires_or_refusal(&db, p).await;
        let rows = db.count_where("periodic_schedules", "true").await;
        db.drop().await;
        assert!(
            got.as_ref().is_err_and(|e| e.contains("max_attempts")),
            "a schedule whose every fire is refused started: {got:?} fires (and \
             {rows} schedule rows); it would never fire, silently"
        );
        assert_eq!(rows, 0);
    }))
}

#[test]
fn a_schedule_whose_grace_is_zero_is_refused_at_build_or_still_fires_on_time() {
    run_in_system(within(60, "zero grace", async {
        let db = TestDb::with_options("atk_pbad_grace0", StoreOptions::default(), POOL).await;
        let p = Periodic::every("tick", Duration::from_secs(1), tock("tick"))
            .unwrap()
            .grace(Duration::ZERO);
        let got = fires_or_refusal(&db, p).await;
        db.drop().await;
        assert!(
            got.as_ref().map_or(true, |n| *n >= 1),
            "an every-second schedule with grace 0 was accepted and fired {got:?} times in 2.5 s"
        );
    }))
}
