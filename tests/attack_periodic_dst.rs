//! Attack: daylight saving in zones the project's tests do not cover — a two-hour
//! shift (Antarctica/Troll), a skipped calendar day (Pacific/Apia, 2011-12-30), a
//! midnight gap in a zone that later abolished DST (America/Sao_Paulo 2018, 2019), the
//! southern hemisphere (Australia/Sydney), "negative DST" (Europe/Dublin), a standard
//! offset moved back (Europe/Moscow 2014) — both live and while catching up across a
//! restart. Expected instants computed independently (Python's zoneinfo).

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
use periodic::{fires, start_on, tock, Tock};
use worker::{run_in_system, POOL};

fn at(s: &str) -> DateTime<Utc> {
    s.parse().unwrap()
}

fn nightly(expr: &str, tz: Tz) -> Periodic {
    Periodic::cron("nightly", expr, tock("nightly"))
        .unwrap()
        .in_time_zone(tz)
        .catch_up(CatchUp::Backfill(50))
}

async fn fire_count(db: &TestDb) -> i64 {
    db.count_where("periodic_fires", "name = 'nightly'").await
}

/// Wait up to `secs` for `n` fires, then a little more for any extra one.
async fn settle(db: &TestDb, n: usize, secs: u64) {
    let end = std::time::Instant::now() + Duration::from_secs(secs);
    while (fire_count(db).await as usize) < n && std::time::Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
}

/// Every process stopped from `from` to `to` (database clock): the first process back
/// catches up over the night with `Backfill(50)`; the late fires are `expected`.
fn caught_up(
    test: &'static str,
    expr: &'static str,
    tz: Tz,
    from: &'static str,
    to: &'static str,
    expected: &'static [&'static str],
) {
    run_in_system(within(60, test, async move {
        let db = TestDb::with_options(test, StoreOptions::default(), POOL).await;
        let clock = DbClock::install(&db).await;
        let h = Tock::default();
        clock.set(at(from)).await;
        let a = start_on(&db, clock.pool.clone(), &h, vec![nightly(expr, tz)]).await;
        worker::wait_until(10, "registered", || async {
            db.count_where("periodic_schedules", "name = 'nightly'")
                .await
                == 1
        })
        .await;
        a.shutdown().await.unwrap();
        clock.set(at(to)).await;
        let b = start_on(&db, clock.pool.clone(), &h, vec![nightly(expr, tz)]).await;
        settle(&db, expected.len(), 10).await;
        b.shutdown().await.unwrap();
        let f = fires(&db, "nightly").await;
        clock.drop().await;
        db.drop().await;
        let want: Vec<_> = expected.iter().map(|s| (at(s), true)).collect();
        assert_eq!(f, want, "{expr} in {tz} caught up from {from} to {to}");
    }))
}

/// A scheduler running from 1.5 s before `instant` until 1.5 s after it: one on-time
/// fire, at `instant`.
fn live(test: &'static str, expr: &'static str, tz: Tz, instant: &'static str) {
    run_in_system(within(60, test, async move {
        let db = TestDb::with_options(test, StoreOptions::default(), POOL).await;
        let clock = DbClock::install(&db).await;
        let h = Tock::default();
        clock
            .set(at(instant) - chrono::Duration::milliseconds(1500))
            .await;
        let s = start_on(&db, clock.pool.clone(), &h, vec![nightly(expr, tz)]).await;
        settle(&db, 1, 10).await;
        tokio::time::sleep(Duration::from_millis(1000)).await;
        s.shutdown().await.unwrap();
        let f = fires(&db, "nightly").await;
        clock.drop().await;
        db.drop().await;
        assert_eq!(f, [(at(instant), false)], "{expr} in {tz}");
    }))
}

#[test]
fn troll_two_hour_spring_gap_fires_both_times_inside_it_once_at_its_end() {
    // 2027-03-28 01:00 +00 jumps to 03:00 +02 (01:00 UTC).
    live(
        "atk_dst_troll_spring_live",
        "0 30 1,2 * * *",
        chrono_tz::Antarctica::Troll,
        "2027-03-28T01:00:00Z",
    );
}

#[test]
fn troll_every_quarter_hour_inside_the_two_hour_gap_fires_the_gap_end_once() {
    live(
        "atk_dst_troll_quarter_live",
        "0 */15 1-2 * * *",
        chrono_tz::Antarctica::Troll,
        "2027-03-28T01:00:00Z",
    );
}

