//! Periodic jobs: schedules defined in code, each fire time enqueued exactly once across
//! any number of processes, with no leader.
//!
//! Register a [`Periodic`] on the [`SchedulerBuilder`](crate::SchedulerBuilder) of every
//! process that should keep it going (all of them, usually). Each one looks at its
//! schedules a few times a second; the process that finds a fire time due locks the
//! schedule's row (`SKIP LOCKED`: the others move on), inserts one row per fire time
//! into `periodic_fires` (whose primary key is `(name, fire_at)`), enqueues the job in the
//! same transaction, and moves the schedule's `last_fire_at` on. So a fire time is
//! enqueued once, whatever the number of processes or their clocks; the fire time is
//! the job's run-at time.
//!
//! After downtime (no process ran the schedule), the fire times that passed more than
//! [`Periodic::grace`] ago follow the schedule's [`CatchUp`] policy. A schedule removed
//! from code simply stops; one whose expression changed takes effect at its next fire
//! time (the missed ones of the new expression are not caught up).

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::error::{Error, Result};
use crate::job::NewJob;

/// What happens to fire times that passed while no process ran the schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CatchUp {
    /// Skip them: only fire times within the grace are enqueued.
    Skip,
    /// One job for all of them (the latest), as if it fired once late.
    RunOnce,
    /// The latest `n` of them, each as its own job.
    Backfill(u32),
}

/// When a schedule fires.
#[derive(Clone, Debug)]
enum When {
    /// A cron expression with seconds (`sec min hour day-of-month month day-of-week
    /// [year]`), in a time zone.
    Cron(Box<cron::Schedule>, chrono_tz::Tz),
    /// Every `d`, at whole multiples of `d` since the Unix epoch (so every process
    /// computes the same fire times).
    Every(Duration),
}

/// A named schedule and the job it enqueues at each fire time.
#[derive(Clone, Debug)]
pub struct Periodic {
    name: String,
    when: When,
    job: NewJob,
    catch_up: CatchUp,
    grace: Duration,
}

/// The default [`Periodic::grace`]: 2 s. A fire time enqueued later than this after it
/// passed counts as missed (a process was down), and the catch-up policy decides.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(2);

/// The farthest back a catch-up looks: 7 days of fire times at most.
pub const CATCH_UP_HORIZON: Duration = Duration::from_secs(7 * 24 * 3600);

impl Periodic {
    /// A schedule named `name` (unique among your schedules; it is how every process
    /// recognizes it) firing by the cron `expression`, with seconds, in UTC: `"0 */5 * *
    /// * *"` is every five minutes, `"0 0 3 * * Mon-Fri"` 03:00 on weekdays. Each fire
    /// enqueues a copy of `job` whose run-at time is the fire time.
    ///
    /// ```
    /// # use leasehold::{CatchUp, NewJob, Periodic};
    /// let settle = Periodic::cron(
    ///     "daily-settlement",
    ///     "0 30 2 * * *",
    ///     NewJob::from_json("settle", serde_json::json!({})),
    /// )?
    /// .in_time_zone(chrono_tz::Europe::Berlin)
    /// .catch_up(CatchUp::RunOnce);
    /// # Ok::<(), leasehold::Error>(())
    /// ```
    pub fn cron(name: impl Into<String>, expression: &str, job: NewJob) -> Result<Self> {
        let schedule = cron::Schedule::from_str(expression).map_err(|e| Error::InvalidInput {
            field: "cron expression",
            reason: format!("{expression:?}: {e}"),
        })?;
        Ok(Periodic {
            name: name.into(),
            when: When::Cron(Box::new(schedule), chrono_tz::UTC),
            job,
            catch_up: CatchUp::Skip,
            grace: DEFAULT_GRACE,
        })
    }

    /// A schedule firing every `interval` (at least a second), at whole multiples of it
    /// since the Unix epoch.
    pub fn every(name: impl Into<String>, interval: Duration, job: NewJob) -> Result<Self> {
        if interval < Duration::from_secs(1) || interval > crate::store::MAX_DELAY {
            return Err(Error::InvalidInput {
                field: "interval",
                reason: format!(
                    "{} is outside 1 second to 100 years",
                    humantime::format_duration(interval)
                ),
            });
        }
        Ok(Periodic {
            name: name.into(),
            when: When::Every(interval),
            job,
            catch_up: CatchUp::Skip,
            grace: DEFAULT_GRACE,
        })
    }

    /// Evaluate the cron expression in `tz` (daylight-saving changes included); no
    /// effect on an interval.
    pub fn in_time_zone(mut self, tz: chrono_tz::Tz) -> Self {
        if let When::Cron(_, zone) = &mut self.when {
            *zone = tz;
        }
        self
    }

