//! Bulk enqueue with COPY: the fastest way to load many unkeyed jobs.
//!
//! Each job passes the same checks as [`Store::enqueue_many`] (names, attempts, payload
//! size, NUL). Rows are checked as they are encoded and streamed straight into `jobs`
//! with one `COPY ... FROM STDIN` (text format), so encoding overlaps the server's work;
//! the first invalid job aborts the COPY and rolls the load back (a savepoint inside the
//! caller's transaction), so nothing is written and the caller's transaction stays
//! usable. One NOTIFY per queue is sent in the same transaction, so workers wake at
//! commit.
//!
//! Keyed jobs are refused: a key needs its `key_seq` under the key row's lock, which
//! only the `enqueue_many` statement takes. Times use the database clock, read once per
//! load with `statement_timestamp()` just before the COPY (not `now()`, which inside a
//! caller's longer transaction is that transaction's start): it is each job's
//! `created_at` and the base of its delay, exactly what the enqueue statement computes.

use std::io::Write;

use chrono::{DateTime, SecondsFormat, Utc};
use sqlx::{Acquire, PgConnection};

use super::unique::{Resolution, Window};
use super::Store;
use crate::error::{Error, Result};
use crate::job::{DeadKeyPolicy, NewJob};

const COLUMNS: &str = "queue, kind, priority, state, payload, payload_bytes, max_attempts, \
     dead_blocks_key, available_at, created_at, unique_key, unique_until";

pub(super) fn copy_statement() -> String {
    format!("/* leasehold:enqueue_copy */ COPY {{s}}.jobs ({COLUMNS}) FROM STDIN")
}

pub(super) const COPY_NOTIFY: &str = r#"/* leasehold:enqueue_copy_notify */
SELECT count(pg_notify($1, left(q, 1000))) FROM unnest($2::text[]) AS q"#;

/// Bytes buffered before a chunk is sent to the server.
const CHUNK_BYTES: usize = 1 << 20;

/// Append `value` to a COPY text-format line, escaping what the format reserves.
fn push_text(line: &mut Vec<u8>, value: &[u8]) {
    let special = |b: &u8| matches!(b, b'\\' | b'\t' | b'\n' | b'\r');
    if !value.iter().any(special) {
        line.extend_from_slice(value);
        return;
    }
    for &b in value {
        match b {
            b'\\' => line.extend_from_slice(b"\\\\"),
            b'\t' => line.extend_from_slice(b"\\t"),
            b'\n' => line.extend_from_slice(b"\\n"),
            b'\r' => line.extend_from_slice(b"\\r"),
            _ => line.push(b),
        }
    }
}

impl Store {
    /// Enqueue many unkeyed jobs with one COPY, in its own transaction. Returns the number
    /// of jobs written (COPY returns no ids: use [`Store::enqueue_many`] when you need
    /// them). All or none. Unique jobs ([`NewJob::unique`]) whose key is taken, by an
    /// existing job or by an earlier job of the load, are left out (not an error): the
    /// count is of the jobs written.
    pub async fn enqueue_copy(&self, jobs: Vec<NewJob>) -> Result<u64> {
        let mut conn = self.acquire().await?;
        self.copy_on(&mut conn, jobs, false).await
    }

    /// [`Store::enqueue_copy`] inside the caller's transaction (in a savepoint): if it
    /// rolls back, none of the jobs existed. A refused load (an invalid job, or text an
    /// index entry cannot hold: [`Error::InvalidInput`] naming the field) leaves the
    /// caller's transaction usable, as [`Store::enqueue_in`] says.
    pub async fn enqueue_copy_in(&self, conn: &mut PgConnection, jobs: Vec<NewJob>) -> Result<u64> {
        self.copy_on(conn, jobs, true).await
    }

