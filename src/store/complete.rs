//! Fenced endings of an attempt: complete, fail (retry or dead), release.
//!
//! Each UPDATE is conditional on `(id, owner, generation, state='running')`. Zero rows
//! means the worker lost authority, except when its own earlier completion already
//! committed and the reply was lost: the read-back tells the two apart, so a retried
//! completion returns the stored result instead of reporting a false `Stale`.

use std::collections::HashMap;

use sqlx::{Acquire, PgConnection, Row};

use super::keys::{Chain, KeyRef};
use super::{sanitize_error_text, secs, Backoff, Store};
use crate::error::Result;
use crate::job::{ClaimedJob, CompleteOutcome, FailOutcome, Fence, Generation, JobId, OwnerId};

pub(super) const COMPLETE: &str = r#"/* leasehold:complete */
WITH u AS (
    UPDATE {s}.jobs
    SET state = 'done', result = $4, finished_at = now(), lease_until = NULL
    WHERE id = $1 AND owner = $2 AND generation = $3 AND state = 'running'
    RETURNING id, generation, queue, job_key
), ev AS (
    INSERT INTO {s}.job_events (job_id, generation, event, owner, at)
    SELECT id, generation, 'completed', $2, now() FROM u WHERE $5
)
SELECT id, queue, job_key FROM u"#;

/// Complete a batch, and leave the completed heads' keys (the first half of
/// [`super::Store::end_heads`]) in the same statement, which takes their rows' locks; the
/// promotion follows in the same transaction, with a fresh snapshot.
pub(super) const COMPLETE_MANY: &str = r#"/* leasehold:complete_many */
WITH c AS (
    SELECT * FROM unnest($1::int8[], $2::int8[], $3::jsonb[]) AS t(id, generation, result)
), u AS (
    UPDATE {s}.jobs j
    SET state = 'done', result = c.result, finished_at = now(), lease_until = NULL
    FROM c
    WHERE j.id = c.id AND j.owner = $4 AND j.generation = c.generation AND j.state = 'running'
    RETURNING j.id, j.generation, j.queue, j.job_key
), ev AS (
    INSERT INTO {s}.job_events (job_id, generation, event, owner, at)
    SELECT id, generation, 'completed', $4, now() FROM u WHERE $5
), k AS (
    UPDATE {s}.job_keys jk
    SET open_jobs = jk.open_jobs - d.n
    FROM (SELECT queue, job_key, count(*) AS n
            FROM u WHERE job_key IS NOT NULL
           GROUP BY queue, job_key
           ORDER BY queue, job_key) d
    WHERE jk.queue = d.queue AND jk.job_key = d.job_key
)
SELECT id, queue, job_key FROM u"#;

pub(super) const COMPLETE_UNKEYED: &str = r#"/* leasehold:complete_unkeyed */
WITH c AS (
    SELECT * FROM unnest($1::int8[], $2::int8[], $3::jsonb[]) AS t(id, generation, result)
), u AS (
    UPDATE {s}.jobs j
    SET state = 'done', result = c.result, finished_at = now(), lease_until = NULL
    FROM c
    WHERE j.id = c.id AND j.owner = $4 AND j.generation = c.generation AND j.state = 'running'
      AND j.job_key IS NULL
    RETURNING j.id, j.generation
), ev AS (
    INSERT INTO {s}.job_events (job_id, generation, event, owner, at)
    SELECT id, generation, 'completed', $4, now() FROM u WHERE $5
)
SELECT id FROM u"#;

pub(super) const COMPLETION_READBACK: &str = r#"/* leasehold:completion_readback */
SELECT id, state, generation, owner, result FROM {s}.jobs WHERE id = ANY($1)"#;

pub(super) const FAIL: &str = r#"/* leasehold:fail */
WITH u AS (
    UPDATE {s}.jobs
    SET state = CASE WHEN $5 OR attempts >= max_attempts THEN 'dead' ELSE 'pending' END,
        available_at = CASE WHEN $5 OR attempts >= max_attempts THEN available_at
            ELSE now() + make_interval(secs =>
                least($7, $6 * power(2, least(greatest(attempts - 1, 0), 60)))
                * (1 - $8 * random())) END,
        finished_at = CASE WHEN $5 OR attempts >= max_attempts THEN now() END,
        lease_until = NULL,
        last_error = $4
    WHERE id = $1 AND owner = $2 AND generation = $3 AND state = 'running'
    RETURNING id, generation, state, available_at, queue, job_key, dead_blocks_key
), ev AS (
    INSERT INTO {s}.job_events (job_id, generation, event, owner, at, detail)
    SELECT id, generation, CASE WHEN state = 'dead' THEN 'dead' ELSE 'failed' END, $2, now(), $4
    FROM u
)
SELECT * FROM u"#;

