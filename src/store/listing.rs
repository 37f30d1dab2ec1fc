//! The statements behind [`Store::list_jobs`](super::Store::list_jobs): which index a
//! page walks, chosen from the filter.
//!
//! # Why the open states are not listed by id
//!
//! Ids grow with time, so the open jobs are the newest and a table's history (done and
//! cancelled jobs, usually nine rows in ten) lies below them. A page of pending jobs by
//! id walks the primary key through that history first: 200 to 250 ms at 10^6 rows
//! (`--only dashboard` in the bench). An index of open jobs by id would fix the order but
//! costs a write on every enqueue and claim, the hot path. So each open state is listed
//! in the order of an index it already has, which is also the order an operator wants:
//!
//! * **pending** in claim order, `(queue, priority, available_at, id)`: what runs next
//!   comes first (the claimer's own index, `jobs_claimable_by_queue`);
//! * **waiting** by `(queue, job_key, key_seq)`: each key's queue in its order
//!   (`jobs_waiting_by_key`);
//! * **running** by id, from the leased jobs only (`jobs_leased`; there are no more
//!   running jobs than slots);
//! * a key's jobs by id, from the indexes its open rows are in and its history's
//!   (`jobs_ended_by_key`);
//! * every other filter by id: dead and held jobs walk `jobs_parked_by_id`, done and
//!   cancelled jobs (and no state) the primary key, where they are the bulk of the rows.
//!
//! Every path is a keyset page: the next page starts after the last job of this one,
//! named by its id (`JobFilter::after`); for the two orders that are not by id the
//! cursor's position is read from that job's row. A job that changes state while an
//! operator pages keeps its position, so a page never skips or repeats a job because
//! another was added or removed.

use crate::job::JobState;

/// The filter predicates every path shares; `$1` (the cursor), `$7` (the limit) and `$8`
/// (the last id of a stretch) are placed by each path; the paths that do not use `$8`
/// leave it unused.
const FILTERS: &str = "($2::text IS NULL OR queue = $2)
  AND ($3::text IS NULL OR state = $3)
  AND ($4::text IS NULL OR kind = $4)
  AND ($5::text IS NULL OR job_key = $5)
  AND ($6::float8 IS NULL OR created_at <= now() - make_interval(secs => $6))";

/// By id from `$1` on: the primary key, or a partial index by id when the filter
/// matches one (`jobs_parked_by_id`). With the values bound,
/// PostgreSQL's custom plans fold `NULL IS NULL OR ...` away.
const BY_ID: &str = r#"/* leasehold:list_jobs */
SELECT __COLUMNS__ FROM {s}.jobs
WHERE id > $1
  AND __FILTERS__
ORDER BY id
LIMIT $7"#;

/// [`BY_ID`] within a stretch of ids, `$1` to `$8`: one step of a bounded search
/// ([`Store::list_jobs_page`](super::Store::list_jobs_page)) through the primary key.
/// Only there: with a range on id the planner walks the primary key even where a
/// partial index by id would read a handful of entries (350 ms for the dead letters
/// at 10^6 rows), and on a never-analyzed table it does so for the open states too.
const BY_ID_STRETCH: &str = r#"/* leasehold:list_jobs_stretch */
SELECT __COLUMNS__ FROM {s}.jobs
WHERE id > $1 AND id <= $8
  AND __FILTERS__
ORDER BY id
LIMIT $7"#;

/// Running jobs by id. The fence (`OFFSET 0`) keeps the planner from walking the
/// primary key in id order and testing each row: it reads the leased jobs (a few
/// hundred at most, one per slot and claimed-ahead job) and sorts them.
const RUNNING: &str = r#"/* leasehold:list_jobs_running */
SELECT __COLUMNS__ FROM (
    SELECT * FROM {s}.jobs
    WHERE lease_until IS NOT NULL AND state = 'running' AND id > $1
      AND __FILTERS__
    OFFSET 0
) running
ORDER BY id
LIMIT $7"#;

