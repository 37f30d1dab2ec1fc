//! Lease renewal: extend many leases in one fenced statement that never waits.
//!
//! A renewal must not wait on a row lock: whoever holds one (a completion batch waiting
//! on a key row behind a host's open transaction, a handler's own `complete_in`
//! transaction, an operator's session) would otherwise hold every other lease of the
//! batch hostage until they expire. So the rows are locked with `SKIP LOCKED`; a skipped
//! row whose fence still matches is *busy* (its owner keeps it; the next renewal tries
//! again, and the attempt's local deadline bounds how long that may go on), and only a
//! row whose fence no longer matches is *lost*.
//!
//! The new deadline is `clock_timestamp() + lease`: the time the row was actually
//! updated, not the start of the statement or transaction.
//!
//! A renewal also records which attempts have started their handler
//! (`started_generation`): the reaper counts an expired lease as an attempt only when its
//! start was recorded, so a job that waited in a crashed process for a slot is not
//! dead-lettered for it (see migrations/0015_recorded_starts.sql). It costs no statement
//! of its own: the start rides on a renewal, the periodic one or one sent soon after the
//! start (see the lease renewer).

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::Row;

use super::{secs, Store};
use crate::error::{Error, Result};
use crate::job::{Attempt, EffectIdentity, Generation, JobId, OwnerId};

pub(super) const RENEW: &str = r#"/* leasehold:renew */
WITH t AS (
    SELECT * FROM unnest($1::int8[], $2::int8[], $5::bool[], $6::uuid[])
      AS t(id, generation, started, identity)
), mine AS MATERIALIZED (
    SELECT j.id, t.started
    FROM {s}.jobs j
    JOIN t ON j.id = t.id AND j.generation = t.generation AND j.effect_identity = t.identity
    WHERE j.owner = $3 AND j.state = 'running'
    FOR UPDATE OF j SKIP LOCKED
), u AS (
    UPDATE {s}.jobs j
    SET lease_until = clock_timestamp() + make_interval(secs => $4),
        started_generation = CASE WHEN mine.started THEN j.generation
                                  ELSE j.started_generation END
    FROM mine WHERE j.id = mine.id
    RETURNING j.id, j.generation, j.effect_identity, j.lease_until,
              j.cancel_requested_at IS NOT NULL AS cancel_requested
)
SELECT t.id, t.generation, t.identity::text AS identity, u.lease_until, coalesce(u.cancel_requested, false) AS cancel_requested,
       u.id IS NULL AND EXISTS (
           SELECT 1 FROM {s}.jobs j
           WHERE j.id = t.id AND j.generation = t.generation AND j.owner = $3
             AND j.effect_identity = t.identity AND j.state = 'running') AS busy
FROM t LEFT JOIN u
  ON u.id = t.id AND u.generation = t.generation AND u.effect_identity = t.identity"#;

/// What a batched renewal found.
#[derive(Clone, Debug, Default)]
pub struct RenewReport {
    /// Leases extended, with their new deadline (database clock).
    pub renewed: Vec<(Attempt, DateTime<Utc>)>,
    /// Still this owner's, but locked by another transaction right now, so not extended
    /// this time (never waited for).
    pub busy: Vec<Attempt>,
    /// Leases this owner no longer holds: the handlers must be told to stop.
    pub lost: Vec<Attempt>,
    /// Renewed jobs an operator asked to cancel: their handlers must be told.
    pub cancel_requested: Vec<Attempt>,
    /// When the statement was sent, once a connection was at hand, on this process's
    /// monotonic clock: every renewed lease runs at least `lease` from this moment.
    pub sent_at: Option<std::time::Instant>,
}

impl Store {
    /// Extend the leases of `jobs` held by `owner` to `clock_timestamp() + lease`,
    /// without waiting on any row lock. A job in `lost` was reaped, released, cancelled
    /// or claimed by a newer generation; one in `busy` is still ours. Every job renewed
    /// is recorded as started (see [`Store::renew_recording`] to say which started).
    #[tracing::instrument(name = "leasehold.renew", level = "debug", skip_all, fields(n = jobs.len()))]
    pub async fn renew(
        &self,
        owner: &OwnerId,
        jobs: &[Attempt],
        lease: Duration,
    ) -> Result<RenewReport> {
        let jobs: Vec<_> = jobs.iter().map(|a| (a.clone(), true)).collect();
        self.renew_recording(owner, &jobs, lease).await
    }

    /// [`Store::renew`], recording the start of the attempts whose flag is true: an
    /// expired lease of an attempt never recorded as started does not count as an
    /// attempt (bounded per job; see `UNSTARTED_EXPIRIES_MAX`).
    pub async fn renew_recording(
        &self,
        owner: &OwnerId,
        jobs: &[(Attempt, bool)],
        lease: Duration,
    ) -> Result<RenewReport> {
        if jobs.is_empty() {
            return Ok(RenewReport::default());
        }
        let ids: Vec<i64> = jobs.iter().map(|j| j.0.job.0).collect();
        let gens: Vec<i64> = jobs.iter().map(|j| j.0.generation.0).collect();
        let identities: Vec<&str> = jobs.iter().map(|j| j.0.identity.as_str()).collect();
        let started: Vec<bool> = jobs.iter().map(|j| j.1).collect();
        let mut conn = self.acquire().await?;
        let sent = std::time::Instant::now();
        let rows = sqlx::query(&self.sql().renew)
            .bind(&ids)
            .bind(&gens)
            .bind(owner.as_str())
            .bind(secs(lease))
            .bind(&started)
            .bind(&identities)
            .fetch_all(self.on(&mut conn))
            .await?;
        let mut report = RenewReport {
            sent_at: Some(sent),
            ..Default::default()
        };
        for row in rows {
            let identity: String = row.try_get("identity")?;
            let id = Attempt {
                job: JobId(row.try_get("id")?),
                generation: Generation(row.try_get("generation")?),
                identity: EffectIdentity::parse(&identity).ok_or_else(|| Error::Decode {
                    what: "effect identity",
                    reason: format!("{identity:?} is not a UUID"),
                })?,
            };
            match row.try_get::<Option<DateTime<Utc>>, _>("lease_until")? {
                Some(until) => {
                    if row.try_get("cancel_requested")? {
                        report.cancel_requested.push(id.clone());
                    }
                    report.renewed.push((id, until));
                }
                None if row.try_get("busy")? => report.busy.push(id),
                None => report.lost.push(id),
            }
        }
        Ok(report)
    }
}
