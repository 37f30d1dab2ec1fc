//! Periodic schedules' fire times (see [`crate::periodic`]): one short transaction per
//! due schedule, holding the schedule's row, so one process fires each fire time.

use chrono::{DateTime, Utc};
use sqlx::{Acquire, Row};

use super::Store;
use crate::error::Result;
use crate::job::JobId;
use crate::periodic::{CatchUp, Periodic};

const REGISTER: &str = r#"/* leasehold:periodic_register */
INSERT INTO {s}.periodic_schedules (name, spec, last_fire_at)
VALUES ($1, $2, clock_timestamp())
ON CONFLICT (name) DO NOTHING"#;

const LOCK: &str = r#"/* leasehold:periodic_lock */
SELECT spec, last_fire_at, clock_timestamp() AS now
FROM {s}.periodic_schedules WHERE name = $1
FOR UPDATE SKIP LOCKED"#;

const RESPEC: &str = r#"/* leasehold:periodic_respec */
UPDATE {s}.periodic_schedules SET spec = $2, last_fire_at = $3, updated_at = clock_timestamp()
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
    /// The next fire time after everything handled; `None` when another process held
    /// the schedule (look again soon).
    pub next: Option<DateTime<Utc>>,
}

impl Store {
    /// Enqueue the due fire times of `p` (see [`crate::periodic`]), in one transaction
    /// that holds the schedule's row; nothing when another process holds it.
    #[tracing::instrument(name = "leasehold.periodic", level = "debug", skip_all, fields(name = p.name()))]
    pub(crate) async fn fire_due(&self, p: &Periodic) -> Result<Fired> {
        let spec = p.spec();
        let mut conn = self.pool().acquire().await?;
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
        let stored: String = row.try_get("spec")?;
        let last: DateTime<Utc> = row.try_get("last_fire_at")?;
        let now: DateTime<Utc> = row.try_get("now")?;
        if stored != spec {
            // A changed schedule takes effect at its next fire time.
            sqlx::query(&self.schema().render(RESPEC))
                .bind(p.name())
                .bind(&spec)
                .bind(now)
                .execute(self.on(&mut tx))
                .await?;
            tx.commit().await?;
            tracing::info!(name = p.name(), from = %stored, to = %spec, "leasehold periodic schedule changed");
            return Ok(Fired {
                enqueued: Vec::new(),
                next: p.next_after(now),
            });
        }
        let backfill = match p.catch_up_policy() {
            CatchUp::Backfill(n) => n as usize,
            _ => 1,
        };
        let due = p.fire_times(last, now, backfill + 64);
        let grace = chrono::Duration::from_std(p.grace_period()).unwrap_or_default();
        let (missed, on_time): (Vec<_>, Vec<_>) = due.iter().partition(|t| now - **t > grace);
        let caught_up: Vec<DateTime<Utc>> = match p.catch_up_policy() {
            CatchUp::Skip => Vec::new(),
            CatchUp::RunOnce => missed.last().copied().into_iter().collect(),
            CatchUp::Backfill(n) => missed[missed.len().saturating_sub(n as usize)..].to_vec(),
        };
        let mut enqueued = Vec::new();
        for (t, late) in caught_up
            .into_iter()
            .map(|t| (t, true))
            .chain(on_time.into_iter().map(|t| (t, false)))
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
        let handled = due.last().copied().unwrap_or(last).max(last);
        if handled > last {
            sqlx::query(&self.schema().render(ADVANCE))
                .bind(p.name())
                .bind(handled)
                .execute(self.on(&mut tx))
                .await?;
        }
        tx.commit().await?;
        Ok(Fired {
            enqueued,
            next: p.next_after(handled.max(now)),
        })
    }
}
