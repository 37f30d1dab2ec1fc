//! When a schedule fires: a cron expression in a time zone, or an interval; its fire
//! times as instants, daylight-saving changes included; and its text form (the spec
//! stored with the schedule), which every build reads back, so a build can fire the
//! times of a spec another build wrote.
//!
//! # Daylight saving
//! A cron expression names local times. A local time that does not exist (the spring
//! gap) fires once, at the first instant after the gap: `02:30` in Berlin on the night
//! the clocks jump from 02:00 to 03:00 fires at 03:00 local. Several local times inside
//! one gap (`*/15` minutes) fire that one instant once. A local time that happens twice
//! (the autumn overlap) fires once, at its first occurrence. An interval counts seconds
//! since the Unix epoch and knows no zone.

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, LocalResult, NaiveDateTime, Offset, TimeZone, Utc};
use chrono_tz::Tz;

use crate::error::{Error, Result};

/// When a schedule fires.
#[derive(Clone, Debug)]
pub(crate) enum When {
    /// A cron expression with seconds (`sec min hour day-of-month month day-of-week
    /// [year]`), in a time zone.
    Cron(Box<cron::Schedule>, Tz),
    /// Every `d`, at whole multiples of `d` since the Unix epoch (so every process
    /// computes the same fire times).
    Every(Duration),
}

/// How many hours the zone furthest behind UTC is (UTC−12, plus one for its summer time
/// if it ever has one): a wall-clock time this far behind UTC's is still ahead there.
const MOST_BEHIND_UTC_HOURS: i64 = 13;

/// The longest run of nonexistent local times tzdb has (Samoa skipped 2011-12-30): a
/// gap is searched for its end no further than this.
const LONGEST_GAP: chrono::Duration = chrono::Duration::hours(48);

impl When {
    /// A cron expression, refused with the parser's reason, or when it never fires.
    pub(crate) fn cron(expression: &str, tz: Tz) -> Result<When> {
        let when = When::parse_cron(expression, tz)?;
        if let When::Cron(schedule, _) = &when {
            // Input checking only (a year in the past is a mistake to say at once); no
            // fire-time decision reads the host's clock. The zone is not known yet, so
            // this asks for a wall-clock time ahead in some zone (UTC−12 is the furthest
            // behind); `Periodic::in_time_zone_named` and the scheduler's start ask again
            // in the schedule's own zone.
            let behind = Utc::now() - chrono::Duration::hours(MOST_BEHIND_UTC_HOURS);
            if schedule.after(&behind).next().is_none() {
                return Err(Error::InvalidInput {
                    field: "cron expression",
                    reason: format!("{expression:?} has no fire time from now on"),
                });
            }
        }
        Ok(when)
    }

    fn parse_cron(expression: &str, tz: Tz) -> Result<When> {
        let schedule = cron::Schedule::from_str(expression).map_err(|e| Error::InvalidInput {
            field: "cron expression",
            reason: format!("{expression:?}: {e}"),
        })?;
        Ok(When::Cron(Box::new(schedule), tz))
    }

    /// An interval of at least a second and at most 100 years, in whole seconds.
    pub(crate) fn every(interval: Duration) -> Result<When> {
        if interval < Duration::from_secs(1)
            || interval > crate::store::MAX_DELAY
            || interval.subsec_nanos() != 0
        {
            return Err(Error::InvalidInput {
                field: "interval",
                reason: format!(
                    "{} is not a whole number of seconds from 1 second to 100 years",
                    humantime::format_duration(interval)
                ),
            });
        }
        Ok(When::Every(interval))
    }

    /// The text stored with the schedule: `cron <expression> <zone>` or `every <interval>`.
    pub(crate) fn spec(&self) -> String {
        match self {
            When::Cron(s, tz) => format!("cron {} {}", s.source(), tz.name()),
            When::Every(d) => format!("every {}", humantime::format_duration(*d)),
        }
    }

    /// The schedule a spec text stands for ([`When::spec`] read back).
    pub(crate) fn parse(spec: &str) -> Result<When> {
        let bad = |reason: String| Error::InvalidInput {
            field: "periodic spec",
            reason: format!("{spec:?}: {reason}"),
        };
        if let Some(rest) = spec.strip_prefix("cron ") {
            let (expression, zone) = rest
                .rsplit_once(' ')
                .ok_or_else(|| bad("no time zone after the expression".into()))?;
            return When::parse_cron(expression, zone_named(zone)?);
        }
        if let Some(interval) = spec.strip_prefix("every ") {
            let d = humantime::parse_duration(interval).map_err(|e| bad(e.to_string()))?;
            return When::every(d);
        }
        Err(bad(
            "neither `cron <expression> <zone>` nor `every <interval>`".into(),
        ))
    }

