//! Retention: delete done and cancelled jobs past the policy (with their history, expiry
//! records and expired effect outcomes), expired effect-ledger rows, old periodic fire
//! records, and key rows no job refers to any more.
//!
//! # What a pass costs
//! What is due, never the retained history. Each pass reads the database clock once and
//! passes its cutoff to every statement as a value, so each index scan stops at it:
//! the jobs scan walks `jobs_prunable` (done and cancelled jobs only, by the moment
//! retention may count from; migration 20) up to the cutoff, the ledger scan
//! `effects_expiry` up to the pass's start. The key pass reads only the keys some of
//! whose jobs retention deleted (`idle_keys`, written by the jobs statement), and asks of
//! each whether a job is left through the partial indexes that together hold every
//! state. A pass with nothing due reads an index entry or two per statement.
//!
//! # One process at a time
//! Every retention transaction first tries a transaction-level advisory lock of the
//! schema (`pg_try_advisory_xact_lock`, never waiting): while one process prunes, the
//! others skip their pass ([`PruneReport::skipped`]). Only retention deletes jobs or
//! `idle_keys` rows, so under that lock the key pass's snapshot is not overtaken by a
//! deletion of a job of its keys.
//!
//! # Never in a producer's way
//! Candidates are locked `SKIP LOCKED`: a row someone holds is left for a later pass.
//! A deleted key row's slot floor (`key_floors`) must be raised before the key can come
//! back, and a keyed enqueue reads its slots' floors `FOR SHARE` until it commits: the
//! floors are raised in a transaction of their own, of one short UPDATE (slots an
//! enqueue holds are skipped), committed before any key row is deleted, and a key row
//! goes only when its `next_seq` is at or below its slot's committed floor and is still
//! the value this statement read (any enqueue of the key since moved it). A keyed
//! enqueue therefore waits at most for that UPDATE, whatever the batch; one of a key
//! whose row is being deleted right now (it had no job left) waits for that statement.
//!
//! # Timeouts
//! Each transaction sets its own `statement_timeout` and `lock_timeout` (`SET LOCAL`,
//! so it holds behind a transaction pooler too) and plans without sequential or bitmap
//! scans (no statistics needed). A statement that hits the timeout is tried again at
//! once with half the batch ([`PruneReport::batch`] says where the pass ended).

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Postgres, Row, Transaction};

use super::{secs, Store};
use crate::error::{Error, Result};

/// Default [`PruneOptions::batch`]: rows of each kind deleted per statement.
pub const DEFAULT_PRUNE_BATCH: i64 = 10_000;

/// Default [`PruneOptions::statement_timeout`]: 10 s.
pub const DEFAULT_PRUNE_STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);

/// How one retention pass runs: [`Store::prune_with`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PruneOptions {
    /// Done and cancelled jobs that finished longer ago than this are deleted (a unique
    /// job once its window has ended too, counted from the later of the two).
    pub keep: Duration,
    /// Most rows of each kind one statement deletes, at least 1. Default
    /// [`DEFAULT_PRUNE_BATCH`]. Halved for the rest of the pass at each statement that
    /// hits `statement_timeout`.
    pub batch: i64,
    /// The bound of each of the pass's statements (`SET LOCAL statement_timeout` and
    /// `lock_timeout`, whatever the pool's sessions set). Default
    /// [`DEFAULT_PRUNE_STATEMENT_TIMEOUT`].
    pub statement_timeout: Duration,
    /// Delete idle key rows too. Default true; the reaper does it every few passes.
    pub keys: bool,
}

impl PruneOptions {
    /// Keep done and cancelled jobs `keep`; the other fields at their defaults.
    pub fn new(keep: Duration) -> Self {
        PruneOptions {
            keep,
            batch: DEFAULT_PRUNE_BATCH,
            statement_timeout: DEFAULT_PRUNE_STATEMENT_TIMEOUT,
            keys: true,
        }
    }
}

