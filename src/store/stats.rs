//! Queue statistics for the metrics snapshot and the Prometheus gauges: depth by state,
//! oldest eligible job, lease ages, expiries and blocked keys — all read from the
//! database, so they hold across processes.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::Row;

use super::Store;
use crate::error::Result;
use crate::job::JobId;

/// Per-queue figures.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct QueueStats {
    pub queue: String,
    /// Jobs by state name.
    pub by_state: BTreeMap<String, i64>,
    /// Seconds the oldest claimable (pending and due) job has waited.
    pub oldest_eligible_age_secs: f64,
    /// Seconds since the oldest running job was claimed.
    pub oldest_running_secs: f64,
    /// Sum of attempts over open jobs (retries show up here).
    pub open_attempts: i64,
    /// Leases that expired and were taken back, ever (reacquisitions).
    pub lease_expiries: i64,
}

/// Per-queue gauges for the metrics endpoint: open and parked jobs only, so a scrape
/// costs the same whatever history the table keeps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QueueGauges {
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

impl Store {
    /// Figures per queue.
    pub async fn queue_stats(&self) -> Result<Vec<QueueStats>> {
        let sql = self.schema().render(
            "SELECT queue, state, count(*) AS n,
                    coalesce(extract(epoch FROM now() - min(available_at)
                        FILTER (WHERE state = 'pending' AND available_at <= now())), 0)::float8 AS eligible_age,
                    coalesce(extract(epoch FROM now() - min(claimed_at)
                        FILTER (WHERE state = 'running')), 0)::float8 AS running_age,
                    coalesce(sum(attempts) FILTER (WHERE state IN ('pending', 'running', 'waiting', 'held')), 0)::int8 AS attempts
             FROM {s}.jobs GROUP BY queue, state",
        );
        let rows = sqlx::query(&sql).fetch_all(self.pool()).await?;
        let mut out: BTreeMap<String, QueueStats> = BTreeMap::new();
        for r in rows {
            let queue: String = r.try_get("queue")?;
            let s = out.entry(queue.clone()).or_insert_with(|| QueueStats {
                queue,
                ..Default::default()
            });
            s.by_state.insert(r.try_get("state")?, r.try_get("n")?);
            s.oldest_eligible_age_secs = s.oldest_eligible_age_secs.max(r.try_get("eligible_age")?);
            s.oldest_running_secs = s.oldest_running_secs.max(r.try_get("running_age")?);
            s.open_attempts += r.try_get::<i64, _>("attempts")?;
        }
        let exp_sql = self.schema().render(
            "SELECT j.queue, count(*) FROM {s}.lease_expiries e JOIN {s}.jobs j ON j.id = e.job_id GROUP BY j.queue",
        );
        for (queue, n) in sqlx::query_as::<_, (String, i64)>(&exp_sql)
            .fetch_all(self.pool())
            .await?
        {
            if let Some(s) = out.get_mut(&queue) {
                s.lease_expiries = n;
            }
        }
        Ok(out.into_values().collect())
    }

    /// [`QueueGauges`] for every queue with an open or parked job, in one statement.
    ///
    /// Cost: each part reads one partial index (pending by queue, waiting by key,
    /// running by lease, held and dead by queue) and, for running jobs and blocked keys,
    /// their rows; so it is proportional to the open and parked jobs (pending, waiting,
    /// running, held, dead), never to the done and cancelled history. A blocked key adds
    /// one probe of the waiting index for its first waiter. At 10^5 pending jobs expect
    /// tens of milliseconds: scrape every 15 s or more, not in a loop.
    pub async fn queue_gauges(&self) -> Result<Vec<QueueGauges>> {
        let sql = self.schema().render(
            "SELECT queue, 'pending' AS part, count(*) AS n,
                    coalesce(extract(epoch FROM now() - min(available_at)
                        FILTER (WHERE available_at <= now())), 0)::float8 AS age
               FROM {s}.jobs WHERE state = 'pending' GROUP BY queue
             UNION ALL
             SELECT queue, 'waiting', count(*), 0
               FROM {s}.jobs WHERE state = 'waiting' GROUP BY queue
             UNION ALL
             SELECT queue, 'running', count(*),
                    coalesce(extract(epoch FROM now() - min(claimed_at)), 0)::float8
               FROM {s}.jobs WHERE state = 'running' GROUP BY queue
             UNION ALL
             SELECT queue, state, count(*), 0
               FROM {s}.jobs WHERE state IN ('held', 'dead') GROUP BY queue, state
             UNION ALL
             SELECT h.queue, 'blocked', count(*),
                    coalesce(extract(epoch FROM now() - min(w.created_at)), 0)::float8
               FROM {s}.jobs h
               LEFT JOIN LATERAL (
                   SELECT created_at FROM {s}.jobs w
                    WHERE w.queue = h.queue AND w.job_key = h.job_key AND w.state = 'waiting'
                    ORDER BY w.key_seq LIMIT 1) w ON true
              WHERE h.state IN ('held', 'dead') AND h.job_key IS NOT NULL
                AND (h.state = 'held' OR h.dead_blocks_key)
              GROUP BY h.queue",
        );
        let rows = sqlx::query(&sql).fetch_all(self.pool()).await?;
        let mut out: BTreeMap<String, QueueGauges> = BTreeMap::new();
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
        let sql = self.schema().render(
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
             WHERE h.job_key IS NOT NULL AND h.state IN ('dead', 'held')
               AND (h.state = 'held' OR h.dead_blocks_key)
             ORDER BY h.id LIMIT $1",
        );
        let rows = sqlx::query(&sql).bind(limit).fetch_all(self.pool()).await?;
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
