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
//!
//! The promotion may also claim the successor for the scheduler that ended its
//! predecessor (see [`Chain`]): waiting → running in that same transaction, with a new
//! generation and lease, exactly as a claim would. The key's order is untouched (it is
//! the same successor), and the key's next job needs no claim statement of its own.

use std::time::Duration;

use sqlx::{PgConnection, Row};

use super::claim::claimed_from_row;
use super::{secs, Store};
use crate::error::Result;
use crate::job::{ClaimedJob, OwnerId};

/// Key rows are locked in (queue, key) order first, the order a batched enqueue takes
/// them in: an UPDATE joined to its input locks in whatever order the join runs, and
/// two batches crossing each other's keys would deadlock.
pub(super) const LEAVE_KEYS: &str = r#"/* leasehold:leave_keys */
WITH d AS (
    SELECT queue, job_key, count(*) AS n
    FROM unnest($1::text[], $2::text[]) AS t(queue, job_key)
    GROUP BY queue, job_key
), locked AS MATERIALIZED (
    SELECT jk.queue, jk.job_key
    FROM {s}.job_keys jk JOIN d ON jk.queue = d.queue AND jk.job_key = d.job_key
    ORDER BY jk.queue, jk.job_key
    FOR UPDATE OF jk
)
UPDATE {s}.job_keys jk
SET open_jobs = jk.open_jobs - d.n
FROM d, (SELECT count(*) AS n FROM locked) all_locked
WHERE jk.queue = d.queue AND jk.job_key = d.job_key AND all_locked.n >= 0"#;

/// The `key_floors` slot of a key row (columns `queue`, `job_key`). Enqueue and
/// retention must compute it the same way.
pub(super) const KEY_SLOT: &str = "(hashtext(queue || '/' || job_key) & 63)";
/// [`KEY_SLOT`] of a row aliased `jk`.
pub(super) const KEY_SLOT_JK: &str = "(hashtext(jk.queue || '/' || jk.job_key) & 63)";
/// [`KEY_SLOT`] of a row aliased `m`.
pub(super) const KEY_SLOT_M: &str = "(hashtext(m.queue || '/' || m.job_key) & 63)";

/// The schema's `promote` function (migrations/0003_claim.sql), also called by keyed
/// completions inside `complete_keyed`: one implementation of succession.
pub(super) const PROMOTE: &str = r#"/* leasehold:promote */
SELECT * FROM {s}.promote($1, $2, $5, $6, $7, $8, $3, $4)"#;

/// Claim the promoted successors too, for the scheduler whose sequencers wait for them.
pub(crate) struct Chain<'a> {
    pub owner: &'a OwnerId,
    /// Kinds this scheduler runs; a successor of another kind is only promoted.
    pub kinds: &'a [String],
    pub lease: Duration,
}

/// A (queue, key) pair.
pub(crate) type KeyRef = (String, String);

impl Store {
    /// The heads of these keys have ended (done, cancelled, or dead under the Continue
    /// policy): release their places and promote each key's next waiting job. Must run
    /// inside the transaction that ended them.
    pub(crate) async fn end_heads(&self, conn: &mut PgConnection, keys: &[KeyRef]) -> Result<()> {
        let no_chain = vec![false; keys.len()];
        self.end_heads_chained(conn, keys, &no_chain, None).await?;
        Ok(())
    }

    /// [`Store::end_heads`], and where `chain[i]` is set, claim key `i`'s promoted
    /// successor for `chain.owner` in the same statement (when it is due and of a kind
    /// the owner runs), instead of leaving it pending for a separate claim: a key's next
    /// job then costs no statement of its own. Returns the successors claimed.
    pub(crate) async fn end_heads_chained(
        &self,
        conn: &mut PgConnection,
        keys: &[KeyRef],
        chain_wanted: &[bool],
        chain: Option<&Chain<'_>>,
    ) -> Result<Vec<ClaimedJob>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        self.leave_keys(conn, keys).await?;
        self.promote_chained(conn, keys, chain_wanted, chain).await
    }

    /// The promotion half of [`Store::end_heads_chained`], for a caller whose own
    /// statement already left the keys (and so holds their rows' locks).
    pub(crate) async fn promote_chained(
        &self,
        conn: &mut PgConnection,
        keys: &[KeyRef],
        chain_wanted: &[bool],
        chain: Option<&Chain<'_>>,
    ) -> Result<Vec<ClaimedJob>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let (queues, names): (Vec<&str>, Vec<&str>) =
            keys.iter().map(|(q, k)| (q.as_str(), k.as_str())).unzip();
        let wanted: Vec<bool> = chain_wanted.iter().map(|w| *w && chain.is_some()).collect();
        let rows = sqlx::query(&self.sql().promote)
            .bind(&queues)
            .bind(&names)
            .bind(self.full_history())
            .bind(self.schema().channel())
            .bind(&wanted)
            .bind(chain.map(|c| c.owner.as_str()))
            .bind(chain.map(|c| c.kinds))
            .bind(chain.map(|c| secs(c.lease)).unwrap_or(0.0))
            .fetch_all(self.on(&mut *conn))
            .await?;
        let mut claimed = Vec::new();
        if let Some(c) = chain {
            for row in &rows {
                if row.try_get::<bool, _>("taken")? {
                    claimed.push(claimed_from_row(row, c.owner)?);
                }
            }
        }
        Ok(claimed)
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
            .execute(self.on(&mut *conn))
            .await?;
        Ok(())
    }
}