/// What a retention pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct PruneReport {
    /// Done and cancelled jobs deleted, with their history and expiry records.
    pub jobs: u64,
    /// Effect-ledger rows deleted.
    pub effects: u64,
    /// Key rows deleted (no job referred to them any more).
    pub keys: u64,
    /// Periodic fire records deleted.
    pub fires: u64,
    /// Candidate rows the pass's statements read: jobs and ledger rows found due, fire
    /// records, and keys whose jobs retention had deleted. With nothing due, 0.
    pub read: u64,
    /// Another process was pruning this schema: this pass did nothing.
    pub skipped: bool,
    /// Statements that hit the statement timeout (each tried again with half the batch).
    pub timeouts: u32,
    /// The batch the pass ended with: the one asked for, unless statements timed out.
    pub batch: i64,
    /// How long the pass took.
    #[serde(with = "crate::config::humantime_serde")]
    pub elapsed: Duration,
}

impl PruneReport {
    /// Rows the pass deleted, of every kind.
    pub fn deleted(&self) -> u64 {
        self.jobs + self.effects + self.keys + self.fires
    }

    /// This pass's figures added to `self` (a run of passes, as `leasehold prune` makes).
    pub fn add(&mut self, pass: &PruneReport) {
        self.jobs += pass.jobs;
        self.effects += pass.effects;
        self.keys += pass.keys;
        self.fires += pass.fires;
        self.read += pass.read;
        self.skipped |= pass.skipped;
        self.timeouts += pass.timeouts;
        self.batch = pass.batch;
        self.elapsed += pass.elapsed;
    }
}

/// One process prunes a schema at a time (see the module docs).
const TRY_LOCK: &str =
    "SELECT pg_try_advisory_xact_lock(hashtext('leasehold.retention'), hashtext($1))";

/// The jobs due, oldest first, through `jobs_prunable` up to the cutoff (`$1` the pass's
/// clock, `$2` the retention in seconds); their history, expiry records and expired
/// effect outcomes go with them, and their keys become candidates of the key pass.
pub(super) const PRUNE_JOBS: &str = r#"/* leasehold:prune_jobs */
WITH cand AS MATERIALIZED (
    SELECT id FROM {s}.jobs
    WHERE greatest(finished_at, unique_until) < $1::timestamptz - make_interval(secs => $2)
      AND state IN ('done', 'cancelled')
    ORDER BY greatest(finished_at, unique_until)
    LIMIT $3
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {s}.jobs j USING cand
    WHERE j.id = cand.id AND j.state IN ('done', 'cancelled')
    RETURNING j.id, j.queue, j.job_key
), ev AS (
    DELETE FROM {s}.job_events WHERE job_id IN (SELECT id FROM gone)
), le AS (
    DELETE FROM {s}.lease_expiries WHERE job_id IN (SELECT id FROM gone)
), ef AS (
    DELETE FROM {s}.effects WHERE job_id IN (SELECT id FROM gone) AND keep_until < $1
    RETURNING 1
), marked AS (
    INSERT INTO {s}.idle_keys (queue, job_key)
    SELECT DISTINCT queue, job_key FROM gone WHERE job_key IS NOT NULL
    ON CONFLICT DO NOTHING
)
SELECT (SELECT count(*) FROM cand) AS read, (SELECT count(*) FROM gone) AS jobs,
       (SELECT count(*) FROM ef) AS effects"#;

