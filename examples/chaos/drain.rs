//! After the faults: drain the queue (with the operator actions a real operator would
//! take) and save the database side of the run as artifacts, with what retention
//! deleted (the audit copies) beside what is left.

use std::path::Path;
use std::time::Duration;

use sqlx::{PgPool, Row};

use crate::harness::Harness;
use crate::kinds::KINDS;
use crate::model::RunInfo;

/// Open jobs that something can still move: pending, running or held, or waiting behind
/// a head that exists (pending, running, held, or dead for the operator to unblock).
const MOVABLE: &str =
    "SELECT count(*) FROM leasehold.jobs j WHERE j.state IN ('pending', 'running', 'held') \
     OR (j.state = 'waiting' AND EXISTS (SELECT 1 FROM leasehold.jobs h WHERE h.queue = j.queue \
         AND h.job_key = j.job_key AND h.state IN ('pending', 'running', 'held', 'dead')))";

/// Wait until nothing is open; the operator releases holds, cancels jobs of a kind no
/// worker runs, and unblocks keys held up by a dead head. False if the limit passed,
/// or if only stranded keys are left (waiting jobs with no head at all: nothing will
/// ever move them, so waiting for the limit would only waste the run's time; the
/// checker reports them as `stranded_key`).
pub async fn drain(h: &Harness, info: &mut RunInfo) -> bool {
    let deadline = tokio::time::Instant::now() + h.profile.drain_limit;
    let mut stranded_polls = 0;
    let known: Vec<String> = KINDS.iter().map(|k| k.to_string()).collect();
    let mut act = |what: &str| *info.drain_actions.entry(what.to_string()).or_default() += 1;
    loop {
        let ids = |sql: &'static str| {
            let known = known.clone();
            async move {
                sqlx::query_scalar::<_, i64>(sql)
                    .bind(known)
                    .fetch_all(&h.admin)
                    .await
                    .unwrap_or_default()
            }
        };
        for id in
            ids("SELECT id FROM leasehold.jobs WHERE state = 'held' AND $1::text[] IS NOT NULL")
                .await
        {
            if h.store.release_hold(leasehold::JobId(id)).await.is_ok() {
                act("release_hold");
            }
        }
        for id in
            ids("SELECT id FROM leasehold.jobs WHERE state = 'pending' AND kind <> ALL($1)").await
        {
            if h.store
                .cancel(leasehold::JobId(id), "unknown kind: no worker handles it")
                .await
                .is_ok()
            {
                act("cancel_unknown_kind");
            }
        }
        for id in ids(
            "SELECT j.id FROM leasehold.jobs j WHERE j.state = 'dead' AND j.job_key IS NOT NULL \
             AND j.dead_blocks_key AND $1::text[] IS NOT NULL AND EXISTS (SELECT 1 FROM leasehold.jobs w \
             WHERE w.queue = j.queue AND w.job_key = j.job_key AND w.state = 'waiting')",
        )
        .await
        {
            if h
                .store
                .cancel(leasehold::JobId(id), "operator unblocks the key behind a dead job")
                .await
                .is_ok()
            {
                act("unblock_key");
            }
        }
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM leasehold.jobs WHERE state IN ('pending', 'waiting', 'running', 'held')",
        )
        .fetch_one(&h.admin)
        .await
        .unwrap_or(-1);
        if open == 0 {
            return true;
        }
        let movable: i64 = sqlx::query_scalar(MOVABLE)
            .fetch_one(&h.admin)
            .await
            .unwrap_or(-1);
        stranded_polls = if movable == 0 { stranded_polls + 1 } else { 0 };
        if stranded_polls >= 10 {
            info.drain_stranded = true;
            return false;
        }
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
}

/// Save the database side of the run as JSON lines under `db/`.
pub async fn dump(admin: &PgPool, out: &Path) -> Result<(), String> {
    let dir = out.join("db");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let us = |c: &str| format!("(extract(epoch from {c}) * 1000000)::bigint AS {c}_us");
    // Live rows and the audit's copies of deleted ones (`deleted_at` NULL when live).
    let all = |t: &str| {
        format!(
            "(SELECT l.*, NULL::timestamptz AS deleted_at FROM leasehold.{t} l \
              UNION ALL SELECT a.* FROM chaos_audit.{t} a)"
        )
    };
    let tables = [
        (
            "jobs",
            format!(
                "SELECT id, queue, kind, job_key, key_seq, state, attempts, max_attempts, generation, owner, \
                 result, left(last_error, 300) AS last_error, dead_blocks_key, \
                 CASE WHEN jsonb_typeof(payload -> 'cid') = 'number' THEN (payload ->> 'cid')::bigint END AS cid, \
                 CASE WHEN jsonb_typeof(payload -> 'steps') = 'number' THEN (payload ->> 'steps')::int ELSE 0 END AS steps, \
                 {}, {}, {}, {}, {}, {} FROM {} j ORDER BY id",
                us("created_at"),
                us("available_at"),
                us("finished_at"),
                us("claimed_at"),
                us("lease_until"),
                us("deleted_at"),
                all("jobs")
            ),
        ),
        (
            "job_events",
            format!(
                "SELECT id, job_id, generation, event, owner, {}, left(detail, 200) AS detail, {} \
                 FROM {} e ORDER BY id",
                us("at"),
                us("deleted_at"),
                all("job_events")
            ),
        ),
        (
            "lease_expiries",
            format!(
                "SELECT id, job_id, generation, owner, {}, {}, reaped_by, new_state \
                 FROM {} x ORDER BY id",
                us("lease_until"),
                us("reaped_at"),
                all("lease_expiries")
            ),
        ),
        (
            "leases",
            format!(
                "SELECT job_id, generation, {}, {} FROM chaos_audit.leases ORDER BY written_at",
                us("lease_until"),
                us("written_at")
            ),
        ),
        (
            "job_keys",
            format!(
                "SELECT queue, job_key, next_seq, open_jobs, {} FROM {} k ORDER BY deleted_at NULLS LAST",
                us("deleted_at"),
                all("job_keys")
            ),
        ),
        (
            "effects",
            format!(
                "SELECT effect_key, job_id, generation, {} FROM leasehold.effects ORDER BY job_id",
                us("recorded_at")
            ),
        ),
    ];
    for (name, sql) in tables {
        let wrapped = format!("SELECT row_to_json(t)::text FROM ({sql}) t");
        let rows = sqlx::query(&wrapped)
            .fetch_all(admin)
            .await
            .map_err(|e| format!("dump {name}: {e}"))?;
        let mut text = String::new();
        for r in rows {
            text.push_str(&r.get::<String, _>(0));
            text.push('\n');
        }
        std::fs::write(dir.join(format!("{name}.jsonl")), text).map_err(|e| e.to_string())?;
    }
    Ok(())
}
