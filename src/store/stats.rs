//! Queue statistics for the metrics snapshot and the Prometheus gauges: depth by state,
//! oldest eligible job, lease ages, expiries and blocked keys — all read from the
//! database, so they hold across processes.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::Row;

use super::Store;
use crate::error::Result;
use crate::job::JobId;

/// Per-queue figures for people and alerts: [`Store::queue_stats`].
///
/// Everything here costs the same whatever history the table keeps (see
/// [`Store::queue_stats`]), so a status page or an alert can poll it. Done and cancelled
/// jobs are history and are not counted here: their rates are the attempt counters of
/// every process ([`crate::metrics`], `leasehold_attempts_total` in Prometheus), and
/// [`Store::job_counts`] counts every row when you need the census.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct QueueStats {
    /// The queue.
    pub queue: String,
    /// Open and parked jobs by state: `pending`, `waiting`, `running`, `held` and `dead`
    /// (a state with no job is absent).
    pub by_state: BTreeMap<String, i64>,
    /// Seconds the oldest claimable job has been due (its `available_at` passed); 0 when
    /// none is due. The figure to alert on: work is waiting and nobody takes it.
    pub oldest_eligible_age_secs: f64,
    /// Seconds since the oldest running job was claimed; 0 when none runs.
    pub oldest_running_secs: f64,
    /// Keys whose head is held, or dead with the default key policy: their later jobs
    /// wait until an operator acts.
    pub blocked_keys: i64,
    /// Seconds the oldest job waiting behind a blocked key has been enqueued; 0 when
    /// none waits.
    pub blocked_oldest_waiting_secs: f64,
    /// Leases that expired and were taken back by a reaper in the last
    /// [`RECENT_EXPIRIES`]: a rising figure means handlers outlive their leases, or
    /// processes die or stall.
    pub recent_lease_expiries: i64,
    /// Paused ([`Store::pause_queue`]): nothing of it is claimed until it is resumed. A
    /// paused queue is listed even when it holds no job.
    pub paused: bool,
}

/// The window of [`QueueStats::recent_lease_expiries`]: 15 minutes.
pub const RECENT_EXPIRIES: std::time::Duration = std::time::Duration::from_secs(15 * 60);

/// Per-queue gauges for the metrics endpoint: open and parked jobs only, so a scrape
/// costs the same whatever history the table keeps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QueueGauges {
    /// The queue.
    pub queue: String,
    /// Jobs by state, for `pending`, `waiting`, `running`, `held` and `dead` (states
    /// with no job are absent). `done` and `cancelled` are history: their rates are in
    /// the attempt counters.
    pub by_state: BTreeMap<String, i64>,
    /// Seconds the oldest pending job has been due (its `available_at` passed); 0 when
    /// none is due.
    pub oldest_eligible_secs: f64,
    /// Seconds since the oldest running job was claimed (its lease began); 0 when none.
    pub oldest_running_secs: f64,
    /// Keys whose head is held, or dead with the default key policy.
    pub blocked_keys: i64,
    /// Seconds the oldest job waiting behind a blocked key has been enqueued; 0 when
    /// none waits.
    pub blocked_oldest_waiting_secs: f64,
    /// Paused ([`Store::pause_queue`]); a paused queue is listed even when empty.
    pub paused: bool,
}

/// A key whose head is dead or held, with jobs waiting behind it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct KeyBlock {
    /// The queue of the key.
    pub queue: String,
    /// The ordering key.
    pub key: String,
    /// The job at the head of the key, the one that blocks it.
    pub head: JobId,
    /// `dead` or `held`.
    pub head_state: String,
    /// Why the head stopped: a dead head's last error, or the note of its hold.
    pub reason: Option<String>,
    /// When the key stopped: the head's death, or the latest hold of it.
    pub since: Option<DateTime<Utc>>,
    /// Jobs of the key waiting behind the head.
    pub waiting: i64,
}

/// The condition under which the job `h` blocks its key: a keyed head that is held, or
/// dead under the default key policy. One text for the gauges' count and
/// [`Store::blocked_keys`]' list, so the two never disagree on what is blocked.
macro_rules! blocks_its_key {
    () => {
        "h.state IN ('held', 'dead') AND h.job_key IS NOT NULL \
         AND (h.state = 'held' OR h.dead_blocks_key)"
    };
}

