//! The effect ledger: effect key → (job, generation, fingerprint, outcome).
//!
//! A record is written only by the job's current generation: the insert reads the job
//! row `FOR SHARE` under the fence, so a reap or a newer claim cannot slip between the
//! check and the insert. The first outcome recorded for a key wins; later attempts get
//! it back instead of acting again.
//!
//! The ledger holds each key as it went to the effect store: `<job's effect identity>/<job
//! id>/<step>` for the keys [`JobContext`](crate::JobContext) makes (see
//! [`crate::EffectKey`]). It is keyed by that text alone; listings and retention go by
//! the job.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::Row;

use super::{check_effect_key, check_json, check_name, secs, JsonLimit, Store};
use crate::error::{Error, Result};
use crate::job::{Fence, Generation, JobId};

pub(super) const RECORD: &str = r#"/* leasehold:effect_record */
WITH fence AS (
    SELECT id FROM {s}.jobs
    WHERE id = $1 AND owner = $2 AND generation = $3 AND effect_identity = $8::uuid
      AND state = 'running'
    FOR SHARE
), ins AS (
    INSERT INTO {s}.effects (effect_key, job_id, generation, fingerprint, outcome, keep_until)
    SELECT $4, $1, $3, $5, $6, now() + make_interval(secs => $7) FROM fence
    ON CONFLICT (effect_key) DO NOTHING
    RETURNING effect_key, outcome
)
SELECT (SELECT count(*) FROM fence) AS fenced, (SELECT count(*) FROM ins) AS inserted,
       (SELECT outcome FROM ins) AS stored"#;

pub(super) const LOOKUP: &str = r#"/* leasehold:effect_lookup */
SELECT effect_key, job_id, generation, fingerprint, outcome, recorded_at, keep_until
FROM {s}.effects WHERE effect_key = $1"#;

/// [`LOOKUP`] under the attempt's fence, in one statement: `held` is whether the attempt
/// (job id $2, its effect identity $3, owner $4, generation $5) still runs the job and
/// no cancel of it is recorded; the effect columns are null when the key has no record.
pub(super) const LOOKUP_UNDER: &str = r#"/* leasehold:effect_lookup_under */
SELECT j.id IS NOT NULL AS held,
       e.effect_key, e.job_id, e.generation, e.fingerprint, e.outcome, e.recorded_at, e.keep_until
FROM (SELECT 1) one
LEFT JOIN {s}.jobs j ON j.id = $2 AND j.effect_identity = $3::uuid AND j.owner = $4
                     AND j.generation = $5 AND j.state = 'running'
                     AND j.cancel_requested_at IS NULL
LEFT JOIN {s}.effects e ON e.effect_key = $1"#;

/// What the ledger says before an attempt acts (see [`Store::effect_under`]).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Lookup {
    /// The key has a record: its outcome is the step's, whoever asks.
    Recorded(EffectRecord),
    /// No record, and the attempt still runs its job: it may act.
    Absent,
    /// No record, and the attempt no longer runs the job (a newer attempt or a reaper
    /// took it back, an operator ended it or asked it to stop, or the job is not in this
    /// schema any more): it must not act.
    Lost,
}

/// A recorded effect.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct EffectRecord {
    /// The stable key, as it went to the effect store: `<job's effect identity>/<job
    /// id>/<step>` for a key [`JobContext`](crate::JobContext) made (see
    /// [`crate::EffectKey`]); whatever text a caller of [`Store::record_effect`] chose.
    pub effect_key: String,
    /// The job that performed the effect.
    pub job: JobId,
    /// The generation that recorded the outcome.
    pub generation: Generation,
    /// SHA-256 of the request (see [`crate::context::fingerprint`]); the same key with
    /// another request is refused, not replayed.
    pub fingerprint: String,
    /// The recorded outcome, returned to any later attempt instead of acting again.
    /// Null when it cannot be decoded (see `outcome_error`).
    pub outcome: serde_json::Value,
    /// Set when the stored outcome cannot be decoded (one nested deeper than
    /// [`MAX_PAYLOAD_DEPTH`](super::MAX_PAYLOAD_DEPTH), recorded before migration 17
    /// made the schema refuse it): why. Only [`Store::job_effects`], the operator's view,
    /// returns such a record; [`Store::effect`], which a handler's retry reads, refuses
    /// it with [`Error::Decode`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome_error: Option<String>,
    /// When it was recorded (database clock).
    pub recorded_at: DateTime<Utc>,
    /// The ledger keeps the record at least until then (recorded at plus
    /// `Config::effect_keep`), and longer while its job may still run.
    pub keep_until: DateTime<Utc>,
}

