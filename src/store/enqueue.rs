//! Enqueue: one job or many in one statement, on the pool or in the caller's transaction.
//!
//! A keyed job takes its `key_seq` from the key's row in `job_keys`, updated with
//! `INSERT .. ON CONFLICT DO UPDATE`, which holds that row's lock until the enqueueing
//! transaction ends. Two concurrent enqueues of one key therefore get their sequence
//! numbers in commit order. The first open job of a key is `pending` (the head), the
//! rest `waiting`.

use chrono::Datelike;
use sqlx::{Acquire, PgConnection};

use super::input::IndexedText;
use super::unique::{Resolution, Window};
use super::{check_name, exec, secs, unstorable_json, Store, MAX_PAYLOAD_DEPTH};
use crate::error::{Error, Result};
use crate::job::{DeadKeyPolicy, Enqueued, JobId, NewJob};

pub(super) const ENQUEUE: &str = r#"/* leasehold:enqueue */
WITH input AS (
    SELECT row_number() OVER () AS ord, t.*
    FROM unnest($1::text[], $2::text[], $3::text[], $4::int2[], $5::timestamptz[],
                $6::float8[], $7::int4[], $8::jsonb[], $9::int4[], $10::bool[],
                $12::text[], $13::timestamptz[], $14::bool[])
      AS t(queue, kind, job_key, priority, run_at, delay_secs, max_attempts, payload,
           payload_bytes, dead_blocks_key, unique_key, unique_until, unique_forever)
), keyed AS (
    SELECT queue, job_key, count(*) AS n, __SLOT__ AS slot
    FROM input WHERE job_key IS NOT NULL
    GROUP BY queue, job_key
), floors AS MATERIALIZED (
    SELECT slot, floor FROM {s}.key_floors
    WHERE slot IN (SELECT slot FROM keyed)
    ORDER BY slot
    FOR SHARE
), k AS (
    INSERT INTO {s}.job_keys AS jk (queue, job_key, next_seq, open_jobs)
    SELECT kd.queue, kd.job_key, f.floor + kd.n, kd.n
    FROM keyed kd JOIN floors f ON f.slot = kd.slot
    ORDER BY kd.queue, kd.job_key
    ON CONFLICT (queue, job_key) DO UPDATE
        SET next_seq = jk.next_seq + excluded.open_jobs,
            open_jobs = jk.open_jobs + excluded.open_jobs
    RETURNING queue, job_key, next_seq, open_jobs
), numbered AS (
    SELECT i.*, row_number() OVER (PARTITION BY i.queue, i.job_key ORDER BY i.ord) AS nth
    FROM input i
), ins AS (
    INSERT INTO {s}.jobs (queue, kind, job_key, key_seq, priority, state, payload,
                          payload_bytes, max_attempts, available_at, created_at, dead_blocks_key,
                          unique_key, unique_until)
    SELECT n.queue, n.kind, n.job_key,
           CASE WHEN n.job_key IS NULL THEN NULL ELSE k.next_seq - kd.n + n.nth END,
           n.priority,
           CASE WHEN n.job_key IS NULL THEN 'pending'
                WHEN k.open_jobs - kd.n = 0 AND n.nth = 1 THEN 'pending'
                ELSE 'waiting' END,
           n.payload, n.payload_bytes, n.max_attempts,
           coalesce(n.run_at, statement_timestamp() + make_interval(secs => coalesce(n.delay_secs, 0))),
           statement_timestamp(),
           n.dead_blocks_key, n.unique_key,
           CASE WHEN n.unique_forever THEN 'infinity'::timestamptz ELSE n.unique_until END
    FROM numbered n
    LEFT JOIN k ON k.queue = n.queue AND k.job_key = n.job_key
    LEFT JOIN keyed kd ON kd.queue = n.queue AND kd.job_key = n.job_key
    ORDER BY n.ord
    RETURNING id, queue, state
)
SELECT id,
       (SELECT count(pg_notify($11, left(q.queue, 1000)))
          FROM (SELECT DISTINCT queue FROM ins WHERE state = 'pending' AND $11::text IS NOT NULL) q) AS notified,
       CASE WHEN state = 'pending' THEN queue END AS wake
FROM ins
ORDER BY id"#;

/// The latest `run_at` any enqueue path accepts: PostgreSQL stores later times, but the
/// COPY path's text format and most clients do not, and one rule holds for every path.
pub(crate) fn latest_run_at() -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::parse_from_rfc3339("9999-12-31T23:59:59Z")
        .expect("a valid constant")
        .with_timezone(&chrono::Utc)
}

