//! Enqueue: one job or many in one statement, on the pool or in the caller's transaction.
//!
//! A keyed job takes its `key_seq` from the key's row in `job_keys`, updated with
//! `INSERT .. ON CONFLICT DO UPDATE`, which holds that row's lock until the enqueueing
//! transaction ends. Two concurrent enqueues of one key therefore get their sequence
//! numbers in commit order. The first open job of a key is `pending` (the head), the
//! rest `waiting`.

use sqlx::PgConnection;

use super::{secs, Store};
use crate::error::{Error, Result};
use crate::job::{DeadKeyPolicy, JobId, NewJob};

pub(super) const ENQUEUE: &str = r#"/* leasehold:enqueue */
WITH input AS (
    SELECT row_number() OVER () AS ord, t.*
    FROM unnest($1::text[], $2::text[], $3::text[], $4::int2[], $5::timestamptz[],
                $6::float8[], $7::int4[], $8::jsonb[], $9::int4[], $10::bool[])
      AS t(queue, kind, job_key, priority, run_at, delay_secs, max_attempts, payload,
           payload_bytes, dead_blocks_key)
), keyed AS (
    SELECT queue, job_key, count(*) AS n
    FROM input WHERE job_key IS NOT NULL
    GROUP BY queue, job_key
    ORDER BY queue, job_key
), k AS (
    INSERT INTO {s}.job_keys AS jk (queue, job_key, next_seq, open_jobs)
    SELECT queue, job_key, n, n FROM keyed
    ON CONFLICT (queue, job_key) DO UPDATE
        SET next_seq = jk.next_seq + excluded.next_seq,
            open_jobs = jk.open_jobs + excluded.open_jobs
    RETURNING queue, job_key, next_seq, open_jobs
), numbered AS (
    SELECT i.*, row_number() OVER (PARTITION BY i.queue, i.job_key ORDER BY i.ord) AS nth
    FROM input i
), ins AS (
    INSERT INTO {s}.jobs (queue, kind, job_key, key_seq, priority, state, payload,
                          payload_bytes, max_attempts, available_at, dead_blocks_key)
    SELECT n.queue, n.kind, n.job_key,
           CASE WHEN n.job_key IS NULL THEN NULL ELSE k.next_seq - kd.n + n.nth END,
           n.priority,
           CASE WHEN n.job_key IS NULL THEN 'pending'
                WHEN k.open_jobs - kd.n = 0 AND n.nth = 1 THEN 'pending'
                ELSE 'waiting' END,
           n.payload, n.payload_bytes, n.max_attempts,
           coalesce(n.run_at, now() + make_interval(secs => coalesce(n.delay_secs, 0))),
           n.dead_blocks_key
    FROM numbered n
    LEFT JOIN k ON k.queue = n.queue AND k.job_key = n.job_key
    LEFT JOIN keyed kd ON kd.queue = n.queue AND kd.job_key = n.job_key
    ORDER BY n.ord
    RETURNING id, queue, state
)
SELECT id,
       (SELECT count(pg_notify($11, left(q.queue, 1000)))
          FROM (SELECT DISTINCT queue FROM ins WHERE state = 'pending') q) AS notified
FROM ins
ORDER BY id"#;

/// The columns of a batch, as arrays for `unnest`.
#[derive(Default)]
struct Columns {
    queue: Vec<String>,
    kind: Vec<String>,
    key: Vec<Option<String>>,
    priority: Vec<i16>,
    run_at: Vec<Option<chrono::DateTime<chrono::Utc>>>,
    delay: Vec<Option<f64>>,
    max_attempts: Vec<i32>,
    payload: Vec<serde_json::Value>,
    payload_bytes: Vec<i32>,
    dead_blocks_key: Vec<bool>,
}

/// Refuse what PostgreSQL text cannot store. Everything else (quotes, SQL, non-ASCII,
/// long strings) is stored unchanged: values are always bound parameters.
pub(crate) fn check_name(field: &'static str, value: &str) -> Result<()> {
    if value.is_empty() {
        return Err(Error::InvalidInput {
            field,
            reason: "must not be empty".into(),
        });
    }
    if value.contains('\0') {
        return Err(Error::InvalidInput {
            field,
            reason: "contains a NUL byte, which PostgreSQL text cannot store".into(),
        });
    }
    Ok(())
}

