//! The commands: each reads or acts through one [`Store`] call (or a few) and says
//! what it found or did, as text and as JSON.

use std::time::Duration;

use chrono::Utc;
use serde_json::json;

use super::actions;
use super::args::{Command, JobsArgs};
use super::text::{age, shown_opt, since, table};
use super::{show, Failure, Printed};
use crate::job::{JobId, JobState};
use crate::store::{Action, JobFilter, PruneOptions, PruneReport, Store, MAX_PAGE, SCHEMA_VERSION};

/// Run one command.
pub(crate) async fn dispatch(store: &Store, command: &Command) -> Result<Printed, Failure> {
    match command {
        Command::Status => status(store).await,
        Command::Jobs(args) => jobs(store, args).await,
        Command::Job { id, full } => show::job(store, JobId(*id), *full).await,
        Command::Retry(target) => actions::run(store, target, Action::Retry).await,
        Command::Cancel {
            target,
            state,
            reason,
        } => actions::run(store, target, Action::Cancel(reason, *state)).await,
        Command::Hold(target) => actions::run(store, target, Action::Hold).await,
        Command::Release(target) => actions::run(store, target, Action::Release).await,
        Command::Keys { limit, .. } => blocked_keys(store, *limit).await,
        Command::Pause { queue, by } => pause(store, queue, by.as_deref()).await,
        Command::Resume { queue } => resume(store, queue).await,
        Command::Migrate { print: true } => migration_script(store).await,
        Command::Migrate { print: false } => migrate(store).await,
        Command::Prune { older_than, batch } => prune(store, *older_than, *batch).await,
    }
}

/// The states `status` counts: open and parked jobs. Done and cancelled are history,
/// whose count would cost a scan of the table (`jobs --state done` lists them).
const COUNTED_STATES: [JobState; 5] = [
    JobState::Pending,
    JobState::Waiting,
    JobState::Running,
    JobState::Held,
    JobState::Dead,
];

async fn status(store: &Store) -> Result<Printed, Failure> {
    let stats = store.queue_stats().await?;
    let mut headers = vec!["QUEUE"];
    headers.extend(COUNTED_STATES.iter().map(|s| s.as_str()));
    headers.extend([
        "OLDEST ELIGIBLE",
        "OLDEST RUNNING",
        "BLOCKED KEYS",
        "LEASE EXPIRIES (15 MIN)",
        "PAUSED",
    ]);
    let mut rows = Vec::new();
    for q in &stats {
        let mut row = vec![q.queue.clone()];
        row.extend(
            COUNTED_STATES
                .iter()
                .map(|s| q.by_state.get(s.as_str()).copied().unwrap_or(0).to_string()),
        );
        row.extend([
            age(q.oldest_eligible_age_secs),
            age(q.oldest_running_secs),
            q.blocked_keys.to_string(),
            q.recent_lease_expiries.to_string(),
            if q.paused { "paused" } else { "-" }.to_string(),
        ]);
        rows.push(row);
    }
    let mut text = if stats.is_empty() {
        "no open jobs\n".to_string()
    } else {
        table(&headers, &rows)
    };
    // The processes that run them, by their heartbeats (see `Store::live_schedulers`).
    let live = store.live_schedulers().await?;
    if live.is_empty() {
        text += "\nno live scheduler\n";
    } else {
        let rows: Vec<Vec<String>> = live
            .iter()
            .map(|s| {
                vec![
                    s.owner.clone(),
                    s.queues.join(","),
                    s.concurrency.to_string(),
                    age(s.seen_secs_ago),
                ]
            })
            .collect();
        text += "\n";
        text += &table(&["SCHEDULER", "QUEUES", "CONCURRENCY", "LAST SEEN"], &rows);
    }
    Ok(Printed {
        text,
        json: json!({ "queues": stats, "schedulers": live }),
    })
}

async fn jobs(store: &Store, args: &JobsArgs) -> Result<Printed, Failure> {
    let filter = JobFilter {
        queue: args.queue.clone(),
        state: args.state,
        kind: args.kind.clone(),
        key: args.key.clone(),
        older_than: args.older_than,
        after: args.after.map(JobId),
        limit: args.limit,
    };
    let page = store.list_jobs(&filter).await?;
    // A full page may have a next one; a short page is the last.
    let next = (page.len() as i64 >= filter.limit.clamp(1, MAX_PAGE))
        .then(|| page.last().map(|j| j.id.0))
        .flatten();
    // Ages against this machine's clock: a display, not a deadline.
    let now = Utc::now();
    let headers = [
        "ID",
        "QUEUE",
        "KIND",
        "KEY",
        "STATE",
        "ATTEMPTS",
        "AGE",
        "LAST ERROR",
    ];
    let rows: Vec<Vec<String>> = page
        .iter()
        .map(|j| {
            vec![
                j.id.to_string(),
                j.queue.clone(),
                j.kind.clone(),
                shown_opt(j.key.as_deref(), false),
                j.state.to_string(),
                format!("{}/{}", j.attempts, j.max_attempts),
                since(j.created_at, now),
                shown_opt(j.last_error.as_deref(), false),
            ]
        })
        .collect();
    let mut text = if page.is_empty() {
        "no jobs match\n".to_string()
    } else {
        table(&headers, &rows)
    };
    if let Some(last) = next {
        text += &format!("next page: --after {last}\n");
    }
    Ok(Printed {
        text,
        json: json!({ "jobs": page, "next_after": next }),
    })
}