/// The longest delay accepted: 100 years.
pub const MAX_DELAY: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 24 * 3600);

/// What the checks of a job found, for its columns.
#[derive(Clone, Copy)]
struct Checked {
    max_attempts: i32,
    priority: i16,
    /// Bytes of the payload's JSON encoding.
    payload_bytes: i32,
}

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
    unique_key: Vec<Option<String>>,
    unique_until: Vec<Option<chrono::DateTime<chrono::Utc>>>,
    unique_forever: Vec<bool>,
}

impl Store {
    /// The checks every enqueue path makes (one statement, many, or COPY), before the
    /// job is written. The payload's JSON encoding, as sized against the cap, is left in
    /// `encoded` (cleared first); returns the job's max attempts and priority: its own,
    /// else its kind's policy where this store knows it (see [`Store::kind_policy`]),
    /// else the store's default.
    pub(crate) fn check_job(&self, job: &NewJob, encoded: &mut Vec<u8>) -> Result<(i32, i16)> {
        check_name("queue", job.queue_name())?;
        check_name("kind", &job.kind)?;
        if let Some(key) = &job.key {
            check_name("key", key)?;
        }
        super::unique::check_unique(job)?;
        let policy = self.kind_policy(&job.kind);
        let max_attempts = job
            .max_attempts
            .or(policy.and_then(|p| p.max_attempts))
            .unwrap_or(self.options().default_max_attempts);
        let priority = job
            .priority
            .or(policy.and_then(|p| p.priority))
            .unwrap_or(0);
        if max_attempts < 1 {
            return Err(Error::InvalidInput {
                field: "max_attempts",
                reason: format!("must be at least 1, got {max_attempts}"),
            });
        }
        // Say so before the database does, in our words. Look at the values, not the
        // encoded text: there an escaped backslash followed by "u0000" (no NUL at all)
        // looks the same. And walk before encoding: the encoder recurses, and a payload
        // 10,000 levels deep would overflow this thread's stack.
        if let Some(reason) = unstorable_json(&job.payload, MAX_PAYLOAD_DEPTH) {
            return Err(Error::InvalidPayload(reason));
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
        if let Some(at) = job.run_at {
            if at > latest_run_at() || at.year() < 1 {
                return Err(Error::InvalidInput {
                    field: "run_at",
                    reason: format!("{at} is outside years 1 to 9999"),
                });
            }
        }
        if let Some(delay) = job.delay {
            if delay > MAX_DELAY {
                return Err(Error::InvalidInput {
                    field: "delay",
                    reason: format!(
                        "{} is longer than the longest delay accepted (100 years)",
                        humantime::format_duration(delay)
                    ),
                });
            }
        }
        Ok((max_attempts, priority))
    }

    /// [`Store::check_job`] of every job, before any statement: each job's max attempts
    /// and payload size.
    fn check_all(&self, jobs: &[NewJob]) -> Result<Vec<Checked>> {
        let mut encoded = Vec::new();
        jobs.iter()
            .map(|job| {
                let (max_attempts, priority) = self.check_job(job, &mut encoded)?;
                Ok(Checked {
                    max_attempts,
                    priority,
                    payload_bytes: encoded.len() as i32,
                })
            })
            .collect()
    }

    /// The statement's columns, of checked jobs with their unique windows (see
    /// `store::unique`), in order.
    fn columns(&self, jobs: Vec<(NewJob, Checked, Window)>) -> Columns {
        let mut c = Columns::default();
        for (job, checked, window) in jobs {
            let (until, forever) = window.params();
            c.unique_key
                .push(job.unique.as_ref().map(|u| u.key.clone()));
            c.unique_until.push(until);
            c.unique_forever.push(forever);
            c.queue.push(job.queue_name().to_string());
            c.kind.push(job.kind);
            c.key.push(job.key);
            c.priority.push(checked.priority);
            c.run_at.push(job.run_at);
            c.delay.push(job.delay.map(secs));
            c.max_attempts.push(checked.max_attempts);
            c.payload.push(job.payload);
            c.payload_bytes.push(checked.payload_bytes);
            c.dead_blocks_key
                .push(job.dead_key_policy == DeadKeyPolicy::Block);
        }
        c
    }

    /// Enqueue one job in its own transaction. A duplicate of a unique job
    /// ([`NewJob::unique`]) returns the existing job's id; [`Store::enqueue_outcome`]
    /// also says whether it was one.
    pub async fn enqueue(&self, job: NewJob) -> Result<JobId> {
        Ok(self.enqueue_outcome(job).await?.id)
    }

    /// [`Store::enqueue`], saying whether the job was a duplicate of an existing one.
    ///
    /// ```no_run
    /// # async fn demo(store: leasehold::Store) -> leasehold::Result<()> {
    /// use leasehold::{NewJob, UniqueScope};
    /// let charge = || {
    ///     NewJob::from_json("charge", serde_json::json!({"order": 42}))
    ///         .unique("order-42", UniqueScope::Forever)
    /// };
    /// let first = store.enqueue_outcome(charge()).await?;
    /// let again = store.enqueue_outcome(charge()).await?;
    /// assert!(!first.duplicate && again.duplicate && again.id == first.id);
    /// # Ok(()) }
    /// ```
    pub async fn enqueue_outcome(&self, job: NewJob) -> Result<Enqueued> {
        Ok(self.enqueue_many_outcomes(vec![job]).await?[0])
    }

    /// Enqueue one job inside the caller's transaction: if it rolls back, the job never
    /// existed. Wake-ups (NOTIFY) are delivered at commit. A unique job's key stays
    /// locked until then (a concurrent enqueuer of the same key waits for this
    /// transaction).
    ///
    /// A refused job leaves the caller's transaction usable, with nothing of the job
    /// written: every check is made before the first statement is sent (names, payload,
    /// attempts, times; see [`Error::InvalidInput`] and [`Error::InvalidPayload`]), and
    /// what only PostgreSQL can judge — whether text longer than
    /// [`INDEXED_TEXT_ALWAYS_FITS`](crate::store::INDEXED_TEXT_ALWAYS_FITS) bytes
    /// compresses into an index entry — is written in a savepoint, whose refusal comes
    /// back as [`Error::InvalidInput`] naming the field. A failure that is not the job's
    /// (a lost connection, a lock timeout or deadlock the caller's own settings allow)
    /// aborts the caller's transaction as any of its statements would.
    pub async fn enqueue_in(&self, conn: &mut PgConnection, job: NewJob) -> Result<JobId> {
        let ids = self.enqueue_many_in(conn, vec![job]).await?;
        Ok(ids[0])
    }

    /// Enqueue many jobs with one statement. Ids come back in input order (a
    /// duplicate's is the existing job's). All or none: one invalid job refuses the
    /// whole batch before anything is written.
    ///
    /// Its own transaction: with other enqueues of this store in flight, the wake-up is
    /// sent after the commit and shared with theirs (see `store/wakeups.rs`), so
    /// concurrent producers' commits are not serialized by NOTIFY.
    pub async fn enqueue_many(&self, jobs: Vec<NewJob>) -> Result<Vec<JobId>> {
        Ok(self
            .enqueue_many_outcomes(jobs)
            .await?
            .into_iter()
            .map(|e| e.id)
            .collect())
    }

    /// [`Store::enqueue_many`], saying of each job whether it was a duplicate.
    pub async fn enqueue_many_outcomes(&self, jobs: Vec<NewJob>) -> Result<Vec<Enqueued>> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let (in_flight, alone) = self.wakeups().begin();
        let mut conn = self.acquire().await?;
        let (out, wakes) = self.write_resolving(&mut conn, jobs, alone).await?;
        drop(conn);
        drop(in_flight);
        if !alone && !wakes.is_empty() {
            self.wake_after_commit(wakes).await;
        }
        Ok(out)
    }

