//! Operator actions (hold, release a hold, cancel, retry a dead job), job lookup with
//! history, and the retention policy.
//!
//! Each action is one short transaction that locks the key row (if any) before the job
//! row, the order the promotion uses, so an action and a promotion cannot deadlock.
//! A worker's completion locks the other way round (its job row, then the key row), so
//! cancelling a running head at the very moment it completes can deadlock; PostgreSQL
//! then aborts one side (40P01), the executor retries its write, and the operator's
//! cancel returns the error to retry. Nothing is left half-done either way.

use std::time::Duration;

use sqlx::postgres::PgRow;
use sqlx::{Acquire, PgConnection, Row};

use super::{sanitize_error_text, secs, Store};
use crate::error::{Error, Result};
use crate::job::{Generation, JobEvent, JobId, JobRecord, JobState};

const JOB_COLUMNS: &str = "id, queue, kind, job_key, key_seq, priority, state, payload, result, attempts, \
     max_attempts, generation, owner, lease_until, available_at, created_at, finished_at, last_error, dead_blocks_key";

/// What the retention policy deleted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PruneReport {
    pub jobs: u64,
    pub effects: u64,
    pub keys: u64,
}

fn record_from_row(row: &PgRow) -> Result<JobRecord> {
    let state: String = row.try_get("state")?;
    Ok(JobRecord {
        id: JobId(row.try_get("id")?),
        queue: row.try_get("queue")?,
        kind: row.try_get("kind")?,
        key: row.try_get("job_key")?,
        key_seq: row.try_get("key_seq")?,
        priority: row.try_get("priority")?,
        state: JobState::parse(&state).ok_or(Error::Decode {
            what: "job state",
            reason: state.clone(),
        })?,
        payload: row.try_get("payload")?,
        result: row.try_get("result")?,
        attempts: row.try_get("attempts")?,
        max_attempts: row.try_get("max_attempts")?,
        generation: Generation(row.try_get("generation")?),
        owner: row.try_get("owner")?,
        lease_until: row.try_get("lease_until")?,
        available_at: row.try_get("available_at")?,
        created_at: row.try_get("created_at")?,
        finished_at: row.try_get("finished_at")?,
        last_error: row.try_get("last_error")?,
    })
}

impl Store {
    /// Look a job up.
    pub async fn job(&self, id: JobId) -> Result<JobRecord> {
        let sql = self.schema().render(&format!(
            "SELECT {JOB_COLUMNS} FROM {{s}}.jobs WHERE id = $1"
        ));
        let row = sqlx::query(&sql)
            .bind(id.0)
            .fetch_optional(self.pool())
            .await?;
        record_from_row(&row.ok_or(Error::JobNotFound(id))?)
    }

    /// A job's history, oldest first.
    pub async fn history(&self, id: JobId) -> Result<Vec<JobEvent>> {
        let sql = self.schema().render(
            "SELECT job_id, generation, event, owner, at, detail FROM {s}.job_events WHERE job_id = $1 ORDER BY id",
        );
        let rows = sqlx::query(&sql).bind(id.0).fetch_all(self.pool()).await?;
        rows.iter()
            .map(|r| {
                Ok(JobEvent {
                    job: JobId(r.try_get("job_id")?),
                    generation: Generation(r.try_get("generation")?),
                    event: r.try_get("event")?,
                    owner: r.try_get("owner")?,
                    at: r.try_get("at")?,
                    detail: r.try_get("detail")?,
                })
            })
            .collect()
    }

    /// Lock the job (and its key row first, if keyed) and return it.
    async fn lock_job(&self, conn: &mut PgConnection, id: JobId) -> Result<JobRecord> {
        let peek = self
            .schema()
            .render("SELECT queue, job_key FROM {s}.jobs WHERE id = $1");
        let (queue, key): (String, Option<String>) = sqlx::query_as(&peek)
            .bind(id.0)
            .fetch_optional(&mut *conn)
            .await?
            .ok_or(Error::JobNotFound(id))?;
        if let Some(key) = key {
            let lock = self
                .schema()
                .render("SELECT 1 FROM {s}.job_keys WHERE queue = $1 AND job_key = $2 FOR UPDATE");
            sqlx::query(&lock)
                .bind(&queue)
                .bind(&key)
                .execute(&mut *conn)
                .await?;
        }
        let sql = self.schema().render(&format!(
            "SELECT {JOB_COLUMNS} FROM {{s}}.jobs WHERE id = $1 FOR UPDATE"
        ));
        let row = sqlx::query(&sql).bind(id.0).fetch_one(&mut *conn).await?;
        record_from_row(&row)
    }