    /// [`Store::enqueue_copy_in`]; `callers` says `conn` is the caller's, which may be
    /// inside a transaction sqlx cannot see (see `exec::refuse_hidden_transaction`).
    async fn copy_on(
        &self,
        conn: &mut PgConnection,
        jobs: Vec<NewJob>,
        callers: bool,
    ) -> Result<u64> {
        if jobs.is_empty() {
            return Ok(0);
        }
        if jobs.iter().any(|j| j.key.is_some()) {
            return Err(Error::InvalidInput {
                field: "key",
                reason: "enqueue_copy takes unkeyed jobs only; enqueue keyed jobs with \
                         enqueue_many, which orders them under the key's lock"
                    .into(),
            });
        }
        if callers {
            super::exec::refuse_hidden_transaction(conn).await?;
        }
        let statement = &self.sql().enqueue_copy;
        // What the database's refusal of a too-long index entry is put down to.
        let text = super::input::IndexedText::of(&jobs);

        let unique = jobs.iter().any(|j| j.unique.is_some());
        if unique {
            super::unique::check_unique_batch(&jobs)?;
        }
        let mut tx = conn.begin().await?;
        let plan = if unique {
            self.resolve_unique(&mut tx, &jobs).await?
        } else {
            Vec::new()
        };
        // The column defaults would say `now()`: the caller's transaction start.
        let now: DateTime<Utc> = sqlx::query_scalar("SELECT statement_timestamp()")
            .fetch_one(self.on(&mut tx))
            .await?;
        let mut queues: Vec<&str> = Vec::new();
        let mut copy = tx.copy_in_raw(statement).await?;
        let mut buf: Vec<u8> = Vec::with_capacity(CHUNK_BYTES + 4096);
        let mut encoded: Vec<u8> = Vec::with_capacity(256);
        for (n, job) in jobs.iter().enumerate() {
            let window = match plan.get(n) {
                None => Window::Open,
                Some(Resolution::Write(window)) => *window,
                Some(_) => continue,
            };
            if let Err(e) = self.copy_row(job, window, now, &mut encoded, &mut buf) {
                // Dropping the transaction afterwards rolls back what was sent.
                let _ = copy
                    .abort("leasehold: an invalid job refused the load")
                    .await;
                return Err(e);
            }
            if !queues.contains(&job.queue_name()) {
                queues.push(job.queue_name());
            }
            if buf.len() >= CHUNK_BYTES {
                copy.send(std::mem::take(&mut buf))
                    .await
                    .map_err(|e| text.refusal(e.into()))?;
                buf.reserve(CHUNK_BYTES + 4096);
            }
        }
        if !buf.is_empty() {
            copy.send(buf).await.map_err(|e| text.refusal(e.into()))?;
        }
        let written = copy.finish().await.map_err(|e| text.refusal(e.into()))?;
        sqlx::query(&self.sql().enqueue_copy_notify)
            .bind(self.schema().channel())
            .bind(&queues)
            .execute(self.on(&mut tx))
            .await?;
        tx.commit().await?;
        Ok(written)
    }

    /// Check one job and append its COPY line to `buf`. `now`: the load's time.
    fn copy_row(
        &self,
        job: &NewJob,
        window: Window,
        now: DateTime<Utc>,
        encoded: &mut Vec<u8>,
        buf: &mut Vec<u8>,
    ) -> Result<()> {
        let (max_attempts, priority) = self.check_job(job, encoded)?;
        let available_at = match (job.run_at, job.delay) {
            (Some(at), _) => at,
            (None, Some(delay)) => chrono::Duration::from_std(delay)
                .ok()
                .and_then(|d| now.checked_add_signed(d))
                .ok_or_else(|| Error::InvalidInput {
                    field: "delay",
                    reason: format!("{delay:?} is out of range"),
                })?,
            (None, None) => now,
        };
        push_text(buf, job.queue_name().as_bytes());
        buf.push(b'\t');
        push_text(buf, job.kind.as_bytes());
        // Writing into a Vec cannot fail.
        let _ = write!(buf, "\t{priority}\tpending\t");
        push_text(buf, encoded);
        let blocks = if job.dead_key_policy == DeadKeyPolicy::Block {
            't'
        } else {
            'f'
        };
        let _ = write!(buf, "\t{}\t{}\t{}", encoded.len(), max_attempts, blocks);
        for at in [available_at, now] {
            buf.push(b'\t');
            buf.extend_from_slice(at.to_rfc3339_opts(SecondsFormat::Micros, true).as_bytes());
        }
        buf.push(b'\t');
        match &job.unique {
            Some(u) => push_text(buf, u.key.as_bytes()),
            None => buf.extend_from_slice(b"\\N"),
        }
        buf.push(b'\t');
        match window {
            Window::Open => buf.extend_from_slice(b"\\N"),
            Window::Forever => buf.extend_from_slice(b"infinity"),
            Window::Until(t) => {
                buf.extend_from_slice(t.to_rfc3339_opts(SecondsFormat::Secs, true).as_bytes())
            }
        }
        buf.push(b'\n');
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::push_text;

    #[test]
    fn copy_text_escapes_what_the_format_reserves() {
        let mut line = Vec::new();
        push_text(&mut line, b"a\\b\tc\nd\re \"x\"");
        assert_eq!(line, b"a\\\\b\\tc\\nd\\re \"x\"");
        let mut plain = Vec::new();
        push_text(&mut plain, b"{\"n\":1}");
        assert_eq!(plain, b"{\"n\":1}");
    }
}