/// A ledger row. An outcome that cannot be decoded is [`Error::Decode`] (not a database
/// error: no retry reads it, so a handler stops rather than tries again), or, for an
/// operator's view (`lenient`), null with the reason, so the job can still be shown.
fn effect_from_row(r: &PgRow, lenient: bool) -> Result<EffectRecord> {
    let (outcome, outcome_error) = match r.try_get("outcome") {
        Ok(outcome) => (outcome, None),
        Err(e) if lenient => (serde_json::Value::Null, Some(e.to_string())),
        Err(e) => {
            return Err(Error::Decode {
                what: "effect outcome",
                reason: e.to_string(),
            })
        }
    };
    Ok(EffectRecord {
        effect_key: r.try_get("effect_key")?,
        job: JobId(r.try_get("job_id")?),
        generation: Generation(r.try_get("generation")?),
        fingerprint: r.try_get("fingerprint")?,
        outcome,
        outcome_error,
        recorded_at: r.try_get("recorded_at")?,
        keep_until: r.try_get("keep_until")?,
    })
}

/// Result of recording an effect's outcome.
#[derive(Clone, Debug, PartialEq)]
pub enum RecordOutcome {
    /// This call recorded the outcome.
    Recorded,
    /// The key already had an outcome (returned); nothing was written.
    AlreadyRecorded(EffectRecord),
    /// The worker no longer owns this generation; nothing was written.
    Stale,
}

impl Store {
    /// Look an effect up by its key. A key that could not have been recorded (empty, or
    /// with a NUL) is refused with [`Error::InvalidInput`].
    pub async fn effect(&self, effect_key: &str) -> Result<Option<EffectRecord>> {
        check_name("effect key", effect_key)?;
        let row = sqlx::query(&self.sql().effect_lookup)
            .bind(effect_key)
            .fetch_optional(self.db())
            .await?;
        row.as_ref().map(|r| effect_from_row(r, false)).transpose()
    }

    /// [`Store::effect`] for the key `effect_key` of the attempt `fence`, read together
    /// with whether that attempt still runs the job. A recorded outcome is returned to any attempt (it acts no
    /// more for it); without one, an attempt that no longer runs the job
    /// ([`Lookup::Lost`]) must not act: a newer attempt may act under the same key
    /// meanwhile, or the job it ran is gone (its schema dropped and created again under
    /// a running process).
    pub(crate) async fn effect_under(&self, effect_key: &str, fence: &Fence) -> Result<Lookup> {
        check_name("effect key", effect_key)?;
        let row = sqlx::query(&self.sql().effect_lookup_under)
            .bind(effect_key)
            .bind(fence.job.0)
            .bind(fence.identity.as_str())
            .bind(fence.owner.as_str())
            .bind(fence.generation.0)
            .fetch_one(self.db())
            .await?;
        let recorded: Option<String> = row.try_get("effect_key")?;
        if recorded.is_some() {
            return effect_from_row(&row, false).map(Lookup::Recorded);
        }
        match row.try_get::<bool, _>("held")? {
            true => Ok(Lookup::Absent),
            false => Ok(Lookup::Lost),
        }
    }

