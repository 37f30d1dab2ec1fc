//! Fenced completions: one job, a batch of unkeyed jobs, a batch of keyed jobs.
//!
//! Each UPDATE is conditional on `(id, owner, generation, effect_identity,
//! state='running')` (the identity because the other three repeat in a schema created
//! again: see [`Fence`](crate::Fence)). Zero rows
//! means the worker lost authority, except when its own earlier completion already
//! committed and the reply was lost: the read-back tells the two apart, so a retried
//! completion returns the stored result instead of reporting a false `Stale`. Outcomes
//! are matched by job *and generation*: one process may hold an old attempt and a newer
//! claim of the same job, and only the newer one can complete.
//!
//! # Lock order
//!
//! A keyed completion must leave its key in the same transaction (the key row's
//! `open_jobs`, then the promotion). Key rows are always locked before job rows, the
//! order enqueue, promotion and operator actions use, so none of them can deadlock with
//! a completion. Unkeyed completions never touch a key row, so they never wait behind a
//! host's open transaction.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use sqlx::{PgConnection, Row};

use super::claim::claimed_from_row;
use super::keys::{Chain, KeyRef};
use super::{check_json, secs, JsonLimit, Store};
use crate::error::Result;
use crate::job::{
    Attempt, ClaimedJob, CompleteOutcome, EffectIdentity, Fence, Generation, JobId, OwnerId,
};

/// Locks the job's key row (if any) before the job row: see the module docs. The
/// initplan `(SELECT count(*) FROM kl)` runs before the UPDATE's scan locks the job.
pub(super) const COMPLETE: &str = r#"/* leasehold:complete */
WITH kl AS MATERIALIZED (
    SELECT 1 FROM {s}.job_keys jk JOIN {s}.jobs j0
      ON j0.id = $1 AND jk.queue = j0.queue AND jk.job_key = j0.job_key
    FOR UPDATE OF jk
), u AS (
    UPDATE {s}.jobs
    SET state = 'done', result = $4, finished_at = clock_timestamp(), lease_until = NULL
    WHERE id = $1 AND owner = $2 AND generation = $3 AND effect_identity = $6::uuid
      AND state = 'running' AND (SELECT count(*) FROM kl) >= 0
    RETURNING id, generation, queue, job_key
), ev AS (
    INSERT INTO {s}.job_events (job_id, generation, event, owner, at)
    SELECT id, generation, 'completed', $2, clock_timestamp() FROM u WHERE $5
)
SELECT id, queue, job_key FROM u"#;

/// Keyed completions: one call of the schema's `complete_keyed` function (see
/// migrations/0023_completions_skip_held_rows.sql), instead of five round trips (begin,
/// lock the keys, lock the jobs, complete, promote, commit). A successor of a paused queue is promoted but not chain-claimed
/// (`$6`, the chain flags, are cleared for paused queues).
pub(super) const COMPLETE_KEYED: &str = r#"/* leasehold:complete_keyed */
SELECT * FROM {s}.complete_keyed($1, $2, $3, $4, $5,
    ARRAY(SELECT c.chain AND NOT EXISTS (SELECT 1 FROM {s}.paused_queues p WHERE p.queue = c.q)
          FROM unnest($6::bool[], $4::text[]) WITH ORDINALITY AS c(chain, q, n)
          ORDER BY c.n),
    $7, $8, $9, $10, $11, $12, $13, $14::uuid[])"#;

