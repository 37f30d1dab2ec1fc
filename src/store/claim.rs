//! Claim: the `claim_capped` function of the schema (migrations/0016_claim_caps.sql: the
//! `claim` of 0003_claim.sql and 0011_claim_walks_once.sql with per-queue caps), one call
//! that locks eligible jobs with `FOR UPDATE SKIP LOCKED` and commits the lease (state,
//! owner, generation+1, attempts+1, lease_until) at once.
//!
//! Only `pending` rows are candidates and the claim index holds only those, so keyed
//! backlogs (`waiting`) and history (terminal rows) are never scanned. The index leads
//! with the queue and the priority, so with both fixed `available_at <= now` bounds the
//! scan: delayed jobs and other queues' jobs are not walked either. The batch is bounded
//! by `limit` (free slots) and by `byte_budget` (the first row may be taken past it, so
//! one large job cannot starve, when the caller holds nothing else), and by `caps`: at
//! most so many jobs of a capped queue, the rest of the limit open to the other queues in
//! the same walk, so priorities hold across capped and uncapped queues alike.
//!
//! Why a function: the claim takes the priorities present one by one (an index probe
//! each) and stops when it has enough, which one statement cannot express; and its SET
//! clauses pin its plans to index scans and generic plans inside the function only. On a
//! table that was never analyzed (autovacuum off, or a bulk load before autoanalyze),
//! the planner guessed a handful of rows and chose to read and sort every pending row,
//! about 9 ms per claim at 20,000 pending instead of 1–2; nothing the host runs is
//! affected by these settings, and they need no session state (so they hold through a
//! transaction-mode pooler too).
//!
//! Until VACUUM runs, the index entries of every row claimed since sit ahead of a queue's
//! first pending job, and each scan from the queue's head steps over them (a 100,000-job
//! drain leaves about 600 index pages of them). The probe that finds the lowest priority
//! present also returns where each queue's first pending entry is, and the locking scan
//! starts there, so a claim steps over them once (migration 11; before, twice).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{Acquire, Row};

use super::{secs, Store};
use crate::error::{Error, Result};
use crate::job::{ClaimedJob, EffectIdentity, Generation, JobId, OwnerId};

const RETURNED: &str = "j.id, j.queue, j.kind, j.job_key, j.key_seq, j.priority, j.payload, \
     j.payload_bytes, j.attempts, j.max_attempts, j.generation, j.lease_until, j.created_at, j.claimed_at, \
     j.effect_identity::text AS effect_identity";

/// The claim function over the requested queues that are not paused: a pause takes
/// effect for every claim that starts after it committed (see [`Store::pause_queue`]).
/// The caps ($10, $11) are by name, so a paused queue's cap is simply unused.
pub(super) const CLAIM: &str = r#"/* leasehold:claim */
SELECT * FROM {s}.claim_capped(
    ARRAY(SELECT u.q FROM unnest($1::text[]) u(q)
          WHERE NOT EXISTS (SELECT 1 FROM {s}.paused_queues p WHERE p.queue = u.q)),
    $2, $3, $4, $9, $5, $6, $7, $8, $10, $11)"#;

/// The function's inner queries (migration 11), for [`Store::explain_claim`]: the probe
/// for each queue's first pending entry at or above a priority, and the locking scan of
/// one priority level, which starts at the entries the probe found. (The function's
/// scan of a capped queue is limited by what is left of its cap as well; the plan is
/// the same.)
const EXPLAIN_PROBE: &str =
    "SELECT u.q, f.priority, f.available_at, f.id FROM unnest($1::text[]) u(q) \
     CROSS JOIN LATERAL (SELECT j.priority, j.available_at, j.id FROM {s}.jobs j \
     WHERE j.state = 'pending' AND j.queue = u.q AND j.priority >= $2::int2 \
     ORDER BY j.priority, j.available_at, j.id LIMIT 1) f";
