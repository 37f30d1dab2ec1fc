//! Claim: one statement that picks eligible jobs with `FOR UPDATE SKIP LOCKED` and
//! commits the lease (state, owner, generation+1, attempts+1, lease_until) at once.
//!
//! Only `pending` rows are candidates and the claim index holds only those, so keyed
//! backlogs (`waiting`) and history (terminal rows) are never scanned. The batch is
//! bounded by `limit` (free slots) and by `byte_budget` (the first row is always
//! taken, so one large job cannot starve).
//!
//! The locked rows are updated by `id = ANY(ARRAY(...))`, not by a join: with a join the
//! generic plan (what a long-lived connection's plan cache may settle on, where `LIMIT
//! $3` is estimated at a tenth of the pending rows) hashes the whole table, 60 ms at
//! 10^5 rows; the array lookup stays on the primary key whatever the estimate.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{Acquire, Row};

use super::{secs, Store};
use crate::error::Result;
use crate::job::{ClaimedJob, Generation, JobId, OwnerId};

const RETURNED: &str = "j.id, j.queue, j.kind, j.job_key, j.key_seq, j.priority, j.payload, \
     j.payload_bytes, j.attempts, j.max_attempts, j.generation, j.lease_until, j.created_at, j.claimed_at";

pub(super) const CLAIM: &str = r#"/* leasehold:claim */
WITH cand AS (
    SELECT id, priority, available_at, payload_bytes
    FROM {s}.jobs
    WHERE state = 'pending'
      AND available_at <= coalesce($6, statement_timestamp())
      AND queue = ANY($1)
      AND ($2::text[] IS NULL OR kind = ANY($2))
    ORDER BY priority, available_at, id
    LIMIT $3
    FOR UPDATE SKIP LOCKED
), pick AS (
    SELECT id FROM (
        SELECT id,
               sum(payload_bytes) OVER w AS bytes,
               row_number() OVER w AS rn
        FROM cand
        WINDOW w AS (ORDER BY priority, available_at, id)
    ) b
    WHERE bytes <= $4 OR (rn = 1 AND $9)
), u AS (
    UPDATE {s}.jobs j
    SET state = 'running', owner = $5, generation = j.generation + 1,
        attempts = j.attempts + 1, claimed_at = coalesce($6, statement_timestamp()),
        lease_until = coalesce($6, statement_timestamp()) + make_interval(secs => $7)
    WHERE j.id = ANY (ARRAY(SELECT id FROM pick))
    RETURNING __RETURNED__
), ev AS (
    INSERT INTO {s}.job_events (job_id, generation, event, owner, at)
    SELECT id, generation, 'claimed', $5, claimed_at FROM u WHERE $8
)
SELECT * FROM u j ORDER BY j.priority, j.id"#;

/// [`CLAIM`] without the running byte sum, for a budget no claim of `limit` jobs can
/// exceed (every payload is capped at enqueue): the window and its sort cost about a
/// tenth of the statement. `$4` is still bound, and unused.
pub(super) fn unbudgeted(claim: &str) -> String {
    let from = claim.find("), pick AS (").expect("claim has a pick step");
    let to = claim.find("), u AS (").expect("claim has an update step");
    format!(
        "{}), pick AS (\n    SELECT id FROM cand WHERE $4::int8 IS NOT NULL AND $9::bool IS NOT NULL\n{}",
        &claim[..from],
        &claim[to..]
    )
    .replace("/* leasehold:claim */", "/* leasehold:claim_unbudgeted */")
}

