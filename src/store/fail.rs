//! Fenced endings other than completion: fail (retry, dead, or cancelled when an
//! operator asked) and release (shutdown).
//!
//! Both lock the job's key row before the job row (see `complete.rs` on lock order)
//! when the ending may end the key's head: a failure can make the job dead under the
//! Continue policy or cancelled, and a release of a job an operator asked to cancel
//! makes it cancelled.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::Row;

use super::keys::KeyRef;
use super::{sanitize_error_text, secs, Backoff, Store};
use crate::error::Result;
use crate::job::{Attempt, FailOutcome, Fence, JobId, OwnerId};

/// The key row is locked only when this failure may end the key's head (cancelled, or
/// dead under the Continue policy); a plain retry does not wait on it.
pub(super) const FAIL: &str = r#"/* leasehold:fail */
WITH t AS MATERIALIZED (
    -- One moment for the row and its history: the retry's backoff counts from it.
    SELECT clock_timestamp() AS now
), kl AS MATERIALIZED (
    SELECT 1 FROM {s}.job_keys jk JOIN {s}.jobs j0
      ON j0.id = $1 AND jk.queue = j0.queue AND jk.job_key = j0.job_key
    WHERE j0.cancel_requested_at IS NOT NULL
       OR (NOT j0.dead_blocks_key AND ($5 OR j0.attempts >= j0.max_attempts))
    FOR UPDATE OF jk
), u AS (
    UPDATE {s}.jobs
    SET state = CASE WHEN cancel_requested_at IS NOT NULL THEN 'cancelled'
                     WHEN $5 OR attempts >= max_attempts THEN 'dead'
                     ELSE 'pending' END,
        available_at = CASE WHEN cancel_requested_at IS NOT NULL OR $5 OR attempts >= max_attempts
            THEN available_at
            ELSE (SELECT now FROM t) + make_interval(secs => coalesce($9::float8,
                least($7, $6 * power(2, least(greatest(attempts - 1, 0), 60)))
                * (1 - $8 * random()))) END,
        finished_at = CASE WHEN cancel_requested_at IS NOT NULL OR $5 OR attempts >= max_attempts
            THEN (SELECT now FROM t) END,
        lease_until = NULL,
        last_error = $4
    WHERE id = $1 AND owner = $2 AND generation = $3 AND effect_identity = $11::uuid
      AND state = 'running' AND (SELECT count(*) FROM kl) >= 0
    RETURNING id, generation, state, available_at, queue, job_key, dead_blocks_key
), ev AS (
    INSERT INTO {s}.job_events (job_id, generation, event, owner, at, detail)
    SELECT id, generation,
           CASE state WHEN 'dead' THEN 'dead' WHEN 'cancelled' THEN 'cancelled' ELSE 'failed' END,
           $2, (SELECT now FROM t), $4
    FROM u WHERE $10
)
SELECT * FROM u"#;

/// A snooze: back to pending after the delay, the attempt given back, counted in
/// `snoozes`. Not for a job an operator asked to cancel, nor past the kind's maximum
/// (`$5`): the caller then fails the attempt instead. A pending job stays its key's
/// head, so no key row is touched.
pub(super) const SNOOZE: &str = r#"/* leasehold:snooze */
WITH u AS (
    UPDATE {s}.jobs
    SET state = 'pending', available_at = clock_timestamp() + make_interval(secs => $4),
        attempts = greatest(attempts - 1, 0), snoozes = snoozes + 1, lease_until = NULL
    WHERE id = $1 AND owner = $2 AND generation = $3 AND effect_identity = $8::uuid
      AND state = 'running' AND cancel_requested_at IS NULL AND snoozes < $5
    RETURNING id, generation, available_at, snoozes
), ev AS (
    INSERT INTO {s}.job_events (job_id, generation, event, owner, at, detail)
    SELECT id, generation, 'snoozed', $2, clock_timestamp(), $6 FROM u WHERE $7
)
SELECT available_at FROM u"#;