/// Pending jobs in claim order after the cursor job's position. With no cursor (`$1` =
/// 0) the position is before every entry; a cursor job that no longer exists (pruned)
/// ends the listing rather than starting it again.
const PENDING: &str = r#"/* leasehold:list_jobs_pending */
WITH cursor AS (SELECT queue, priority, available_at, id FROM {s}.jobs WHERE id = $1)
SELECT __COLUMNS__ FROM {s}.jobs
WHERE state = 'pending'
  AND ($1 = 0 OR EXISTS (SELECT 1 FROM cursor))
  AND ROW(queue, priority, available_at, id) > ROW(
        coalesce((SELECT queue FROM cursor), ''),
        coalesce((SELECT priority FROM cursor), (-32768)::smallint),
        coalesce((SELECT available_at FROM cursor), '-infinity'::timestamptz),
        coalesce((SELECT id FROM cursor), 0::bigint))
  AND __FILTERS__
ORDER BY queue, priority, available_at, id
LIMIT $7"#;

/// Waiting jobs by queue, key and position in the key, after the cursor job's; as
/// [`PENDING`] for a missing cursor.
const WAITING: &str = r#"/* leasehold:list_jobs_waiting */
WITH cursor AS (SELECT queue, job_key, key_seq FROM {s}.jobs WHERE id = $1)
SELECT __COLUMNS__ FROM {s}.jobs
WHERE state = 'waiting'
  AND ($1 = 0 OR EXISTS (SELECT 1 FROM cursor))
  AND ROW(queue, job_key, key_seq) > ROW(
        coalesce((SELECT queue FROM cursor), ''),
        coalesce((SELECT job_key FROM cursor), ''),
        coalesce((SELECT key_seq FROM cursor), (-9223372036854775807)::bigint - 1))
  AND __FILTERS__
ORDER BY queue, job_key, key_seq
LIMIT $7"#;

/// A key's jobs by id: three arms, each on an index a key's rows are already in — the
/// open jobs (pending, running, held, dead) on `jobs_open_by_key`, the waiting ones on
/// `jobs_waiting_by_key`, the history (done, cancelled) on `jobs_ended_by_key` in id order
/// — each cut at the page, then merged. No index holds every version of a keyed row:
/// one did (migration 13), and cost the keyed path a tenth of its throughput (migration
/// 14). The open arms sort what they read: a key's open jobs, not its history.
const BY_KEY: &str = r#"/* leasehold:list_jobs_by_key */
SELECT __COLUMNS__ FROM (
    (SELECT * FROM {s}.jobs
     WHERE job_key = $5 AND state IN ('done', 'cancelled') AND id > $1 AND __FILTERS__
     ORDER BY id LIMIT $7)
    UNION ALL
    (SELECT * FROM {s}.jobs
     WHERE job_key = $5 AND state IN ('pending', 'running', 'held', 'dead') AND id > $1
       AND __FILTERS__
     ORDER BY id LIMIT $7)
    UNION ALL
    (SELECT * FROM {s}.jobs
     WHERE job_key = $5 AND state = 'waiting' AND id > $1 AND __FILTERS__
     ORDER BY id LIMIT $7)
) keyed
ORDER BY id
LIMIT $7"#;

/// The statement for a filter on `state` and `key`, before the schema and columns are
/// filled in. A key's jobs are few, so a key filter always reads its indexes by id. A
/// `stretch` is one step of a bounded search of a filter that
/// [walks the table](walks_the_table).
pub(super) fn list_statement(state: Option<JobState>, keyed: bool, stretch: bool) -> String {
    let template = match (state, keyed) {
        _ if stretch && walks_the_table(state, keyed) => BY_ID_STRETCH,
        (_, true) => BY_KEY,
        (Some(JobState::Pending), false) => PENDING,
        (Some(JobState::Waiting), false) => WAITING,
        (Some(JobState::Running), false) => RUNNING,
        _ => BY_ID,
    };
    template.replace("__FILTERS__", FILTERS)
}

/// Whether a filter walks the whole table by id: no key, and a state whose rows are
/// not few (done, cancelled) or no state. Such a walk over a rare match reads every
/// row, so a bounded page searches it a stretch of ids at a time.
pub(super) fn walks_the_table(state: Option<JobState>, keyed: bool) -> bool {
    !keyed && matches!(state, None | Some(JobState::Done | JobState::Cancelled))
}