/// The gauges' statement (see [`Store::queue_gauges`]).
///
/// Pending and waiting jobs can be many (10^5 and more in a backlog), so they are counted
/// per queue without grouping: the queues come from a loose scan of each partial index
/// (one probe per queue), each count is a plain aggregate over its queue's index range,
/// and the oldest eligible job is the earliest head of each priority level (one probe
/// per level) instead of a minimum over every pending row. On a never-analyzed table
/// with 10^5 pending rows this halved the statement against `GROUP BY queue`.
const GAUGES_SQL: &str = concat!(
    "WITH RECURSIVE pending_queues AS (
    (SELECT j.queue FROM {s}.jobs j WHERE j.state = 'pending' ORDER BY j.queue LIMIT 1)
  UNION ALL
    SELECT (SELECT j.queue FROM {s}.jobs j
             WHERE j.state = 'pending' AND j.queue > q.queue ORDER BY j.queue LIMIT 1)
      FROM pending_queues q WHERE q.queue IS NOT NULL
), waiting_queues AS (
    (SELECT j.queue FROM {s}.jobs j WHERE j.state = 'waiting' ORDER BY j.queue LIMIT 1)
  UNION ALL
    SELECT (SELECT j.queue FROM {s}.jobs j
             WHERE j.state = 'waiting' AND j.queue > q.queue ORDER BY j.queue LIMIT 1)
      FROM waiting_queues q WHERE q.queue IS NOT NULL
), levels AS (
    SELECT q.queue, (SELECT j.priority FROM {s}.jobs j
                      WHERE j.state = 'pending' AND j.queue = q.queue
                      ORDER BY j.priority LIMIT 1) AS priority
      FROM pending_queues q WHERE q.queue IS NOT NULL
  UNION ALL
    SELECT l.queue, (SELECT j.priority FROM {s}.jobs j
                      WHERE j.state = 'pending' AND j.queue = l.queue AND j.priority > l.priority
                      ORDER BY j.priority LIMIT 1)
      FROM levels l WHERE l.priority IS NOT NULL
), level_heads AS (
    SELECT l.queue, (SELECT j.available_at FROM {s}.jobs j
                      WHERE j.state = 'pending' AND j.queue = l.queue AND j.priority = l.priority
                      ORDER BY j.available_at LIMIT 1) AS due
      FROM levels l WHERE l.priority IS NOT NULL
)
SELECT q.queue, 'pending' AS part,
       (SELECT count(*) FROM {s}.jobs j WHERE j.state = 'pending' AND j.queue = q.queue) AS n,
       coalesce((SELECT extract(epoch FROM now() - min(h.due)) FROM level_heads h
                  WHERE h.queue = q.queue AND h.due <= now()), 0)::float8 AS age
  FROM pending_queues q WHERE q.queue IS NOT NULL
UNION ALL
SELECT q.queue, 'waiting',
       (SELECT count(*) FROM {s}.jobs j WHERE j.state = 'waiting' AND j.queue = q.queue), 0
  FROM waiting_queues q WHERE q.queue IS NOT NULL
UNION ALL
SELECT j.queue, 'running', count(*),
       coalesce(extract(epoch FROM now() - min(j.claimed_at)), 0)::float8
  FROM {s}.jobs j WHERE j.lease_until IS NOT NULL AND j.state = 'running' GROUP BY j.queue
UNION ALL
SELECT j.queue, j.state, count(*), 0
  FROM {s}.jobs j WHERE j.state IN ('held', 'dead') GROUP BY j.queue, j.state
UNION ALL
SELECT h.queue, 'blocked', count(*),
       coalesce(extract(epoch FROM now() - min(w.created_at)), 0)::float8
  FROM {s}.jobs h
  LEFT JOIN LATERAL (
      SELECT w.created_at FROM {s}.jobs w
       WHERE w.queue = h.queue AND w.job_key = h.job_key AND w.state = 'waiting'
       ORDER BY w.key_seq LIMIT 1) w ON true
 WHERE ",
    blocks_its_key!(),
    " GROUP BY h.queue"
);

/// Run before the gauges, in their transaction. Without statistics the planner's
/// estimates for the loose scans are large enough to pass `jit_above_cost` (on by
/// default), and compiling the expressions took half a second where the statement itself
/// takes tens of milliseconds. And it guesses that nearly every row has a lease, so it
/// would count the running jobs with a pass over the whole table, history included,
/// rather than through the index of leased jobs (migration 12).
pub(super) const GAUGE_SETTINGS: &str = "SET LOCAL jit = off; SET LOCAL enable_seqscan = off";

