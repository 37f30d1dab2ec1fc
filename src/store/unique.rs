//! Unique jobs ([`NewJob::unique`]): an enqueue of a job whose kind and unique key are
//! taken in its scope returns the existing job instead of writing a new one.
//!
//! Two layers. The database enforces it: unique partial indexes (migration 8) on
//! `(kind, unique_key)` over the open states, and on `(kind, unique_key, unique_until)`
//! for the period and forever scopes. And an enqueue answers a duplicate with the
//! existing job's id rather than an error: inside the enqueue's transaction it first
//! takes a transaction-level advisory lock per unique key (in hash order, so concurrent
//! batches cannot deadlock), then looks for the existing job in a statement of its own
//! (whose snapshot is taken after the locks were granted, so it sees a job another
//! enqueuer committed while it waited), and writes only the jobs it did not find. A
//! lock is held until the enqueuing transaction ends: inside a caller's transaction
//! ([`Store::enqueue_in`]), a second enqueuer of the same unique key waits for that
//! transaction, and sees its job if it committed.
//!
//! Jobs without a unique key never take these locks or run the lookup.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::{check_name, Store};
use crate::error::{Error, Result};
use crate::job::{JobId, NewJob, UniqueScope};

/// One lock per distinct unique key of the batch, taken in hash order; and the
/// database's time, which places each period-scoped job in its window.
const LOCK: &str = r#"/* leasehold:unique_lock */
SELECT statement_timestamp() AS now, count(*) AS locks
FROM (SELECT pg_advisory_xact_lock(hashtext($1), h)
      FROM (SELECT DISTINCT hashtext(k) AS h FROM unnest($2::text[]) AS k) s
      ORDER BY h) l"#;

/// The existing job that takes each unique job's key in its scope: open (no window),
/// in the same window, or for ever (`unique_until` infinity).
const LOOKUP: &str = r#"/* leasehold:unique_lookup */
SELECT (SELECT j.id FROM {s}.jobs j
         WHERE j.kind = u.kind AND j.unique_key = u.ukey
           AND CASE WHEN u.forever THEN j.unique_until = 'infinity'
                    WHEN u.until IS NOT NULL THEN j.unique_until = u.until
                    ELSE j.unique_until IS NULL
                         AND j.state IN ('pending', 'waiting', 'running', 'held') END
         LIMIT 1) AS existing
FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::bool[]) WITH ORDINALITY
  AS u(kind, ukey, until, forever, n)
ORDER BY u.n"#;

/// Where a unique job's key holds: the `unique_until` it is written with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Window {
    /// Not unique, or unique while open (`unique_until` NULL).
    Open,
    /// Until the end of its period.
    Until(DateTime<Utc>),
    /// For ever (`unique_until` infinity).
    Forever,
}

impl Window {
    /// The `unique_until` and `unique_forever` parameters.
    pub(super) fn params(self) -> (Option<DateTime<Utc>>, bool) {
        match self {
            Window::Open => (None, false),
            Window::Until(t) => (Some(t), false),
            Window::Forever => (None, true),
        }
    }

    /// The window of `scope` at `now`: periods are fixed windows from the Unix epoch.
    fn of(scope: UniqueScope, now: DateTime<Utc>) -> Window {
        match scope {
            UniqueScope::WhileOpen => Window::Open,
            UniqueScope::Forever => Window::Forever,
            UniqueScope::Period(p) => {
                let p = p.as_secs().max(1) as i64;
                let end = (now.timestamp().div_euclid(p) + 1).saturating_mul(p);
                DateTime::from_timestamp(end, 0).map_or(Window::Forever, Window::Until)
            }
        }
    }
}

/// What to do with one job of a batch that holds unique jobs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Resolution {
    /// Write it, unique in this window (`Open` also for a job that is not unique).
    Write(Window),
    /// A duplicate of this existing job.
    Existing(JobId),
    /// A duplicate of an earlier job of the same batch (its index), which is written.
    SameAs(usize),
}

