//! Reap: take back running jobs whose lease passed, record each expiry, and retry them
//! with backoff (or make them dead when their attempts are spent).
//!
//! One statement per batch. Candidates are locked with `SKIP LOCKED`, so a job whose
//! completion is committing right now is skipped rather than waited for. A job whose
//! expiry ends its key's head (cancelled because an operator asked, or dead under the
//! Continue policy) needs its key row too; that is also taken with `SKIP LOCKED`, and a
//! job whose key row is busy (a host's open transaction enqueued into the key) waits
//! for the next pass, so the reaper never stalls behind anyone. The UPDATE
//! re-checks `state='running' AND lease_until < now`, so a job that completed in the
//! meantime is never moved back. `UNIQUE(job_id, generation)` in `lease_expiries`
//! makes a second reaper's record a no-op. The reaper needs no handler registry: a
//! kind this process does not know is never a reason to drop a job.

use chrono::{DateTime, Utc};
use sqlx::{Acquire, Row};

use super::keys::KeyRef;
use super::{secs, Backoff, Store};
use crate::error::Result;
use crate::job::{JobId, OwnerId};

/// Expired leases of one job whose start was never recorded that are given back without
/// counting an attempt; past this, an expiry counts whatever was recorded. A job waiting
/// for a slot survives this many crashes of the processes holding it; a handler that
/// kills its process before its start is recorded (within a fraction of a second; see the
/// lease renewer) reaches dead after at most this many extra runs.
pub const UNSTARTED_EXPIRIES_MAX: i32 = 3;

pub(super) const REAP: &str = r#"/* leasehold:reap */
WITH c AS (
    SELECT id, generation, owner, lease_until, queue, job_key, cancel_requested_at,
           attempts, max_attempts, dead_blocks_key,
           -- Claimed but never recorded as started (it waited for a slot, or its owner
           -- died within moments of starting it): not an attempt, a bounded number of
           -- times per job (see migrations/0015_recorded_starts.sql).
           started_generation IS DISTINCT FROM generation
               AND unstarted_expiries < $8 AND cancel_requested_at IS NULL AS unstarted
    FROM {s}.jobs
    WHERE state = 'running' AND lease_until < coalesce($1, now())
    ORDER BY lease_until
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), x AS (
    SELECT id, generation, owner, lease_until, queue, job_key, unstarted,
           job_key IS NOT NULL AND (cancel_requested_at IS NOT NULL
               OR (NOT unstarted AND attempts >= max_attempts AND NOT dead_blocks_key)) AS ends_head
    FROM c
), kl AS MATERIALIZED (
    SELECT jk.queue, jk.job_key
    FROM {s}.job_keys jk
    JOIN (SELECT DISTINCT queue, job_key FROM x WHERE ends_head) d
      ON jk.queue = d.queue AND jk.job_key = d.job_key
    ORDER BY jk.queue, jk.job_key
    FOR UPDATE OF jk SKIP LOCKED
), u AS (
    UPDATE {s}.jobs j
    SET state = CASE WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled'
                     WHEN x.unstarted THEN 'pending'
                     WHEN j.attempts >= j.max_attempts THEN 'dead'
                     ELSE 'pending' END,
        available_at = CASE WHEN x.unstarted THEN coalesce($1, now())
            WHEN j.cancel_requested_at IS NOT NULL OR j.attempts >= j.max_attempts
            THEN j.available_at
            ELSE coalesce($1, now()) + make_interval(secs =>
                least($5, $4 * power(2, least(greatest(j.attempts - 1, 0), 60)))
                * (1 - $6 * random())) END,
        finished_at = CASE WHEN x.unstarted THEN NULL
            WHEN j.cancel_requested_at IS NOT NULL OR j.attempts >= j.max_attempts
            THEN coalesce($1, now()) END,
        attempts = CASE WHEN x.unstarted THEN greatest(j.attempts - 1, 0) ELSE j.attempts END,
        unstarted_expiries = j.unstarted_expiries + CASE WHEN x.unstarted THEN 1 ELSE 0 END,
        lease_until = NULL,
        last_error = 'lease expired (generation ' || x.generation || ', owner ' || x.owner
                     || ', lease until ' || x.lease_until || ')'
                     || CASE WHEN x.unstarted THEN ' before its handler was recorded as started: not counted as an attempt'
                             ELSE '' END
    FROM x
    WHERE j.id = x.id AND j.generation = x.generation
      AND j.state = 'running' AND j.lease_until < coalesce($1, now())
      AND (NOT x.ends_head
           OR EXISTS (SELECT 1 FROM kl WHERE kl.queue = x.queue AND kl.job_key = x.job_key))
    RETURNING j.id, j.generation, j.state, j.queue, j.job_key, j.dead_blocks_key,
              x.owner AS old_owner, x.lease_until AS old_lease_until, x.unstarted
), rec AS (
    INSERT INTO {s}.lease_expiries (job_id, generation, owner, lease_until, reaped_at, reaped_by, new_state)
    SELECT id, generation, old_owner, old_lease_until, coalesce($1, now()), $3, state FROM u
    ON CONFLICT (job_id, generation) DO NOTHING
), ev AS (
    INSERT INTO {s}.job_events (job_id, generation, event, owner, at, detail)
    SELECT id, generation, 'reaped', $3, coalesce($1, now()),
           'lease of ' || old_owner || ' expired at ' || old_lease_until || '; now ' || state
           || CASE WHEN unstarted THEN ' (never started: not counted as an attempt)' ELSE '' END
    FROM u WHERE $9
)
SELECT id, state, queue, job_key, dead_blocks_key, unstarted,
       (SELECT count(pg_notify($7, left(q.queue, 1000))) FROM (SELECT DISTINCT queue FROM u WHERE state = 'pending') q) AS notified