/// A NUL character in any string or object key of the payload.
fn contains_nul(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::String(s) => s.contains('\0'),
        serde_json::Value::Array(items) => items.iter().any(contains_nul),
        serde_json::Value::Object(map) => {
            map.iter().any(|(k, v)| k.contains('\0') || contains_nul(v))
        }
        _ => false,
    }
}

impl Store {
    /// The checks every enqueue path makes (one statement, many, or COPY), before the
    /// job is written. The payload's JSON encoding, as sized against the cap, is left in
    /// `encoded` (cleared first); returns the job's max attempts.
    pub(super) fn check_job(&self, job: &NewJob, encoded: &mut Vec<u8>) -> Result<i32> {
        check_name("queue", &job.queue)?;
        check_name("kind", &job.kind)?;
        if let Some(key) = &job.key {
            check_name("key", key)?;
        }
        let max_attempts = job
            .max_attempts
            .unwrap_or(self.options().default_max_attempts);
        if max_attempts < 1 {
            return Err(Error::InvalidInput {
                field: "max_attempts",
                reason: format!("must be at least 1, got {max_attempts}"),
            });
        }
        encoded.clear();
        serde_json::to_writer(&mut *encoded, &job.payload)
            .map_err(|e| Error::InvalidPayload(e.to_string()))?;
        let limit = self.options().max_payload_bytes;
        if encoded.len() > limit {
            return Err(Error::PayloadTooLarge {
                size: encoded.len(),
                limit,
            });
        }
        // jsonb refuses \u0000; say so before the database does, in our words. Look
        // at the values, not the encoded text: there an escaped backslash followed by
        // "u0000" (no NUL at all) looks the same.
        if contains_nul(&job.payload) {
            return Err(Error::InvalidPayload(
                "a string contains NUL (\\u0000), which PostgreSQL jsonb cannot store".into(),
            ));
        }
        Ok(max_attempts)
    }

    fn columns(&self, jobs: Vec<NewJob>) -> Result<Columns> {
        let mut c = Columns::default();
        let mut encoded = Vec::new();
        for job in jobs {
            let max_attempts = self.check_job(&job, &mut encoded)?;
            c.queue.push(job.queue);
            c.kind.push(job.kind);
            c.key.push(job.key);
            c.priority.push(job.priority);
            c.run_at.push(job.run_at);
            c.delay.push(job.delay.map(secs));
            c.max_attempts.push(max_attempts);
            c.payload.push(job.payload);
            c.payload_bytes.push(encoded.len() as i32);
            c.dead_blocks_key
                .push(job.dead_key_policy == DeadKeyPolicy::Block);
        }
        Ok(c)
    }

    /// Enqueue one job in its own transaction.
    pub async fn enqueue(&self, job: NewJob) -> Result<JobId> {
        let mut conn = self.pool().acquire().await?;
        self.enqueue_in(&mut conn, job).await
    }

    /// Enqueue one job inside the caller's transaction: if it rolls back, the job never
    /// existed. Wake-ups (NOTIFY) are delivered at commit.
    pub async fn enqueue_in(&self, conn: &mut PgConnection, job: NewJob) -> Result<JobId> {
        let ids = self.enqueue_many_in(conn, vec![job]).await?;
        Ok(ids[0])
    }

    /// Enqueue many jobs with one statement. Ids come back in input order. All or none:
    /// one invalid job refuses the whole batch before anything is written.
    pub async fn enqueue_many(&self, jobs: Vec<NewJob>) -> Result<Vec<JobId>> {
        let mut conn = self.pool().acquire().await?;
        self.enqueue_many_in(&mut conn, jobs).await
    }

    /// [`Store::enqueue_many`] inside the caller's transaction.
    pub async fn enqueue_many_in(
        &self,
        conn: &mut PgConnection,
        jobs: Vec<NewJob>,
    ) -> Result<Vec<JobId>> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let c = self.columns(jobs)?;
        let rows: Vec<(i64, i64)> = sqlx::query_as(&self.sql().enqueue)
            .bind(&c.queue)
            .bind(&c.kind)
            .bind(&c.key)
            .bind(&c.priority)
            .bind(&c.run_at)
            .bind(&c.delay)
            .bind(&c.max_attempts)
            .bind(&c.payload)
            .bind(&c.payload_bytes)
            .bind(&c.dead_blocks_key)
            .bind(self.schema().channel())
            .fetch_all(&mut *conn)
            .await?;
        Ok(rows.into_iter().map(|(id, _)| JobId(id)).collect())
    }
}