    /// The effects a job recorded, oldest first (for an operator looking at the job;
    /// `effects_by_job` finds them). A record whose outcome cannot be decoded comes back
    /// with `outcome_error` set, so the job can still be looked at.
    pub async fn job_effects(&self, id: JobId) -> Result<Vec<EffectRecord>> {
        let sql = self.schema().render(
            "SELECT effect_key, job_id, generation, fingerprint, outcome, recorded_at, keep_until
             FROM {s}.effects WHERE job_id = $1 ORDER BY recorded_at, effect_key",
        );
        let rows = sqlx::query(&sql).bind(id.0).fetch_all(self.db()).await?;
        rows.iter().map(|r| effect_from_row(r, true)).collect()
    }

    /// Record an effect's outcome under the fence. `keep` is how long the ledger must
    /// keep it (at least the longest retry window).
    ///
    /// The row belongs to the job that recorded it: retention deletes it once `keep` has
    /// passed and that job has ended for good (done or cancelled, or deleted), whichever
    /// other job found it since. The keys of [`EffectKey`](crate::EffectKey) are one
    /// job's; a key of your own that several jobs share needs a `keep` that covers the
    /// retries of every job relying on it.
    ///
    /// Refused before anything is written, with [`Error::InvalidInput`]: an effect key
    /// that is empty, holds a NUL or is longer than
    /// [`INDEXED_TEXT_ALWAYS_FITS`](super::INDEXED_TEXT_ALWAYS_FITS) bytes (`effect key`),
    /// and an outcome that a later attempt could not read back — a NUL, nesting deeper
    /// than [`MAX_PAYLOAD_DEPTH`](super::MAX_PAYLOAD_DEPTH), more than
    /// [`StoreOptions::max_result_bytes`](super::StoreOptions::max_result_bytes) of JSON
    /// (`effect outcome`).
    pub async fn record_effect(
        &self,
        fence: &Fence,
        effect_key: &str,
        fingerprint: &str,
        outcome: &serde_json::Value,
        keep: Duration,
    ) -> Result<RecordOutcome> {
        self.record_effect_as_stored(fence, effect_key, fingerprint, outcome, keep)
            .await
            .map(|(recorded, _)| recorded)
    }

    /// [`Store::record_effect`], and, when this call recorded it, the outcome as the
    /// ledger holds it (PostgreSQL's jsonb prints some numbers otherwise than they were
    /// sent: `1e16` as `10000000000000000`, `-0.0` as `0.0`), which is what every later
    /// attempt reads.
    pub(crate) async fn record_effect_as_stored(
        &self,
        fence: &Fence,
        effect_key: &str,
        fingerprint: &str,
        outcome: &serde_json::Value,
        keep: Duration,
    ) -> Result<(RecordOutcome, Option<serde_json::Value>)> {
        check_effect_key(effect_key)?;
        check_name("fingerprint", fingerprint)?;
        let limit = JsonLimit {
            bytes: self.options().max_result_bytes,
            name: "store.max_result_bytes",
        };
        check_json("effect outcome", outcome, &limit)?;
        let row = sqlx::query(&self.sql().effect_record)
            .bind(fence.job.0)
            .bind(fence.owner.as_str())
            .bind(fence.generation.0)
            .bind(effect_key)
            .bind(fingerprint)
            .bind(outcome)
            .bind(secs(keep))
            .bind(fence.identity.as_str())
            .fetch_one(self.db())
            .await?;
        let fenced: i64 = row.try_get("fenced")?;
        let inserted: i64 = row.try_get("inserted")?;
        if fenced == 0 {
            return Ok((RecordOutcome::Stale, None));
        }
        if inserted == 1 {
            return Ok((RecordOutcome::Recorded, row.try_get("stored")?));
        }
        match self.effect(effect_key).await? {
            Some(existing) => Ok((RecordOutcome::AlreadyRecorded(existing), None)),
            // Pruned between the two statements: only possible with a keep shorter than
            // the retry window; report it as already there rather than guess.
            None => Ok((RecordOutcome::Stale, None)),
        }
    }
}
