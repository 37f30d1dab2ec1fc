//! Reap: take back running jobs whose lease passed, record each expiry, and retry them
//! with backoff (or make them dead when their attempts are spent).
//!
//! One statement per batch. Candidates are locked with `SKIP LOCKED`, so a job whose
//! completion is committing right now is skipped rather than waited for; the UPDATE
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

pub(super) const REAP: &str = r#"/* leasehold:reap */
WITH x AS (
    SELECT id, generation, owner, lease_until
    FROM {s}.jobs
    WHERE state = 'running' AND lease_until < coalesce($1, now())
    ORDER BY lease_until
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), u AS (
    UPDATE {s}.jobs j
    SET state = CASE WHEN j.attempts >= j.max_attempts THEN 'dead' ELSE 'pending' END,
        available_at = CASE WHEN j.attempts >= j.max_attempts THEN j.available_at
            ELSE coalesce($1, now()) + make_interval(secs =>
                least($5, $4 * power(2, least(greatest(j.attempts - 1, 0), 60)))
                * (1 - $6 * random())) END,
        finished_at = CASE WHEN j.attempts >= j.max_attempts THEN coalesce($1, now()) END,
        lease_until = NULL,
        last_error = 'lease expired (generation ' || x.generation || ', owner ' || x.owner
                     || ', lease until ' || x.lease_until || ')'
    FROM x
    WHERE j.id = x.id AND j.generation = x.generation
      AND j.state = 'running' AND j.lease_until < coalesce($1, now())
    RETURNING j.id, j.generation, j.state, j.queue, j.job_key, j.dead_blocks_key,
              x.owner AS old_owner, x.lease_until AS old_lease_until
), rec AS (
    INSERT INTO {s}.lease_expiries (job_id, generation, owner, lease_until, reaped_at, reaped_by, new_state)
    SELECT id, generation, old_owner, old_lease_until, coalesce($1, now()), $3, state FROM u
    ON CONFLICT (job_id, generation) DO NOTHING
), ev AS (
    INSERT INTO {s}.job_events (job_id, generation, event, owner, at, detail)
    SELECT id, generation, 'reaped', $3, coalesce($1, now()),
           'lease of ' || old_owner || ' expired at ' || old_lease_until || '; now ' || state
    FROM u
)
SELECT id, state, queue, job_key, dead_blocks_key,
       (SELECT count(pg_notify($7, left(q.queue, 1000))) FROM (SELECT DISTINCT queue FROM u WHERE state = 'pending') q) AS notified
FROM u"#;

/// What one reap pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReapReport {
    /// Expired jobs put back to pending (claimable after backoff).
    pub retried: Vec<JobId>,
    /// Expired jobs whose attempts were spent.
    pub dead: Vec<JobId>,
}

impl ReapReport {
    pub fn is_empty(&self) -> bool {
        self.retried.is_empty() && self.dead.is_empty()
    }
}

impl Store {
    /// Reap up to `limit` expired leases. `at` is the test clock (None: the database's).
    pub async fn reap(
        &self,
        reaper: &OwnerId,
        backoff: &Backoff,
        limit: i64,
        at: Option<DateTime<Utc>>,
    ) -> Result<ReapReport> {
        let mut conn = self.pool().acquire().await?;
        let mut tx = conn.begin().await?;
        let rows = sqlx::query(&self.sql().reap)
            .bind(at)
            .bind(limit)
            .bind(reaper.as_str())
            .bind(secs(backoff.base))
            .bind(secs(backoff.cap))
            .bind(backoff.jitter)
            .bind(self.schema().channel())
            .fetch_all(&mut *tx)
            .await?;
        let mut report = ReapReport::default();
        let mut heads: Vec<KeyRef> = Vec::new();
        for row in &rows {
            let id = JobId(row.try_get("id")?);
            if row.try_get::<String, _>("state")? == "dead" {
                report.dead.push(id);
                let key: Option<String> = row.try_get("job_key")?;
                if let (Some(key), false) = (key, row.try_get::<bool, _>("dead_blocks_key")?) {
                    heads.push((row.try_get("queue")?, key));
                }
            } else {
                report.retried.push(id);
            }
        }
        self.end_heads(&mut tx, &heads).await?;
        tx.commit().await?;
        if !report.is_empty() {
            tracing::info!(
                retried = report.retried.len(),
                dead = report.dead.len(),
                "leasehold reaped expired leases"
            );
        }
        Ok(report)
    }
}
