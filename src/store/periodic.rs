//! Periodic schedules' fire times (see [`crate::periodic`]): one short transaction per
//! look at a schedule, holding the schedule's row, so one process fires each fire time;
//! what is due is decided by [`crate::periodic::plan`] on the database's clock.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{Acquire, PgConnection, Row};

use super::Store;
use crate::error::Result;
use crate::job::JobId;
use crate::periodic::{plan, Periodic, When, LOOK_AT_LEAST_EVERY, SPEC_KEPT_FOR};

const REGISTER: &str = r#"/* leasehold:periodic_register */
INSERT INTO {s}.periodic_schedules (name, spec, last_fire_at)
VALUES ($1, $2, clock_timestamp())
ON CONFLICT (name) DO NOTHING"#;

const LOCK: &str = r#"/* leasehold:periodic_lock */
SELECT spec, version, last_fire_at, clock_timestamp() AS now
FROM {s}.periodic_schedules WHERE name = $1
FOR UPDATE SKIP LOCKED"#;

/// This build keeps `spec`: a spec seen for the first time gets the next version. Run
/// under the schedule's row lock, so no two builds take the same version. The times are
/// set here, not by the columns' defaults, so they are read from the same clock the
/// statement that compares them reads. `kept_at` is rewritten at most once per `$3`
/// seconds, however many processes look: it only has to stay well within
/// `SPEC_KEPT_FOR`.
const KEEP: &str = r#"/* leasehold:periodic_keep */
INSERT INTO {s}.periodic_specs (name, spec, version, first_seen_at, kept_at)
SELECT $1, $2, coalesce(max(version), 0) + 1, clock_timestamp(), clock_timestamp()
FROM {s}.periodic_specs WHERE name = $1
ON CONFLICT (name, spec) DO UPDATE SET kept_at = clock_timestamp()
WHERE periodic_specs.kept_at < clock_timestamp() - make_interval(secs => $3)"#;

/// The spec the schedule fires: the highest version a running build keeps.
const STORED: &str = r#"/* leasehold:periodic_stored */
SELECT spec, version FROM {s}.periodic_specs
WHERE name = $1 AND kept_at > clock_timestamp() - make_interval(secs => $2)
ORDER BY version DESC LIMIT 1"#;

const RESPEC: &str = r#"/* leasehold:periodic_respec */
UPDATE {s}.periodic_schedules SET spec = $2, version = $3, updated_at = clock_timestamp()
WHERE name = $1"#;

const FIRE: &str = r#"/* leasehold:periodic_fire */
INSERT INTO {s}.periodic_fires (name, fire_at, late) VALUES ($1, $2, $3)
ON CONFLICT (name, fire_at) DO NOTHING
RETURNING fire_at"#;

const FIRED: &str = r#"/* leasehold:periodic_fired */
UPDATE {s}.periodic_fires SET job_id = $3 WHERE name = $1 AND fire_at = $2"#;

const ADVANCE: &str = r#"/* leasehold:periodic_advance */
UPDATE {s}.periodic_schedules SET last_fire_at = $2 WHERE name = $1 AND last_fire_at < $2"#;

/// What one look at a schedule did.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Fired {
    /// Fire times enqueued now, with the job and whether it was a late (catch-up) fire.
    pub enqueued: Vec<(DateTime<Utc>, JobId, bool)>,
    /// How long until the next look, by the database's clock: until the next fire
    /// time, at most [`LOOK_AT_LEAST_EVERY`]. `None` when another process held the
    /// schedule (look again soon).
    pub wait: Option<Duration>,
    /// The database's time of this look; `None` when another process held the schedule.
    pub now: Option<DateTime<Utc>>,
}

/// The schedule's row as the look found it, under its lock.
struct Locked {
    spec: String,
    version: i64,
    last: DateTime<Utc>,
    now: DateTime<Utc>,
}