/// Recent lease expiries per queue; `$1` is the window in seconds.
///
/// The job's queue through a scalar subquery: a probe of the primary key per
/// recent expiry whatever the planner knows. As a join, a never-analyzed
/// table got a hash of every job. OFFSET 0 keeps the subquery whole, so the
/// probe runs once per expiry rather than once per use of its result.
const RECENT_EXPIRIES_SQL: &str = "SELECT queue, count(*)
               FROM (SELECT (SELECT j.queue FROM {s}.jobs j WHERE j.id = e.job_id) AS queue
                       FROM {s}.lease_expiries e
                      WHERE e.reaped_at > now() - make_interval(secs => $1)
                     OFFSET 0) recent
              WHERE queue IS NOT NULL
              GROUP BY queue";

impl Store {
    /// [`QueueStats`] for every queue with an open or parked job, or a lease expiry in
    /// the last [`RECENT_EXPIRIES`].
    ///
    /// Cost: the statement of [`Store::queue_gauges`] (the open and parked jobs' partial
    /// indexes, never the done history) and one range of the lease-expiry record by time
    /// (migration 5), each recent expiry joined to its job by primary key. At 10^6 done
    /// and 10^5 pending jobs it stays in tens of milliseconds on a table that was never
    /// analyzed (`cargo run --release -p leasehold-bench -- --only stats` measures it).
    pub async fn queue_stats(&self) -> Result<Vec<QueueStats>> {
        let mut out: BTreeMap<String, QueueStats> = self
            .queue_gauges()
            .await?
            .into_iter()
            .map(|g| {
                let stats = QueueStats {
                    queue: g.queue.clone(),
                    by_state: g.by_state,
                    oldest_eligible_age_secs: g.oldest_eligible_secs,
                    oldest_running_secs: g.oldest_running_secs,
                    blocked_keys: g.blocked_keys,
                    blocked_oldest_waiting_secs: g.blocked_oldest_waiting_secs,
                    recent_lease_expiries: 0,
                    paused: g.paused,
                };
                (g.queue, stats)
            })
            .collect();
        let sql = self.schema().render(RECENT_EXPIRIES_SQL);
        for (queue, n) in sqlx::query_as::<_, (String, i64)>(&sql)
            .bind(RECENT_EXPIRIES.as_secs_f64())
            .fetch_all(self.db())
            .await?
        {
            out.entry(queue.clone())
                .or_insert_with(|| QueueStats {
                    queue,
                    ..Default::default()
                })
                .recent_lease_expiries = n;
        }
        Ok(out.into_values().collect())
    }

    /// `EXPLAIN (ANALYZE, BUFFERS)` of the two statements [`Store::queue_stats`] runs,
    /// for operators checking on their own table that it reads indexes and not the
    /// history.
    pub async fn explain_queue_stats(&self) -> Result<String> {
        let mut out = String::new();
        for (name, sql, window) in [
            ("per-queue gauges", GAUGES_SQL, None),
            (
                "recent lease expiries",
                RECENT_EXPIRIES_SQL,
                Some(RECENT_EXPIRIES.as_secs_f64()),
            ),
        ] {
            let sql = format!("EXPLAIN (ANALYZE, BUFFERS) {}", self.schema().render(sql));
            let mut query = sqlx::query_scalar::<_, String>(&sql);
            if let Some(w) = window {
                query = query.bind(w);
            }
            let mut conn = self.acquire().await?;
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            sqlx::raw_sql(GAUGE_SETTINGS).execute(&mut *tx).await?;
            let lines = query.fetch_all(self.on(&mut tx)).await?;
            tx.rollback().await?;
            out.push_str(&format!("-- {name}\n{}\n", lines.join("\n")));
        }
        Ok(out)
    }

    /// Every job counted by queue and state, done and cancelled history included: a
    /// census for scripts, demos and tests.
    ///
    /// Cost: a scan of the whole jobs table (at 10^6 rows, hundreds of milliseconds).
    /// Do not poll it; [`Store::queue_stats`] is the cheap figure.
    pub async fn job_counts(&self) -> Result<BTreeMap<String, BTreeMap<String, i64>>> {
        let sql = self
            .schema()
            .render("SELECT queue, state, count(*) FROM {s}.jobs GROUP BY queue, state");
        let mut out: BTreeMap<String, BTreeMap<String, i64>> = BTreeMap::new();
        for (queue, state, n) in sqlx::query_as::<_, (String, String, i64)>(&sql)
            .fetch_all(self.db())
            .await?
        {
            out.entry(queue).or_default().insert(state, n);
        }
        Ok(out)
    }