/// Ledger rows past their `keep_until` (`$1`, the pass's clock) whose job is gone or
/// finished for good. An outcome is kept while its job may run again: a dead job can be
/// retried by an operator, and a retry must find what its earlier attempts did.
pub(super) const PRUNE_EFFECTS: &str = r#"/* leasehold:prune_effects */
WITH cand AS MATERIALIZED (
    SELECT x.effect_key FROM {s}.effects x
    LEFT JOIN LATERAL (SELECT j.state FROM {s}.jobs j WHERE j.id = x.job_id LIMIT 1) j ON true
    WHERE x.keep_until < $1::timestamptz
      AND (j.state IS NULL OR j.state IN ('done', 'cancelled'))
    ORDER BY x.keep_until
    LIMIT $2
), gone AS (
    DELETE FROM {s}.effects e USING cand
    WHERE e.effect_key = cand.effect_key
      AND NOT EXISTS (SELECT 1 FROM {s}.jobs j
                      WHERE j.id = e.job_id AND j.state NOT IN ('done', 'cancelled'))
    RETURNING 1
)
SELECT (SELECT count(*) FROM cand) AS read, (SELECT count(*) FROM gone) AS deleted"#;

/// Periodic fire records past retention: a schedule never fires a time at or before its
/// `last_fire_at`, so old records guard nothing.
pub(super) const PRUNE_FIRES: &str = r#"/* leasehold:prune_periodic_fires */
WITH cand AS MATERIALIZED (
    SELECT x.name, x.fire_at FROM {s}.periodic_fires x
    WHERE x.enqueued_at < $1::timestamptz - make_interval(secs => $2)
    ORDER BY x.enqueued_at
    LIMIT $3
), gone AS (
    DELETE FROM {s}.periodic_fires f USING cand
    WHERE f.name = cand.name AND f.fire_at = cand.fire_at
    RETURNING 1
)
SELECT (SELECT count(*) FROM cand) AS read, (SELECT count(*) FROM gone) AS deleted"#;

/// The key pass's candidates (`idle_keys`, at most `$1`) as this statement's snapshot
/// has them: whether the key row exists, its `next_seq` and slot floor, and whether a job
/// of the key is left, asked of the three partial indexes that together hold every state
/// (a question about `jobs` without a state no partial index answers: it read the table
/// once per key). Each probe is a LATERAL with LIMIT, so it stays a probe per key: as an
/// EXISTS, the planner may hash the whole index once instead (200,000 entries read for
/// 1,000 keys).
const KEY_CANDIDATES: &str = r#"marks AS MATERIALIZED (
    SELECT ik.queue, ik.job_key FROM {s}.idle_keys ik ORDER BY ik.queue, ik.job_key LIMIT $1
), seen AS MATERIALIZED (
    SELECT m.queue, m.job_key, jk.next_seq, jk.queue IS NOT NULL AS has_row, f.floor,
           __SLOT_M__ AS slot,
           (jk.open_jobs > 0 OR o.one IS NOT NULL OR w.one IS NOT NULL OR e.one IS NOT NULL)
               AS has_jobs
    FROM marks m
    LEFT JOIN {s}.job_keys jk ON jk.queue = m.queue AND jk.job_key = m.job_key
    LEFT JOIN {s}.key_floors f ON f.slot = __SLOT_M__
    LEFT JOIN LATERAL (
        SELECT 1 AS one FROM {s}.jobs j WHERE j.queue = m.queue AND j.job_key = m.job_key
          AND j.state IN ('pending', 'running', 'held', 'dead') LIMIT 1) o ON true
    LEFT JOIN LATERAL (
        SELECT 1 AS one FROM {s}.jobs j WHERE j.queue = m.queue AND j.job_key = m.job_key
          AND j.state = 'waiting' LIMIT 1) w ON true
    LEFT JOIN LATERAL (
        SELECT 1 AS one FROM {s}.jobs j WHERE j.job_key = m.job_key AND j.queue = m.queue
          AND j.state IN ('done', 'cancelled') LIMIT 1) e ON true
)"#;

/// The floors the key pass needs: per slot, the highest `next_seq` of its candidates with
/// no job left.
pub(super) fn prune_key_tops() -> String {
    format!(
        "/* leasehold:prune_key_tops */\nWITH {KEY_CANDIDATES}\n\
         SELECT slot, max(next_seq) AS top FROM seen\n\
         WHERE has_row AND NOT has_jobs AND next_seq > floor GROUP BY slot"
    )
}

