//! Periodic jobs: schedules defined in code, each fire time enqueued exactly once across
//! any number of processes, with no leader.
//!
//! Register a [`Periodic`] on the [`SchedulerBuilder`](crate::SchedulerBuilder) of every
//! process that should keep it going (all of them, usually). A process looks at a
//! schedule when the database says its next fire time has come; the one that looks
//! first locks the schedule's row (`SKIP LOCKED`: the others move on), inserts one row
//! per fire time into `periodic_fires` (whose primary key is `(name, fire_at)`),
//! enqueues the job in the same transaction, and moves the schedule's `last_fire_at`
//! on. So a fire time is enqueued once, whatever the number of processes; the fire time
//! is the job's run-at time. The job gets its kind's [`KindPolicy`](crate::KindPolicy)
//! (attempts, priority) where it sets none, as an enqueue through the scheduler does.
//!
//! # One clock
//! Which fire times are due, which were missed and when the next one is: all decided by
//! the database's clock, read in the transaction that holds the schedule's row, as every
//! other deadline. A look answers how long until the next fire time, and the process
//! waits that long on its monotonic clock (at most [`LOOK_AT_LEAST_EVERY`]), so a host
//! clock ahead of or behind the database's by any amount loses and doubles nothing.
//!
//! # Daylight saving
//! A cron expression names local times in its zone ([`Periodic::in_time_zone`]). A
//! local time that does not exist (the spring gap) fires once, at the first instant
//! after the gap: `02:30` in Berlin on the night the clocks jump from 02:00 to 03:00
//! fires at 03:00 local; several times inside one gap fire that instant once. A local
//! time that happens twice (the autumn overlap) fires once, at its first occurrence. An
//! interval ([`Periodic::every`]) counts seconds since the Unix epoch and knows no zone.
//!
//! # Rolling deploys
//! The schedule's *spec* (its expression and zone, or its interval: [`Periodic::spec`])
//! may differ between two builds running side by side. Each spec a schedule has been
//! registered with gets a version when first seen, one higher than any before, and
//! every look records that its build still keeps it. The stored spec is the highest
//! version kept by a build seen in the last [`SPEC_KEPT_FOR`]; every build fires the
//! stored spec's times, whatever its own (the job is the firing build's). So during a
//! deploy the new build's spec takes over at once, each fire time of it is enqueued
//! once, and the old build keeps enqueuing them if it looks first; a rollback (the new
//! build gone) goes back to the old spec after [`SPEC_KEPT_FOR`]. A changed spec goes on
//! from the schedule's position: its times after the last one handled fire, and missed
//! ones follow the catch-up policy. A build that does not register a schedule leaves
//! it alone; the schedule stops when no running build registers it.
//!
//! # Catch-up
//! A fire time found more than [`Periodic::grace`] (default [`DEFAULT_GRACE`]) after it
//! passed was missed: no process looked while it was due (every process was stopped).
//! The schedule's [`CatchUp`] decides: [`CatchUp::Skip`] (the default) enqueues none of
//! them, [`CatchUp::RunOnce`] the latest, [`CatchUp::Backfill(n)`](CatchUp::Backfill)
//! the latest `n` (all of them when fewer were missed); none older than
//! [`CATCH_UP_HORIZON`]. Catch-up jobs are marked `late` in `periodic_fires`. The ones
//! left out count as handled: they never fire later.

mod plan;
mod when;

use std::time::Duration;

use crate::error::Result;
use crate::job::NewJob;

pub(crate) use plan::plan;
pub(crate) use when::When;

/// What happens to fire times missed while no process ran the schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CatchUp {
    /// Skip them: only fire times within the grace are enqueued. The default.
    Skip,
    /// One job for all of them (the latest), as if it fired once late.
    RunOnce,
    /// The latest `n` of them, each as its own job (all of them when fewer were
    /// missed).
    Backfill(u32),
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

/// The shortest [`Periodic::grace`] a scheduler starts with: 1 s. A fire is enqueued
/// after its time (the look, then the insert), so a shorter grace would count fires that
/// were on time as missed.
pub const MIN_GRACE: Duration = Duration::from_secs(1);