    /// [`QueueGauges`] for every queue with an open or parked job, in one statement.
    ///
    /// Cost: each part reads one partial index (pending by queue, waiting by key,
    /// leased by deadline, held and dead by queue) and, for running jobs and blocked keys,
    /// their rows; so it is proportional to the open and parked jobs (pending, waiting,
    /// running, held, dead), never to the done and cancelled history. A blocked key adds
    /// one probe of the waiting index for its first waiter. At 10^5 pending jobs expect
    /// tens of milliseconds (`bench -- --only stats`); the metrics route caches a reading
    /// for [`Config::metrics_cache`](crate::Config::metrics_cache). Runs in a short
    /// transaction with JIT and sequential scans off (see `GAUGE_SETTINGS` in the source).
    pub async fn queue_gauges(&self) -> Result<Vec<QueueGauges>> {
        let sql = self.schema().render(GAUGES_SQL);
        let mut conn = self.acquire().await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        sqlx::raw_sql(GAUGE_SETTINGS).execute(&mut *tx).await?;
        let rows = sqlx::query(&sql).fetch_all(self.on(&mut tx)).await?;
        let paused: Vec<String> =
            sqlx::query_scalar(&self.schema().render("SELECT queue FROM {s}.paused_queues"))
                .fetch_all(self.on(&mut tx))
                .await?;
        tx.commit().await?;
        let mut out: BTreeMap<String, QueueGauges> = BTreeMap::new();
        for queue in paused {
            out.entry(queue.clone())
                .or_insert_with(|| QueueGauges {
                    queue,
                    ..Default::default()
                })
                .paused = true;
        }
        for r in rows {
            let queue: String = r.try_get("queue")?;
            let part: String = r.try_get("part")?;
            let (n, age): (i64, f64) = (r.try_get("n")?, r.try_get("age")?);
            let g = out.entry(queue.clone()).or_insert_with(|| QueueGauges {
                queue,
                ..Default::default()
            });
            match part.as_str() {
                "blocked" => (g.blocked_keys, g.blocked_oldest_waiting_secs) = (n, age),
                state => {
                    match state {
                        "pending" => g.oldest_eligible_secs = age,
                        "running" => g.oldest_running_secs = age,
                        _ => {}
                    }
                    g.by_state.insert(part, n);
                }
            }
        }
        Ok(out.into_values().collect())
    }

    /// Keys blocked by a dead or held head, with the number of jobs waiting behind it.
    pub async fn blocked_keys(&self, limit: i64) -> Result<Vec<KeyBlock>> {
        let sql = self.schema().render(concat!(
            "SELECT h.id, h.queue, h.job_key, h.state,
                    CASE WHEN h.state = 'dead' THEN h.last_error ELSE hold.detail END AS reason,
                    CASE WHEN h.state = 'dead' THEN h.finished_at ELSE hold.at END AS since,
                    (SELECT count(*) FROM {s}.jobs w
                      WHERE w.queue = h.queue AND w.job_key = h.job_key AND w.state = 'waiting') AS waiting
             FROM {s}.jobs h
             LEFT JOIN LATERAL (
                 SELECT e.at, e.detail FROM {s}.job_events e
                 WHERE e.job_id = h.id AND e.event = 'held' ORDER BY e.id DESC LIMIT 1
             ) hold ON h.state = 'held'
             WHERE ",
            blocks_its_key!(),
            " ORDER BY h.id LIMIT $1"
        ));
        let rows = sqlx::query(&sql).bind(limit).fetch_all(self.db()).await?;
        rows.iter()
            .map(|r| {
                Ok(KeyBlock {
                    queue: r.try_get("queue")?,
                    key: r.try_get("job_key")?,
                    head: JobId(r.try_get("id")?),
                    head_state: r.try_get("state")?,
                    reason: r.try_get("reason")?,
                    since: r.try_get("since")?,
                    waiting: r.try_get("waiting")?,
                })
            })
            .collect()
    }
}