/// Raise those floors, in a transaction of their own that holds the floor rows for this
/// statement only; a slot a keyed enqueue holds (`FOR SHARE`, until it commits) is
/// skipped, and its keys wait for a later pass.
pub(super) const RAISE_FLOORS: &str = r#"/* leasehold:prune_raise_floors */
WITH l AS MATERIALIZED (
    SELECT f.slot, t.top
    FROM {s}.key_floors f JOIN unnest($1::int4[], $2::int8[]) AS t(slot, top) ON f.slot = t.slot
    WHERE f.floor < t.top
    ORDER BY f.slot
    FOR UPDATE OF f SKIP LOCKED
)
UPDATE {s}.key_floors f SET floor = greatest(f.floor, l.top) FROM l WHERE f.slot = l.slot"#;

/// Delete the candidates' key rows that have no job left and are covered by their
/// slot's committed floor, unless an enqueue moved them since this statement's snapshot
/// (`next_seq` changed) or holds them now (`SKIP LOCKED`); forget the candidates whose
/// row went, was gone, or still has jobs (deleting those jobs makes them candidates
/// again).
pub(super) fn prune_keys() -> String {
    format!(
        r#"/* leasehold:prune_keys */
WITH {KEY_CANDIDATES}, locked AS MATERIALIZED (
    SELECT jk.queue, jk.job_key, s.next_seq
    FROM {{s}}.job_keys jk JOIN seen s ON jk.queue = s.queue AND jk.job_key = s.job_key
    WHERE s.has_row AND NOT s.has_jobs AND s.next_seq <= s.floor
    ORDER BY jk.queue, jk.job_key
    FOR UPDATE OF jk SKIP LOCKED
), gone AS (
    DELETE FROM {{s}}.job_keys jk USING locked l
    WHERE jk.queue = l.queue AND jk.job_key = l.job_key
      AND jk.next_seq = l.next_seq AND jk.open_jobs = 0
    RETURNING jk.queue, jk.job_key
), forgotten AS (
    DELETE FROM {{s}}.idle_keys ik USING seen s
    WHERE ik.queue = s.queue AND ik.job_key = s.job_key
      AND (NOT s.has_row OR s.has_jobs
           OR EXISTS (SELECT 1 FROM gone g WHERE g.queue = s.queue AND g.job_key = s.job_key))
    RETURNING 1
)
SELECT (SELECT count(*) FROM seen) AS read, (SELECT count(*) FROM gone) AS deleted,
       (SELECT count(*) FROM forgotten) AS forgotten"#
    )
}

/// The retention transaction's settings: its own bounds, and plans that need no
/// statistics: every statement is "for each candidate, probe an index", and on a table
/// never analyzed the planner may otherwise scan or hash a whole table.
fn begin_sql(timeout: Duration) -> String {
    let ms = timeout.as_millis().max(1);
    format!(
        "BEGIN; SET LOCAL statement_timeout = {ms}; SET LOCAL lock_timeout = {ms}; \
         SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; \
         SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off; SET LOCAL jit = off"
    )
}

/// The statement hit `statement_timeout` or `lock_timeout`.
fn timed_out(e: &Error) -> bool {
    matches!(e, Error::Database(sqlx::Error::Database(db))
        if matches!(db.code().as_deref(), Some("57014" | "55P03")))
}

/// Counts a statement returned: (rows read, rows deleted).
type Counts = (i64, i64);

impl Store {
    /// The retention policy with the default batch and timeouts: see
    /// [`Store::prune_with`]. `limit` is the batch.
    pub async fn prune(&self, keep: Duration, limit: i64) -> Result<PruneReport> {
        let mut options = PruneOptions::new(keep);
        options.batch = limit;
        self.prune_with(&options).await
    }