    /// Fire times in `(after, until]`, oldest first, each once.
    pub(crate) fn between(
        &self,
        after: DateTime<Utc>,
        until: DateTime<Utc>,
        mut each: impl FnMut(DateTime<Utc>),
    ) {
        match self {
            When::Cron(s, tz) => {
                // The expression is evaluated on local wall-clock times (UTC has no
                // daylight saving, so iterating it "in UTC" walks local times), and each
                // local time is then placed on the time line by `instant`.
                let local = after.with_timezone(tz).naive_local();
                let mut last = after;
                for t in s.after(&local.and_utc()) {
                    let at = instant(tz, t.naive_utc());
                    if at > until {
                        break;
                    }
                    // A repeated local time whose first occurrence is not after `after`,
                    // or a second nonexistent time of the same gap: already fired.
                    if at > last {
                        each(at);
                        last = at;
                    }
                }
            }
            When::Every(d) => {
                let step = d.as_secs().max(1) as i64;
                let mut k = after.timestamp().div_euclid(step) + 1;
                while let Some(t) = DateTime::from_timestamp(k.saturating_mul(step), 0) {
                    if t > until {
                        break;
                    }
                    if t > after {
                        each(t);
                    }
                    k += 1;
                }
            }
        }
    }

    /// Refused when there is no fire time after `now` (in the schedule's zone): a one-off
    /// expression whose time has passed there, or whose year is over.
    pub(crate) fn check_fires_after(&self, now: DateTime<Utc>) -> Result<()> {
        match self {
            When::Cron(s, tz) if self.next_after(now).is_none() => Err(Error::InvalidInput {
                field: "cron expression",
                reason: format!(
                    "{:?} has no fire time from now on in {}",
                    s.source(),
                    tz.name()
                ),
            }),
            _ => Ok(()),
        }
    }

    /// The first fire time after `t`.
    pub(crate) fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match self {
            When::Cron(s, tz) => {
                let local = t.with_timezone(tz).naive_local();
                s.after(&local.and_utc())
                    .map(|x| instant(tz, x.naive_utc()))
                    .find(|at| *at > t)
            }
            When::Every(d) => {
                let step = d.as_secs().max(1) as i64;
                DateTime::from_timestamp((t.timestamp().div_euclid(step) + 1) * step, 0)
            }
        }
    }
}

/// A time zone by its IANA name (`Europe/Berlin`), refused with a clear reason.
pub(crate) fn zone_named(name: &str) -> Result<Tz> {
    name.parse::<Tz>().map_err(|_| Error::InvalidInput {
        field: "time zone",
        reason: format!("{name:?} is not an IANA time zone name (e.g. \"Europe/Berlin\")"),
    })
}

/// The instant a local wall-clock time stands for in `tz`: itself when it exists once;
/// its first occurrence when it happens twice; the first instant after the gap when it
/// does not exist.
fn instant(tz: &Tz, local: NaiveDateTime) -> DateTime<Utc> {
    match tz.from_local_datetime(&local) {
        LocalResult::Single(t) => t.with_timezone(&Utc),
        LocalResult::Ambiguous(first, _) => first.with_timezone(&Utc),
        LocalResult::None => gap_end(tz, local),
    }
}

