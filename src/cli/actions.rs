//! `retry`, `cancel`, `hold`, `release`: on one job by id, or on every job a filter
//! selects (the dead letters of a kind, the jobs of a blocked key).
//!
//! # Confirmation
//!
//! An action on more than one job shows how many match and needs a yes: `--yes`, or an
//! answer at the prompt when standard input is a terminal. Without one nothing is
//! changed and the command exits 1, so a script cannot retry ten thousand jobs by a
//! typo in a filter.
//!
//! # One job at a time
//!
//! Each job goes through its own store call and transaction, like a single action: a
//! job that changed state since it was selected is refused on its own (listed with
//! its reason, exit 1) and the others go ahead.

use std::io::{BufRead, IsTerminal, Write};

use serde_json::json;

use super::args::Target;
use super::{Failure, Printed};
use crate::error::Error;
use crate::job::JobId;
use crate::store::{Action, JobFilter, Store, OPERATOR};

/// Jobs one bulk action selects at most: past this, narrow the filter.
const MAX_SELECTED: usize = 100_000;

/// Run `action` on the target: one job, or the selection after confirmation.
pub(crate) async fn run(
    store: &Store,
    target: &Target,
    action: Action<'_>,
) -> Result<Printed, Failure> {
    match target.id {
        Some(id) => one(store, JobId(id), &action).await,
        None => many(store, target, &action).await,
    }
}

/// Do the action, then read the job back, so the output shows the state it is in now
/// (a retried job of a busy key is `waiting`, not `pending`).
async fn one(store: &Store, id: JobId, action: &Action<'_>) -> Result<Printed, Failure> {
    let before = store.job(id).await?.state;
    let note = store.act(id, action, OPERATOR).await?;
    let after = store.job(id).await?.state;
    let mut text = format!("job {id}: {} done, {before} -> {after}\n", action.name());
    if let Some(note) = note {
        text += &format!("{note}\n");
    }
    Ok(Printed {
        text,
        json: json!({
            "id": id, "action": action.name(), "before": before, "after": after,
            "cancel_requested": note.is_some(),
        }),
    })
}

async fn many(store: &Store, target: &Target, action: &Action<'_>) -> Result<Printed, Failure> {
    let ids = select(store, target, action).await?;
    if ids.len() > 1 && !confirmed(target, action, &ids)? {
        return Err(Failure::Refused(format!(
            "{} jobs match; nothing was changed (add --yes to {} them all)",
            ids.len(),
            action.name()
        )));
    }
    let mut done = Vec::new();
    let mut refused = Vec::new();
    for &id in &ids {
        match store.act(id, action, OPERATOR).await {
            Ok(_) => done.push(id),
            Err(e @ (Error::InvalidTransition { .. } | Error::JobNotFound(_))) => {
                refused.push((id, e.to_string()))
            }
            Err(e) => return Err(e.into()),
        }
    }
    let mut text = format!(
        "{}: {} of {} selected jobs done\n",
        action.name(),
        done.len(),
        ids.len()
    );
    for (id, reason) in &refused {
        text += &format!("job {id} refused: {reason}\n");
    }
    let printed = Printed {
        text,
        json: json!({
            "action": action.name(),
            "matched": ids.len(),
            "done": done,
            "refused": refused.iter().map(|(id, r)| json!({"id": id, "reason": r})).collect::<Vec<_>>(),
        }),
    };
    if refused.is_empty() {
        Ok(printed)
    } else {
        Err(Failure::Partial(printed))
    }
}

/// Every job the filters select in the states the action applies to, by id.
async fn select(
    store: &Store,
    target: &Target,
    action: &Action<'_>,
) -> Result<Vec<JobId>, Failure> {
    let filter = JobFilter {
        queue: target.queue.clone(),
        kind: target.kind.clone(),
        key: target.key.clone(),
        ..JobFilter::default()
    };
    Ok(store
        .job_ids(&filter, &action.states(), MAX_SELECTED)
        .await?)
}

/// `--yes`, or a `y` at the prompt when a person is at the terminal.
fn confirmed(target: &Target, action: &Action<'_>, ids: &[JobId]) -> Result<bool, Failure> {
    if target.yes {
        return Ok(true);
    }
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Ok(false);
    }
    let shown: Vec<String> = ids.iter().take(10).map(|id| id.to_string()).collect();
    let more = if ids.len() > 10 { ", …" } else { "" };
    eprint!(
        "{} {} jobs ({}{more})? [y/N] ",
        action.name(),
        ids.len(),
        shown.join(", ")
    );
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    stdin
        .lock()
        .read_line(&mut answer)
        .map_err(|e| Failure::Failed(format!("cannot read the answer: {e}")))?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}