    /// One retention pass: delete done and cancelled jobs that finished more than
    /// `options.keep` ago (with their history, expiry records and expired effect
    /// outcomes), at most a batch per statement; effect-ledger rows past their
    /// `keep_until` whose job is gone or done or cancelled; periodic fire records older
    /// than `keep`; and, with `options.keys`, key rows no job refers to any more.
    ///
    /// Dead jobs are the dead-letter queue: never deleted here (an operator retries or
    /// cancels them). Every condition is checked on the rows being deleted, under their
    /// lock (`SKIP LOCKED`: prune never waits), so a job an operator retries at the same
    /// moment is never deleted. A key row goes only when no job of its key is left, and
    /// its slot's floor is raised to its `next_seq` first, so a key enqueued again later
    /// continues its `key_seq` where it left off (see `key_floors`).
    ///
    /// Its cost is what is due (see the module docs of `store::retention`), and one
    /// process prunes a schema at a time: while another does,
    /// [`PruneReport::skipped`] is set and nothing is done. A statement that hits
    /// `options.statement_timeout` is tried again with half the batch; one that times out
    /// with a batch of 1 is the error.
    pub async fn prune_with(&self, options: &PruneOptions) -> Result<PruneReport> {
        let started = Instant::now();
        let mut report = PruneReport {
            batch: options.batch.max(1),
            ..PruneReport::default()
        };
        let pass = self.prune_steps(options, &mut report).await;
        report.elapsed = started.elapsed();
        pass.map(|()| report)
    }

    async fn prune_steps(&self, options: &PruneOptions, report: &mut PruneReport) -> Result<()> {
        let keep = secs(options.keep);
        let timeout = options.statement_timeout;
        // The pass's clock, read once: every cutoff is a value, so index scans stop at it.
        let Some((now, (read, jobs), effects)) = self
            .shrinking(report, |store, batch| async move {
                store.prune_jobs(timeout, keep, batch).await
            })
            .await?
        else {
            report.skipped = true;
            return Ok(());
        };
        report.read += read as u64;
        report.jobs = jobs as u64;
        report.effects = effects as u64;
        for (sql, fires) in [
            (&self.sql().prune_effects, false),
            (&self.sql().prune_fires, true),
        ] {
            let Some((read, deleted)) = self
                .shrinking(report, |store, batch| async move {
                    store
                        .retention_counts(timeout, sql, now, fires.then_some(keep), batch)
                        .await
                })
                .await?
            else {
                report.skipped = true;
                return Ok(());
            };
            report.read += read as u64;
            if fires {
                report.fires = deleted as u64;
            } else {
                report.effects += deleted as u64;
            }
        }
        if options.keys {
            let Some((read, keys)) = self
                .shrinking(report, |store, batch| async move {
                    store.prune_keys(timeout, batch).await
                })
                .await?
            else {
                report.skipped = true;
                return Ok(());
            };
            report.read += read as u64;
            report.keys = keys as u64;
        }
        Ok(())
    }

