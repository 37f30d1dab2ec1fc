//! Reads the dashboard and the CLI share beyond the listing: the jobs a bulk action
//! selects, recent throughput per minute, and where a keyed job stands in its key.
//!
//! Each is one statement on an index (or a loop of keyset pages), so a page that shows
//! them costs the same at 10^6 rows of history as at 10.

use chrono::{DateTime, Utc};
use sqlx::Row;

use super::Store;
use crate::error::{Error, Result};
use crate::job::{JobId, JobState};
use crate::store::{JobFilter, MAX_PAGE};

/// Jobs that ended in one minute of one queue: [`Store::throughput`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MinuteCount {
    /// The queue.
    pub queue: String,
    /// The start of the minute (database clock).
    pub minute: DateTime<Utc>,
    /// Jobs that became done in it.
    pub done: i64,
    /// Jobs that became dead in it (attempts exhausted, or poison).
    pub dead: i64,
    /// Jobs that became cancelled in it.
    pub cancelled: i64,
}

/// Where a keyed job stands in its key: [`Store::key_position`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct KeyPosition {
    /// Open jobs of the key enqueued before it (0: it is the head, or done).
    pub ahead: i64,
    /// The key's head when it is not this job: the job whose turn it is.
    pub head: Option<JobId>,
    /// The head's state; a `dead` or `held` head blocks the key.
    pub head_state: Option<JobState>,
}

/// Every job that ended in the window, through the index on `finished_at`: the cost is
/// the jobs that ended in the window, never the history before it.
const THROUGHPUT: &str = r#"/* leasehold:throughput */
SELECT queue, date_trunc('minute', finished_at) AS minute,
       count(*) FILTER (WHERE state = 'done') AS done,
       count(*) FILTER (WHERE state = 'dead') AS dead,
       count(*) FILTER (WHERE state = 'cancelled') AS cancelled
FROM {s}.jobs
WHERE finished_at IS NOT NULL
  AND finished_at >= date_trunc('minute', now()) - make_interval(mins => $1)
GROUP BY 1, 2
ORDER BY 1, 2"#;

/// The open jobs of the key before this one, through the open-by-key index and the
/// waiting jobs' own (one state list over both made PostgreSQL scan the table: 220 ms
/// at 10^6 rows): the first is the head.
const KEY_POSITION: &str = r#"/* leasehold:key_position */
WITH me AS (SELECT queue, job_key, key_seq FROM {s}.jobs WHERE id = $1 AND job_key IS NOT NULL),
ahead AS (
    SELECT j.id, j.state, j.key_seq FROM {s}.jobs j, me
    WHERE j.queue = me.queue AND j.job_key = me.job_key AND j.key_seq < me.key_seq
      AND j.state IN ('pending', 'running', 'held', 'dead')
      AND (j.state <> 'dead' OR j.dead_blocks_key)
  UNION ALL
    SELECT j.id, j.state, j.key_seq FROM {s}.jobs j, me
    WHERE j.queue = me.queue AND j.job_key = me.job_key AND j.key_seq < me.key_seq
      AND j.state = 'waiting'
)
SELECT (SELECT count(*) FROM ahead) AS ahead,
       (SELECT id FROM ahead ORDER BY key_seq LIMIT 1) AS head,
       (SELECT state FROM ahead ORDER BY key_seq LIMIT 1) AS head_state,
       EXISTS (SELECT 1 FROM me) AS keyed"#;

impl Store {
    /// The ids of every job `filter` selects in any of `states` (its own `state`,
    /// `after` and `limit` are ignored), by id, read a keyset page at a time: what a
    /// bulk action works through. Refused with [`Error::InvalidInput`] past `max` jobs,
    /// so a loose filter cannot select the whole table.
    pub async fn job_ids(
        &self,
        filter: &JobFilter,
        states: &[JobState],
        max: usize,
    ) -> Result<Vec<JobId>> {
        let mut ids = Vec::new();
        for &state in states {
            let mut page_filter = JobFilter {
                state: Some(state),
                after: None,
                limit: MAX_PAGE,
                ..filter.clone()
            };
            loop {
                let page = self.list_jobs(&page_filter).await?;
                ids.extend(page.iter().map(|j| j.id));
                if ids.len() > max {
                    return Err(Error::InvalidInput {
                        field: "filter",
                        reason: format!(
                            "more than {max} jobs match; nothing was changed (narrow the filter)"
                        ),
                    });
                }
                match page.last() {
                    Some(last) if page.len() as i64 == MAX_PAGE => {
                        page_filter.after = Some(last.id)
                    }
                    _ => break,
                }
            }
        }
        ids.sort();
        Ok(ids)
    }

    /// Jobs that ended per queue and minute over the last `minutes` whole minutes and
    /// the current one, oldest first; a minute in which nothing ended is absent.
    pub async fn throughput(&self, minutes: i32) -> Result<Vec<MinuteCount>> {
        let rows = sqlx::query(&self.schema().render(THROUGHPUT))
            .bind(minutes)
            .fetch_all(self.db())
            .await?;
        rows.iter()
            .map(|r| {
                Ok(MinuteCount {
                    queue: r.try_get("queue")?,
                    minute: r.try_get("minute")?,
                    done: r.try_get("done")?,
                    dead: r.try_get("dead")?,
                    cancelled: r.try_get("cancelled")?,
                })
            })
            .collect()
    }

    /// Where job `id` stands in its key; `None` for an unkeyed (or unknown) job.
    pub async fn key_position(&self, id: JobId) -> Result<Option<KeyPosition>> {
        let row = sqlx::query(&self.schema().render(KEY_POSITION))
            .bind(id.0)
            .fetch_one(self.db())
            .await?;
        if !row.try_get::<bool, _>("keyed")? {
            return Ok(None);
        }
        let state: Option<String> = row.try_get("head_state")?;
        Ok(Some(KeyPosition {
            ahead: row.try_get("ahead")?,
            head: row.try_get::<Option<i64>, _>("head")?.map(JobId),
            head_state: state.as_deref().and_then(JobState::parse),
        }))
    }
}