/// Unkeyed completions in one statement, waiting for job rows other sessions hold: at
/// most `$7` milliseconds when set (`set_config(.., true)` lasts to the end of the
/// statement's own transaction; the initplan runs before the first row is locked), or as
/// long as the session's `lock_timeout` allows.
pub(super) const COMPLETE_UNKEYED: &str = r#"/* leasehold:complete_unkeyed */
WITH c AS (
    SELECT * FROM unnest($1::int8[], $2::int8[], $3::jsonb[], $6::uuid[])
      AS t(id, generation, result, identity)
), bound AS MATERIALIZED (
    SELECT CASE WHEN $7::int4 IS NOT NULL
                THEN set_config('lock_timeout', $7::int4 || 'ms', true) END AS s
), u AS (
    UPDATE {s}.jobs j
    SET state = 'done', result = c.result, finished_at = clock_timestamp(), lease_until = NULL
    FROM c
    WHERE j.id = c.id AND j.owner = $4 AND j.generation = c.generation
      AND j.effect_identity = c.identity AND j.state = 'running'
      AND j.job_key IS NULL AND (SELECT count(*) FROM bound) >= 0
    RETURNING j.id, j.generation, j.effect_identity
), ev AS (
    INSERT INTO {s}.job_events (job_id, generation, event, owner, at)
    SELECT id, generation, 'completed', $4, clock_timestamp() FROM u WHERE $5
)
SELECT id, generation, effect_identity::text AS identity, true AS done FROM u"#;

/// [`COMPLETE_UNKEYED`] skipping the job rows another session holds: the rows it could
/// not lock that are still this owner's running attempt come back with `done` false
/// (busy), and nothing is written for them.
pub(super) const COMPLETE_UNKEYED_SKIPPING: &str = r#"/* leasehold:complete_unkeyed_skipping */
WITH c AS (
    SELECT * FROM unnest($1::int8[], $2::int8[], $3::jsonb[], $6::uuid[])
      AS t(id, generation, result, identity)
), l AS MATERIALIZED (
    SELECT j.id FROM {s}.jobs j
    WHERE j.id = ANY ($1) AND j.owner = $4 AND j.state = 'running' AND j.job_key IS NULL
    FOR UPDATE OF j SKIP LOCKED
), u AS (
    UPDATE {s}.jobs j
    SET state = 'done', result = c.result, finished_at = clock_timestamp(), lease_until = NULL
    FROM c JOIN l ON l.id = c.id
    WHERE j.id = c.id AND j.owner = $4 AND j.generation = c.generation
      AND j.effect_identity = c.identity AND j.state = 'running' AND j.job_key IS NULL
    RETURNING j.id, j.generation, j.effect_identity
), ev AS (
    INSERT INTO {s}.job_events (job_id, generation, event, owner, at)
    SELECT id, generation, 'completed', $4, clock_timestamp() FROM u WHERE $5
)
SELECT id, generation, effect_identity::text AS identity, true AS done FROM u
UNION ALL
SELECT c.id, c.generation, c.identity::text, false FROM c
WHERE NOT EXISTS (SELECT 1 FROM l WHERE l.id = c.id)
  AND EXISTS (SELECT 1 FROM {s}.jobs j
              WHERE j.id = c.id AND j.generation = c.generation AND j.owner = $4
                AND j.effect_identity = c.identity AND j.state = 'running'
                AND j.job_key IS NULL)"#;

pub(super) const COMPLETION_READBACK: &str = r#"/* leasehold:completion_readback */
SELECT id, state, generation, owner, effect_identity::text AS identity, result
FROM {s}.jobs WHERE id = ANY($1)"#;

pub(super) const JOB_ROW_EXISTS: &str = r#"/* leasehold:job_row_exists */
SELECT EXISTS (SELECT 1 FROM {s}.jobs WHERE id = $1 AND effect_identity = $2::uuid)"#;

pub(super) const KEYS_OF: &str = r#"/* leasehold:keys_of */
SELECT id, queue, job_key FROM {s}.jobs WHERE id = ANY($1) AND job_key IS NOT NULL"#;

/// One completion of a batch: the attempt and its result.
pub(crate) type Item = (Attempt, Option<serde_json::Value>);

/// What [`Store::complete_keyed`] wrote for one item: its outcome (`None` when its key
/// was busy and nothing was written), and the key's successor if one was claimed, with
/// the moment the claiming statement was sent.
pub(crate) type KeyedOutcome = (Option<CompleteOutcome>, Option<(ClaimedJob, Instant)>);

/// A keyed completion for [`Store::complete_keyed`]: the item, its key, and whether
/// to claim the key's successor for the completing scheduler.
pub(crate) struct KeyedItem {
    pub item: Item,
    pub key: KeyRef,
    pub chain: bool,
}

