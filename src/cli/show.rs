//! `leasehold job ID`: everything about one job an operator needs to say what happened
//! to it — its row, its history, the leases it lost, the effects it recorded, and for
//! a waiting job the head of its key it waits behind.

use chrono::Utc;
use serde_json::json;

use super::commands::encode;
use super::text::{fields, shown, shown_opt, since, table, when};
use super::{Failure, Printed};
use crate::job::{JobId, JobRecord, JobState};
use crate::store::{JobFilter, Store};

/// Blocked keys searched for a waiting job's dead head.
const BLOCKED_SEARCHED: i64 = 10_000;

pub(crate) async fn job(store: &Store, id: JobId, full: bool) -> Result<Printed, Failure> {
    let job = store.job(id).await?;
    let history = store.history(id).await?;
    let expiries = store.lease_expiries(id).await?;
    let effects = store.job_effects(id).await?;
    let head = match job.state {
        JobState::Waiting => key_head(store, &job).await?,
        _ => None,
    };

    let mut text = format!(
        "job {id}\n{}",
        fields(&row_fields(&job, head.as_ref(), full))
    );
    text += "\nhistory\n";
    text += &section(
        &["AT", "GEN", "EVENT", "OWNER", "DETAIL"],
        &history
            .iter()
            .map(|e| {
                vec![
                    when(Some(e.at)),
                    e.generation.to_string(),
                    e.event.clone(),
                    shown_opt(e.owner.as_deref(), full),
                    shown_opt(e.detail.as_deref(), full),
                ]
            })
            .collect::<Vec<_>>(),
    );
    if !expiries.is_empty() {
        text += "\nexpired leases\n";
        text += &section(
            &[
                "GEN",
                "OWNER",
                "LEASE UNTIL",
                "REAPED AT",
                "REAPED BY",
                "THEN",
            ],
            &expiries
                .iter()
                .map(|x| {
                    vec![
                        x.generation.to_string(),
                        x.owner.clone(),
                        when(Some(x.lease_until)),
                        when(Some(x.reaped_at)),
                        x.reaped_by.clone(),
                        x.new_state.clone(),
                    ]
                })
                .collect::<Vec<_>>(),
        );
    }
    if !effects.is_empty() {
        text += "\nrecorded effects\n";
        text += &section(
            &["EFFECT KEY", "GEN", "RECORDED AT", "OUTCOME"],
            &effects
                .iter()
                .map(|e| {
                    vec![
                        shown(&e.effect_key, full),
                        e.generation.to_string(),
                        when(Some(e.recorded_at)),
                        shown(&e.outcome.to_string(), full),
                    ]
                })
                .collect::<Vec<_>>(),
        );
    }
    let json = json!({
        "job": serde_json::to_value(&job).map_err(encode)?,
        "waits_behind": head,
        "history": history,
        "lease_expiries": expiries,
        "effects": effects,
    });
    Ok(Printed { text, json })
}

/// A table indented under its heading, or `none` (a job enqueued with history off, or
/// whose history was pruned, has none).
fn section(headers: &[&str], rows: &[Vec<String>]) -> String {
    if rows.is_empty() {
        return "  none\n".into();
    }
    table(headers, rows)
        .lines()
        .map(|line| format!("  {line}\n"))
        .collect()
}

fn row_fields(
    job: &JobRecord,
    head: Option<&JobRecord>,
    full: bool,
) -> Vec<(&'static str, String)> {
    let now = Utc::now();
    let key = match (&job.key, job.key_seq) {
        (Some(k), Some(seq)) => format!("{} (position {seq})", shown(k, full)),
        _ => "-".into(),
    };
    let mut out = vec![
        ("queue", job.queue.clone()),
        ("kind", job.kind.clone()),
        ("key", key),
        ("state", job.state.to_string()),
    ];
    if let Some(h) = head {
        let why = shown_opt(h.last_error.as_deref(), full);
        out.push(("waits behind", format!("job {} ({}): {why}", h.id, h.state)));
    }
    out.extend([
        ("priority", job.priority.to_string()),
        (
            "attempts",
            match job.snoozes {
                0 => format!("{} of {}", job.attempts, job.max_attempts),
                n => format!(
                    "{} of {} (snoozed {n} times)",
                    job.attempts, job.max_attempts
                ),
            },
        ),
        ("generation", job.generation.to_string()),
        ("owner", shown_opt(job.owner.as_deref(), full)),
        ("lease until", when(job.lease_until)),
        ("available at", when(Some(job.available_at))),
        (
            "created at",
            format!(
                "{} ({} ago)",
                when(Some(job.created_at)),
                since(job.created_at, now)
            ),
        ),
        ("finished at", when(job.finished_at)),
        ("cancel asked", when(job.cancel_requested_at)),
        ("payload", shown(&job.payload.to_string(), full)),
        (
            "result",
            shown_opt(job.result.as_ref().map(|r| r.to_string()).as_deref(), full),
        ),
        (
            "progress",
            shown_opt(
                job.progress.as_ref().map(|p| p.to_string()).as_deref(),
                full,
            ),
        ),
        ("last error", shown_opt(job.last_error.as_deref(), full)),
    ]);
    if let Some(e) = &job.payload_error {
        out.push(("undecodable", shown(e, full)));
    }
    out
}

/// The open job at the front of a waiting job's key: the earliest of its key that is
/// pending, running or held, else the dead head that blocks the key.
async fn key_head(store: &Store, job: &JobRecord) -> Result<Option<JobRecord>, Failure> {
    let Some(key) = &job.key else {
        return Ok(None);
    };
    let mut heads = Vec::new();
    for state in [JobState::Running, JobState::Pending, JobState::Held] {
        let filter = JobFilter {
            queue: Some(job.queue.clone()),
            key: Some(key.clone()),
            state: Some(state),
            limit: 1,
            ..JobFilter::default()
        };
        heads.extend(store.list_jobs(&filter).await?);
    }
    if heads.is_empty() {
        let blocked = store.blocked_keys(BLOCKED_SEARCHED).await?;
        if let Some(b) = blocked
            .iter()
            .find(|b| b.queue == job.queue && &b.key == key)
        {
            heads.push(store.job(b.head).await?);
        }
    }
    Ok(heads.into_iter().min_by_key(|h| h.key_seq))
}
