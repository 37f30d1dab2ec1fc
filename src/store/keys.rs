//! Per-key succession: when a key's head ends, its next waiting job is promoted in the
//! same transaction.
//!
//! This is two statements on purpose. The first takes the key row's lock (the same lock
//! an enqueue of that key holds until it commits). The second reads the waiting jobs
//! with a fresh snapshot (READ COMMITTED), so it sees any successor whose enqueue
//! committed while we waited for the lock. Folded into one statement, the promotion
//! would read the statement's older snapshot and could leave that successor waiting
//! forever. Under REPEATABLE READ the first statement fails with a serialization error
//! instead, which is safe: the caller retries.

use sqlx::PgConnection;

use super::Store;
use crate::error::Result;

pub(super) const LEAVE_KEYS: &str = r#"/* leasehold:leave_keys */
UPDATE {s}.job_keys jk
SET open_jobs = jk.open_jobs - d.n
FROM (SELECT queue, job_key, count(*) AS n
        FROM unnest($1::text[], $2::text[]) AS t(queue, job_key)
       GROUP BY queue, job_key
       ORDER BY queue, job_key) d
WHERE jk.queue = d.queue AND jk.job_key = d.job_key"#;

pub(super) const PROMOTE: &str = r#"/* leasehold:promote */
WITH nxt AS (
    SELECT w.id
    FROM (SELECT DISTINCT queue, job_key FROM unnest($1::text[], $2::text[]) AS t(queue, job_key)) t
    CROSS JOIN LATERAL (
        SELECT id FROM {s}.jobs
        WHERE queue = t.queue AND job_key = t.job_key AND state = 'waiting'
        ORDER BY key_seq
        LIMIT 1
    ) w
), u AS (
    UPDATE {s}.jobs j
    SET state = 'pending', available_at = greatest(j.available_at, now())
    FROM nxt WHERE j.id = nxt.id AND j.state = 'waiting'
    RETURNING j.id, j.generation, j.queue
), ev AS (
    INSERT INTO {s}.job_events (job_id, generation, event, at)
    SELECT id, generation, 'promoted', now() FROM u WHERE $3
)
SELECT id, (SELECT count(pg_notify($4, left(q.queue, 1000))) FROM (SELECT DISTINCT queue FROM u) q) AS notified
FROM u"#;

/// A (queue, key) pair.
pub(crate) type KeyRef = (String, String);

impl Store {
    /// The heads of these keys have ended (done, cancelled, or dead under the Continue
    /// policy): release their places and promote each key's next waiting job. Must run
    /// inside the transaction that ended them.
    pub(crate) async fn end_heads(&self, conn: &mut PgConnection, keys: &[KeyRef]) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        self.leave_keys(conn, keys).await?;
        let (queues, names): (Vec<&str>, Vec<&str>) =
            keys.iter().map(|(q, k)| (q.as_str(), k.as_str())).unzip();
        sqlx::query(&self.sql().promote)
            .bind(&queues)
            .bind(&names)
            .bind(self.options().full_history)
            .bind(self.schema().channel())
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    /// Jobs of these keys ended without being heads (a cancelled waiting job): they no
    /// longer count as open, and nobody is promoted.
    pub(crate) async fn leave_keys(&self, conn: &mut PgConnection, keys: &[KeyRef]) -> Result<()> {
        let mut sorted: Vec<&KeyRef> = keys.iter().collect();
        sorted.sort();
        let (queues, names): (Vec<&str>, Vec<&str>) =
            sorted.iter().map(|(q, k)| (q.as_str(), k.as_str())).unzip();
        sqlx::query(&self.sql().leave_keys)
            .bind(&queues)
            .bind(&names)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}