/// The farthest back a catch-up looks: 7 days of fire times at most.
pub const CATCH_UP_HORIZON: Duration = Duration::from_secs(7 * 24 * 3600);

/// The longest a process waits between two looks at a schedule, however far its next
/// fire time: 5 s. Each look records that the process's build keeps the schedule's
/// spec (see "Rolling deploys"), and notices a database clock that was stepped.
pub const LOOK_AT_LEAST_EVERY: Duration = Duration::from_secs(5);

/// How long a spec counts as kept by a running build after its latest look: 30 s (six
/// looks missed). See "Rolling deploys" in [the module docs](self).
pub const SPEC_KEPT_FOR: Duration = Duration::from_secs(30);

impl Periodic {
    /// A schedule named `name` (unique among your schedules; it is how every process
    /// recognizes it) firing by the cron `expression`, with seconds, in UTC:
    /// `"0 */5 * * * *"` is every five minutes, `"0 0 3 * * Mon-Fri"` 03:00 on weekdays.
    /// Each fire enqueues a copy of `job` whose run-at time is the fire time. An
    /// expression that does not parse, or has no fire time left in any zone, is refused
    /// with the reason; the scheduler's start checks again in the schedule's own zone.
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
        Ok(Self::new(
            name,
            When::cron(expression, chrono_tz::UTC)?,
            job,
        ))
    }

    /// A schedule firing every `interval` (whole seconds, from 1 second to 100 years),
    /// at whole multiples of it since the Unix epoch.
    pub fn every(name: impl Into<String>, interval: Duration, job: NewJob) -> Result<Self> {
        Ok(Self::new(name, When::every(interval)?, job))
    }

    fn new(name: impl Into<String>, when: When, job: NewJob) -> Self {
        Periodic {
            name: name.into(),
            when,
            job,
            catch_up: CatchUp::Skip,
            grace: DEFAULT_GRACE,
        }
    }

    /// Evaluate the cron expression in `tz` (see "Daylight saving" in
    /// [the module docs](self)); no effect on an interval.
    pub fn in_time_zone(mut self, tz: chrono_tz::Tz) -> Self {
        if let When::Cron(_, zone) = &mut self.when {
            *zone = tz;
        }
        self
    }

    /// [`Periodic::in_time_zone`] by the zone's IANA name (`"Europe/Berlin"`), e.g. from
    /// a config file; an unknown name is refused with the reason.
    pub fn in_time_zone_named(self, name: &str) -> Result<Self> {
        let p = self.in_time_zone(when::zone_named(name)?);
        p.when.check_fires_after(chrono::Utc::now())?;
        Ok(p)
    }

    /// What to do with fire times missed during downtime. Default [`CatchUp::Skip`].
    pub fn catch_up(mut self, policy: CatchUp) -> Self {
        self.catch_up = policy;
        self
    }

    /// How late a fire time may be enqueued and still count as on time. Default
    /// [`DEFAULT_GRACE`]; a scheduler refuses to start with less than [`MIN_GRACE`].
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

    pub(crate) fn when(&self) -> &When {
        &self.when
    }

    /// The schedule as text, stored with it (`cron <expression> <zone>` or `every
    /// <interval>`): two builds whose specs differ fire the stored one's times (see
    /// "Rolling deploys" in [the module docs](self)).
    pub fn spec(&self) -> String {
        self.when.spec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_input_is_refused_with_its_reason() {
        let job = || NewJob::from_json("k", 1.into());
        let err = Periodic::cron("bad", "not cron", job()).err().unwrap();
        assert!(err.to_string().contains("cron expression"), "{err}");
        let err = Periodic::every("fast", Duration::from_millis(10), job())
            .err()
            .unwrap();
        assert!(err.to_string().contains("interval"), "{err}");
        let p = Periodic::cron("c", "0 0 9 * * *", job()).unwrap();
        let err = p
            .clone()
            .in_time_zone_named("Europe/Atlantis")
            .err()
            .unwrap();
        assert!(err.to_string().contains("Europe/Atlantis"), "{err}");
        let berlin = p.in_time_zone_named("Europe/Berlin").unwrap();
        assert_eq!(berlin.spec(), "cron 0 0 9 * * * Europe/Berlin");
    }
}