const EXPLAIN_LEVEL: &str = "SELECT c.id, c.payload_bytes \
     FROM unnest($1::text[], $6::timestamptz[], $7::int8[]) s(q, a, i) \
     CROSS JOIN LATERAL (SELECT j.id, j.available_at, j.payload_bytes FROM {s}.jobs j \
     WHERE j.state = 'pending' AND j.queue = s.q AND j.priority = $2::int2 \
     AND (j.available_at, j.id) >= (s.a, s.i) \
     AND j.available_at <= coalesce($3::timestamptz, statement_timestamp()) \
     AND ($4::text[] IS NULL OR j.kind = ANY ($4)) \
     ORDER BY j.available_at, j.id LIMIT $5::int4 FOR UPDATE OF j SKIP LOCKED) c \
     ORDER BY c.available_at, c.id LIMIT $5::int4";

/// The settings the claim function runs under (its SET clauses).
const FUNCTION_SETTINGS: [&str; 5] = [
    "SET LOCAL plan_cache_mode = force_generic_plan",
    "SET LOCAL enable_seqscan = off",
    "SET LOCAL enable_bitmapscan = off",
    "SET LOCAL enable_sort = off",
    "SET LOCAL jit = off",
];

pub(super) const CLAIM_KEY: &str = r#"/* leasehold:claim_key */
WITH pick AS (
    SELECT id FROM {s}.jobs
    WHERE queue = $1 AND job_key = $2 AND state = 'pending'
      AND available_at <= coalesce($5, statement_timestamp())
      AND ($3::text[] IS NULL OR kind = ANY($3))
      AND NOT EXISTS (SELECT 1 FROM {s}.paused_queues p WHERE p.queue = $1)
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
    /// Who claims: the owner every later write about the claimed jobs must carry.
    pub owner: OwnerId,
    /// Queues to claim from.
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
    /// At most this many jobs of each queue named here (0 or less: none of it); queues
    /// not named are bounded by `limit` only. A cap is not a share: what a capped queue
    /// has not got (nothing due, paused) goes to the other queues, in claim order.
    /// Default empty: no caps.
    pub caps: BTreeMap<String, i64>,
    /// Lease taken on each claimed job, from the database's clock at the claim.
    pub lease: Duration,
    /// Test clock: claim as if the database time were `at`. The claim's time is also the
    /// attempt's fencing token ([`ClaimedJob::fencing_token`]), so a claim at a time
    /// ahead of the database's gives a token later claims by the database's clock do not
    /// pass until that time. The scheduler never sets it.
    pub at: Option<DateTime<Utc>>,
}

impl ClaimRequest {
    /// Claim up to `limit` jobs of any kind from `queues` for `owner`, each leased for
    /// `lease`, with no byte budget and the database's clock.
    pub fn new(owner: OwnerId, queues: Vec<String>, limit: i64, lease: Duration) -> Self {
        ClaimRequest {
            owner,
            queues,
            kinds: None,
            limit,
            byte_budget: i64::MAX,
            first_over_budget: true,
            caps: BTreeMap::new(),
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
        effect_identity: {
            let text: String = row.try_get("effect_identity")?;
            EffectIdentity::parse(&text).ok_or_else(|| Error::Decode {
                what: "effect identity",
                reason: format!("{text:?} is not a UUID"),
            })?
        },
    })
}

impl ClaimRequest {
    /// The caps as the function takes them: names, and the caps at the same positions;
    /// both NULL without caps.
    fn cap_arrays(&self) -> (Option<Vec<&str>>, Option<Vec<i32>>) {
        if self.caps.is_empty() {
            return (None, None);
        }
        let names = self.caps.keys().map(String::as_str).collect();
        let caps = self
            .caps
            .values()
            .map(|&n| i32::try_from(n.max(0)).unwrap_or(i32::MAX))
            .collect();
        (Some(names), Some(caps))
    }
}

