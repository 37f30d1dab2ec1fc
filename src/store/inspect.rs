//! Read-only views for operators: a filtered, paginated job listing and a job's lease
//! expiries. Nothing here locks or writes.
//!
//! # Why keyset pagination
//!
//! A page is "after this job, in the listing's order, LIMIT n": an index is read from
//! the cursor on, with no `OFFSET` and no sort, so page 1000 costs what page 1 costs,
//! and a job enqueued or pruned meanwhile never shifts a page (OFFSET would skip or
//! repeat rows). Which index, and so which order, is the filter's:
//! [`listing`](super::listing).

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::Row;

use super::admin::{record_from_row, JOB_COLUMNS};
use super::listing::{list_statement, walks_the_table};
use super::stats::GAUGE_SETTINGS;
use super::{check_name, secs, Store};
use crate::error::Result;
use crate::job::{Generation, JobId, JobRecord, JobState};

/// Jobs a page of [`Store::list_jobs`] holds when the caller does not say.
pub const DEFAULT_PAGE: i64 = 50;

/// The largest page [`Store::list_jobs`] returns: a listing is for reading, and a page
/// of payloads must not load a million rows into one process.
pub const MAX_PAGE: i64 = 10_000;

/// Which jobs [`Store::list_jobs`] returns: every field that is set must match. A
/// queue, kind or key no job can have (empty, or with a NUL) is refused with
/// [`Error::InvalidInput`](crate::Error::InvalidInput), in the words an enqueue of it
/// gets (`invalid key: must not be empty`), rather than matching nothing; `None` is no
/// filter.
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

impl JobFilter {
    /// Refuse a name no job can have, as the enqueue does.
    fn check(&self) -> Result<()> {
        for (field, value) in [
            ("queue", &self.queue),
            ("kind", &self.kind),
            ("key", &self.key),
        ] {
            if let Some(value) = value {
                check_name(field, value)?;
            }
        }
        Ok(())
    }
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

/// Ids a bounded page ([`Store::list_jobs_page`]) searches per statement when its
/// filter walks the table: about 25 ms of reading at 10^6 rows on a small machine.
pub const SEARCH_STRETCH: i64 = 100_000;

/// A page of [`Store::list_jobs_page`].
#[derive(Clone, Debug)]
pub struct JobPage {
    /// The jobs found, in the listing's order.
    pub jobs: Vec<JobRecord>,
    /// Where the next page starts (its `JobFilter::after`); `None` when this is the
    /// last page.
    pub next: Option<JobId>,
    /// Set when the search stopped at its time budget before the page was full: every
    /// job up to this id was searched, and `next` goes on from it.
    pub searched_to: Option<JobId>,
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

impl Store {
    /// One page of jobs that match `filter`: by ascending id, except pending jobs
    /// (listed by state without a key) in claim order, `(queue, priority,
    /// available_at, id)`, and waiting jobs by `(queue, key, position in the key)`.
    /// Each page walks an index from the cursor on, so it costs the same at 10^6 rows
    /// of history as at 10: the open states are the newest ids, above the history, so
    /// listing them by id would walk the history first, and an index of open jobs by
    /// id would cost a write on every enqueue and claim. The next page starts after
    /// the last job of this one (`filter.after` = its id, whatever the order); a page
    /// shorter than the limit is the last. Filters no index serves alone (a rare
    /// `kind`, or `older_than`, without a state or key) read the table. Runs in a
    /// short read transaction with sequential scans and JIT off, as the gauges do: on a
    /// never-analyzed table the planner guesses that most rows are leased and would
    /// scan the table for a page of running jobs.
    pub async fn list_jobs(&self, filter: &JobFilter) -> Result<Vec<JobRecord>> {
        self.list_upto(filter, i64::MAX).await
    }