    /// Run `step` with the report's batch, halving it at each timeout down to 1.
    async fn shrinking<'a, T, F, Fut>(&'a self, report: &mut PruneReport, step: F) -> Result<T>
    where
        F: Fn(&'a Store, i64) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        loop {
            match step(self, report.batch).await {
                Err(e) if timed_out(&e) && report.batch > 1 => {
                    report.timeouts += 1;
                    report.batch = (report.batch / 2).max(1);
                    tracing::warn!(error = %e, batch = report.batch,
                        "leasehold retention statement timed out; trying again with a smaller batch");
                }
                other => return other,
            }
        }
    }

    /// Begin a retention transaction on `conn` and take the schema's retention lock;
    /// `None` (rolled back) when another process holds it.
    async fn begin_retention<'c>(
        &self,
        conn: &'c mut PgConnection,
        timeout: Duration,
    ) -> Result<Option<Transaction<'c, Postgres>>> {
        let mut tx = sqlx::Connection::begin_with(conn, begin_sql(timeout)).await?;
        let locked: bool = sqlx::query_scalar(TRY_LOCK)
            .bind(self.schema().name())
            .fetch_one(self.on(&mut tx))
            .await?;
        if !locked {
            tx.rollback().await?;
            return Ok(None);
        }
        Ok(Some(tx))
    }

    /// The jobs statement, with the pass's clock read in its transaction: (the clock,
    /// (read, jobs deleted), effect outcomes deleted with them); `None` when another
    /// process prunes.
    async fn prune_jobs(
        &self,
        timeout: Duration,
        keep: f64,
        batch: i64,
    ) -> Result<Option<(DateTime<Utc>, Counts, i64)>> {
        let mut conn = self.pool().acquire().await?;
        let Some(mut tx) = self.begin_retention(&mut conn, timeout).await? else {
            return Ok(None);
        };
        let done = async {
            let now: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
                .fetch_one(self.on(&mut tx))
                .await?;
            let row = sqlx::query(&self.sql().prune_jobs)
                .bind(now)
                .bind(keep)
                .bind(batch)
                .fetch_one(self.on(&mut tx))
                .await?;
            Ok((
                now,
                (row.try_get("read")?, row.try_get("jobs")?),
                row.try_get("effects")?,
            ))
        }
        .await;
        finish(tx, done).await.map(Some)
    }

    /// A statement of the form `(read, deleted)` over `$1` the clock, then `$2` the
    /// retention (when `keep` is given) and the batch.
    async fn retention_counts(
        &self,
        timeout: Duration,
        sql: &str,
        now: DateTime<Utc>,
        keep: Option<f64>,
        batch: i64,
    ) -> Result<Option<Counts>> {
        let mut conn = self.pool().acquire().await?;
        let Some(mut tx) = self.begin_retention(&mut conn, timeout).await? else {
            return Ok(None);
        };
        let done = async {
            let mut query = sqlx::query(sql).bind(now);
            if let Some(keep) = keep {
                query = query.bind(keep);
            }
            let row = query.bind(batch).fetch_one(self.on(&mut tx)).await?;
            Ok((row.try_get("read")?, row.try_get("deleted")?))
        }
        .await;
        finish(tx, done).await.map(Some)
    }

    /// The key pass: raise the floors its candidates need (a transaction of its own),
    /// then delete the key rows those floors cover. (read, key rows deleted).
    async fn prune_keys(&self, timeout: Duration, batch: i64) -> Result<Option<Counts>> {
        let mut conn = self.pool().acquire().await?;
        let Some(mut tx) = self.begin_retention(&mut conn, timeout).await? else {
            return Ok(None);
        };
        let raised = async {
            let tops: Vec<(i32, i64)> = sqlx::query_as(&self.sql().prune_key_tops)
                .bind(batch)
                .fetch_all(self.on(&mut tx))
                .await?;
            if !tops.is_empty() {
                let (slots, tops): (Vec<i32>, Vec<i64>) = tops.into_iter().unzip();
                sqlx::query(&self.sql().raise_floors)
                    .bind(&slots)
                    .bind(&tops)
                    .execute(self.on(&mut tx))
                    .await?;
            }
            Ok(())
        }
        .await;
        finish(tx, raised).await?;
        let Some(mut tx) = self.begin_retention(&mut conn, timeout).await? else {
            return Ok(None);
        };
        let done = async {
            let row = sqlx::query(&self.sql().prune_keys)
                .bind(batch)
                .fetch_one(self.on(&mut tx))
                .await?;
            Ok((row.try_get("read")?, row.try_get("deleted")?))
        }
        .await;
        finish(tx, done).await.map(Some)
    }
}

/// Commit `tx` when its statements succeeded; roll it back at once otherwise (a dropped
/// transaction is rolled back only when its connection is next used, and until then it
/// would hold the retention lock, and the next try would find it taken).
async fn finish<T>(tx: Transaction<'_, Postgres>, done: Result<T>) -> Result<T> {
    match done {
        Ok(v) => {
            tx.commit().await?;
            Ok(v)
        }
        Err(e) => {
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}