/// The claim statement's eleven parameters, in order, on any sqlx query builder.
macro_rules! bind_claim {
    ($query:expr, $req:expr, $store:expr) => {{
        let (capped, caps) = $req.cap_arrays();
        $query
            .bind(&$req.queues)
            .bind(&$req.kinds)
            .bind(i32::try_from($req.limit).unwrap_or(i32::MAX))
            .bind($req.byte_budget)
            .bind($req.owner.as_str())
            .bind($req.at)
            .bind(secs($req.lease))
            .bind($store.full_history())
            .bind($req.first_over_budget)
            .bind(capped)
            .bind(caps)
    }};
}

pub(super) fn with_returned(template: &str) -> String {
    template.replace("__RETURNED__", RETURNED)
}

impl Store {
    /// Claim up to `req.limit` eligible jobs in one short statement.
    pub async fn claim(&self, req: &ClaimRequest) -> Result<Vec<ClaimedJob>> {
        Ok(self.claim_sent(req).await?.0)
    }

    /// [`Store::claim`], and the moment the statement was sent, once a connection was
    /// at hand: the leases it took count from a later time, so a local lease deadline
    /// counted from this one is safe, and waiting for a connection does not eat into it.
    #[tracing::instrument(name = "leasehold.claim", level = "debug", skip_all, fields(limit = req.limit))]
    pub(crate) async fn claim_sent(
        &self,
        req: &ClaimRequest,
    ) -> Result<(Vec<ClaimedJob>, Instant)> {
        if req.limit <= 0 || req.queues.is_empty() {
            return Ok((Vec::new(), Instant::now()));
        }
        self.unless_history_refused("claim", || self.claim_once(req))
            .await
    }

    async fn claim_once(&self, req: &ClaimRequest) -> Result<(Vec<ClaimedJob>, Instant)> {
        let mut conn = self.acquire().await?;
        let sent = Instant::now();
        let rows = bind_claim!(sqlx::query(&self.sql().claim), req, self)
            .fetch_all(self.on(&mut conn))
            .await?;
        let jobs = rows
            .iter()
            .map(|r| claimed_from_row(r, &req.owner))
            .collect::<Result<_>>()?;
        Ok((jobs, sent))
    }