pub(super) const RELEASE: &str = r#"/* leasehold:release */
WITH c AS (
    SELECT * FROM unnest($1::int8[], $2::int8[]) AS t(id, generation)
), u AS (
    UPDATE {s}.jobs j
    SET state = 'pending', attempts = greatest(j.attempts - 1, 0), available_at = now(),
        lease_until = NULL, last_error = $4
    FROM c
    WHERE j.id = c.id AND j.generation = c.generation AND j.owner = $3 AND j.state = 'running'
    RETURNING j.id, j.generation, j.queue
), ev AS (
    INSERT INTO {s}.job_events (job_id, generation, event, owner, at, detail)
    SELECT id, generation, 'released', $3, now(), $4 FROM u
)
SELECT id, (SELECT count(pg_notify($5, left(q.queue, 1000))) FROM (SELECT DISTINCT queue FROM u) q) AS notified
FROM u"#;

/// Why an attempt failed, for [`Store::fail`].
#[derive(Clone, Debug)]
pub struct Failure {
    pub reason: String,
    /// Dead at once, whatever attempts remain (undecodable payload, permanent error).
    pub permanent: bool,
}

impl Store {
    /// Complete a claimed job, storing `result`. Promotes the key's successor in the
    /// same transaction.
    pub async fn complete(
        &self,
        fence: &Fence,
        result: Option<serde_json::Value>,
    ) -> Result<CompleteOutcome> {
        let mut conn = self.pool().acquire().await?;
        self.complete_in(&mut conn, fence, result).await
    }

    /// Complete inside the caller's transaction, together with its business writes:
    /// both commit or neither does. A `Stale` outcome means the caller must roll back
    /// its own writes (leasehold does not abort the caller's transaction for it).
    pub async fn complete_in(
        &self,
        conn: &mut PgConnection,
        fence: &Fence,
        result: Option<serde_json::Value>,
    ) -> Result<CompleteOutcome> {
        let mut tx = conn.begin().await?;
        let row = sqlx::query(&self.sql().complete)
            .bind(fence.job.0)
            .bind(fence.owner.as_str())
            .bind(fence.generation.0)
            .bind(&result)
            .bind(self.options().full_history)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(row) = row else {
            drop(tx);
            let mut back = self
                .completion_readback(conn, &fence.owner, &[(fence.job, fence.generation)])
                .await?;
            return Ok(back.remove(&fence.job).unwrap_or(CompleteOutcome::Stale));
        };
        let key: Option<String> = row.try_get("job_key")?;
        if let Some(key) = key {
            self.end_heads(&mut tx, &[(row.try_get("queue")?, key)])
                .await?;
        }
        tx.commit().await?;
        Ok(CompleteOutcome::Completed)
    }

    /// Complete many jobs of one owner in one transaction (the completion batcher).
    /// Outcomes come back in input order.
    pub async fn complete_many(
        &self,
        owner: &OwnerId,
        items: &[(JobId, Generation, Option<serde_json::Value>)],
    ) -> Result<Vec<CompleteOutcome>> {
        let no_chain = vec![false; items.len()];
        let done = self
            .complete_many_chained(owner, items, &no_chain, None)
            .await?;
        Ok(done.into_iter().map(|(o, _)| o).collect())
    }