/// How a completion treats the rows (key rows, job rows) other transactions hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RowWait {
    /// Skip them: those items are not written, and come back busy.
    Skip,
    /// Wait for them as long as the session's `lock_timeout` allows.
    Session,
    /// Wait for them at most this long (at least 1 ms), whatever the session allows.
    AtMost(Duration),
}

impl RowWait {
    /// As `complete_keyed`'s `p_wait_ms`: NULL, 0, or the bound in milliseconds.
    fn millis(self) -> Option<i32> {
        match self {
            RowWait::Skip => None,
            RowWait::Session => Some(0),
            RowWait::AtMost(d) => Some(i32::try_from(d.as_millis()).unwrap_or(i32::MAX).max(1)),
        }
    }
}

/// How a keyed completion treats its key rows and its job rows other transactions hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KeyedWait {
    pub keys: RowWait,
    pub rows: RowWait,
}

impl KeyedWait {
    /// Both as long as the session's `lock_timeout` allows.
    pub const SESSION: KeyedWait = KeyedWait {
        keys: RowWait::Session,
        rows: RowWait::Session,
    };
}

impl Store {
    /// Refuse a result that cannot be stored or read back: a NUL, nesting deeper than
    /// [`MAX_PAYLOAD_DEPTH`](super::MAX_PAYLOAD_DEPTH), or more than
    /// [`StoreOptions::max_result_bytes`](super::StoreOptions::max_result_bytes).
    fn check_result(&self, result: &Option<serde_json::Value>) -> Result<()> {
        if let Some(value) = result {
            let limit = JsonLimit {
                bytes: self.options().max_result_bytes,
                name: "store.max_result_bytes",
            };
            check_json("result", value, &limit)?;
        }
        Ok(())
    }

    /// Complete a claimed job, storing `result`. Promotes the key's successor in the
    /// same transaction. A result that cannot be stored or read back is refused with
    /// [`Error::InvalidInput`](crate::Error::InvalidInput) for `result` (see
    /// [`Store::complete_in`]); nothing is written and the job stays running.
    pub async fn complete(
        &self,
        fence: &Fence,
        result: Option<serde_json::Value>,
    ) -> Result<CompleteOutcome> {
        let mut conn = self.acquire().await?;
        self.check_result(&result)?;
        self.complete_on(&mut conn, fence, result).await
    }

    /// Complete inside the caller's transaction, together with its business writes:
    /// both commit or neither does. A `Stale` outcome means the caller must roll back
    /// its own writes (leasehold does not abort the caller's transaction for it).
    ///
    /// A keyed job's key row is locked until the caller commits: keep the transaction
    /// short (the key's next job cannot start before it ends). A handler calls
    /// [`JobContext::complete_in`](crate::JobContext::complete_in), which has an example.
    ///
    /// A result with a NUL, nested deeper than
    /// [`MAX_PAYLOAD_DEPTH`](super::MAX_PAYLOAD_DEPTH) levels, or larger than
    /// [`StoreOptions::max_result_bytes`](super::StoreOptions::max_result_bytes) is
    /// refused before anything is sent ([`Error::InvalidInput`](crate::Error::InvalidInput)
    /// for `result`): the caller's transaction is untouched and the job still running,
    /// so it can complete with another result. The statements run in a savepoint of the
    /// caller's transaction, so a failure of theirs leaves it usable too.
    pub async fn complete_in(
        &self,
        conn: &mut PgConnection,
        fence: &Fence,
        result: Option<serde_json::Value>,
    ) -> Result<CompleteOutcome> {
        self.check_result(&result)?;
        super::exec::refuse_hidden_transaction(conn).await?;
        self.complete_on(conn, fence, result).await
    }

    /// [`Store::complete_in`] once the result is checked and `conn` is known to be the
    /// store's own or inside a transaction sqlx began.
    async fn complete_on(
        &self,
        conn: &mut PgConnection,
        fence: &Fence,
        result: Option<serde_json::Value>,
    ) -> Result<CompleteOutcome> {
        let on = self.history_from();
        let first = self.complete_once(conn, fence, &result).await;
        match self.history_refused(on, first) {
            Ok(done) => done,
            Err(refused) => {
                let second =
                    super::history::without_history(self.complete_once(conn, fence, &result)).await;
                self.after_history_retry("complete", refused, second)
            }
        }
    }

