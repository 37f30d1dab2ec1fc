//! Operator actions (hold, release a hold, cancel, retry a dead job), and job lookup with
//! history. Retention is `retention.rs`.
//!
//! Each action is one short transaction that locks the key row (if any) before the job
//! row, the order completions, failures and promotions use too, so they cannot
//! deadlock.
//!
//! # Cancel of a running job
//!
//! A request, not a transition: the job stays `running` with `cancel_requested_at` set,
//! and its owner is told at once (NOTIFY on the schema's cancel channel, and again by
//! its next renewal). Its key does not move on until that attempt has ended: a
//! completion makes it done (the work happened), a failure or release makes it
//! cancelled, and if the owner is gone its lease expires and the reaper cancels it.
//! Promoting the successor at once would let two attempts of one key run together.

use sqlx::postgres::PgRow;
use sqlx::{Acquire, PgConnection, Row};

use super::operator::OPERATOR;
use super::{sanitize_error_text, Store};
use crate::error::{Error, Result};
use crate::job::{Generation, JobEvent, JobId, JobRecord, JobState};

pub(super) const JOB_COLUMNS: &str = "id, queue, kind, job_key, key_seq, priority, state, payload, result, attempts, \
     max_attempts, generation, owner, lease_until, available_at, created_at, finished_at, last_error, \
     dead_blocks_key, cancel_requested_at, snoozes, progress";

/// What [`Store::cancel`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CancelOutcome {
    /// The job was not running: it is cancelled now (a head's key moved on).
    Cancelled,
    /// The job is running (or claimed ahead, waiting in its process for a slot): its
    /// owner was asked to stop. It stays running until that attempt ends (done if it
    /// completes, cancelled otherwise, or cancelled by the reaper when its lease
    /// expires); its key moves on only then. A claimed-ahead job whose process has heard
    /// of the cancel never starts; one whose slot freed just before runs as a running
    /// job does.
    Requested,
}