pub(super) const CLAIM_KEY: &str = r#"/* leasehold:claim_key */
WITH pick AS (
    SELECT id FROM {s}.jobs
    WHERE queue = $1 AND job_key = $2 AND state = 'pending'
      AND available_at <= coalesce($5, statement_timestamp())
      AND ($3::text[] IS NULL OR kind = ANY($3))
    LIMIT 1
    FOR UPDATE SKIP LOCKED
), u AS (
    UPDATE {s}.jobs j
    SET state = 'running', owner = $4, generation = j.generation + 1,
        attempts = j.attempts + 1, claimed_at = coalesce($5, statement_timestamp()),
        lease_until = coalesce($5, statement_timestamp()) + make_interval(secs => $6)
    FROM pick WHERE j.id = pick.id
    RETURNING __RETURNED__
), ev AS (
    INSERT INTO {s}.job_events (job_id, generation, event, owner, at)
    SELECT id, generation, 'claimed', $4, claimed_at FROM u WHERE $7
)
SELECT * FROM u j"#;

/// What to claim.
#[derive(Clone, Debug)]
pub struct ClaimRequest {
    pub owner: OwnerId,
    pub queues: Vec<String>,
    /// Kinds this worker can run; `None` claims any kind (tools and tests).
    pub kinds: Option<Vec<String>>,
    /// At most this many jobs (the caller's free slots).
    pub limit: i64,
    /// Stop adding jobs once their payloads sum past this many bytes.
    pub byte_budget: i64,
    /// Take the first job even when its payload alone exceeds `byte_budget`, so one
    /// large job cannot starve. A scheduler sets this only when it holds no payload
    /// bytes at all; otherwise a spent budget claims nothing. Default true.
    pub first_over_budget: bool,
    pub lease: Duration,
    /// Test clock: claim as if the database time were `at`.
    pub at: Option<DateTime<Utc>>,
}

impl ClaimRequest {
    pub fn new(owner: OwnerId, queues: Vec<String>, limit: i64, lease: Duration) -> Self {
        ClaimRequest {
            owner,
            queues,
            kinds: None,
            limit,
            byte_budget: i64::MAX,
            first_over_budget: true,
            lease,
            at: None,
        }
    }
}

/// A claimed row. A payload that cannot be decoded (stored by an older version, or
/// written around the enqueue checks) does not fail the claim: the job comes back with
/// `payload_error` set, and the executor makes that job alone dead with the reason.
pub(crate) fn claimed_from_row(row: &PgRow, owner: &OwnerId) -> Result<ClaimedJob> {
    let (payload, payload_error) = match row.try_get::<serde_json::Value, _>("payload") {
        Ok(v) => (v, None),
        Err(e) => (
            serde_json::Value::Null,
            Some(format!("payload cannot be decoded: {e}")),
        ),
    };
    Ok(ClaimedJob {
        id: JobId(row.try_get("id")?),
        queue: row.try_get("queue")?,
        kind: row.try_get("kind")?,
        key: row.try_get("job_key")?,
        key_seq: row.try_get("key_seq")?,
        priority: row.try_get("priority")?,
        payload,
        payload_error,
        payload_bytes: row.try_get("payload_bytes")?,
        attempt: row.try_get("attempts")?,
        max_attempts: row.try_get("max_attempts")?,
        generation: Generation(row.try_get("generation")?),
        owner: owner.clone(),
        lease_until: row.try_get("lease_until")?,
        created_at: row.try_get("created_at")?,
        claimed_at: row.try_get("claimed_at")?,
    })
}

/// The claim statement's nine parameters, in order, on any sqlx query builder.
macro_rules! bind_claim {
    ($query:expr, $req:expr, $store:expr) => {
        $query
            .bind(&$req.queues)
            .bind(&$req.kinds)
            .bind($req.limit)
            .bind($req.byte_budget)
            .bind($req.owner.as_str())
            .bind($req.at)
            .bind(secs($req.lease))
            .bind($store.options().full_history)
            .bind($req.first_over_budget)
    };
}

pub(super) fn with_returned(template: &str) -> String {
    template.replace("__RETURNED__", RETURNED)
}

impl Store {
    /// Claim up to `req.limit` eligible jobs in one short statement.
    pub async fn claim(&self, req: &ClaimRequest) -> Result<Vec<ClaimedJob>> {
        if req.limit <= 0 || req.queues.is_empty() {
            return Ok(Vec::new());
        }
        let rows = bind_claim!(sqlx::query(self.claim_sql(req)), req, self)
            .fetch_all(self.pool())
            .await?;
        rows.iter()
            .map(|r| claimed_from_row(r, &req.owner))
            .collect()
    }

