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
//! A deleted row's index entries stay until no snapshot can see it, so while one is open
//! (a backup) a scan from the oldest due job would walk every entry retention deleted
//! since. The jobs scan therefore resumes after the last job this process's previous pass
//! deleted (`jobs_prunable` orders by the moment, then id; migration 22), and starts from
//! the oldest due job again once a minute (a job locked when its turn came, or one whose
//! finish committed late, is picked up then).
//!
//! A due job too big to delete within the statement timeout even alone (a history of
//! millions of events) does not hold the rest back: the jobs statement leaves it out,
//! and each pass deletes its history a batch per statement ([`PruneReport::history`]),
//! then the job goes as the others do.
//!
//! # One process at a time
//! Every retention transaction first tries a transaction-level advisory lock of the
//! schema (`pg_try_advisory_xact_lock`, never waiting): while one process prunes, the
//! others skip their pass ([`PruneReport::skipped`]). A pass whose later transaction finds
//! the lock taken ends there (the other process's pass does the rest); it is reported
//! skipped only when it deleted nothing. Only retention deletes jobs or
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

/// Default [`PruneOptions::floor`]: a job is kept at least 5 minutes after it finished,
/// whatever `keep` says.
///
/// A worker whose ending's reply was lost (a cut connection, a restarted database)
/// reads the job's row back to learn whether its write committed. Once the attempt's
/// local lease deadline has passed, a row that is gone says nothing (this attempt's
/// completion, another generation's, or an operator's cancel, then pruned), and the
/// attempt is reported stale though its write may have committed. The floor keeps the
/// row for those read-backs: they come within seconds of the write, minutes through a
/// database restart.
pub const DEFAULT_PRUNE_FLOOR: Duration = Duration::from_secs(5 * 60);

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
    /// Nothing that finished less than this long ago is deleted, whatever `keep` says
    /// (the effective retention is the larger of the two). Default
    /// [`DEFAULT_PRUNE_FLOOR`]; lower it only where no worker can still be reading an
    /// ending back (a test's own schema, a schema whose workers are all stopped).
    pub floor: Duration,
}

impl PruneOptions {
    /// Keep done and cancelled jobs `keep`; the other fields at their defaults.
    pub fn new(keep: Duration) -> Self {
        PruneOptions {
            keep,
            batch: DEFAULT_PRUNE_BATCH,
            statement_timeout: DEFAULT_PRUNE_STATEMENT_TIMEOUT,
            keys: true,
            floor: DEFAULT_PRUNE_FLOOR,
        }
    }

    /// The retention this pass applies: `keep`, or the floor if that is longer.
    pub fn effective_keep(&self) -> Duration {
        self.keep.max(self.floor)
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
    /// History rows deleted ahead of their job: a due job whose history was too big to
    /// delete with it within the statement timeout loses it a batch per statement, and
    /// then goes as the others do.
    pub history: u64,
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
        self.history += pass.history;
        self.fires += pass.fires;
        self.read += pass.read;
        self.skipped |= pass.skipped;
        self.timeouts += pass.timeouts;
        self.batch = pass.batch;
        self.elapsed += pass.elapsed;
    }
}

/// The arguments of the advisory lock a retention pass of schema `$1` takes in each of
/// its transactions (`pg_try_advisory_xact_lock(<this>)`; see the module docs). Holding it
/// (`pg_advisory_lock(<this>)` in a session of your own) pauses retention of the schema
/// in every process. The schema is named by its oid, shifted into `int4`: unique among
/// the database's schemas (a hash of the name would let two tenants' schemas whose names
/// collide skip each other).
pub const RETENTION_LOCK_KEY: &str = "hashtext('leasehold.retention'), \
     coalesce((SELECT (n.oid::int8 - 2147483648)::int4 FROM pg_namespace n WHERE n.nspname = $1), 0)";

/// How long a pass may resume the jobs scan where this process's previous pass ended;
/// after this, a pass scans from the oldest due job again (and picks up what the resumed
/// passes could not see: a job locked when its turn came, or one that committed its
/// finish late).
const RESUME_FOR: Duration = Duration::from_secs(60);

/// Jobs set aside by one pass as too big to delete within the statement timeout.
const OVERSIZED_PER_PASS: usize = 4;

/// What this process's passes carry from one to the next.
#[derive(Default)]
pub(super) struct Memory {
    state: std::sync::Mutex<Remembered>,
}