    /// What to do with fire times missed during downtime. Default [`CatchUp::Skip`].
    pub fn catch_up(mut self, policy: CatchUp) -> Self {
        self.catch_up = policy;
        self
    }

    /// How late a fire time may be enqueued and still count as on time. Default
    /// [`DEFAULT_GRACE`].
    pub fn grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// The schedule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The job enqueued at each fire time.
    pub fn job(&self) -> &NewJob {
        &self.job
    }

    pub(crate) fn job_mut(&mut self) -> &mut NewJob {
        &mut self.job
    }

    /// The policy for missed fire times.
    pub fn catch_up_policy(&self) -> CatchUp {
        self.catch_up
    }

    pub(crate) fn grace_period(&self) -> Duration {
        self.grace
    }

    /// The schedule as text, stored with it: a change of it is a changed expression.
    pub fn spec(&self) -> String {
        match &self.when {
            When::Cron(s, tz) => format!("cron {} {}", s.source(), tz.name()),
            When::Every(d) => format!("every {}", humantime::format_duration(*d)),
        }
    }

    /// Fire times in `(after, until]`, oldest first, starting no earlier than
    /// [`CATCH_UP_HORIZON`] before `until`; at most `limit` of them (the latest).
    pub(crate) fn fire_times(
        &self,
        after: DateTime<Utc>,
        until: DateTime<Utc>,
        limit: usize,
    ) -> Vec<DateTime<Utc>> {
        let horizon = chrono::Duration::from_std(CATCH_UP_HORIZON).unwrap_or_default();
        let from = after.max(until - horizon);
        let mut out: std::collections::VecDeque<DateTime<Utc>> = Default::default();
        let mut push = |t: DateTime<Utc>| {
            out.push_back(t);
            if out.len() > limit {
                out.pop_front();
            }
        };
        match &self.when {
            When::Cron(s, tz) => {
                for t in s.after(&from.with_timezone(tz)) {
                    let t = t.with_timezone(&Utc);
                    if t > until {
                        break;
                    }
                    push(t);
                }
            }
            When::Every(d) => {
                let step = d.as_secs().max(1) as i64;
                let mut k = from.timestamp().div_euclid(step) + 1;
                while let Some(t) = DateTime::from_timestamp(k.saturating_mul(step), 0) {
                    if t > until {
                        break;
                    }
                    if t > from {
                        push(t);
                    }
                    k += 1;
                }
            }
        }
        out.into_iter().collect()
    }

    /// The first fire time after `t`.
    pub(crate) fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match &self.when {
            When::Cron(s, tz) => s
                .after(&t.with_timezone(tz))
                .next()
                .map(|x| x.with_timezone(&Utc)),
            When::Every(d) => {
                let step = d.as_secs().max(1) as i64;
                DateTime::from_timestamp((t.timestamp().div_euclid(step) + 1) * step, 0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    #[test]
    fn intervals_fire_at_whole_multiples_since_the_epoch() {
        let p = Periodic::every(
            "p",
            Duration::from_secs(10),
            NewJob::from_json("k", 1.into()),
        )
        .unwrap();
        let t = p.fire_times(at("2026-01-01T00:00:05Z"), at("2026-01-01T00:00:30Z"), 100);
        assert_eq!(
            t,
            [
                at("2026-01-01T00:00:10Z"),
                at("2026-01-01T00:00:20Z"),
                at("2026-01-01T00:00:30Z")
            ]
        );
        assert_eq!(
            p.next_after(at("2026-01-01T00:00:30Z")),
            Some(at("2026-01-01T00:00:40Z"))
        );
        let latest = p.fire_times(at("2026-01-01T00:00:05Z"), at("2026-01-01T00:00:30Z"), 1);
        assert_eq!(latest, [at("2026-01-01T00:00:30Z")]);
    }

    #[test]
    fn cron_expressions_follow_their_time_zone() {
        let p = Periodic::cron("c", "0 0 9 * * *", NewJob::from_json("k", 1.into()))
            .unwrap()
            .in_time_zone(chrono_tz::Europe::Berlin);
        // 09:00 in Berlin is 08:00 UTC in winter.
        let t = p.fire_times(at("2026-01-01T00:00:00Z"), at("2026-01-02T23:00:00Z"), 10);
        assert_eq!(t, [at("2026-01-01T08:00:00Z"), at("2026-01-02T08:00:00Z")]);
        assert!(p.spec().contains("Europe/Berlin"));
        assert!(Periodic::cron("bad", "not cron", NewJob::from_json("k", 1.into())).is_err());
        assert!(Periodic::every(
            "fast",
            Duration::from_millis(10),
            NewJob::from_json("k", 1.into())
        )
        .is_err());
    }
}
