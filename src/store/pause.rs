//! Pausing a queue, for every process at once.
//!
//! The pause is a row in `paused_queues`, so it survives restarts and holds for
//! schedulers that start later. Every claim statement filters its queues through that
//! table (the claim, a key's fetch-next, a completion's chained successor), so a claim
//! that starts after the pause committed takes none of the queue's jobs. Jobs already
//! running finish. Jobs a scheduler claimed ahead and has not started are given back
//! when it hears of the pause (a NOTIFY on [`Schema::pause_channel`], or its periodic
//! look at the table), without counting an attempt. Resuming deletes the row and wakes
//! every scheduler like an enqueue does.
//!
//! [`Schema::pause_channel`]: super::Schema::pause_channel

use chrono::{DateTime, Utc};
use sqlx::Row;

use super::input::IndexedText;
use super::{check_name, Store};
use crate::error::Result;

const PAUSE: &str = r#"/* leasehold:pause_queue */
WITH p AS (
    INSERT INTO {s}.paused_queues (queue, paused_by) VALUES ($1, $2)
    ON CONFLICT (queue) DO NOTHING
    RETURNING queue
)
SELECT count(*) AS paused, count(pg_notify($3, left($1, 1000))) FROM p"#;

const RESUME: &str = r#"/* leasehold:resume_queue */
WITH r AS (
    DELETE FROM {s}.paused_queues WHERE queue = $1 RETURNING queue
)
SELECT count(*) AS resumed, count(pg_notify($2, left($1, 1000))) FROM r"#;

const PAUSED: &str = r#"/* leasehold:paused_queues */
SELECT queue, paused_at, paused_by FROM {s}.paused_queues ORDER BY queue"#;

/// A paused queue, as [`Store::paused_queues`] lists it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PausedQueue {
    /// The queue.
    pub queue: String,
    /// When it was paused (database clock).
    pub paused_at: DateTime<Utc>,
    /// Who paused it, as the pausing call said; `None` when it did not say.
    pub paused_by: Option<String>,
}

impl Store {
    /// Pause `queue` in every process: from the moment this returns, no claim takes its
    /// jobs; running jobs finish; jobs already claimed ahead are given back within a
    /// second (their attempt not counted). Enqueues still go in. `by` is recorded (an
    /// operator's name, a deploy script). Returns false when it was already paused (the
    /// first pause's time and author stay). A queue does not need to exist to be paused.
    ///
    /// ```no_run
    /// # async fn demo(store: leasehold::store::Store) -> leasehold::Result<()> {
    /// // The payment provider is down: stop starting its jobs, keep accepting them.
    /// store.pause_queue("payouts", Some("ops: provider incident")).await?;
    /// // ... later
    /// store.resume_queue("payouts").await?;
    /// # Ok(()) }
    /// ```
    #[tracing::instrument(name = "leasehold.pause_queue", level = "debug", skip(self))]
    pub async fn pause_queue(&self, queue: &str, by: Option<&str>) -> Result<bool> {
        check_name("queue", queue)?;
        let row = sqlx::query(&self.schema().render(PAUSE))
            .bind(queue)
            .bind(by.map(super::sanitize_error_text))
            .bind(self.schema().pause_channel())
            .fetch_one(self.db())
            .await
            .map_err(|e| IndexedText::of_queue(queue).refusal(e.into()))?;
        let paused: i64 = row.try_get("paused")?;
        if paused > 0 {
            tracing::info!(queue, by, "leasehold queue paused");
        }
        Ok(paused > 0)
    }

    /// Resume a paused queue: every scheduler is woken and claims its jobs again.
    /// Returns false when it was not paused.
    #[tracing::instrument(name = "leasehold.resume_queue", level = "debug", skip(self))]
    pub async fn resume_queue(&self, queue: &str) -> Result<bool> {
        check_name("queue", queue)?;
        let row = sqlx::query(&self.schema().render(RESUME))
            .bind(queue)
            .bind(self.schema().channel())
            .fetch_one(self.db())
            .await?;
        let resumed: i64 = row.try_get("resumed")?;
        if resumed > 0 {
            tracing::info!(queue, "leasehold queue resumed");
        }
        Ok(resumed > 0)
    }

    /// The paused queues, by name.
    pub async fn paused_queues(&self) -> Result<Vec<PausedQueue>> {
        let rows = sqlx::query(&self.schema().render(PAUSED))
            .fetch_all(self.db())
            .await?;
        rows.iter()
            .map(|r| {
                Ok(PausedQueue {
                    queue: r.try_get("queue")?,
                    paused_at: r.try_get("paused_at")?,
                    paused_by: r.try_get("paused_by")?,
                })
            })
            .collect()
    }
}