FROM u"#;

/// What one reap pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReapReport {
    /// Expired jobs put back to pending (claimable after backoff).
    pub retried: Vec<JobId>,
    /// Of `retried`: jobs whose handler was never recorded as started (claimed ahead and
    /// waiting for a slot, say), pending again at once without spending an attempt.
    pub unstarted: Vec<JobId>,
    /// Expired jobs whose attempts were spent.
    pub dead: Vec<JobId>,
    /// Expired jobs an operator had asked to cancel: cancelled now.
    pub cancelled: Vec<JobId>,
}

impl ReapReport {
    /// True when the pass found no expired lease.
    pub fn is_empty(&self) -> bool {
        self.retried.is_empty() && self.dead.is_empty() && self.cancelled.is_empty()
    }
}

impl Store {
    /// Reap up to `limit` expired leases. `at` is the test clock (None: the database's).
    #[tracing::instrument(name = "leasehold.reap", level = "debug", skip_all)]
    pub async fn reap(
        &self,
        reaper: &OwnerId,
        backoff: &Backoff,
        limit: i64,
        at: Option<DateTime<Utc>>,
    ) -> Result<ReapReport> {
        self.unless_history_refused("reap", || self.reap_once(reaper, backoff, limit, at))
            .await
    }

    async fn reap_once(
        &self,
        reaper: &OwnerId,
        backoff: &Backoff,
        limit: i64,
        at: Option<DateTime<Utc>>,
    ) -> Result<ReapReport> {
        let mut conn = self.acquire().await?;
        let mut tx = conn.begin().await?;
        let rows = sqlx::query(&self.sql().reap)
            .bind(at)
            .bind(limit)
            .bind(reaper.as_str())
            .bind(secs(backoff.base))
            .bind(secs(backoff.cap))
            .bind(backoff.jitter)
            .bind(self.schema().channel())
            .bind(UNSTARTED_EXPIRIES_MAX)
            .bind(self.history_on())
            .fetch_all(self.on(&mut tx))
            .await?;
        let mut report = ReapReport::default();
        let mut heads: Vec<KeyRef> = Vec::new();
        for row in &rows {
            let id = JobId(row.try_get("id")?);
            let key: Option<String> = row.try_get("job_key")?;
            let ends_head = match row.try_get::<String, _>("state")?.as_str() {
                "dead" => {
                    report.dead.push(id);
                    !row.try_get::<bool, _>("dead_blocks_key")?
                }
                "cancelled" => {
                    report.cancelled.push(id);
                    true
                }
                _ => {
                    report.retried.push(id);
                    if row.try_get::<bool, _>("unstarted")? {
                        report.unstarted.push(id);
                    }
                    false
                }
            };
            if let (Some(key), true) = (key, ends_head) {
                heads.push((row.try_get("queue")?, key));
            }
        }
        self.end_heads(&mut tx, &heads).await?;
        tx.commit().await?;
        if !report.is_empty() {
            tracing::info!(
                retried = report.retried.len(),
                dead = report.dead.len(),
                cancelled = report.cancelled.len(),
                "leasehold reaped expired leases"
            );
        }
        Ok(report)
    }
}
