//! The operator's actions on one job, as one type the CLI and the dashboard share: its
//! name, the states a bulk selection of it takes, and [`Store::act`], which does it
//! through the fenced store calls in `admin.rs` and records who did it.

use super::{CancelOutcome, Store};
use crate::error::Result;
use crate::job::{JobId, JobState};

/// Who an action was done by when the caller does not say (the history's `owner`).
pub const OPERATOR: &str = "operator";

/// An operator action on a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action<'a> {
    /// Dead → pending (or waiting behind its key): [`Store::retry_dead`].
    Retry,
    /// With its reason; a bulk selection takes only jobs in the state given, or every
    /// unfinished one: [`Store::cancel`].
    Cancel(&'a str, Option<JobState>),
    /// Pending → held: [`Store::hold`].
    Hold,
    /// Held → pending: [`Store::release_hold`].
    Release,
}

/// What [`Store::act`] says when a cancel was a request to a running attempt.
pub const CANCEL_REQUESTED: &str =
    "it is running: its owner was asked to stop, and it ends cancelled unless that attempt completes";

impl<'a> Action<'a> {
    /// `retry`, `cancel`, `hold` or `release`.
    pub fn name(&self) -> &'static str {
        match self {
            Action::Retry => "retry",
            Action::Cancel(..) => "cancel",
            Action::Hold => "hold",
            Action::Release => "release",
        }
    }

    /// The action named `name` (a cancel with `reason`, any state); `None` if unknown.
    pub fn parse(name: &str, reason: &'a str) -> Option<Self> {
        Some(match name {
            "retry" => Action::Retry,
            "cancel" => Action::Cancel(reason, None),
            "hold" => Action::Hold,
            "release" => Action::Release,
            _ => return None,
        })
    }

    /// The states a filter selects for this action: the ones it applies to.
    pub fn states(&self) -> Vec<JobState> {
        match self {
            Action::Retry => vec![JobState::Dead],
            Action::Hold => vec![JobState::Pending],
            Action::Release => vec![JobState::Held],
            Action::Cancel(_, Some(state)) => vec![*state],
            Action::Cancel(_, None) => JobState::ALL
                .into_iter()
                .filter(|s| !matches!(s, JobState::Done | JobState::Cancelled))
                .collect(),
        }
    }
}

impl Store {
    /// Do `action` to job `id`, recording `by` in its history. `Some(note)` when it was
    /// a request rather than a transition ([`CANCEL_REQUESTED`]). Errors as the store
    /// call behind the action.
    pub async fn act(
        &self,
        id: JobId,
        action: &Action<'_>,
        by: &str,
    ) -> Result<Option<&'static str>> {
        match action {
            Action::Retry => self.retry_dead_by(id, by).await?,
            Action::Hold => self.hold_by(id, by).await?,
            Action::Release => self.release_hold_by(id, by).await?,
            Action::Cancel(reason, _) => {
                if self.cancel_by(id, reason, by).await? == CancelOutcome::Requested {
                    return Ok(Some(CANCEL_REQUESTED));
                }
            }
        }
        Ok(None)
    }
}