#[derive(Default)]
struct Remembered {
    /// Every due job ordered at or before this (its `greatest(finished_at,
    /// unique_until)`, then id) was deleted by a pass of this process since `scanned_at`.
    /// Starting after it, a pass does not walk the index entries of rows it deleted
    /// (an open snapshot, a backup's say, keeps them until it ends).
    resume: Option<(DateTime<Utc>, i64)>,
    /// When a pass last scanned from the oldest due job.
    scanned_at: Option<Instant>,
    /// Due jobs whose deletion outlasted the statement timeout even alone (a history of
    /// millions of events): the jobs statement leaves them out, and each pass deletes
    /// their history a batch at a time, then the job.
    oversized: std::collections::BTreeSet<i64>,
}

impl Memory {
    fn lock(&self) -> std::sync::MutexGuard<'_, Remembered> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where this pass's jobs scan starts, and the jobs it leaves out.
    fn start(&self) -> (Option<(DateTime<Utc>, i64)>, Vec<i64>) {
        let mut m = self.lock();
        let fresh = m.scanned_at.is_some_and(|at| at.elapsed() < RESUME_FOR);
        if !fresh {
            m.resume = None;
            m.scanned_at = Some(Instant::now());
        }
        (m.resume, m.oversized.iter().copied().collect())
    }

    /// Scan from the oldest due job next pass.
    fn rescan(&self) {
        let mut m = self.lock();
        m.resume = None;
        m.scanned_at = None;
    }
}

/// The due jobs in the order retention takes them, through `jobs_prunable` up to the
/// cutoff (`$1` the pass's clock, `$2` the retention in seconds), at most `$3`: after
/// `$4, $5` (the `(moment, id)` the scan resumes after) and without `$6` (the jobs set
/// aside as too big, see `Remembered::oversized`). Shared by the two statements below.
const DUE_JOBS: &str = "SELECT id, greatest(finished_at, unique_until) AS since FROM {s}.jobs
    WHERE greatest(finished_at, unique_until) < $1::timestamptz - make_interval(secs => $2)
      AND state IN ('done', 'cancelled')
      AND (greatest(finished_at, unique_until), id) > (coalesce($4::timestamptz, '-infinity'), $5::int8)
      AND id <> ALL($6::int8[])
    ORDER BY greatest(finished_at, unique_until), id
    LIMIT $3";

/// Delete the due jobs (`DUE_JOBS`); their history, expiry records and expired effect
/// outcomes go with them, and their keys become candidates of the key pass.
/// `resume_at, resume_id` is where the next pass may resume: the last candidate, when
/// every candidate was deleted.
pub(super) fn prune_jobs() -> String {
    format!(
        r#"/* leasehold:prune_jobs */
WITH cand AS MATERIALIZED (
    {DUE_JOBS}
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {{s}}.jobs j USING cand
    WHERE j.id = cand.id AND j.state IN ('done', 'cancelled')
    RETURNING j.id, j.queue, j.job_key
), ev AS (
    DELETE FROM {{s}}.job_events WHERE job_id IN (SELECT id FROM gone)
), le AS (
    DELETE FROM {{s}}.lease_expiries WHERE job_id IN (SELECT id FROM gone)
), ef AS (
    DELETE FROM {{s}}.effects WHERE job_id IN (SELECT id FROM gone) AND keep_until < $1
    RETURNING 1
), marked AS (
    INSERT INTO {{s}}.idle_keys (queue, job_key)
    SELECT DISTINCT queue, job_key FROM gone WHERE job_key IS NOT NULL
    ON CONFLICT DO NOTHING
)
SELECT (SELECT count(*) FROM cand) AS read, (SELECT count(*) FROM gone) AS jobs,
       (SELECT count(*) FROM ef) AS effects, last.since AS resume_at, last.id AS resume_id
FROM (SELECT 1) one
LEFT JOIN LATERAL (SELECT c.since, c.id FROM cand c ORDER BY c.since DESC, c.id DESC LIMIT 1) last
       ON (SELECT count(*) FROM gone) = (SELECT count(*) FROM cand)"#
    )
}

/// The first due job the jobs statement would take (`DUE_JOBS` with a batch of 1): the
/// one a batch of 1 timed out on.
fn prune_jobs_head() -> String {
    format!("/* leasehold:prune_jobs_head */\n{DUE_JOBS}")
}

/// Up to `$4` history rows of the oversized job `$1`, while it is still due (`$2` the
/// clock, `$3` the retention) and nobody holds it; `due` 0 when it is not (gone, retried,
/// held by an operator's action right now).
pub(super) const TRIM_HISTORY: &str = r#"/* leasehold:prune_trim_history */
WITH j AS MATERIALIZED (
    SELECT id FROM {s}.jobs
    WHERE id = $1 AND state IN ('done', 'cancelled')
      AND greatest(finished_at, unique_until) < $2::timestamptz - make_interval(secs => $3)
    FOR UPDATE SKIP LOCKED
), ev AS (
    DELETE FROM {s}.job_events e
    WHERE e.id IN (SELECT x.id FROM j, LATERAL (SELECT y.id FROM {s}.job_events y
                                                 WHERE y.job_id = j.id ORDER BY y.id LIMIT $4) x)
    RETURNING 1
)
SELECT (SELECT count(*) FROM j) AS read, (SELECT count(*) FROM ev) AS deleted"#;

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

