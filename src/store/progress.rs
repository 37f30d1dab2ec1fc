//! Progress: a small JSON value a running handler records on its job (how far a long
//! export got, the cursor to resume from), readable by operators while it runs and
//! after. Fenced like every write about a claimed job: an attempt that lost its lease
//! cannot overwrite what the current one recorded.

use super::{check_json, JsonLimit, Store};
use crate::error::Result;
use crate::job::{Fence, FenceOutcome};

/// The largest progress value accepted, in bytes of its JSON encoding: it is rewritten
/// on every call, so it must stay small (a counter, a cursor, a status line).
pub const MAX_PROGRESS_BYTES: usize = 16 * 1024;

const RECORD: &str = r#"/* leasehold:record_progress */
UPDATE {s}.jobs SET progress = $4
WHERE id = $1 AND owner = $2 AND generation = $3 AND effect_identity = $5::uuid
  AND state = 'running'"#;

impl Store {
    /// Record `progress` on a running job, if `fence` still holds it
    /// ([`FenceOutcome::Stale`] otherwise: nothing written). Replaces what was recorded
    /// before; kept after the job ends, and shown by [`Store::job`] and `leasehold job`.
    /// A handler calls [`JobContext::record_progress`](crate::JobContext::record_progress).
    ///
    /// A value with a NUL, nested deeper than
    /// [`MAX_PAYLOAD_DEPTH`](super::MAX_PAYLOAD_DEPTH) levels or larger than
    /// [`MAX_PROGRESS_BYTES`] is refused with
    /// [`Error::InvalidInput`](crate::Error::InvalidInput) for `progress`, before
    /// anything is written.
    pub async fn record_progress(
        &self,
        fence: &Fence,
        progress: &serde_json::Value,
    ) -> Result<FenceOutcome> {
        let limit = JsonLimit {
            bytes: MAX_PROGRESS_BYTES,
            name: "MAX_PROGRESS_BYTES",
        };
        check_json("progress", progress, &limit)?;
        let done = sqlx::query(&self.schema().render(RECORD))
            .bind(fence.job.0)
            .bind(fence.owner.as_str())
            .bind(fence.generation.0)
            .bind(progress)
            .bind(fence.identity.as_str())
            .execute(self.db())
            .await?;
        Ok(if done.rows_affected() == 1 {
            FenceOutcome::Applied
        } else {
            FenceOutcome::Stale
        })
    }
}