    /// The claim statement for `req`: without the byte window when the budget cannot
    /// bind.
    fn claim_sql(&self, req: &ClaimRequest) -> &str {
        let max_payload = i64::try_from(self.options().max_payload_bytes).unwrap_or(i64::MAX);
        if req.byte_budget >= req.limit.saturating_mul(max_payload) {
            &self.sql().claim_unbudgeted
        } else {
            &self.sql().claim
        }
    }

    /// `EXPLAIN (ANALYZE, BUFFERS)` of the claim statement for `req`, as planned with its
    /// parameters and as the generic plan a long-lived connection may switch to. Runs
    /// in a transaction that is rolled back: nothing is claimed. For operators checking
    /// that the claim index serves the claim on a large table.
    pub async fn explain_claim(&self, req: &ClaimRequest) -> Result<String> {
        const NAME: &str = "leasehold_explain_claim";
        let mut conn = self.pool().acquire().await?;
        let mut out = String::from("-- planned with its parameters\n");
        let mut tx = conn.begin().await?;
        let explain_sql = format!("EXPLAIN (ANALYZE, BUFFERS) {}", self.claim_sql(req));
        let rows: Vec<String> = bind_claim!(sqlx::query_scalar(&explain_sql), req, self)
            .fetch_all(&mut *tx)
            .await?;
        tx.rollback().await?;
        out.push_str(&rows.join("\n"));

        // PREPARE outlives transactions: clear a leftover, and deallocate after use.
        let _ = sqlx::raw_sql(&format!("DEALLOCATE {NAME}"))
            .execute(&mut *conn)
            .await;
        sqlx::raw_sql(&format!(
            "PREPARE {NAME}(text[], text[], int8, int8, text, timestamptz, float8, bool, bool) AS {}",
            self.claim_sql(req)
        ))
        .execute(&mut *conn)
        .await?;
        let mut tx = conn.begin().await?;
        sqlx::query("SET LOCAL plan_cache_mode = force_generic_plan")
            .execute(&mut *tx)
            .await?;
        // EXECUTE takes no bound parameters: let the server quote the values.
        let quote_sql = format!(
            "SELECT format('EXPLAIN (ANALYZE, BUFFERS) EXECUTE {NAME}(%L, %L, %L, %L, %L, %L, %L, %L, %L)', \
             $1::text[], $2::text[], $3::int8, $4::int8, $5::text, $6::timestamptz, $7::float8, $8::bool, $9::bool)"
        );
        let explain: String = bind_claim!(sqlx::query_scalar(&quote_sql), req, self)
            .fetch_one(&mut *tx)
            .await?;
        let rows: Vec<String> = sqlx::query_scalar(&explain).fetch_all(&mut *tx).await?;
        tx.rollback().await?;
        let _ = sqlx::raw_sql(&format!("DEALLOCATE {NAME}"))
            .execute(&mut *conn)
            .await;
        out.push_str("\n-- generic plan (plan_cache_mode = force_generic_plan)\n");
        out.push_str(&rows.join("\n"));
        Ok(out)
    }

    /// Claim the head of one key, if it is pending and due. The sequencer calls this as
    /// soon as the key's previous job ended, instead of waiting for the next poll.
    pub async fn claim_key(
        &self,
        owner: &OwnerId,
        queue: &str,
        key: &str,
        kinds: Option<&[String]>,
        lease: Duration,
        at: Option<DateTime<Utc>>,
    ) -> Result<Option<ClaimedJob>> {
        let row = sqlx::query(&self.sql().claim_key)
            .bind(queue)
            .bind(key)
            .bind(kinds)
            .bind(owner.as_str())
            .bind(at)
            .bind(secs(lease))
            .bind(self.options().full_history)
            .fetch_optional(self.pool())
            .await?;
        row.map(|r| claimed_from_row(&r, owner)).transpose()
    }
}
