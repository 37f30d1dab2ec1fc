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
use crate::error::Result;
use crate::job::{Generation, JobId, OwnerId};

pub(super) const RENEW: &str = r#"/* leasehold:renew */
WITH t AS (
    SELECT * FROM unnest($1::int8[], $2::int8[], $5::bool[]) AS t(id, generation, started)
), mine AS MATERIALIZED (
    SELECT j.id, t.started
    FROM {s}.jobs j JOIN t ON j.id = t.id AND j.generation = t.generation
    WHERE j.owner = $3 AND j.state = 'running'
    FOR UPDATE OF j SKIP LOCKED
), u AS (
    UPDATE {s}.jobs j
    SET lease_until = clock_timestamp() + make_interval(secs => $4),
        started_generation = CASE WHEN mine.started THEN j.generation
                                  ELSE j.started_generation END
    FROM mine WHERE j.id = mine.id
    RETURNING j.id, j.lease_until, j.cancel_requested_at IS NOT NULL AS cancel_requested
)
SELECT t.id, u.lease_until, coalesce(u.cancel_requested, false) AS cancel_requested,
       u.id IS NULL AND EXISTS (
           SELECT 1 FROM {s}.jobs j
           WHERE j.id = t.id AND j.generation = t.generation AND j.owner = $3
             AND j.state = 'running') AS busy
FROM t LEFT JOIN u ON u.id = t.id"#;

/// What a batched renewal found.
#[derive(Clone, Debug, Default)]
pub struct RenewReport {
    /// Leases extended, with their new deadline (database clock).
    pub renewed: Vec<(JobId, DateTime<Utc>)>,
    /// Still this owner's, but locked by another transaction right now, so not extended
    /// this time (never waited for).
    pub busy: Vec<JobId>,
    /// Leases this owner no longer holds: the handlers must be told to stop.
    pub lost: Vec<JobId>,
    /// Renewed jobs an operator asked to cancel: their handlers must be told.
    pub cancel_requested: Vec<JobId>,
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
        jobs: &[(JobId, Generation)],
        lease: Duration,
    ) -> Result<RenewReport> {
        let jobs: Vec<_> = jobs.iter().map(|&(j, g)| (j, g, true)).collect();
        self.renew_recording(owner, &jobs, lease).await
    }

    /// [`Store::renew`], recording the start of the attempts whose flag is true: an
    /// expired lease of an attempt never recorded as started does not count as an
    /// attempt (bounded per job; see `UNSTARTED_EXPIRIES_MAX`).
    pub async fn renew_recording(
        &self,
        owner: &OwnerId,
        jobs: &[(JobId, Generation, bool)],
        lease: Duration,
    ) -> Result<RenewReport> {
        if jobs.is_empty() {
            return Ok(RenewReport::default());
        }
        let ids: Vec<i64> = jobs.iter().map(|j| j.0 .0).collect();
        let gens: Vec<i64> = jobs.iter().map(|j| j.1 .0).collect();
        let started: Vec<bool> = jobs.iter().map(|j| j.2).collect();
        let mut conn = self.acquire().await?;
        let sent = std::time::Instant::now();
        let rows = sqlx::query(&self.sql().renew)
            .bind(&ids)
            .bind(&gens)
            .bind(owner.as_str())
            .bind(secs(lease))
            .bind(&started)
            .fetch_all(self.on(&mut conn))
            .await?;
        let mut report = RenewReport {
            sent_at: Some(sent),
            ..Default::default()
        };
        for row in rows {
            let id = JobId(row.try_get("id")?);
            match row.try_get::<Option<DateTime<Utc>>, _>("lease_until")? {
                Some(until) => {
                    report.renewed.push((id, until));
                    if row.try_get("cancel_requested")? {
                        report.cancel_requested.push(id);
                    }
                }
                None if row.try_get("busy")? => report.busy.push(id),
                None => report.lost.push(id),
            }
        }
        Ok(report)
    }
}
