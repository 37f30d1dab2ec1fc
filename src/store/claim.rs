//! Claim: one statement that picks eligible jobs with `FOR UPDATE SKIP LOCKED` and
//! commits the lease (state, owner, generation+1, attempts+1, lease_until) at once.
//!
//! Only `pending` rows are candidates and the claim index holds only those, so keyed
//! backlogs (`waiting`) and history (terminal rows) are never scanned. The batch is
//! bounded by `limit` (free slots) and by `byte_budget` (the first row is always
//! taken, so one large job cannot starve).

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::Row;

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
      AND available_at <= coalesce($6, now())
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
    WHERE rn = 1 OR bytes <= $4
), u AS (
    UPDATE {s}.jobs j
    SET state = 'running', owner = $5, generation = j.generation + 1,
        attempts = j.attempts + 1, claimed_at = coalesce($6, now()),
        lease_until = coalesce($6, now()) + make_interval(secs => $7)
    FROM pick WHERE j.id = pick.id
    RETURNING __RETURNED__
), ev AS (
    INSERT INTO {s}.job_events (job_id, generation, event, owner, at)
    SELECT id, generation, 'claimed', $5, claimed_at FROM u WHERE $8
)
SELECT * FROM u j ORDER BY j.priority, j.id"#;

pub(super) const CLAIM_KEY: &str = r#"/* leasehold:claim_key */
WITH pick AS (
    SELECT id FROM {s}.jobs
    WHERE queue = $1 AND job_key = $2 AND state = 'pending'
      AND available_at <= coalesce($5, now())
      AND ($3::text[] IS NULL OR kind = ANY($3))
    LIMIT 1
    FOR UPDATE SKIP LOCKED
), u AS (
    UPDATE {s}.jobs j
    SET state = 'running', owner = $4, generation = j.generation + 1,
        attempts = j.attempts + 1, claimed_at = coalesce($5, now()),
        lease_until = coalesce($5, now()) + make_interval(secs => $6)
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
            lease,
            at: None,
        }
    }
}

pub(crate) fn claimed_from_row(row: &PgRow, owner: &OwnerId) -> Result<ClaimedJob> {
    Ok(ClaimedJob {
        id: JobId(row.try_get("id")?),
        queue: row.try_get("queue")?,
        kind: row.try_get("kind")?,
        key: row.try_get("job_key")?,
        key_seq: row.try_get("key_seq")?,
        priority: row.try_get("priority")?,
        payload: row.try_get("payload")?,
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

pub(super) fn with_returned(template: &str) -> String {
    template.replace("__RETURNED__", RETURNED)
}

impl Store {
    /// Claim up to `req.limit` eligible jobs in one short statement.
    pub async fn claim(&self, req: &ClaimRequest) -> Result<Vec<ClaimedJob>> {
        if req.limit <= 0 || req.queues.is_empty() {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(&self.sql().claim)
            .bind(&req.queues)
            .bind(&req.kinds)
            .bind(req.limit)
            .bind(req.byte_budget)
            .bind(req.owner.as_str())
            .bind(req.at)
            .bind(secs(req.lease))
            .bind(self.options().full_history)
            .fetch_all(self.pool())
            .await?;
        rows.iter()
            .map(|r| claimed_from_row(r, &req.owner))
            .collect()
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