    /// `EXPLAIN (ANALYZE, BUFFERS)` of the claim function's inner queries as it runs
    /// them (generic plans, index scans only): the locking scan of the lowest priority
    /// present in `req.queues`, from the entries the probe found, and the probe for
    /// the next priority. Runs in a transaction that is rolled back: nothing is
    /// claimed. For operators checking that the claim index serves the claim on a large
    /// table.
    pub async fn explain_claim(&self, req: &ClaimRequest) -> Result<String> {
        let mut conn = self.acquire().await?;
        let mut tx = conn.begin().await?;
        for setting in FUNCTION_SETTINGS {
            sqlx::query(setting).execute(self.on(&mut tx)).await?;
        }
        let probe = self.schema().render(EXPLAIN_PROBE);
        let firsts = sqlx::query(&probe)
            .bind(&req.queues)
            .bind(i16::MIN)
            .fetch_all(self.on(&mut tx))
            .await?;
        let mut level: Option<i16> = None;
        for row in &firsts {
            let p: i16 = row.try_get("priority")?;
            level = Some(level.map_or(p, |l| l.min(p)));
        }
        let level = level.unwrap_or(0);
        let (mut queues, mut starts_at, mut starts_id) = (Vec::new(), Vec::new(), Vec::new());
        for row in &firsts {
            if row.try_get::<i16, _>("priority")? == level {
                queues.push(row.try_get::<String, _>("q")?);
                starts_at.push(row.try_get::<DateTime<Utc>, _>("available_at")?);
                starts_id.push(row.try_get::<i64, _>("id")?);
            }
        }
        let limit = i32::try_from(req.limit).unwrap_or(i32::MAX);
        // Prepared statements, so EXPLAIN shows the generic plans the function uses;
        // EXECUTE takes no bound parameters, so the server quotes the values.
        let mut out = String::new();
        for (name, statement, sql, types, execute, from) in [
            (
                "one priority level (locks the due jobs)",
                "leasehold_explain_level",
                EXPLAIN_LEVEL,
                "text[], int2, timestamptz, text[], int4, timestamptz[], int8[]",
                "SELECT format('EXPLAIN (ANALYZE, BUFFERS) EXECUTE leasehold_explain_level(%L, %L, %L, %L, %L, %L, %L)', \
                 $1::text[], $2::int2, $3::timestamptz, $4::text[], $5::int4, $6::timestamptz[], $7::int8[])",
                level,
            ),
            (
                "the next priority present",
                "leasehold_explain_probe",
                EXPLAIN_PROBE,
                "text[], int2",
                // The unused parameters keep one binding for both statements.
                "SELECT format('EXPLAIN (ANALYZE, BUFFERS) EXECUTE leasehold_explain_probe(%L, %L)', \
                 $1::text[], $2::int2) WHERE $3::timestamptz IS NULL OR $4::text[] IS NULL \
                 OR $5::int4 IS NOT NULL OR $6::timestamptz[] IS NULL OR $7::int8[] IS NULL",
                level.saturating_add(1),
            ),
        ] {
            sqlx::raw_sql(&format!(
                "PREPARE {statement}({types}) AS {}",
                self.schema().render(sql)
            ))
            .execute(self.on(&mut tx))
            .await?;
            let explain: String = sqlx::query_scalar(execute)
                .bind(if sql == EXPLAIN_LEVEL { &queues } else { &req.queues })
                .bind(from)
                .bind(req.at)
                .bind(&req.kinds)
                .bind(limit)
                .bind(&starts_at)
                .bind(&starts_id)
                .fetch_one(self.on(&mut tx))
                .await?;
            let rows: Vec<String> = sqlx::query_scalar(&explain).fetch_all(self.on(&mut tx)).await?;
            out.push_str(&format!("-- {name}, priority {from}\n{}\n", rows.join("\n")));
        }
        // PREPARE outlives the transaction: deallocate while this transaction holds the
        // server connection (behind a transaction pooler, a later statement may not).
        sqlx::raw_sql("DEALLOCATE leasehold_explain_level; DEALLOCATE leasehold_explain_probe")
            .execute(&mut *tx)
            .await?;
        tx.rollback().await?;
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
        let key = self
            .claim_key_sent(owner, queue, key, kinds, lease, at)
            .await?;
        Ok(key.map(|(job, _)| job))
    }

    /// [`Store::claim_key`], and the moment the statement was sent (see
    /// [`Store::claim_sent`]).
    #[tracing::instrument(name = "leasehold.claim_key", level = "debug", skip_all)]
    pub(crate) async fn claim_key_sent(
        &self,
        owner: &OwnerId,
        queue: &str,
        key: &str,
        kinds: Option<&[String]>,
        lease: Duration,
        at: Option<DateTime<Utc>>,
    ) -> Result<Option<(ClaimedJob, Instant)>> {
        self.unless_history_refused("claim_key", || {
            self.claim_key_once(owner, queue, key, kinds, lease, at)
        })
        .await
    }

    async fn claim_key_once(
        &self,
        owner: &OwnerId,
        queue: &str,
        key: &str,
        kinds: Option<&[String]>,
        lease: Duration,
        at: Option<DateTime<Utc>>,
    ) -> Result<Option<(ClaimedJob, Instant)>> {
        let mut conn = self.acquire().await?;
        let sent = Instant::now();
        let row = sqlx::query(&self.sql().claim_key)
            .bind(queue)
            .bind(key)
            .bind(kinds)
            .bind(owner.as_str())
            .bind(at)
            .bind(secs(lease))
            .bind(self.full_history())
            .fetch_optional(self.on(&mut conn))
            .await?;
        row.map(|r| Ok((claimed_from_row(&r, owner)?, sent)))
            .transpose()
    }
}