    async fn set_state(
        &self,
        conn: &mut PgConnection,
        job: &JobRecord,
        to: JobState,
        event: &str,
        detail: &str,
    ) -> Result<()> {
        let sql = self.schema().render(
            "WITH u AS (
                 UPDATE {s}.jobs
                 SET state = $2,
                     available_at = CASE WHEN $2 = 'pending' THEN greatest(available_at, now()) ELSE available_at END,
                     finished_at = CASE WHEN $2 IN ('done', 'dead', 'cancelled') THEN now() END,
                     lease_until = NULL,
                     last_error = CASE WHEN $2 = 'cancelled' THEN $4 ELSE last_error END
                 WHERE id = $1
                 RETURNING id, generation, queue, state)
             INSERT INTO {s}.job_events (job_id, generation, event, owner, at, detail)
             SELECT id, generation, $3, 'operator', now(), $4 FROM u",
        );
        sqlx::query(&sql)
            .bind(job.id.0)
            .bind(to.as_str())
            .bind(event)
            .bind(sanitize_error_text(detail))
            .execute(&mut *conn)
            .await?;
        if to == JobState::Pending {
            sqlx::query("SELECT pg_notify($1, left($2, 1000))")
                .bind(self.schema().channel())
                .bind(&job.queue)
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }

