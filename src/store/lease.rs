//! Lease renewal: extend many leases in one fenced statement.

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::{secs, Store};
use crate::error::Result;
use crate::job::{Generation, JobId, OwnerId};

pub(super) const RENEW: &str = r#"/* leasehold:renew */
UPDATE {s}.jobs j
SET lease_until = now() + make_interval(secs => $4)
FROM unnest($1::int8[], $2::int8[]) AS t(id, generation)
WHERE j.id = t.id AND j.generation = t.generation AND j.owner = $3 AND j.state = 'running'
RETURNING j.id, j.lease_until"#;

/// What a batched renewal found.
#[derive(Clone, Debug, Default)]
pub struct RenewReport {
    /// Leases extended, with their new deadline (database clock).
    pub renewed: Vec<(JobId, DateTime<Utc>)>,
    /// Leases this owner no longer holds: the handlers must be told to stop.
    pub lost: Vec<JobId>,
}

impl Store {
    /// Extend the leases of `jobs` held by `owner` to `now() + lease`. A job missing from
    /// the result was reaped, released, cancelled or claimed by a newer generation.
    pub async fn renew(
        &self,
        owner: &OwnerId,
        jobs: &[(JobId, Generation)],
        lease: Duration,
    ) -> Result<RenewReport> {
        if jobs.is_empty() {
            return Ok(RenewReport::default());
        }
        let ids: Vec<i64> = jobs.iter().map(|j| j.0 .0).collect();
        let gens: Vec<i64> = jobs.iter().map(|j| j.1 .0).collect();
        let rows: Vec<(i64, DateTime<Utc>)> = sqlx::query_as(&self.sql().renew)
            .bind(&ids)
            .bind(&gens)
            .bind(owner.as_str())
            .bind(secs(lease))
            .fetch_all(self.pool())
            .await?;
        let renewed: Vec<(JobId, DateTime<Utc>)> =
            rows.into_iter().map(|(id, t)| (JobId(id), t)).collect();
        let lost = jobs
            .iter()
            .map(|j| j.0)
            .filter(|id| !renewed.iter().any(|(r, _)| r == id))
            .collect();
        Ok(RenewReport { renewed, lost })
    }
}