    /// [`Store::enqueue_many`] inside the caller's transaction (its NOTIFY is delivered
    /// at the caller's commit). One refused job refuses the batch and leaves the
    /// caller's transaction usable, as [`Store::enqueue_in`] says.
    pub async fn enqueue_many_in(
        &self,
        conn: &mut PgConnection,
        jobs: Vec<NewJob>,
    ) -> Result<Vec<JobId>> {
        Ok(self
            .enqueue_outcomes_in(conn, jobs)
            .await?
            .into_iter()
            .map(|e| e.id)
            .collect())
    }

    /// [`Store::enqueue_many_in`], saying of each job whether it was a duplicate.
    pub async fn enqueue_outcomes_in(
        &self,
        conn: &mut PgConnection,
        jobs: Vec<NewJob>,
    ) -> Result<Vec<Enqueued>> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        // A unique job's transaction and a long text's savepoint need to know whose
        // transaction `conn` is in (see `exec::refuse_hidden_transaction`).
        let opens_its_own =
            jobs.iter().any(|j| j.unique.is_some()) || IndexedText::of(&jobs).may_be_refused();
        if opens_its_own {
            self.check_all(&jobs)?;
            exec::refuse_hidden_transaction(conn).await?;
        }
        Ok(self.write_resolving(conn, jobs, true).await?.0)
    }

    /// Write the jobs, resolving unique ones first (in a transaction, or a savepoint of
    /// the caller's): each job's outcome, and the queues to wake when `notify` is off.
    /// Every job is checked before the first statement.
    async fn write_resolving(
        &self,
        conn: &mut PgConnection,
        jobs: Vec<NewJob>,
        notify: bool,
    ) -> Result<(Vec<Enqueued>, Vec<String>)> {
        let checked = self.check_all(&jobs)?;
        let text = IndexedText::of(&jobs);
        if jobs.iter().all(|j| j.unique.is_none()) {
            let batch = jobs
                .into_iter()
                .zip(checked)
                .map(|(j, c)| (j, c, Window::Open))
                .collect();
            // Text an index entry may refuse (only the database knows how well it
            // compresses) goes in a savepoint inside the caller's transaction, so the
            // refusal cannot abort it. Shorter text cannot be refused, and a statement of
            // its own is atomic: neither pays the savepoint's two round trips.
            let rows = if text.may_be_refused() && exec::in_transaction(conn) {
                let mut savepoint = conn.begin().await?;
                let rows = self
                    .write_jobs(&mut savepoint, batch, notify)
                    .await
                    .map_err(|e| text.refusal(e))?;
                savepoint.commit().await?;
                rows
            } else {
                self.write_jobs(conn, batch, notify)
                    .await
                    .map_err(|e| text.refusal(e))?
            };
            return Ok(written(rows));
        }
        let mut tx = conn.begin().await?;
        let plan = self.resolve_unique(&mut tx, &jobs).await?;
        let fresh: Vec<(NewJob, Checked, Window)> = jobs
            .into_iter()
            .zip(checked)
            .zip(&plan)
            .filter_map(|((job, c), r)| match r {
                Resolution::Write(window) => Some((job, c, *window)),
                _ => None,
            })
            .collect();
        let rows = if fresh.is_empty() {
            Vec::new()
        } else {
            self.write_jobs(&mut tx, fresh, notify)
                .await
                .map_err(|e| text.refusal(e))?
        };
        tx.commit().await?;
        let (new, wakes) = written(rows);
        let mut new = new.into_iter();
        let mut out: Vec<Enqueued> = Vec::with_capacity(plan.len());
        for r in &plan {
            let e = match *r {
                Resolution::Write(_) => new.next().ok_or_else(|| Error::Decode {
                    what: "enqueue",
                    reason: "fewer ids than jobs written".into(),
                })?,
                Resolution::Existing(id) => Enqueued {
                    id,
                    duplicate: true,
                },
                Resolution::SameAs(i) => Enqueued {
                    id: out[i].id,
                    duplicate: true,
                },
            };
            out.push(e);
        }
        Ok((out, wakes))
    }

    /// The enqueue statement; `notify`: it sends its own wake-up. Each job's id, and its
    /// queue when it went in pending (so a later wake-up knows what to announce).
    #[tracing::instrument(name = "leasehold.enqueue", level = "debug", skip_all, fields(n = jobs.len()))]
    async fn write_jobs(
        &self,
        conn: &mut PgConnection,
        jobs: Vec<(NewJob, Checked, Window)>,
        notify: bool,
    ) -> Result<Vec<(JobId, Option<String>)>> {
        let c = self.columns(jobs);
        let channel = notify.then(|| self.schema().channel());
        let rows: Vec<(i64, i64, Option<String>)> = sqlx::query_as(&self.sql().enqueue)
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
            .bind(channel)
            .bind(&c.unique_key)
            .bind(&c.unique_until)
            .bind(&c.unique_forever)
            .fetch_all(self.on(&mut *conn))
            .await?;
        Ok(rows
            .into_iter()
            .map(|(id, _, wake)| (JobId(id), wake))
            .collect())
    }
}

/// Outcomes of freshly written jobs, and the queues they went in pending to.
fn written(rows: Vec<(JobId, Option<String>)>) -> (Vec<Enqueued>, Vec<String>) {
    let mut wakes = Vec::new();
    let out = rows
        .into_iter()
        .map(|(id, wake)| {
            wakes.extend(wake);
            Enqueued {
                id,
                duplicate: false,
            }
        })
        .collect();
    (out, wakes)
}