/// The shortest period accepted: windows are counted in whole seconds.
const MIN_PERIOD: std::time::Duration = std::time::Duration::from_secs(1);

/// The unique key's checks, made with the job's others before anything is written.
pub(super) fn check_unique(job: &NewJob) -> Result<()> {
    let Some(unique) = &job.unique else {
        return Ok(());
    };
    check_name("unique key", &unique.key)?;
    if let UniqueScope::Period(p) = unique.scope {
        if p < MIN_PERIOD || p > super::MAX_DELAY {
            return Err(Error::InvalidInput {
                field: "unique period",
                reason: format!(
                    "{} is outside 1 second to 100 years",
                    humantime::format_duration(p)
                ),
            });
        }
    }
    Ok(())
}

/// What the lock and lookup statements bind, checked before they run: the kinds and
/// the unique keys (a NUL would be the database's error, not ours). The rest of each
/// job is checked as it is written, inside the same transaction, so an invalid job
/// still writes nothing.
pub(super) fn check_unique_batch(jobs: &[NewJob]) -> Result<()> {
    for job in jobs.iter().filter(|j| j.unique.is_some()) {
        check_name("kind", &job.kind)?;
        check_unique(job)?;
    }
    Ok(())
}

impl Store {
    /// Lock the batch's unique keys and find the jobs that already take them; every job
    /// of the batch gets a [`Resolution`]. Call inside the enqueue's transaction.
    pub(super) async fn resolve_unique(
        &self,
        conn: &mut PgConnection,
        jobs: &[NewJob],
    ) -> Result<Vec<Resolution>> {
        let unique: Vec<(usize, &NewJob)> = jobs
            .iter()
            .enumerate()
            .filter(|(_, j)| j.unique.is_some())
            .collect();
        let kinds: Vec<&str> = unique.iter().map(|(_, j)| j.kind.as_str()).collect();
        let keys: Vec<&str> = unique
            .iter()
            .filter_map(|(_, j)| j.unique.as_ref().map(|u| u.key.as_str()))
            .collect();
        let lock_keys: Vec<String> = kinds
            .iter()
            .zip(&keys)
            .map(|(k, u)| format!("{k}\u{1f}{u}"))
            .collect();
        let (now, _locks): (DateTime<Utc>, i64) = sqlx::query_as(LOCK)
            .bind(format!("leasehold.unique.{}", self.schema().name()))
            .bind(&lock_keys)
            .fetch_one(self.on(&mut *conn))
            .await?;
        let windows: Vec<Window> = unique
            .iter()
            .filter_map(|(_, j)| j.unique.as_ref())
            .map(|u| Window::of(u.scope, now))
            .collect();
        let (untils, forevers): (Vec<Option<DateTime<Utc>>>, Vec<bool>) =
            windows.iter().map(|w| w.params()).unzip();
        let found: Vec<(Option<i64>,)> = sqlx::query_as(&self.schema().render(LOOKUP))
            .bind(&kinds)
            .bind(&keys)
            .bind(&untils)
            .bind(&forevers)
            .fetch_all(self.on(&mut *conn))
            .await?;
        let mut out = vec![Resolution::Write(Window::Open); jobs.len()];
        // The first job of the batch with a (kind, key, window) is written; later ones
        // are its duplicates.
        let mut first: HashMap<(&str, &str, Window), usize> = HashMap::new();
        for (((i, job), window), (existing,)) in unique.iter().zip(windows).zip(found) {
            let key = job.unique.as_ref().map_or("", |u| u.key.as_str());
            out[*i] = match (existing, first.get(&(job.kind.as_str(), key, window))) {
                (Some(id), _) => Resolution::Existing(JobId(id)),
                (None, Some(&earlier)) => Resolution::SameAs(earlier),
                (None, None) => {
                    first.insert((job.kind.as_str(), key, window), *i);
                    Resolution::Write(window)
                }
            };
        }
        Ok(out)
    }
}