/// A job row for an operator. Any row can be shown: a payload or result that cannot be
/// decoded comes back as null with the reason in `payload_error`, so a poison job can
/// still be looked at and cancelled.
pub(super) fn record_from_row(row: &PgRow) -> Result<JobRecord> {
    let state: String = row.try_get("state")?;
    let mut errors = Vec::new();
    let mut json = |column: &str| match row.try_get::<Option<serde_json::Value>, _>(column) {
        Ok(v) => v,
        Err(e) => {
            errors.push(format!("{column} cannot be decoded: {e}"));
            Some(serde_json::Value::Null)
        }
    };
    let payload = json("payload").unwrap_or(serde_json::Value::Null);
    let result = json("result");
    let progress = json("progress");
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
        payload,
        payload_error: (!errors.is_empty()).then(|| errors.join("; ")),
        result,
        attempts: row.try_get("attempts")?,
        max_attempts: row.try_get("max_attempts")?,
        snoozes: row.try_get("snoozes")?,
        progress,
        generation: Generation(row.try_get("generation")?),
        owner: row.try_get("owner")?,
        lease_until: row.try_get("lease_until")?,
        available_at: row.try_get("available_at")?,
        created_at: row.try_get("created_at")?,
        finished_at: row.try_get("finished_at")?,
        last_error: row.try_get("last_error")?,
        cancel_requested_at: row.try_get("cancel_requested_at")?,
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
            .fetch_optional(self.db())
            .await?;
        record_from_row(&row.ok_or(Error::JobNotFound(id))?)
    }

    /// A job's history, oldest first.
    pub async fn history(&self, id: JobId) -> Result<Vec<JobEvent>> {
        let sql = self.schema().render(
            "SELECT job_id, generation, event, owner, at, detail FROM {s}.job_events WHERE job_id = $1 ORDER BY id",
        );
        let rows = sqlx::query(&sql).bind(id.0).fetch_all(self.db()).await?;
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
            .fetch_optional(self.on(&mut *conn))
            .await?
            .ok_or(Error::JobNotFound(id))?;
        if let Some(key) = key {
            let lock = self
                .schema()
                .render("SELECT 1 FROM {s}.job_keys WHERE queue = $1 AND job_key = $2 FOR UPDATE");
            sqlx::query(&lock)
                .bind(&queue)
                .bind(&key)
                .execute(self.on(&mut *conn))
                .await?;
        }
        let sql = self.schema().render(&format!(
            "SELECT {JOB_COLUMNS} FROM {{s}}.jobs WHERE id = $1 FOR UPDATE"
        ));
        let row = sqlx::query(&sql)
            .bind(id.0)
            .fetch_one(self.on(&mut *conn))
            .await?;
        record_from_row(&row)
    }

    async fn set_state(
        &self,
        conn: &mut PgConnection,
        job: &JobRecord,
        to: JobState,
        event: &str,
        detail: &str,
        by: &str,
    ) -> Result<()> {
        let sql = self.schema().render(
            "WITH u AS (
                 UPDATE {s}.jobs
                 SET state = $2,
                     available_at = CASE WHEN $2 = 'pending' THEN greatest(available_at, clock_timestamp()) ELSE available_at END,
                     finished_at = CASE WHEN $2 IN ('done', 'dead', 'cancelled') THEN clock_timestamp() END,
                     lease_until = NULL,
                     last_error = CASE WHEN $2 = 'cancelled' THEN $4 ELSE last_error END
                 WHERE id = $1
                 RETURNING id, generation, queue, state)
             INSERT INTO {s}.job_events (job_id, generation, event, owner, at, detail)
             SELECT id, generation, $3, $5, clock_timestamp(), $4 FROM u",
        );
        sqlx::query(&sql)
            .bind(job.id.0)
            .bind(to.as_str())
            .bind(event)
            .bind(sanitize_error_text(detail))
            .bind(sanitize_error_text(by))
            .execute(self.on(&mut *conn))
            .await?;
        if to == JobState::Pending {
            sqlx::query("SELECT pg_notify($1, left($2, 1000))")
                .bind(self.schema().channel())
                .bind(&job.queue)
                .execute(self.on(&mut *conn))
                .await?;
        }
        Ok(())
    }

    /// Put a pending job on hold: it is not claimed until [`Store::release_hold`]. A held
    /// head blocks its key. Only pending jobs can be held (a waiting job is held by
    /// holding its key's head).
    ///
    /// Errors: [`Error::JobNotFound`], or [`Error::InvalidTransition`] when the job is
    /// not pending (nothing changed).
    ///
    /// ```no_run
    /// # async fn example(scheduler: leasehold::Scheduler) -> leasehold::Result<()> {
    /// use leasehold::{Error, JobId};
    ///
    /// let store = scheduler.store(); // or a Store of your own over the same schema
    /// let id = JobId(42);
    /// match store.hold(id).await {
    ///     Ok(()) => println!("job {id} is held"),
    ///     // Already claimed, finished, or waiting behind its key: say so, change nothing.
    ///     Err(Error::InvalidTransition { state, .. }) => println!("job {id} is {state}"),
    ///     Err(e) => return Err(e),
    /// }
    /// // ... look into it, then let it run again:
    /// store.release_hold(id).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn hold(&self, id: JobId) -> Result<()> {
        self.hold_by(id, OPERATOR).await
    }

    /// [`Store::hold`], recording `by` (who did it: a person, a tool) in the history.
    pub async fn hold_by(&self, id: JobId, by: &str) -> Result<()> {
        let mut conn = self.acquire().await?;
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
        self.set_state(
            &mut tx,
            &job,
            JobState::Held,
            "held",
            "held by operator",
            by,
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Release a hold: the job is pending again, claimable from its `available_at` (or
    /// at once if that has passed). Errors: [`Error::JobNotFound`], or
    /// [`Error::InvalidTransition`] when the job is not held. See [`Store::hold`] for an
    /// example.
    pub async fn release_hold(&self, id: JobId) -> Result<()> {
        self.release_hold_by(id, OPERATOR).await
    }

    /// [`Store::release_hold`], recording `by` in the history.
    pub async fn release_hold_by(&self, id: JobId, by: &str) -> Result<()> {
        let mut conn = self.acquire().await?;
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
            by,
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Cancel a job that has not finished. A job that is not running is cancelled at
    /// once (a head's key moves on to its next job). A running job is asked to stop:
    /// see the module docs and [`CancelOutcome::Requested`]. A dead job can be cancelled
    /// too (taking it out of the dead-letter queue and unblocking its key).
    ///
    /// `reason` is stored in the job's `last_error` and history. Errors:
    /// [`Error::JobNotFound`], or [`Error::InvalidTransition`] when the job is already
    /// done or cancelled.
    ///
    /// ```no_run
    /// # async fn example(store: leasehold::Store) -> leasehold::Result<()> {
    /// use leasehold::{CancelOutcome, JobId};
    ///
    /// match store.cancel(JobId(42), "customer closed the account").await? {
    ///     CancelOutcome::Cancelled => println!("cancelled"),
    ///     // It was running: its handler is told to stop. It ends cancelled, or done if
    ///     // that attempt completes anyway; watch its state to see which.
    ///     CancelOutcome::Requested => println!("asked the running attempt to stop"),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn cancel(&self, id: JobId, reason: &str) -> Result<CancelOutcome> {
        self.cancel_by(id, reason, OPERATOR).await
    }

    /// [`Store::cancel`], recording `by` in the history.
    pub async fn cancel_by(&self, id: JobId, reason: &str, by: &str) -> Result<CancelOutcome> {
        let mut conn = self.acquire().await?;
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
        let detail = format!("cancelled by operator: {reason}");
        if job.state == JobState::Running {
            if job.cancel_requested_at.is_none() {
                self.request_cancel(&mut tx, &job, &detail, by).await?;
            }
            tx.commit().await?;
            return Ok(CancelOutcome::Requested);
        }
        let left_key_already =
            job.state == JobState::Dead && !self.dead_blocks_key(&mut tx, id).await?;
        self.set_state(&mut tx, &job, JobState::Cancelled, "cancelled", &detail, by)
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
        Ok(CancelOutcome::Cancelled)
    }

    /// Mark a running job for cancellation and tell its owner (NOTIFY, delivered at
    /// commit; the owner's next renewal says it too, should the notification be lost).
    async fn request_cancel(
        &self,
        conn: &mut PgConnection,
        job: &JobRecord,
        detail: &str,
        by: &str,
    ) -> Result<()> {
        let sql = self.schema().render(
            "WITH u AS (
                 UPDATE {s}.jobs SET cancel_requested_at = clock_timestamp(), last_error = $2
                 WHERE id = $1 RETURNING id, generation)
             INSERT INTO {s}.job_events (job_id, generation, event, owner, at, detail)
             SELECT id, generation, 'cancel_requested', $3, clock_timestamp(), $2 FROM u",
        );
        sqlx::query(&sql)
            .bind(job.id.0)
            .bind(sanitize_error_text(detail))
            .bind(sanitize_error_text(by))
            .execute(self.on(&mut *conn))
            .await?;
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(self.schema().cancel_channel())
            .bind(job.id.0.to_string())
            .execute(self.on(&mut *conn))
            .await?;
        Ok(())
    }

    /// Retry a dead job from a fresh attempt count. A job that blocked its key resumes
    /// as the head; one whose key moved on (Continue policy) re-enters at the key's end.
    /// Errors: [`Error::JobNotFound`], or [`Error::InvalidTransition`] when the job is
    /// not dead.
    ///
    /// ```no_run
    /// # async fn example(store: leasehold::Store) -> leasehold::Result<()> {
    /// use leasehold::store::JobFilter;
    /// use leasehold::JobState;
    ///
    /// // Retry every dead job of one queue, a page at a time (the dead-letter queue).
    /// let mut filter = JobFilter {
    ///     queue: Some("payments".into()),
    ///     state: Some(JobState::Dead),
    ///     ..JobFilter::default()
    /// };
    /// loop {
    ///     let page = store.list_jobs(&filter).await?;
    ///     for job in &page {
    ///         println!("retrying {} after: {:?}", job.id, job.last_error);
    ///         store.retry_dead(job.id).await?;
    ///     }
    ///     match page.last() {
    ///         Some(last) if page.len() as i64 == filter.limit => filter.after = Some(last.id),
    ///         _ => break,
    ///     }
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn retry_dead(&self, id: JobId) -> Result<()> {
        self.retry_dead_by(id, OPERATOR).await
    }

    /// [`Store::retry_dead`], recording `by` in the history.
    pub async fn retry_dead_by(&self, id: JobId, by: &str) -> Result<()> {
        let mut conn = self.acquire().await?;
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
                .fetch_one(self.on(&mut tx))
                .await?;
            let resequence = self
                .schema()
                .render("UPDATE {s}.jobs SET key_seq = $2 WHERE id = $1");
            sqlx::query(&resequence)
                .bind(id.0)
                .bind(seq)
                .execute(self.on(&mut tx))
                .await?;
            if open > 1 {
                to = JobState::Waiting;
            }
        }
        let reset = self
            .schema()
            .render("UPDATE {s}.jobs SET attempts = 0 WHERE id = $1");
        sqlx::query(&reset)
            .bind(id.0)
            .execute(self.on(&mut tx))
            .await?;
        self.set_state(
            &mut tx,
            &job,
            to,
            "retried_by_operator",
            "retried by operator",
            by,
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
            .fetch_one(self.on(&mut *conn))
            .await?)
    }
}