    /// One try of [`Store::complete_on`], in a transaction (a savepoint inside the
    /// caller's) of its own.
    async fn complete_once(
        &self,
        conn: &mut PgConnection,
        fence: &Fence,
        result: &Option<serde_json::Value>,
    ) -> Result<CompleteOutcome> {
        let mut tx = self.begin(conn).await?;
        let row = sqlx::query(&self.sql().complete)
            .bind(fence.job.0)
            .bind(fence.owner.as_str())
            .bind(fence.generation.0)
            .bind(result)
            .bind(self.full_history())
            .bind(fence.identity.as_str())
            .fetch_optional(self.on(&mut tx))
            .await?;
        let Some(row) = row else {
            tx.rollback().await?;
            let attempt = fence.attempt();
            let mut back = self
                .completion_readback(conn, &fence.owner, std::slice::from_ref(&attempt))
                .await?;
            return Ok(back.remove(&attempt).unwrap_or(CompleteOutcome::Stale));
        };
        let key: Option<String> = row.try_get("job_key")?;
        if let Some(key) = key {
            self.end_heads(&mut tx, &[(row.try_get("queue")?, key)])
                .await?;
        }
        tx.commit().await?;
        Ok(CompleteOutcome::Completed)
    }

    /// Complete many jobs of one owner (keyed or not) in one transaction. Outcomes come
    /// back in input order. One result that cannot be stored (as [`Store::complete`]
    /// says) refuses the batch before anything is written.
    pub async fn complete_many(
        &self,
        owner: &OwnerId,
        items: &[Item],
    ) -> Result<Vec<CompleteOutcome>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        for (_, result) in items {
            self.check_result(result)?;
        }
        let ids: Vec<i64> = items.iter().map(|i| i.0.job.0).collect();
        let keys: HashMap<i64, KeyRef> = sqlx::query(&self.sql().keys_of)
            .bind(&ids)
            .fetch_all(self.db())
            .await?
            .iter()
            .map(|r| {
                Ok((
                    r.try_get("id")?,
                    (r.try_get("queue")?, r.try_get("job_key")?),
                ))
            })
            .collect::<Result<_>>()?;
        let (keyed, unkeyed): (Vec<&Item>, Vec<&Item>) =
            items.iter().partition(|i| keys.contains_key(&i.0.job.0));
        let mut outcomes: HashMap<Attempt, CompleteOutcome> = HashMap::new();
        if !keyed.is_empty() {
            let batch: Vec<KeyedItem> = keyed
                .iter()
                .map(|i| KeyedItem {
                    item: (*i).clone(),
                    key: keys[&i.0.job.0].clone(),
                    chain: false,
                })
                .collect();
            for (k, (outcome, _)) in batch.iter().zip(
                self.complete_keyed(owner, &batch, None, KeyedWait::SESSION)
                    .await?,
            ) {
                outcomes.insert(k.item.0.clone(), outcome.unwrap_or(CompleteOutcome::Stale));
            }
        }
        if !unkeyed.is_empty() {
            let batch: Vec<Item> = unkeyed.into_iter().cloned().collect();
            // Waiting for held rows, so none comes back busy.
            for (i, outcome) in batch.iter().zip(
                self.complete_unkeyed(owner, &batch, RowWait::Session)
                    .await?,
            ) {
                outcomes.insert(i.0.clone(), outcome.unwrap_or(CompleteOutcome::Stale));
            }
        }
        Ok(items
            .iter()
            .map(|i| outcomes.remove(&i.0).unwrap_or(CompleteOutcome::Stale))
            .collect())
    }

    /// Complete keyed jobs in one transaction: lock their key rows in key order, complete
    /// the jobs, leave the keys, promote (and, where `chain` is set and a [`Chain`] is
    /// given, claim) each key's successor.
    ///
    /// With [`RowWait::Skip`] for `keys` (or `rows`), a key row (or a job row) that another
    /// transaction holds is skipped, not waited for: that item's outcome is `None`
    /// (nothing written) and the caller writes it again waiting, in a transaction of its
    /// own, so one key held by a host's open transaction (or one job row a report holds)
    /// does not hold up the rest of the batch. Each
    /// outcome comes with the successor claimed for it, if any, and the moment the
    /// claiming statement was sent, after every wait for a lock: its lease counts from
    /// then (`clock_timestamp()` in the statement), not from the batch's start.
    #[tracing::instrument(name = "leasehold.complete_keyed", level = "debug", skip_all, fields(n = batch.len(), wait = ?wait))]
    pub(crate) async fn complete_keyed(
        &self,
        owner: &OwnerId,
        batch: &[KeyedItem],
        chain: Option<&Chain<'_>>,
        wait: KeyedWait,
    ) -> Result<Vec<KeyedOutcome>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        self.unless_history_refused("complete_keyed", || {
            self.complete_keyed_once(owner, batch, chain, wait)
        })
        .await
    }

    async fn complete_keyed_once(
        &self,
        owner: &OwnerId,
        batch: &[KeyedItem],
        chain: Option<&Chain<'_>>,
        wait: KeyedWait,
    ) -> Result<Vec<KeyedOutcome>> {
        let mut conn = self.acquire().await?;
        let sent = Instant::now();
        let col = |f: fn(&KeyedItem) -> &str| batch.iter().map(f).collect::<Vec<&str>>();
        let ids: Vec<i64> = batch.iter().map(|k| k.item.0.job.0).collect();
        let gens: Vec<i64> = batch.iter().map(|k| k.item.0.generation.0).collect();
        let identities: Vec<&str> = batch.iter().map(|k| k.item.0.identity.as_str()).collect();
        let results: Vec<Option<serde_json::Value>> =
            batch.iter().map(|k| k.item.1.clone()).collect();
        let chain_wanted: Vec<bool> = batch.iter().map(|k| k.chain && chain.is_some()).collect();
        let rows = sqlx::query(&self.sql().complete_keyed)
            .bind(&ids)
            .bind(&gens)
            .bind(&results)
            .bind(col(|k| k.key.0.as_str()))
            .bind(col(|k| k.key.1.as_str()))
            .bind(&chain_wanted)
            .bind(wait.keys.millis())
            .bind(owner.as_str())
            .bind(chain.map(|c| c.kinds))
            .bind(chain.map(|c| secs(c.lease)).unwrap_or(0.0))
            .bind(self.full_history())
            .bind(self.schema().channel())
            .bind(wait.rows.millis())
            .bind(&identities)
            .fetch_all(self.on(&mut conn))
            .await?;
        let mut busy: HashSet<Attempt> = HashSet::new();
        let mut done: HashSet<Attempt> = HashSet::new();
        // Each successor belongs to the item that ended its key's head.
        let mut next: HashMap<KeyRef, (ClaimedJob, Instant)> = HashMap::new();
        for row in &rows {
            match row.try_get::<String, _>("row_kind")?.as_str() {
                "busy" => {
                    busy.insert(attempt_of(row)?);
                }
                "done" => {
                    done.insert(attempt_of(row)?);
                }
                _ => {
                    let (Some(chain), Some(key)) =
                        (chain, row.try_get::<Option<String>, _>("job_key")?)
                    else {
                        continue;
                    };
                    let after: f64 = row
                        .try_get::<Option<f64>, _>("claimed_after_secs")?
                        .unwrap_or(0.0);
                    let leased_from = sent + Duration::from_secs_f64(after.max(0.0));
                    let job = claimed_from_row(row, chain.owner)?;
                    next.insert((job.queue.clone(), key), (job, leased_from));
                }
            }
        }
        let missing: Vec<Attempt> = batch
            .iter()
            .map(|k| k.item.0.clone())
            .filter(|a| !busy.contains(a) && !done.contains(a))
            .collect();
        let mut back = if missing.is_empty() {
            HashMap::new()
        } else {
            self.completion_readback(&mut conn, owner, &missing).await?
        };
        Ok(batch
            .iter()
            .map(|k| {
                let attempt = &k.item.0;
                if busy.contains(attempt) {
                    (None, None)
                } else if done.contains(attempt) {
                    (Some(CompleteOutcome::Completed), next.remove(&k.key))
                } else {
                    (
                        Some(back.remove(attempt).unwrap_or(CompleteOutcome::Stale)),
                        None,
                    )
                }
            })
            .collect())
    }

    /// Complete jobs the caller believes unkeyed (the completion batcher's common case):
    /// one statement in its own implicit transaction, no BEGIN/COMMIT round trips and
    /// no key row, since there is no successor to promote. The statement skips keyed
    /// rows, so whatever it did not complete (a keyed job after all, a lost fence, a
    /// completion already committed) goes through [`Store::complete_many`], which
    /// promotes or tells the cases apart.
    ///
    /// With [`RowWait::Skip`], a job row another session holds is not waited for: its
    /// outcome is `None` (nothing written) and the caller writes it again alone, waiting.
    /// The other two wait (and never return `None`); [`RowWait::AtMost`] fails with a lock
    /// timeout when its bound passes.
    #[tracing::instrument(name = "leasehold.complete", level = "debug", skip_all, fields(n = items.len(), wait = ?wait))]
    pub(crate) async fn complete_unkeyed(
        &self,
        owner: &OwnerId,
        items: &[Item],
        wait: RowWait,
    ) -> Result<Vec<Option<CompleteOutcome>>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<(i64, i64, String, bool)> = self
            .unless_history_refused("complete", || {
                self.complete_unkeyed_once(owner, items, wait)
            })
            .await?;
        let raw = |i: &Item| {
            (
                i.0.job.0,
                i.0.generation.0,
                i.0.identity.as_str().to_owned(),
            )
        };
        let pair = |r: &(i64, i64, String, bool)| (r.0, r.1, r.2.clone());
        let done: HashSet<(i64, i64, String)> = rows.iter().filter(|r| r.3).map(pair).collect();
        let busy: HashSet<(i64, i64, String)> = rows.iter().filter(|r| !r.3).map(pair).collect();
        if done.len() == items.len() {
            return Ok(vec![Some(CompleteOutcome::Completed); items.len()]);
        }
        let rest: Vec<Item> = items
            .iter()
            .filter(|i| !done.contains(&raw(i)) && !busy.contains(&raw(i)))
            .cloned()
            .collect();
        let mut rest_outcomes = if rest.is_empty() {
            Vec::new().into_iter()
        } else {
            self.complete_leftovers(owner, &rest).await?.into_iter()
        };
        Ok(items
            .iter()
            .map(|i| {
                if done.contains(&raw(i)) {
                    Some(CompleteOutcome::Completed)
                } else if busy.contains(&raw(i)) {
                    None
                } else {
                    Some(rest_outcomes.next().unwrap_or(CompleteOutcome::Stale))
                }
            })
            .collect())
    }

    /// One try of [`Store::complete_unkeyed`]'s statement: (id, generation, identity,
    /// done) rows, `done` false for a row skipped because another session holds it.
    async fn complete_unkeyed_once(
        &self,
        owner: &OwnerId,
        items: &[Item],
        wait: RowWait,
    ) -> Result<Vec<(i64, i64, String, bool)>> {
        let ids: Vec<i64> = items.iter().map(|i| i.0.job.0).collect();
        let gens: Vec<i64> = items.iter().map(|i| i.0.generation.0).collect();
        let identities: Vec<&str> = items.iter().map(|i| i.0.identity.as_str()).collect();
        let results: Vec<Option<serde_json::Value>> = items.iter().map(|i| i.1.clone()).collect();
        let sql = match wait {
            RowWait::Skip => &self.sql().complete_unkeyed_skipping,
            RowWait::Session | RowWait::AtMost(_) => &self.sql().complete_unkeyed,
        };
        let query = sqlx::query_as(sql)
            .bind(ids)
            .bind(gens)
            .bind(results)
            .bind(owner.as_str())
            .bind(self.full_history())
            .bind(identities);
        let query = match wait {
            RowWait::Skip => query,
            RowWait::Session | RowWait::AtMost(_) => query.bind(wait.millis().filter(|ms| *ms > 0)),
        };
        Ok(query.fetch_all(self.db()).await?)
    }

    /// What the unkeyed statement did not complete: keyed jobs go through the keyed path;
    /// the rest are lost fences or replays, told apart by the read-back.
    async fn complete_leftovers(
        &self,
        owner: &OwnerId,
        rest: &[Item],
    ) -> Result<Vec<CompleteOutcome>> {
        let ids: Vec<i64> = rest.iter().map(|i| i.0.job.0).collect();
        let keyed: i64 = sqlx::query(&self.sql().keys_of)
            .bind(&ids)
            .fetch_all(self.db())
            .await?
            .len() as i64;
        if keyed > 0 {
            return Box::pin(self.complete_many(owner, rest)).await;
        }
        let mut conn = self.acquire().await?;
        let attempts: Vec<Attempt> = rest.iter().map(|i| i.0.clone()).collect();
        let mut back = self
            .completion_readback(&mut conn, owner, &attempts)
            .await?;
        Ok(attempts
            .iter()
            .map(|a| back.remove(a).unwrap_or(CompleteOutcome::Stale))
            .collect())
    }

    /// Ask again after a lost reply: was this generation's completion committed?
    pub async fn completion_status(&self, fence: &Fence) -> Result<CompleteOutcome> {
        let mut conn = self.acquire().await?;
        let attempt = fence.attempt();
        let mut back = self
            .completion_readback(&mut conn, &fence.owner, std::slice::from_ref(&attempt))
            .await?;
        Ok(back.remove(&attempt).unwrap_or(CompleteOutcome::Stale))
    }

    /// Whether the job of `fence` still has its row (the same id and identity), in any
    /// state.
    pub(crate) async fn attempt_row_exists(&self, fence: &Fence) -> Result<bool> {
        Ok(sqlx::query_scalar(&self.sql().job_row_exists)
            .bind(fence.job.0)
            .bind(fence.identity.as_str())
            .fetch_one(self.db())
            .await?)
    }

    async fn completion_readback(
        &self,
        conn: &mut PgConnection,
        owner: &OwnerId,
        items: &[Attempt],
    ) -> Result<HashMap<Attempt, CompleteOutcome>> {
        let ids: Vec<i64> = items.iter().map(|a| a.job.0).collect();
        let rows = sqlx::query(&self.sql().completion_readback)
            .bind(&ids)
            .fetch_all(self.on(&mut *conn))
            .await?;
        let mut out = HashMap::new();
        for row in rows {
            let id = JobId(row.try_get("id")?);
            let state: String = row.try_get("state")?;
            let generation = Generation(row.try_get("generation")?);
            let row_owner: Option<String> = row.try_get("owner")?;
            let identity: String = row.try_get("identity")?;
            let ours = state == "done" && row_owner.as_deref() == Some(owner.as_str());
            for wanted in items.iter().filter(|a| a.job == id) {
                let same = wanted.generation == generation && wanted.identity.as_str() == identity;
                let outcome = if ours && same {
                    CompleteOutcome::AlreadyCompleted {
                        result: row.try_get("result").unwrap_or(None),
                    }
                } else {
                    CompleteOutcome::Stale
                };
                out.insert(wanted.clone(), outcome);
            }
        }
        Ok(out)
    }
}

/// The attempt a `complete_keyed` row names (its id, generation and identity).
fn attempt_of(row: &sqlx::postgres::PgRow) -> Result<Attempt> {
    let identity: String = row.try_get("effect_identity")?;
    Ok(Attempt {
        job: JobId(row.try_get("id")?),
        generation: Generation(row.try_get("generation")?),
        identity: EffectIdentity::parse(&identity).ok_or_else(|| crate::Error::Decode {
            what: "effect identity",
            reason: format!("{identity:?} is not a UUID"),
        })?,
    })
}
