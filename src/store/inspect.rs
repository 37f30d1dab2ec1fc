//! Read-only views for operators: a filtered, paginated job listing and a job's lease
//! expiries. Nothing here locks or writes.
//!
//! # Why keyset pagination
//!
//! A page is `id > after ORDER BY id LIMIT n`: the primary key is read from `after` on,
//! with no `OFFSET` and no sort, so page 1000 costs what page 1 costs, and a job
//! enqueued or pruned meanwhile never shifts a page (OFFSET would skip or repeat rows).

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::Row;

use super::admin::{record_from_row, JOB_COLUMNS};
use super::{secs, Store};
use crate::error::Result;
use crate::job::{Generation, JobId, JobRecord, JobState};

/// Jobs a page of [`Store::list_jobs`] holds when the caller does not say.
pub const DEFAULT_PAGE: i64 = 50;

/// The largest page [`Store::list_jobs`] returns: a listing is for reading, and a page
/// of payloads must not load a million rows into one process.
pub const MAX_PAGE: i64 = 10_000;

/// Which jobs [`Store::list_jobs`] returns: every field that is set must match.
#[derive(Clone, Debug, PartialEq)]
pub struct JobFilter {
    /// Only jobs of this queue.
    pub queue: Option<String>,
    /// Only jobs in this state.
    pub state: Option<JobState>,
    /// Only jobs of this kind.
    pub kind: Option<String>,
    /// Only jobs of this ordering key (in any queue, unless `queue` is set too).
    pub key: Option<String>,
    /// Only jobs enqueued at least this long ago (by the database clock).
    pub older_than: Option<Duration>,
    /// Only jobs with a larger id: the last id of the previous page.
    pub after: Option<JobId>,
    /// At most this many jobs, 1 to [`MAX_PAGE`] (values outside are clamped).
    /// Default [`DEFAULT_PAGE`].
    pub limit: i64,
}

impl Default for JobFilter {
    fn default() -> Self {
        JobFilter {
            queue: None,
            state: None,
            kind: None,
            key: None,
            older_than: None,
            after: None,
            limit: DEFAULT_PAGE,
        }
    }
}

/// A lease that expired and was taken back by a reaper.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LeaseExpiry {
    /// The generation that lost its lease; its later writes were refused.
    pub generation: Generation,
    /// The owner that held the lease.
    pub owner: String,
    /// The deadline that passed.
    pub lease_until: DateTime<Utc>,
    /// When the reaper took the job back (database clock).
    pub reaped_at: DateTime<Utc>,
    /// The owner id of the reaping process.
    pub reaped_by: String,
    /// What the job became: pending (retried) or dead (attempts exhausted).
    pub new_state: String,
}

/// Each filter is a parameter that may be null. With the values bound, PostgreSQL's
/// custom plans fold `NULL IS NULL OR ...` away. A common match (no filter, or pending
/// among done) walks the primary key and stops at the limit: 0.1 ms at 500k rows. A
/// rare one (50 dead jobs among 500k done) finds no index to use and scans the table,
/// 66 ms there: the limit bounds the answer, not the scan. A partial index on
/// `(id) WHERE state IN ('dead', 'held')` would make the dead-letter listing an index
/// scan at almost no write cost (rows enter it only when they die or are held).
const LIST_JOBS: &str = r#"/* leasehold:list_jobs */
SELECT __COLUMNS__ FROM {s}.jobs
WHERE id > $1
  AND ($2::text IS NULL OR queue = $2)
  AND ($3::text IS NULL OR state = $3)
  AND ($4::text IS NULL OR kind = $4)
  AND ($5::text IS NULL OR job_key = $5)
  AND ($6::float8 IS NULL OR created_at <= now() - make_interval(secs => $6))
ORDER BY id
LIMIT $7"#;

impl Store {
    /// One page of jobs that match `filter`, by ascending id. The next page starts
    /// after the last id of this one (`filter.after`); a page shorter than the limit
    /// is the last. See the module docs for the cost.
    pub async fn list_jobs(&self, filter: &JobFilter) -> Result<Vec<JobRecord>> {
        let sql = self
            .schema()
            .render(&LIST_JOBS.replace("__COLUMNS__", JOB_COLUMNS));
        let rows = sqlx::query(&sql)
            .bind(filter.after.map_or(0, |id| id.0))
            .bind(filter.queue.as_deref())
            .bind(filter.state.map(JobState::as_str))
            .bind(filter.kind.as_deref())
            .bind(filter.key.as_deref())
            .bind(filter.older_than.map(secs))
            .bind(filter.limit.clamp(1, MAX_PAGE))
            .fetch_all(self.pool())
            .await?;
        rows.iter().map(record_from_row).collect()
    }

    /// The leases of a job that expired and were taken back, oldest first.
    pub async fn lease_expiries(&self, id: JobId) -> Result<Vec<LeaseExpiry>> {
        let sql = self.schema().render(
            "SELECT generation, owner, lease_until, reaped_at, reaped_by, new_state
             FROM {s}.lease_expiries WHERE job_id = $1 ORDER BY generation",
        );
        let rows = sqlx::query(&sql).bind(id.0).fetch_all(self.pool()).await?;
        rows.iter()
            .map(|r| {
                Ok(LeaseExpiry {
                    generation: Generation(r.try_get("generation")?),
                    owner: r.try_get("owner")?,
                    lease_until: r.try_get("lease_until")?,
                    reaped_at: r.try_get("reaped_at")?,
                    reaped_by: r.try_get("reaped_by")?,
                    new_state: r.try_get("new_state")?,
                })
            })
            .collect()
    }
}
