//! Live schedulers: each scheduler's reaper writes a heartbeat row every pass, and its
//! shutdown deletes it, so `leasehold status` and the dashboard can show which
//! processes run, with their owner ids, queues and concurrency.
//!
//! Nothing in the protocol reads these rows: leases, not heartbeats, decide who owns a
//! job. A process that dies leaves its row; it stops being listed after three missed
//! heartbeats, and a heartbeat of any scheduler deletes rows not seen for an hour.

use chrono::{DateTime, Utc};
use sqlx::Row;

use super::Store;
use crate::error::Result;

/// A scheduler that reported in recently: [`Store::live_schedulers`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LiveScheduler {
    /// Its owner id (as in a job's `owner`).
    pub owner: String,
    /// The host it runs on.
    pub host: String,
    /// Its process id there.
    pub pid: i32,
    /// The queues it claims from.
    pub queues: Vec<String>,
    /// Handlers it runs at once at most.
    pub concurrency: i32,
    /// Its first heartbeat.
    pub started_at: DateTime<Utc>,
    /// Its latest heartbeat.
    pub last_seen: DateTime<Utc>,
    /// Seconds since its latest heartbeat (database clock).
    pub seen_secs_ago: f64,
}

/// What a heartbeat says about its scheduler.
#[derive(Clone, Debug)]
pub(crate) struct Heartbeat {
    pub(crate) owner: String,
    pub(crate) queues: Vec<String>,
    pub(crate) concurrency: i32,
    pub(crate) every: std::time::Duration,
}

const BEAT: &str = r#"/* leasehold:heartbeat */
WITH gone AS (
    DELETE FROM {s}.schedulers WHERE last_seen < now() - interval '1 hour'
)
INSERT INTO {s}.schedulers (owner, host, pid, queues, concurrency, heartbeat_secs)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (owner) DO UPDATE
SET last_seen = clock_timestamp(), queues = EXCLUDED.queues,
    concurrency = EXCLUDED.concurrency, heartbeat_secs = EXCLUDED.heartbeat_secs"#;

const LIVE: &str = r#"/* leasehold:live_schedulers */
SELECT owner, host, pid, queues, concurrency, started_at, last_seen,
       extract(epoch FROM clock_timestamp() - last_seen)::float8 AS ago
FROM {s}.schedulers
WHERE last_seen > clock_timestamp() - make_interval(secs => 3 * heartbeat_secs + 1)
ORDER BY host, pid, owner"#;

impl Store {
    /// Write this scheduler's heartbeat (the reaper does, every pass).
    pub(crate) async fn heartbeat(&self, beat: &Heartbeat) -> Result<()> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_default();
        sqlx::query(&self.schema().render(BEAT))
            .bind(&beat.owner)
            .bind(if host.is_empty() { "host".into() } else { host })
            .bind(std::process::id() as i32)
            .bind(&beat.queues)
            .bind(beat.concurrency)
            .bind(beat.every.as_secs_f64())
            .execute(self.db())
            .await?;
        Ok(())
    }

    /// Delete this scheduler's row (at its shutdown).
    pub(crate) async fn forget_scheduler(&self, owner: &str) -> Result<()> {
        sqlx::query(
            &self
                .schema()
                .render("DELETE FROM {s}.schedulers WHERE owner = $1"),
        )
        .bind(owner)
        .execute(self.db())
        .await?;
        Ok(())
    }

    /// The schedulers whose latest heartbeat is less than three of their heartbeat
    /// intervals old, by host and pid.
    pub async fn live_schedulers(&self) -> Result<Vec<LiveScheduler>> {
        let rows = sqlx::query(&self.schema().render(LIVE))
            .fetch_all(self.db())
            .await?;
        rows.iter()
            .map(|r| {
                Ok(LiveScheduler {
                    owner: r.try_get("owner")?,
                    host: r.try_get("host")?,
                    pid: r.try_get("pid")?,
                    queues: r.try_get("queues")?,
                    concurrency: r.try_get("concurrency")?,
                    started_at: r.try_get("started_at")?,
                    last_seen: r.try_get("last_seen")?,
                    seen_secs_ago: r.try_get("ago")?,
                })
            })
            .collect()
    }
}