/// The first instant after the gap that `local` falls into: the first existing local
/// time after it, found by bisection on whole seconds (tzdb's transitions are).
fn gap_end(tz: &Tz, local: NaiveDateTime) -> DateTime<Utc> {
    let exists = |t: NaiveDateTime| tz.from_local_datetime(&t).earliest();
    let (mut lo, mut hi) = (local, local + LONGEST_GAP);
    if exists(hi).is_none() {
        // Not a gap tzdb has: place it as if the zone's offset before it held.
        let before = tz.offset_from_utc_datetime(&(local - LONGEST_GAP));
        let offset = chrono::Duration::seconds(before.fix().local_minus_utc().into());
        return Utc.from_utc_datetime(&(local - offset));
    }
    // Invariant: `lo` does not exist, `hi` does.
    while (hi - lo).num_seconds() > 1 {
        let mid = lo + chrono::Duration::seconds((hi - lo).num_seconds() / 2);
        if exists(mid).is_some() {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    exists(hi)
        .map(|t| t.with_timezone(&Utc))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    fn cron(expr: &str, tz: Tz) -> When {
        When::cron(expr, tz).unwrap()
    }

    fn times(w: &When, after: &str, until: &str) -> Vec<DateTime<Utc>> {
        let mut out = Vec::new();
        w.between(at(after), at(until), |t| out.push(t));
        out
    }

    #[test]
    fn a_nonexistent_local_time_fires_once_at_the_end_of_the_gap() {
        let berlin = cron("0 30 2 * * *", chrono_tz::Europe::Berlin);
        // 2027-03-28: 02:00 CET jumps to 03:00 CEST (01:00 UTC).
        assert_eq!(
            times(&berlin, "2027-03-27T12:00:00Z", "2027-03-29T12:00:00Z"),
            [at("2027-03-28T01:00:00Z"), at("2027-03-29T00:30:00Z")]
        );
        assert_eq!(
            berlin.next_after(at("2027-03-27T12:00:00Z")),
            Some(at("2027-03-28T01:00:00Z"))
        );
        // Every quarter hour: the four times inside the gap and 03:00 itself are one fire.
        let quarter = cron("0 */15 * * * *", chrono_tz::Europe::Berlin);
        assert_eq!(
            times(&quarter, "2027-03-28T00:40:00Z", "2027-03-28T01:20:00Z"),
            [
                at("2027-03-28T00:45:00Z"),
                at("2027-03-28T01:00:00Z"),
                at("2027-03-28T01:15:00Z")
            ]
        );
        let new_york = cron("0 30 2 * * *", chrono_tz::America::New_York);
        // 2027-03-14: 02:00 EST jumps to 03:00 EDT (07:00 UTC).
        assert_eq!(
            times(&new_york, "2027-03-13T12:00:00Z", "2027-03-14T12:00:00Z"),
            [at("2027-03-14T07:00:00Z")]
        );
        // Lord Howe moves by 30 minutes: 2027-10-03 02:00 +10:30 jumps to 02:30 +11.
        let lord_howe = cron("0 15 2 * * *", chrono_tz::Australia::Lord_Howe);
        assert_eq!(
            times(&lord_howe, "2027-10-02T00:00:00Z", "2027-10-03T12:00:00Z"),
            [at("2027-10-02T15:30:00Z")]
        );
    }

    #[test]
    fn a_repeated_local_time_fires_once_at_its_first_occurrence() {
        let berlin = cron("0 30 2 * * *", chrono_tz::Europe::Berlin);
        // 2027-10-31: 03:00 CEST falls back to 02:00 CET; 02:30 is 00:30 and 01:30 UTC.
        assert_eq!(
            times(&berlin, "2027-10-30T12:00:00Z", "2027-11-01T12:00:00Z"),
            [at("2027-10-31T00:30:00Z"), at("2027-11-01T01:30:00Z")]
        );
        // Asked from inside the repeated hour (after the first 02:30 fired), nothing
        // fires again until the next day.
        assert!(times(&berlin, "2027-10-31T01:10:00Z", "2027-10-31T23:00:00Z").is_empty());
        assert_eq!(
            berlin.next_after(at("2027-10-31T01:10:00Z")),
            Some(at("2027-11-01T01:30:00Z"))
        );
        let new_york = cron("0 30 1 * * *", chrono_tz::America::New_York);
        // 2027-11-07: 02:00 EDT falls back to 01:00 EST; 01:30 is 05:30 and 06:30 UTC.
        assert_eq!(
            times(&new_york, "2027-11-06T12:00:00Z", "2027-11-07T12:00:00Z"),
            [at("2027-11-07T05:30:00Z")]
        );
        // Lord Howe: 2027-04-04 02:00 +11 falls back to 01:30 +10:30; 01:45 is 14:45
        // and 15:15 UTC.
        let lord_howe = cron("0 45 1 * * *", chrono_tz::Australia::Lord_Howe);
        assert_eq!(
            times(&lord_howe, "2027-04-03T00:00:00Z", "2027-04-04T12:00:00Z"),
            [at("2027-04-03T14:45:00Z")]
        );
    }

    #[test]
    fn intervals_fire_at_whole_multiples_since_the_epoch() {
        let w = When::every(Duration::from_secs(10)).unwrap();
        assert_eq!(
            times(&w, "2026-01-01T00:00:05Z", "2026-01-01T00:00:30Z"),
            [
                at("2026-01-01T00:00:10Z"),
                at("2026-01-01T00:00:20Z"),
                at("2026-01-01T00:00:30Z")
            ]
        );
        assert_eq!(
            w.next_after(at("2026-01-01T00:00:30Z")),
            Some(at("2026-01-01T00:00:40Z"))
        );
        // 09:00 in Berlin is 08:00 UTC in winter.
        let berlin = cron("0 0 9 * * *", chrono_tz::Europe::Berlin);
        assert_eq!(
            times(&berlin, "2026-01-01T00:00:00Z", "2026-01-02T23:00:00Z"),
            [at("2026-01-01T08:00:00Z"), at("2026-01-02T08:00:00Z")]
        );
    }

    #[test]
    fn specs_read_back_as_the_schedule_they_name() {
        let w = cron("0 30 2 * * *", chrono_tz::Europe::Berlin);
        assert_eq!(w.spec(), "cron 0 30 2 * * * Europe/Berlin");
        assert_eq!(When::parse(&w.spec()).unwrap().spec(), w.spec());
        let e = When::every(Duration::from_secs(90)).unwrap();
        assert_eq!(When::parse(&e.spec()).unwrap().spec(), e.spec());
        for (bad, says) in [
            ("cron 0 30 2 * * * Mars/Olympus", "not an IANA time zone"),
            ("cron nonsense UTC", "cron expression"),
            ("every soon", "periodic spec"),
            ("hourly", "neither"),
        ] {
            let err = When::parse(bad).err().unwrap().to_string();
            assert!(err.contains(says), "{bad}: {err}");
        }
        assert!(When::cron("0 0 0 30 2 * 2020", chrono_tz::UTC).is_err());
        assert!(When::every(Duration::from_millis(1500)).is_err());
    }
}