    /// One page of [`Store::list_jobs`] that stops searching after about `budget`:
    /// what a page a person waits for uses (the dashboard's jobs page). A filter that
    /// walks the table by id (a rare `kind` or an `older_than` without a state or key,
    /// or among done or cancelled jobs) is searched [`SEARCH_STRETCH`] ids at a time;
    /// when the budget runs out before the page is full, the page holds what it found
    /// and says how far it searched ([`JobPage::searched_to`]), and its next page
    /// searches on from there. Every other filter reads an index that stops at the
    /// page, and is answered whole.
    pub async fn list_jobs_page(&self, filter: &JobFilter, budget: Duration) -> Result<JobPage> {
        filter.check()?;
        let limit = filter.limit.clamp(1, MAX_PAGE);
        let full_page = |jobs: Vec<JobRecord>| {
            let next = (jobs.len() as i64 == limit)
                .then(|| jobs.last().map(|j| j.id))
                .flatten();
            JobPage {
                jobs,
                next,
                searched_to: None,
            }
        };
        if !walks_the_table(filter.state, filter.key.is_some()) {
            return Ok(full_page(self.list_jobs(filter).await?));
        }
        let started = Instant::now();
        let last_id: i64 = sqlx::query_scalar(
            &self
                .schema()
                .render("SELECT coalesce(max(id), 0) FROM {s}.jobs"),
        )
        .fetch_one(self.db())
        .await?;
        let mut jobs = Vec::new();
        let mut from = filter.after.map_or(0, |id| id.0);
        loop {
            let upto = from.saturating_add(SEARCH_STRETCH);
            let stretch = JobFilter {
                after: Some(JobId(from)),
                limit: limit - jobs.len() as i64,
                ..filter.clone()
            };
            jobs.extend(self.list_upto(&stretch, upto).await?);
            if jobs.len() as i64 == limit {
                return Ok(full_page(jobs));
            }
            if upto >= last_id {
                return Ok(JobPage {
                    jobs,
                    next: None,
                    searched_to: None,
                });
            }
            if started.elapsed() >= budget {
                return Ok(JobPage {
                    jobs,
                    next: Some(JobId(upto)),
                    searched_to: Some(JobId(upto)),
                });
            }
            from = upto;
        }
    }

    /// The listing, reading no job above id `upto`.
    async fn list_upto(&self, filter: &JobFilter, upto: i64) -> Result<Vec<JobRecord>> {
        filter.check()?;
        let sql = self.list_sql(filter, upto < i64::MAX);
        let mut conn = self.acquire().await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        sqlx::raw_sql(GAUGE_SETTINGS).execute(&mut *tx).await?;
        let rows = list_query(&sql, filter, upto)
            .fetch_all(self.on(&mut tx))
            .await?;
        tx.commit().await?;
        rows.iter().map(record_from_row).collect()
    }

    /// `EXPLAIN (ANALYZE, BUFFERS)` of [`Store::list_jobs`] with `filter`'s values bound,
    /// to check on a real table that a page reads an index and stops at its limit.
    pub async fn explain_list_jobs(&self, filter: &JobFilter) -> Result<String> {
        let sql = format!(
            "EXPLAIN (ANALYZE, BUFFERS) {}",
            self.list_sql(filter, false)
        );
        let mut conn = self.acquire().await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        sqlx::raw_sql(GAUGE_SETTINGS).execute(&mut *tx).await?;
        let lines: Vec<String> = list_query(&sql, filter, i64::MAX)
            .fetch_all(self.on(&mut tx))
            .await?
            .iter()
            .map(|r| r.try_get(0))
            .collect::<std::result::Result<_, _>>()?;
        tx.commit().await?;
        Ok(lines.join("\n"))
    }

    /// The listing statement `filter` takes (one step of a bounded search when
    /// `stretch`), ready to bind.
    fn list_sql(&self, filter: &JobFilter, stretch: bool) -> String {
        self.schema().render(
            &list_statement(filter.state, filter.key.is_some(), stretch)
                .replace("__COLUMNS__", JOB_COLUMNS),
        )
    }

    /// The leases of a job that expired and were taken back, oldest first.
    pub async fn lease_expiries(&self, id: JobId) -> Result<Vec<LeaseExpiry>> {
        let sql = self.schema().render(
            "SELECT generation, owner, lease_until, reaped_at, reaped_by, new_state
             FROM {s}.lease_expiries WHERE job_id = $1 ORDER BY generation",
        );
        let rows = sqlx::query(&sql).bind(id.0).fetch_all(self.db()).await?;
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

/// A listing statement (or its EXPLAIN) with the filter's values bound: every path
/// takes the same seven parameters.
fn list_query<'q>(
    sql: &'q str,
    filter: &'q JobFilter,
    upto: i64,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .bind(filter.after.map_or(0, |id| id.0))
        .bind(filter.queue.as_deref())
        .bind(filter.state.map(JobState::as_str))
        .bind(filter.kind.as_deref())
        .bind(filter.key.as_deref())
        .bind(filter.older_than.map(secs))
        .bind(filter.limit.clamp(1, MAX_PAGE))
        .bind(upto)
}