/// Release (give-backs, shutdown). A job an operator asked to cancel is not put back: it
/// is cancelled, and its key moves on (its key row locked first, `SKIP LOCKED`: a release
/// never waits, since the jobs it would hold meanwhile could not be renewed). One row per
/// job asked for: `released` when it was given back or cancelled, else `busy` when it is
/// still this attempt's and running as this statement's snapshot saw it: its key row
/// was held, or an operator's cancel committed while the statement waited for the row
/// (the key rows to lock were chosen from the snapshot, before the cancel). The caller
/// tries a busy job again, it is never done.
pub(super) const RELEASE: &str = r#"/* leasehold:release */
WITH c AS (
    -- Each attempt once: a job named twice must leave its key once.
    SELECT DISTINCT * FROM unnest($1::int8[], $2::int8[], $7::uuid[]) AS t(id, generation, identity)
), kl AS MATERIALIZED (
    SELECT jk.queue, jk.job_key FROM {s}.job_keys jk
    JOIN (SELECT DISTINCT j0.queue, j0.job_key FROM {s}.jobs j0 JOIN c ON j0.id = c.id
           WHERE j0.cancel_requested_at IS NOT NULL AND j0.job_key IS NOT NULL) d
      ON jk.queue = d.queue AND jk.job_key = d.job_key
    ORDER BY jk.queue, jk.job_key
    FOR UPDATE OF jk SKIP LOCKED
), u AS (
    UPDATE {s}.jobs j
    SET state = CASE WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled' ELSE 'pending' END,
        finished_at = CASE WHEN j.cancel_requested_at IS NOT NULL THEN clock_timestamp() END,
        attempts = greatest(j.attempts - 1, 0), available_at = clock_timestamp(),
        lease_until = NULL, last_error = $4
    FROM c
    WHERE j.id = c.id AND j.generation = c.generation AND j.owner = $3
      AND j.effect_identity = c.identity AND j.state = 'running'
      AND (SELECT count(*) FROM kl) >= 0
      AND (j.cancel_requested_at IS NULL OR j.job_key IS NULL
           OR EXISTS (SELECT 1 FROM kl WHERE kl.queue = j.queue AND kl.job_key = j.job_key))
    RETURNING j.id, j.generation, j.queue, j.job_key, j.state
), ev AS (
    INSERT INTO {s}.job_events (job_id, generation, event, owner, at, detail)
    SELECT id, generation, CASE WHEN state = 'cancelled' THEN 'cancelled' ELSE 'released' END,
           $3, clock_timestamp(), $4 FROM u WHERE $6
)
SELECT c.id, u.id IS NOT NULL AS released, u.queue, u.job_key, u.state,
       u.id IS NULL AND EXISTS (
           SELECT 1 FROM {s}.jobs j
           WHERE j.id = c.id AND j.generation = c.generation AND j.owner = $3
             AND j.effect_identity = c.identity AND j.state = 'running') AS busy,
       (SELECT count(pg_notify($5, left(q.queue, 1000)))
          FROM (SELECT DISTINCT queue FROM u WHERE state = 'pending') q) AS notified
FROM c LEFT JOIN u ON u.id = c.id AND u.generation = c.generation"#;

/// What a release did: the jobs given back (or cancelled), and those still held by the
/// attempt that asked (see `RELEASE`), to try again.
#[derive(Debug, Default)]
pub(crate) struct Released {
    /// Given back or cancelled.
    pub released: Vec<JobId>,
    /// Of `released`, those cancelled (an operator had asked).
    pub cancelled: Vec<JobId>,
    /// Still this attempt's: try again.
    pub busy: Vec<JobId>,
}

/// Why an attempt failed, for [`Store::fail`].
#[derive(Clone, Debug, Default)]
pub struct Failure {
    /// Why, stored as the job's `last_error` (cut to 4 KiB, NULs escaped).
    pub reason: String,
    /// Dead at once, whatever attempts remain (undecodable payload, permanent error).
    pub permanent: bool,
    /// Retry after this long instead of the backoff ([`crate::JobError::retry_after`]);
    /// capped at [`MAX_DELAY`](super::MAX_DELAY).
    pub retry_after: Option<Duration>,
}

impl Store {
    /// Fail the attempt: back to pending with backoff (database clock), or dead when the
    /// attempts are spent or the failure is permanent, or cancelled when an operator
    /// asked to cancel the job while it ran. A dead head keeps its key blocked unless
    /// the job was enqueued with [`crate::DeadKeyPolicy::Continue`].
    #[tracing::instrument(name = "leasehold.fail", level = "debug", skip_all, fields(job = fence.job.0))]
    pub async fn fail(
        &self,
        fence: &Fence,
        failure: &Failure,
        backoff: &Backoff,
    ) -> Result<FailOutcome> {
        self.unless_history_refused("fail", || self.fail_once(fence, failure, backoff))
            .await
    }

    async fn fail_once(
        &self,
        fence: &Fence,
        failure: &Failure,
        backoff: &Backoff,
    ) -> Result<FailOutcome> {
        let reason = sanitize_error_text(&failure.reason);
        let mut conn = self.acquire().await?;
        let mut tx = self.begin(&mut conn).await?;
        let row = sqlx::query(&self.sql().fail)
            .bind(fence.job.0)
            .bind(fence.owner.as_str())
            .bind(fence.generation.0)
            .bind(&reason)
            .bind(failure.permanent)
            .bind(secs(backoff.base))
            .bind(secs(backoff.cap))
            .bind(backoff.jitter)
            .bind(failure.retry_after.map(|d| secs(d.min(super::MAX_DELAY))))
            .bind(self.history_on())
            .bind(fence.identity.as_str())
            .fetch_optional(self.on(&mut tx))
            .await?;
        let Some(row) = row else {
            tx.rollback().await?;
            return Ok(FailOutcome::Stale);
        };
        let state: String = row.try_get("state")?;
        let key: Option<String> = row.try_get("job_key")?;
        let ends_head = match state.as_str() {
            "cancelled" => true,
            "dead" => !row.try_get::<bool, _>("dead_blocks_key")?,
            _ => false,
        };
        if let (Some(key), true) = (key, ends_head) {
            self.end_heads(&mut tx, &[(row.try_get("queue")?, key)])
                .await?;
        }
        let outcome = match state.as_str() {
            "dead" => FailOutcome::Dead,
            "cancelled" => FailOutcome::Cancelled,
            _ => FailOutcome::Retrying {
                available_at: row.try_get("available_at")?,
            },
        };
        tx.commit().await?;
        Ok(outcome)
    }