async fn blocked_keys(store: &Store, limit: i64) -> Result<Printed, Failure> {
    let keys = store.blocked_keys(limit.max(1)).await?;
    let now = Utc::now();
    let rows: Vec<Vec<String>> = keys
        .iter()
        .map(|k| {
            vec![
                k.queue.clone(),
                shown_opt(Some(&k.key), false),
                k.head.to_string(),
                k.head_state.clone(),
                k.since.map_or("-".into(), |t| since(t, now)),
                k.waiting.to_string(),
                shown_opt(k.reason.as_deref(), false),
            ]
        })
        .collect();
    let text = if keys.is_empty() {
        "no blocked keys\n".to_string()
    } else {
        table(
            &[
                "QUEUE", "KEY", "HEAD", "STATE", "SINCE", "WAITING", "REASON",
            ],
            &rows,
        )
    };
    Ok(Printed {
        text,
        json: json!({ "blocked_keys": keys }),
    })
}

async fn pause(store: &Store, queue: &str, by: Option<&str>) -> Result<Printed, Failure> {
    let changed = store.pause_queue(queue, by).await?;
    let since = store
        .paused_queues()
        .await?
        .into_iter()
        .find(|p| p.queue == queue);
    let text = match (&since, changed) {
        (_, true) => format!(
            "paused queue {}: nothing of it is claimed until it is resumed\n",
            super::text::shown(queue, false)
        ),
        (Some(p), false) => format!(
            "queue {queue} was already paused (since {}{})\n",
            super::text::when(Some(p.paused_at)),
            p.paused_by
                .as_deref()
                .map(|b| format!(", by {}", super::text::shown(b, false)))
                .unwrap_or_default()
        ),
        (None, false) => format!(
            "queue {} was resumed meanwhile; pause it again\n",
            super::text::shown(queue, false)
        ),
    };
    Ok(Printed {
        text,
        json: json!({ "queue": queue, "paused": since.is_some(), "changed": changed, "pause": since }),
    })
}

async fn resume(store: &Store, queue: &str) -> Result<Printed, Failure> {
    let changed = store.resume_queue(queue).await?;
    let text = if changed {
        format!("resumed queue {queue}\n")
    } else {
        format!("queue {queue} was not paused\n")
    };
    Ok(Printed {
        text,
        json: json!({ "queue": queue, "paused": false, "changed": changed }),
    })
}

async fn migrate(store: &Store) -> Result<Printed, Failure> {
    store.migrate().await?;
    let schema = store.schema().name();
    Ok(Printed {
        text: format!("schema {schema} is at version {SCHEMA_VERSION}\n"),
        json: json!({ "schema": schema, "version": SCHEMA_VERSION }),
    })
}

async fn migration_script(store: &Store) -> Result<Printed, Failure> {
    let sql = store.migration_script().await?;
    Ok(Printed {
        json: json!({ "schema": store.schema().name(), "sql": sql }),
        text: sql,
    })
}

/// Prune in batches until a pass deletes less than a batch of everything: one
/// statement never holds a million row locks. A statement that times out is tried
/// again with half the batch (see `Store::prune_with`), and the passes after it keep
/// the smaller batch. A pass skipped because another process is pruning ends the run.
async fn prune(store: &Store, keep: Duration, batch: i64) -> Result<Printed, Failure> {
    let mut options = PruneOptions::new(keep);
    options.batch = batch.max(1);
    let mut total = PruneReport::default();
    loop {
        let pass = store.prune_with(&options).await?;
        total.add(&pass);
        options.batch = pass.batch;
        let full = [pass.jobs, pass.effects, pass.keys, pass.fires]
            .iter()
            .any(|&n| n as i64 >= pass.batch);
        if pass.skipped || !full {
            break;
        }
    }
    let busy = if total.skipped {
        " (another process was pruning: run again to finish)"
    } else {
        ""
    };
    Ok(Printed {
        text: format!(
            "pruned {} jobs that finished more than {} ago, {} expired effect records, {} idle keys, \
             {} fire records{busy}\n",
            total.jobs,
            humantime::format_duration(keep),
            total.effects,
            total.keys,
            total.fires,
        ),
        json: serde_json::to_value(&total).map_err(encode)?,
    })
}

pub(super) fn encode(e: serde_json::Error) -> Failure {
    Failure::Failed(format!("cannot encode JSON: {e}"))
}