    /// [`Store::complete_many`], also claiming (for `chain.owner`) the promoted successor
    /// of each keyed item whose `chain_wanted` is set; see [`Store::end_heads_chained`].
    /// Each outcome comes with the successor claimed for it, if any.
    pub(crate) async fn complete_many_chained(
        &self,
        owner: &OwnerId,
        items: &[(JobId, Generation, Option<serde_json::Value>)],
        chain_wanted: &[bool],
        chain: Option<&Chain<'_>>,
    ) -> Result<Vec<(CompleteOutcome, Option<ClaimedJob>)>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<i64> = items.iter().map(|i| i.0 .0).collect();
        let gens: Vec<i64> = items.iter().map(|i| i.1 .0).collect();
        let results: Vec<Option<serde_json::Value>> = items.iter().map(|i| i.2.clone()).collect();
        let wanted_by_id: HashMap<i64, bool> = ids
            .iter()
            .zip(chain_wanted)
            .map(|(id, w)| (*id, *w))
            .collect();
        let mut conn = self.pool().acquire().await?;
        let mut tx = conn.begin().await?;
        let rows = sqlx::query(&self.sql().complete_many)
            .bind(&ids)
            .bind(&gens)
            .bind(&results)
            .bind(owner.as_str())
            .bind(self.options().full_history)
            .fetch_all(&mut *tx)
            .await?;
        let mut done = std::collections::HashSet::with_capacity(rows.len());
        let mut heads: Vec<KeyRef> = Vec::new();
        let mut head_of: Vec<i64> = Vec::new();
        let mut wanted: Vec<bool> = Vec::new();
        for row in &rows {
            let id: i64 = row.try_get("id")?;
            done.insert(id);
            if let Some(key) = row.try_get::<Option<String>, _>("job_key")? {
                heads.push((row.try_get("queue")?, key));
                head_of.push(id);
                wanted.push(wanted_by_id.get(&id).copied().unwrap_or(false));
            }
        }
        let successors = self
            .promote_chained(&mut tx, &heads, &wanted, chain)
            .await?;
        tx.commit().await?;
        // Each successor belongs to the item that ended its key's head.
        let mut next: HashMap<i64, ClaimedJob> = HashMap::new();
        for job in successors {
            let at = heads
                .iter()
                .position(|(q, k)| *q == job.queue && Some(k) == job.key.as_ref());
            if let Some(at) = at {
                next.insert(head_of[at], job);
            }
        }
        let missing: Vec<(JobId, Generation)> = items
            .iter()
            .filter(|i| !done.contains(&i.0 .0))
            .map(|i| (i.0, i.1))
            .collect();
        let mut back = if missing.is_empty() {
            HashMap::new()
        } else {
            self.completion_readback(&mut conn, owner, &missing).await?
        };
        Ok(items
            .iter()
            .map(|i| {
                if done.contains(&i.0 .0) {
                    (CompleteOutcome::Completed, next.remove(&i.0 .0))
                } else {
                    (back.remove(&i.0).unwrap_or(CompleteOutcome::Stale), None)
                }
            })
            .collect())
    }

    /// [`Store::complete_many`] for jobs the caller believes unkeyed (the completion
    /// batcher's common case): one statement in its own implicit transaction, no
    /// BEGIN/COMMIT round trips, since there is no successor to promote. The statement
    /// skips keyed rows, so whatever it did not complete (a keyed job after all, a lost
    /// fence, a completion already committed) goes through `complete_many`, which
    /// promotes or tells the cases apart.
    pub(crate) async fn complete_unkeyed(
        &self,
        owner: &OwnerId,
        items: &[(JobId, Generation, Option<serde_json::Value>)],
    ) -> Result<Vec<CompleteOutcome>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<i64> = items.iter().map(|i| i.0 .0).collect();
        let gens: Vec<i64> = items.iter().map(|i| i.1 .0).collect();
        let results: Vec<Option<serde_json::Value>> = items.iter().map(|i| i.2.clone()).collect();
        let done: std::collections::HashSet<i64> = sqlx::query_scalar(&self.sql().complete_unkeyed)
            .bind(&ids)
            .bind(&gens)
            .bind(&results)
            .bind(owner.as_str())
            .bind(self.options().full_history)
            .fetch_all(self.pool())
            .await?
            .into_iter()
            .collect();
        if done.len() == items.len() {
            return Ok(vec![CompleteOutcome::Completed; items.len()]);
        }
        let rest: Vec<_> = items
            .iter()
            .filter(|i| !done.contains(&i.0 .0))
            .cloned()
            .collect();
        let mut rest_outcomes = self.complete_many(owner, &rest).await?.into_iter();
        Ok(items
            .iter()
            .map(|i| {
                if done.contains(&i.0 .0) {
                    CompleteOutcome::Completed
                } else {
                    rest_outcomes.next().unwrap_or(CompleteOutcome::Stale)
                }
            })
            .collect())
    }

    /// Ask again after a lost reply: was this generation's completion committed?
    pub async fn completion_status(&self, fence: &Fence) -> Result<CompleteOutcome> {
        let mut conn = self.pool().acquire().await?;
        let mut back = self
            .completion_readback(&mut conn, &fence.owner, &[(fence.job, fence.generation)])
            .await?;
        Ok(back.remove(&fence.job).unwrap_or(CompleteOutcome::Stale))
    }

    async fn completion_readback(
        &self,
        conn: &mut PgConnection,
        owner: &OwnerId,
        items: &[(JobId, Generation)],
    ) -> Result<HashMap<JobId, CompleteOutcome>> {
        let ids: Vec<i64> = items.iter().map(|(id, _)| id.0).collect();
        let rows = sqlx::query(&self.sql().completion_readback)
            .bind(&ids)
            .fetch_all(&mut *conn)
            .await?;
        let wanted: HashMap<i64, i64> = items.iter().map(|(id, g)| (id.0, g.0)).collect();
        let mut out = HashMap::new();
        for row in rows {
            let id: i64 = row.try_get("id")?;
            let state: String = row.try_get("state")?;
            let generation: i64 = row.try_get("generation")?;
            let row_owner: Option<String> = row.try_get("owner")?;
            let ours = state == "done"
                && Some(generation) == wanted.get(&id).copied()
                && row_owner.as_deref() == Some(owner.as_str());
            let outcome = if ours {
                CompleteOutcome::AlreadyCompleted {
                    result: row.try_get("result")?,
                }
            } else {
                CompleteOutcome::Stale
            };
            out.insert(JobId(id), outcome);
        }
        Ok(out)
    }

    /// Fail the attempt: back to pending with backoff (database clock), or dead when the
    /// attempts are spent or the failure is permanent. A dead head keeps its key blocked
    /// unless the job was enqueued with [`crate::DeadKeyPolicy::Continue`].
    pub async fn fail(
        &self,
        fence: &Fence,
        failure: &Failure,
        backoff: &Backoff,
    ) -> Result<FailOutcome> {
        let reason = sanitize_error_text(&failure.reason);
        let mut conn = self.pool().acquire().await?;
        let mut tx = conn.begin().await?;
        let row = sqlx::query(&self.sql().fail)
            .bind(fence.job.0)
            .bind(fence.owner.as_str())
            .bind(fence.generation.0)
            .bind(&reason)
            .bind(failure.permanent)
            .bind(secs(backoff.base))
            .bind(secs(backoff.cap))
            .bind(backoff.jitter)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(row) = row else {
            return Ok(FailOutcome::Stale);
        };
        let state: String = row.try_get("state")?;
        let outcome = if state == "dead" {
            let key: Option<String> = row.try_get("job_key")?;
            let blocks: bool = row.try_get("dead_blocks_key")?;
            if let (Some(key), false) = (key, blocks) {
                self.end_heads(&mut tx, &[(row.try_get("queue")?, key)])
                    .await?;
            }
            FailOutcome::Dead
        } else {
            FailOutcome::Retrying {
                available_at: row.try_get("available_at")?,
            }
        };
        tx.commit().await?;
        Ok(outcome)
    }

    /// Give jobs back without counting the attempt (graceful shutdown): pending and
    /// claimable at once by any worker. Returns the ids actually released.
    pub async fn release_many(
        &self,
        owner: &OwnerId,
        jobs: &[(JobId, Generation)],
        reason: &str,
    ) -> Result<Vec<JobId>> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<i64> = jobs.iter().map(|j| j.0 .0).collect();
        let gens: Vec<i64> = jobs.iter().map(|j| j.1 .0).collect();
        let rows: Vec<(i64, i64)> = sqlx::query_as(&self.sql().release)
            .bind(&ids)
            .bind(&gens)
            .bind(owner.as_str())
            .bind(sanitize_error_text(reason))
            .bind(self.schema().channel())
            .fetch_all(self.pool())
            .await?;
        Ok(rows.into_iter().map(|(id, _)| JobId(id)).collect())
    }
}