#[test]
fn troll_spring_night_caught_up_fires_the_gap_once_and_the_next_night_normally() {
    caught_up(
        "atk_dst_troll_spring_cu",
        "0 30 1,2 * * *",
        chrono_tz::Antarctica::Troll,
        "2027-03-27T12:00:00Z",
        "2027-03-29T06:00:00Z",
        &[
            "2027-03-28T01:00:00Z",
            "2027-03-28T23:30:00Z",
            "2027-03-29T00:30:00Z",
        ],
    );
}

#[test]
fn troll_autumn_night_caught_up_fires_each_repeated_time_once_at_its_first_occurrence() {
    // 2027-10-31 03:00 +02 falls back to 01:00 +00 (01:00 UTC): 01:00-03:00 twice.
    caught_up(
        "atk_dst_troll_autumn_cu",
        "0 30 1,2 * * *",
        chrono_tz::Antarctica::Troll,
        "2027-10-30T12:00:00Z",
        "2027-10-31T12:00:00Z",
        &["2027-10-30T23:30:00Z", "2027-10-31T00:30:00Z"],
    );
}

#[test]
fn apia_skipped_day_fires_its_noon_once_at_the_first_instant_after_it() {
    // 2011-12-29 23:59:59 -10 was followed by 2011-12-31 00:00 +14 (10:00 UTC on the 30th).
    caught_up(
        "atk_dst_apia_cu",
        "0 0 12 * * *",
        chrono_tz::Pacific::Apia,
        "2011-12-29T12:00:00Z",
        "2011-12-31T00:00:00Z",
        &[
            "2011-12-29T22:00:00Z",
            "2011-12-30T10:00:00Z",
            "2011-12-30T22:00:00Z",
        ],
    );
}

#[test]
fn sao_paulo_midnight_gap_fires_once_after_it_and_the_year_without_dst_fires_normally() {
    // 2018-11-04 00:00 -03 jumped to 01:00 -02; DST was abolished from 2019.
    caught_up(
        "atk_dst_sao_paulo_2018",
        "0 30 0 * * *",
        chrono_tz::America::Sao_Paulo,
        "2018-11-03T12:00:00Z",
        "2018-11-05T12:00:00Z",
        &["2018-11-04T03:00:00Z", "2018-11-05T02:30:00Z"],
    );
}

#[test]
fn sao_paulo_after_dst_was_abolished_fires_at_the_standard_offset() {
    caught_up(
        "atk_dst_sao_paulo_2019",
        "0 30 0 * * *",
        chrono_tz::America::Sao_Paulo,
        "2019-11-02T12:00:00Z",
        "2019-11-04T12:00:00Z",
        &["2019-11-03T03:30:00Z", "2019-11-04T03:30:00Z"],
    );
}

#[test]
fn sydney_autumn_night_caught_up_fires_the_repeated_time_once() {
    // 2027-04-04 03:00 +11 falls back to 02:00 +10: 02:30 is 15:30 and 16:30 UTC.
    caught_up(
        "atk_dst_sydney_autumn_cu",
        "0 30 2 * * *",
        chrono_tz::Australia::Sydney,
        "2027-04-03T12:00:00Z",
        "2027-04-04T12:00:00Z",
        &["2027-04-03T15:30:00Z"],
    );
}

#[test]
fn sydney_spring_gap_fires_once_at_its_end() {
    // 2027-10-03 02:00 +10 jumps to 03:00 +11 (16:00 UTC the day before).
    live(
        "atk_dst_sydney_spring_live",
        "0 30 2 * * *",
        chrono_tz::Australia::Sydney,
        "2027-10-02T16:00:00Z",
    );
}

#[test]
fn dublin_negative_dst_autumn_fires_the_repeated_time_once() {
    caught_up(
        "atk_dst_dublin_autumn_cu",
        "0 30 1 * * *",
        chrono_tz::Europe::Dublin,
        "2027-10-30T12:00:00Z",
        "2027-10-31T12:00:00Z",
        &["2027-10-31T00:30:00Z"],
    );
}

#[test]
fn moscow_2014_offset_moved_back_fires_the_repeated_time_once() {
    // 2014-10-26 02:00 +04 became 01:00 +03: 01:30 is 21:30 and 22:30 UTC on the 25th.
    caught_up(
        "atk_dst_moscow_2014_cu",
        "0 30 1 * * *",
        chrono_tz::Europe::Moscow,
        "2014-10-25T12:00:00Z",
        "2014-10-26T20:00:00Z",
        &["2014-10-25T21:30:00Z"],
    );
}