impl Store {
    /// Enqueue the due fire times of `p` (see [`crate::periodic`]), in one transaction
    /// that holds the schedule's row; nothing when another process holds it.
    #[tracing::instrument(name = "leasehold.periodic", level = "debug", skip_all, fields(name = p.name()))]
    ///
    /// `looked`: when this process last looked at the schedule (database time, from
    /// [`Fired::now`]), so a look that comes late while the process runs does not take
    /// the times it was waiting for as missed (see `periodic::plan`).
    pub(crate) async fn fire_due(
        &self,
        p: &Periodic,
        looked: Option<DateTime<Utc>>,
    ) -> Result<Fired> {
        let spec = p.spec();
        let mut conn = self.acquire().await?;
        let mut tx = conn.begin().await?;
        sqlx::query(&self.schema().render(REGISTER))
            .bind(p.name())
            .bind(&spec)
            .execute(self.on(&mut tx))
            .await?;
        let Some(row) = sqlx::query(&self.schema().render(LOCK))
            .bind(p.name())
            .fetch_optional(self.on(&mut tx))
            .await?
        else {
            return Ok(Fired::default());
        };
        let row = Locked {
            spec: row.try_get("spec")?,
            version: row.try_get("version")?,
            last: row.try_get("last_fire_at")?,
            now: row.try_get("now")?,
        };
        let Some(stored) = self.stored_spec(&mut tx, p, &row).await? else {
            tx.commit().await?;
            return Ok(Fired {
                enqueued: Vec::new(),
                wait: Some(LOOK_AT_LEAST_EVERY),
                now: Some(row.now),
            });
        };
        let due = plan(
            &stored,
            p.catch_up_policy(),
            p.grace_period(),
            row.last,
            row.now,
            looked,
        );
        let mut enqueued = Vec::new();
        for (t, late) in due
            .late
            .into_iter()
            .map(|t| (t, true))
            .chain(due.on_time.into_iter().map(|t| (t, false)))
        {
            let fresh: Option<DateTime<Utc>> = sqlx::query_scalar(&self.schema().render(FIRE))
                .bind(p.name())
                .bind(t)
                .bind(late)
                .fetch_optional(self.on(&mut tx))
                .await?;
            if fresh.is_none() {
                continue;
            }
            let job = p.job().clone().with_run_at(t);
            let id = self.enqueue_outcomes_in(&mut tx, vec![job]).await?[0].id;
            sqlx::query(&self.schema().render(FIRED))
                .bind(p.name())
                .bind(t)
                .bind(id.0)
                .execute(self.on(&mut tx))
                .await?;
            enqueued.push((t, id, late));
        }
        if due.handled > row.last {
            sqlx::query(&self.schema().render(ADVANCE))
                .bind(p.name())
                .bind(due.handled)
                .execute(self.on(&mut tx))
                .await?;
        }
        tx.commit().await?;
        let wait = due
            .next
            .map_or(LOOK_AT_LEAST_EVERY, |next| {
                (next - row.now).to_std().unwrap_or_default()
            })
            .min(LOOK_AT_LEAST_EVERY);
        Ok(Fired {
            enqueued,
            wait: Some(wait),
            now: Some(row.now),
        })
    }

    /// Record that this build keeps its spec of `p`, and return the spec the schedule
    /// fires (see "Rolling deploys" in [`crate::periodic`]), moving the schedule's row
    /// to it when it changed. `None` when that spec is one this build cannot read (a
    /// newer build's): the builds that can fire it.
    async fn stored_spec(
        &self,
        tx: &mut PgConnection,
        p: &Periodic,
        row: &Locked,
    ) -> Result<Option<When>> {
        let own = p.spec();
        sqlx::query(&self.schema().render(KEEP))
            .bind(p.name())
            .bind(&own)
            .bind(LOOK_AT_LEAST_EVERY.as_secs_f64())
            .execute(self.on(&mut *tx))
            .await?;
        // This build's own spec was kept within the last `LOOK_AT_LEAST_EVERY`, far
        // inside `SPEC_KEPT_FOR`, so there is always one.
        let (spec, version): (String, i64) = sqlx::query_as(&self.schema().render(STORED))
            .bind(p.name())
            .bind(SPEC_KEPT_FOR.as_secs_f64())
            .fetch_one(self.on(&mut *tx))
            .await?;
        if (spec.as_str(), version) != (row.spec.as_str(), row.version) {
            sqlx::query(&self.schema().render(RESPEC))
                .bind(p.name())
                .bind(&spec)
                .bind(version)
                .execute(self.on(&mut *tx))
                .await?;
            tracing::info!(name = p.name(), from = %row.spec, to = %spec, version, "leasehold periodic schedule fires another spec");
        }
        if spec == own {
            return Ok(Some(p.when().clone()));
        }
        match When::parse(&spec) {
            Ok(when) => Ok(Some(when)),
            Err(e) => {
                tracing::warn!(name = p.name(), spec = %spec, error = %e, "leasehold periodic schedule's spec is not one this build reads; a build that does fires it");
                Ok(None)
            }
        }
    }
}
