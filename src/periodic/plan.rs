//! One look at a schedule, decided by the database's clock: which fire times are due,
//! which of them were missed and what the catch-up policy keeps of those, where the
//! schedule's position moves, and when the next fire time is. A pure function of the
//! stored position and the database's `now` (read in the transaction that holds the
//! schedule's row), so no host clock enters the decision, and tests can give it any
//! `now`.

use std::collections::VecDeque;
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::when::When;
use super::{CatchUp, CATCH_UP_HORIZON, LOOK_AT_LEAST_EVERY};

/// How long after this process's last look a fire time counts as watched: twice the
/// longest a running process goes between looks ([`LOOK_AT_LEAST_EVERY`]).
pub(crate) const WATCHED: Duration = Duration::from_secs(2 * LOOK_AT_LEAST_EVERY.as_secs());

/// What one look at a schedule decided.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Plan {
    /// Missed fire times the catch-up policy enqueues (marked late), oldest first.
    pub late: Vec<DateTime<Utc>>,
    /// Fire times at most the grace old, oldest first.
    pub on_time: Vec<DateTime<Utc>>,
    /// The schedule's position after the look: the latest fire time handled (enqueued,
    /// or skipped by the catch-up policy), or the position before when none was due.
    pub handled: DateTime<Utc>,
    /// The first fire time after the position and `now`.
    pub next: Option<DateTime<Utc>>,
}

/// The due fire times of `when` after position `last`, at database time `now`;
/// `looked` is when this process last looked at the schedule (database time), if it
/// did since it started.
///
/// A fire time more than `grace` before `now` was missed (no process looked at it
/// while it was due: a stop, or every process down), unless this process had looked at
/// the schedule at most [`WATCHED`] before it: then it was running, and this look came
/// late (a lock it waited on, a stall, a clock that stepped forward), so the time is on
/// time, not a miss. (A restarted process has not looked yet, so what it finds late
/// was missed; and a long outage of the database loses only its first [`WATCHED`] to
/// the rule.) Otherwise the policy decides what of the missed times is enqueued. None older than [`CATCH_UP_HORIZON`] before `now` is considered.
pub(crate) fn plan(
    when: &When,
    catch_up: CatchUp,
    grace: Duration,
    last: DateTime<Utc>,
    now: DateTime<Utc>,
    looked: Option<DateTime<Utc>>,
) -> Plan {
    let watched_until = looked.map(|l| l + chrono::Duration::from_std(WATCHED).unwrap_or_default());
    let horizon = chrono::Duration::from_std(CATCH_UP_HORIZON).unwrap_or_default();
    let grace = chrono::Duration::from_std(grace).unwrap_or_default();
    let keep = match catch_up {
        CatchUp::Skip => 0,
        CatchUp::RunOnce => 1,
        CatchUp::Backfill(n) => n as usize,
    };
    let mut late = VecDeque::new();
    let mut on_time = Vec::new();
    let mut handled = last;
    when.between(last.max(now - horizon), now, |t| {
        handled = t;
        if now - t <= grace || watched_until.is_some_and(|w| t <= w) {
            on_time.push(t);
        } else if keep > 0 {
            late.push_back(t);
            if late.len() > keep {
                late.pop_front();
            }
        }
    });
    Plan {
        late: late.into(),
        on_time,
        handled,
        next: when.next_after(handled.max(now)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    const GRACE: Duration = Duration::from_secs(2);

    #[test]
    fn each_policy_keeps_what_it_says_of_the_missed_times() {
        let minute = When::every(Duration::from_secs(60)).unwrap();
        let (last, now) = (at("2027-01-01T10:00:30Z"), at("2027-01-01T10:10:01Z"));
        let on_time = vec![at("2027-01-01T10:10:00Z")];
        let skip = plan(&minute, CatchUp::Skip, GRACE, last, now, None);
        assert_eq!((skip.late.len(), &skip.on_time), (0, &on_time));
        assert_eq!(skip.handled, at("2027-01-01T10:10:00Z"));
        assert_eq!(skip.next, Some(at("2027-01-01T10:11:00Z")));
        let once = plan(&minute, CatchUp::RunOnce, GRACE, last, now, None);
        assert_eq!(once.late, [at("2027-01-01T10:09:00Z")]);
        let three = plan(&minute, CatchUp::Backfill(3), GRACE, last, now, None);
        assert_eq!(
            three.late,
            [
                at("2027-01-01T10:07:00Z"),
                at("2027-01-01T10:08:00Z"),
                at("2027-01-01T10:09:00Z")
            ]
        );
        // All of them, when the bound is larger than what was missed.
        let all = plan(&minute, CatchUp::Backfill(100), GRACE, last, now, None);
        assert_eq!(all.late.len(), 9);
        assert_eq!(all.on_time, on_time);
    }

    #[test]
    fn nothing_due_leaves_the_position_and_names_the_next_time() {
        let hourly = When::every(Duration::from_secs(3600)).unwrap();
        let last = at("2027-01-01T10:00:00Z");
        let p = plan(
            &hourly,
            CatchUp::Backfill(5),
            GRACE,
            last,
            at("2027-01-01T10:20:00Z"),
            None,
        );
        assert_eq!((p.late.len(), p.on_time.len(), p.handled), (0, 0, last));
        assert_eq!(p.next, Some(at("2027-01-01T11:00:00Z")));
    }

    #[test]
    fn catching_up_over_the_autumn_night_fires_the_repeated_hour_once() {
        let berlin = When::cron("0 30 2 * * *", chrono_tz::Europe::Berlin).unwrap();
        // Down from before the night to the next morning: 02:30 happened twice
        // (00:30 and 01:30 UTC); the catch-up enqueues it once.
        let p = plan(
            &berlin,
            CatchUp::Backfill(10),
            GRACE,
            at("2027-10-30T12:00:00Z"),
            at("2027-10-31T09:00:00Z"),
            None,
        );
        assert_eq!(p.late, [at("2027-10-31T00:30:00Z")]);
        // Back inside the repeated hour after the first fired: nothing more.
        let p = plan(
            &berlin,
            CatchUp::Backfill(10),
            GRACE,
            at("2027-10-31T00:30:00Z"),
            at("2027-10-31T01:30:01Z"),
            None,
        );
        assert_eq!((p.late.len(), p.on_time.len()), (0, 0));
        assert_eq!(p.next, Some(at("2027-11-01T01:30:00Z")));
    }

    #[test]
    fn a_fire_time_found_late_soon_after_this_process_last_looked_is_on_time_not_missed() {
        let nightly = When::cron("0 30 2 * * *", chrono_tz::UTC).unwrap();
        let last = at("2027-01-01T02:30:00Z");
        let now = at("2027-01-02T02:30:05Z");
        // A process looked at 02:29:57 and the next look came 5 s after the fire time
        // (it waited on a lock): fired, whatever the policy.
        let stalled = plan(
            &nightly,
            CatchUp::Skip,
            GRACE,
            last,
            now,
            Some(at("2027-01-02T02:29:57Z")),
        );
        assert_eq!(
            (stalled.on_time, stalled.late.len()),
            (vec![at("2027-01-02T02:30:00Z")], 0)
        );
        // Nobody had looked since the evening before: every process was down; missed.
        let down = plan(
            &nightly,
            CatchUp::Skip,
            GRACE,
            last,
            now,
            Some(at("2027-01-01T20:00:00Z")),
        );
        assert_eq!((down.on_time.len(), down.late.len()), (0, 0));
    }
}