/// Where a pass's jobs scan looks (see `DUE_JOBS`).
struct JobsScan<'a> {
    /// The retention, in seconds.
    keep: f64,
    /// The `(moment, id)` the scan resumes after.
    resume: Option<(DateTime<Utc>, i64)>,
    /// Jobs set aside as too big.
    left_out: &'a [i64],
}

/// What the jobs statement did.
struct JobsPass {
    /// The pass's clock.
    now: DateTime<Utc>,
    read: i64,
    jobs: i64,
    /// Effect outcomes deleted with the jobs.
    effects: i64,
    /// Where the next pass may resume the scan.
    resume: Option<(DateTime<Utc>, i64)>,
}

impl Store {
    /// The retention policy with the default batch and timeouts: see
    /// [`Store::prune_with`]. `limit` is the batch.
    pub async fn prune(&self, keep: Duration, limit: i64) -> Result<PruneReport> {
        let mut options = PruneOptions::new(keep);
        options.batch = limit;
        self.prune_with(&options).await
    }

    /// One retention pass: delete done and cancelled jobs that finished more than
    /// `options.keep` ago (never less than `options.floor`: [`DEFAULT_PRUNE_FLOOR`]) (with their history, expiry records and expired effect
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
        let keep = secs(options.effective_keep());
        let timeout = options.statement_timeout;
        let Some(now) = self.prune_all_jobs(options, report).await? else {
            return lost_lock(report);
        };
        if self.trim_oversized(options, now, report).await?.is_none() {
            return lost_lock(report);
        }
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
                return lost_lock(report);
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
                return lost_lock(report);
            };
            report.read += read as u64;
            report.keys = keys as u64;
        }
        Ok(())
    }

    /// The jobs step, halving its batch at each timeout. A batch of 1 that still times
    /// out names one job too big to delete within the timeout (its history, say): that
    /// job is set aside (`trim_oversized` deletes it a batch of history at a time), the
    /// batch is restored, and the step goes on without it. Returns the pass's clock;
    /// `None` when another process prunes.
    async fn prune_all_jobs(
        &self,
        options: &PruneOptions,
        report: &mut PruneReport,
    ) -> Result<Option<DateTime<Utc>>> {
        let keep = secs(options.effective_keep());
        let timeout = options.statement_timeout;
        let memory = &self.inner.retention;
        let (resume, mut left_out) = memory.start();
        let mut set_aside = 0;
        loop {
            let scan = JobsScan {
                keep,
                resume,
                left_out: &left_out,
            };
            match self.prune_jobs(timeout, &scan, report.batch).await {
                Ok(None) => return Ok(None),
                Ok(Some(pass)) => {
                    report.read += pass.read as u64;
                    report.jobs = pass.jobs as u64;
                    report.effects = pass.effects as u64;
                    if let Some(at) = pass.resume {
                        memory.lock().resume = Some(at);
                    }
                    return Ok(Some(pass.now));
                }
                Err(e) if timed_out(&e) && report.batch > 1 => {
                    report.timeouts += 1;
                    report.batch = (report.batch / 2).max(1);
                    tracing::warn!(error = %e, batch = report.batch,
                        "leasehold retention statement timed out; trying again with a smaller batch");
                }
                Err(e) if timed_out(&e) && set_aside < OVERSIZED_PER_PASS => {
                    report.timeouts += 1;
                    let Some(head) = self.jobs_head(timeout, &scan).await? else {
                        return Err(e);
                    };
                    tracing::warn!(job = head, error = %e,
                        "leasehold retention: a due job is too big to delete within the statement \
                         timeout; deleting its history a batch at a time");
                    memory.lock().oversized.insert(head);
                    left_out.push(head);
                    set_aside += 1;
                    report.batch = options.batch.max(1);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The jobs statement (its counts, and where the next pass may resume); `None`
    /// when another process prunes.
    async fn prune_jobs(
        &self,
        timeout: Duration,
        scan: &JobsScan<'_>,
        batch: i64,
    ) -> Result<Option<JobsPass>> {
        let Some((now, row)) = self
            .due_jobs(timeout, &self.sql().prune_jobs, scan, batch)
            .await?
        else {
            return Ok(None);
        };
        let row = row.ok_or_else(|| Error::Database(sqlx::Error::RowNotFound))?;
        let at: Option<DateTime<Utc>> = row.try_get("resume_at")?;
        let id: Option<i64> = row.try_get("resume_id")?;
        Ok(Some(JobsPass {
            now,
            read: row.try_get("read")?,
            jobs: row.try_get("jobs")?,
            effects: row.try_get("effects")?,
            resume: at.zip(id),
        }))
    }

    /// The job a batch of 1 of the jobs statement takes first.
    async fn jobs_head(&self, timeout: Duration, scan: &JobsScan<'_>) -> Result<Option<i64>> {
        let head = self
            .due_jobs(timeout, &self.schema().render(&prune_jobs_head()), scan, 1)
            .await?;
        Ok(match head {
            Some((_, Some(row))) => Some(row.try_get("id")?),
            _ => None,
        })
    }

    /// Run `sql`, a statement over `DUE_JOBS`, in a retention transaction with the
    /// pass's clock read there: (the clock, its row); `None` when another process prunes.
    async fn due_jobs(
        &self,
        timeout: Duration,
        sql: &str,
        scan: &JobsScan<'_>,
        batch: i64,
    ) -> Result<Option<(DateTime<Utc>, Option<sqlx::postgres::PgRow>)>> {
        let mut conn = self.acquire().await?;
        let Some(mut tx) = self.begin_retention(&mut conn, timeout).await? else {
            return Ok(None);
        };
        let done = async {
            let now: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
                .fetch_one(self.on(&mut tx))
                .await?;
            let row = sqlx::query(sql)
                .bind(now)
                .bind(scan.keep)
                .bind(batch)
                .bind(scan.resume.map(|r| r.0))
                .bind(scan.resume.map_or(0, |r| r.1))
                .bind(scan.left_out)
                .fetch_optional(self.on(&mut tx))
                .await?;
            Ok((now, row))
        }
        .await;
        finish(tx, done).await.map(Some)
    }

    /// Delete the history of the jobs set aside as too big, a batch per statement, for at
    /// most one statement timeout of this pass. A job whose history is gone (or that is no
    /// longer due) leaves the set, and the next pass scans from the oldest due job, so
    /// the jobs statement deletes it. `None` when another process prunes.
    async fn trim_oversized(
        &self,
        options: &PruneOptions,
        now: DateTime<Utc>,
        report: &mut PruneReport,
    ) -> Result<Option<()>> {
        let memory = &self.inner.retention;
        let ids: Vec<i64> = memory.lock().oversized.iter().copied().collect();
        if ids.is_empty() {
            return Ok(Some(()));
        }
        let sql = self.schema().render(TRIM_HISTORY);
        let keep = secs(options.effective_keep());
        let started = Instant::now();
        let mut batch = options.batch.max(1);
        let mut conn = self.acquire().await?;
        for id in ids {
            while started.elapsed() < options.statement_timeout {
                let Some(mut tx) = self
                    .begin_retention(&mut conn, options.statement_timeout)
                    .await?
                else {
                    return Ok(None);
                };
                let done = async {
                    let row = sqlx::query(&sql)
                        .bind(id)
                        .bind(now)
                        .bind(keep)
                        .bind(batch)
                        .fetch_one(self.on(&mut tx))
                        .await?;
                    let counts: Counts = (row.try_get("read")?, row.try_get("deleted")?);
                    Ok(counts)
                }
                .await;
                match finish(tx, done).await {
                    Ok((due, deleted)) => {
                        report.read += due as u64;
                        report.history += deleted as u64;
                        if due == 0 || deleted < batch {
                            memory.lock().oversized.remove(&id);
                            memory.rescan();
                            break;
                        }
                    }
                    Err(e) if timed_out(&e) => {
                        report.timeouts += 1;
                        if batch == 1 {
                            tracing::warn!(job = id, error = %e,
                                "leasehold retention: one history row of a set-aside job outlasts \
                                 the statement timeout; trying again next pass");
                            break;
                        }
                        batch = (batch / 2).max(1);
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(Some(()))
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
        let locked: bool = sqlx::query_scalar(&format!(
            "SELECT pg_try_advisory_xact_lock({RETENTION_LOCK_KEY})"
        ))
        .bind(self.schema().name())
        .fetch_one(self.on(&mut tx))
        .await?;
        if !locked {
            tx.rollback().await?;
            return Ok(None);
        }
        Ok(Some(tx))
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
        let mut conn = self.acquire().await?;
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
        let mut conn = self.acquire().await?;
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

/// Another process took the retention lock between two of this pass's transactions
/// (each takes it for itself, so a pass never holds it across a round trip of the
/// host's): the pass ends here, and the other process's pass does the rest. It is
/// "skipped" only when it deleted nothing.
fn lost_lock(report: &mut PruneReport) -> Result<()> {
    report.skipped = report.deleted() == 0;
    Ok(())
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