    /// Snooze the attempt ([`crate::JobError::snooze`]): the job is pending again after
    /// `delay` (database clock; capped at [`MAX_DELAY`](super::MAX_DELAY)) and the attempt
    /// is not counted. Returns when it becomes claimable, or `None` when nothing was
    /// written: the fence is gone, an operator asked to cancel the job, or it already
    /// snoozed `max_snoozes` times. The caller then fails the attempt instead, which
    /// tells those apart.
    #[tracing::instrument(name = "leasehold.snooze", level = "debug", skip_all, fields(job = fence.job.0))]
    pub async fn snooze(
        &self,
        fence: &Fence,
        delay: Duration,
        max_snoozes: u32,
    ) -> Result<Option<DateTime<Utc>>> {
        let delay = delay.min(super::MAX_DELAY);
        let detail = format!("snoozed for {}", humantime::format_duration(delay));
        self.unless_history_refused("snooze", || async {
            Ok(sqlx::query_scalar(&self.sql().snooze)
                .bind(fence.job.0)
                .bind(fence.owner.as_str())
                .bind(fence.generation.0)
                .bind(secs(delay))
                .bind(i32::try_from(max_snoozes).unwrap_or(i32::MAX))
                .bind(&detail)
                .bind(self.history_on())
                .bind(fence.identity.as_str())
                .fetch_optional(self.db())
                .await?)
        })
        .await
    }

    /// Give jobs back without counting the attempt (graceful shutdown): pending and
    /// claimable at once by any worker; a job an operator asked to cancel is cancelled
    /// instead. Returns the ids actually released or cancelled.
    ///
    /// A job missing from the answer is no longer this attempt's, or is still held: a
    /// cancelled job whose key row another session holds, or one whose cancel was
    /// committed while the statement waited for its row. Call again for a job that is
    /// still yours (a renewal says so), or let its lease expire.
    pub async fn release_many(
        &self,
        owner: &OwnerId,
        jobs: &[Attempt],
        reason: &str,
    ) -> Result<Vec<JobId>> {
        Ok(self.release_reporting(owner, jobs, reason).await?.released)
    }

    /// [`Store::release_many`], saying also which jobs are still held (to try again).
    #[tracing::instrument(name = "leasehold.release", level = "debug", skip_all, fields(n = jobs.len()))]
    pub(crate) async fn release_reporting(
        &self,
        owner: &OwnerId,
        jobs: &[Attempt],
        reason: &str,
    ) -> Result<Released> {
        if jobs.is_empty() {
            return Ok(Released::default());
        }
        self.unless_history_refused("release", || self.release_once(owner, jobs, reason))
            .await
    }

    async fn release_once(
        &self,
        owner: &OwnerId,
        jobs: &[Attempt],
        reason: &str,
    ) -> Result<Released> {
        let ids: Vec<i64> = jobs.iter().map(|j| j.job.0).collect();
        let gens: Vec<i64> = jobs.iter().map(|j| j.generation.0).collect();
        let identities: Vec<&str> = jobs.iter().map(|j| j.identity.as_str()).collect();
        let mut conn = self.acquire().await?;
        let mut tx = self.begin(&mut conn).await?;
        let rows = sqlx::query(&self.sql().release)
            .bind(&ids)
            .bind(&gens)
            .bind(owner.as_str())
            .bind(sanitize_error_text(reason))
            .bind(self.schema().channel())
            .bind(self.history_on())
            .bind(&identities)
            .fetch_all(self.on(&mut tx))
            .await?;
        let mut released = Released::default();
        let mut heads: Vec<KeyRef> = Vec::new();
        for row in &rows {
            let id = JobId(row.try_get("id")?);
            if !row.try_get::<bool, _>("released")? {
                if row.try_get::<bool, _>("busy")? {
                    released.busy.push(id);
                }
                continue;
            }
            released.released.push(id);
            if row.try_get::<Option<String>, _>("state")?.as_deref() == Some("cancelled") {
                released.cancelled.push(id);
            }
            let key: Option<String> = row.try_get("job_key")?;
            if let (Some(key), "cancelled") = (key, row.try_get::<String, _>("state")?.as_str()) {
                heads.push((row.try_get("queue")?, key));
            }
        }
        self.end_heads(&mut tx, &heads).await?;
        tx.commit().await?;
        Ok(released)
    }
}