    /// Put a pending job on hold: it is not claimed until [`Store::release_hold`]. A held
    /// head blocks its key. Only pending jobs can be held (a waiting job is held by
    /// holding its key's head).
    pub async fn hold(&self, id: JobId) -> Result<()> {
        let mut conn = self.pool().acquire().await?;
        let mut tx = conn.begin().await?;
        let job = self.lock_job(&mut tx, id).await?;
        if job.state != JobState::Pending {
            // Roll back now, not on drop: a dropped transaction is rolled back only once
            // the pool takes the connection back, and until then the job and key rows
            // stay locked (a claim right after this refusal would skip the job).
            tx.rollback().await?;
            return Err(Error::InvalidTransition {
                id,
                state: job.state,
                action: "hold",
            });
        }
        self.set_state(&mut tx, &job, JobState::Held, "held", "held by operator")
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Release a hold: the job is pending again.
    pub async fn release_hold(&self, id: JobId) -> Result<()> {
        let mut conn = self.pool().acquire().await?;
        let mut tx = conn.begin().await?;
        let job = self.lock_job(&mut tx, id).await?;
        if job.state != JobState::Held {
            tx.rollback().await?;
            return Err(Error::InvalidTransition {
                id,
                state: job.state,
                action: "release a hold",
            });
        }
        self.set_state(
            &mut tx,
            &job,
            JobState::Pending,
            "unheld",
            "released by operator",
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Cancel a job that has not finished. A running job's worker finds its fence gone
    /// (its renewal and completion come back stale). If the job was its key's head, the
    /// next job of the key is promoted.
    pub async fn cancel(&self, id: JobId, reason: &str) -> Result<()> {
        let mut conn = self.pool().acquire().await?;
        let mut tx = conn.begin().await?;
        let job = self.lock_job(&mut tx, id).await?;
        if matches!(job.state, JobState::Done | JobState::Cancelled) {
            tx.rollback().await?;
            return Err(Error::InvalidTransition {
                id,
                state: job.state,
                action: "cancel",
            });
        }
        let left_key_already =
            job.state == JobState::Dead && !self.dead_blocks_key(&mut tx, id).await?;
        self.set_state(
            &mut tx,
            &job,
            JobState::Cancelled,
            "cancelled",
            &format!("cancelled by operator: {reason}"),
        )
        .await?;
        if let (Some(key), false) = (job.key.clone(), left_key_already) {
            let keys = [(job.queue.clone(), key)];
            if job.state == JobState::Waiting {
                self.leave_keys(&mut tx, &keys).await?;
            } else {
                self.end_heads(&mut tx, &keys).await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }

    /// Retry a dead job from a fresh attempt count. A job that blocked its key resumes
    /// as the head; one whose key moved on (Continue policy) re-enters at the key's end.
    pub async fn retry_dead(&self, id: JobId) -> Result<()> {
        let mut conn = self.pool().acquire().await?;
        let mut tx = conn.begin().await?;
        let job = self.lock_job(&mut tx, id).await?;
        if job.state != JobState::Dead {
            tx.rollback().await?;
            return Err(Error::InvalidTransition {
                id,
                state: job.state,
                action: "retry",
            });
        }
        let mut to = JobState::Pending;
        if let (Some(key), false) = (&job.key, self.dead_blocks_key(&mut tx, id).await?) {
            let sql = self.schema().render(
                "UPDATE {s}.job_keys SET next_seq = next_seq + 1, open_jobs = open_jobs + 1
                 WHERE queue = $1 AND job_key = $2 RETURNING next_seq, open_jobs",
            );
            let (seq, open): (i64, i64) = sqlx::query_as(&sql)
                .bind(&job.queue)
                .bind(key)
                .fetch_one(&mut *tx)
                .await?;
            let resequence = self
                .schema()
                .render("UPDATE {s}.jobs SET key_seq = $2 WHERE id = $1");
            sqlx::query(&resequence)
                .bind(id.0)
                .bind(seq)
                .execute(&mut *tx)
                .await?;
            if open > 1 {
                to = JobState::Waiting;
            }
        }
        let reset = self
            .schema()
            .render("UPDATE {s}.jobs SET attempts = 0 WHERE id = $1");
        sqlx::query(&reset).bind(id.0).execute(&mut *tx).await?;
        self.set_state(
            &mut tx,
            &job,
            to,
            "retried_by_operator",
            "retried by operator",
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn dead_blocks_key(&self, conn: &mut PgConnection, id: JobId) -> Result<bool> {
        let sql = self
            .schema()
            .render("SELECT dead_blocks_key FROM {s}.jobs WHERE id = $1");
        Ok(sqlx::query_scalar(&sql)
            .bind(id.0)
            .fetch_one(&mut *conn)
            .await?)
    }

    /// The retention policy: delete terminal jobs (with their history and expiry
    /// records) that finished more than `keep` ago, effect-ledger rows past their
    /// `keep_until`, and key rows with no open job. At most `limit` jobs per call.
    pub async fn prune(&self, keep: Duration, limit: i64) -> Result<PruneReport> {
        let jobs_sql = self.schema().render(
            "WITH gone AS (
                 DELETE FROM {s}.jobs WHERE id IN (
                     SELECT id FROM {s}.jobs
                     WHERE finished_at < now() - make_interval(secs => $1)
                       AND state IN ('done', 'dead', 'cancelled')
                     ORDER BY finished_at LIMIT $2)
                 RETURNING id),
             ev AS (DELETE FROM {s}.job_events WHERE job_id IN (SELECT id FROM gone)),
             le AS (DELETE FROM {s}.lease_expiries WHERE job_id IN (SELECT id FROM gone))
             SELECT count(*) FROM gone",
        );
        let jobs: i64 = sqlx::query_scalar(&jobs_sql)
            .bind(secs(keep))
            .bind(limit)
            .fetch_one(self.pool())
            .await?;
        let effects = sqlx::query(
            &self
                .schema()
                .render("DELETE FROM {s}.effects WHERE keep_until < now()"),
        )
        .execute(self.pool())
        .await?
        .rows_affected();
        let keys = sqlx::query(
            &self
                .schema()
                .render("DELETE FROM {s}.job_keys WHERE open_jobs = 0"),
        )
        .execute(self.pool())
        .await?
        .rows_affected();
        Ok(PruneReport {
            jobs: jobs as u64,
            effects,
            keys,
        })
    }
}
