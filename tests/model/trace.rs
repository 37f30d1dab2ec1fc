//! Counterexamples as readable traces: one line per step (the clock, who, which
//! statement), then the job rows, keys and process attempts after it.

use std::fmt::Write;

use super::actions::{Action, Leasehold};
use super::config::Config;
use super::state::{Effect, Ending, JobState, Phase, Renewer, State, Up};

/// The trace of `steps` taken from `first`.
pub fn render(m: &Leasehold, first: &State, steps: &[(Action, State)]) -> String {
    render_from(m, first, steps, "start", 0)
}

/// [`render`], with `first` labelled `label` and the clock at `t` there (a cycle that
/// goes on from where a path left off).
pub fn render_from(
    m: &Leasehold,
    first: &State,
    steps: &[(Action, State)],
    label: &str,
    mut t: usize,
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "  0. t={t:<2} {:<66} | {}",
        label,
        summary(&m.cfg, first)
    );
    let mut before = first;
    for (i, (action, after)) in steps.iter().enumerate() {
        if *action == Action::Tick {
            t += 1;
        }
        let (who, _) = action.statement();
        let what = describe(&m.cfg, before, action);
        let _ = writeln!(
            out,
            "{:>3}. t={:<2} {:<8} {:<57} | {}",
            i + 1,
            t,
            who,
            what,
            summary(&m.cfg, after)
        );
        before = after;
    }
    out
}

/// The statement, with the job and generation it acts on; for an ending, which
/// statement it is (the attempt in `before` says).
fn describe(cfg: &Config, before: &State, a: &Action) -> String {
    use Action::*;
    let (_, what) = a.statement();
    match a {
        End(p, j, g, park) | Resume(p, j, g, park) => {
            let phase = before.attempt(*p, *j, *g).map(|x| x.phase);
            let ending = match phase {
                Some(Phase::Ending(e)) | Some(Phase::Writing { ending: e, .. }) => e,
                _ => Ending::Fail,
            };
            let sql = match (ending, cfg.key_of(*j)) {
                (Ending::Fail, _) => "fail.rs FAIL",
                (Ending::Complete { chain: true }, Some(_)) => "complete_keyed, promote chained",
                (Ending::Complete { .. }, Some(_)) => "complete_keyed, promote",
                (Ending::Complete { .. }, None) => "COMPLETE_UNKEYED",
            };
            let resumed = if matches!(a, Resume(..)) {
                "key row free: "
            } else {
                ""
            };
            let parked = if *park {
                "; successor to the ready queue"
            } else {
                ""
            };
            format!("j{j}g{g} {resumed}{sql}{parked}")
        }
        Start(_, j, g, _) if cfg.defects.renewal_from_handler_start => {
            format!("j{j}g{g} {}", what.replace("lease check", "no lease check"))
        }
        Start(_, j, g, _) | Record(_, j, g) | Release(_, j, g, _) => format!("j{j}g{g} {what}"),
        ResumeReap(j) | Cancel(j) | Hold(j) | ReleaseHold(j) | RetryDead(j) => {
            format!("j{j} {what}")
        }
        Deliver(i) => {
            let req = before.store.in_flight.get(*i as usize);
            req.map_or(what.to_string(), |r| {
                format!("{what} (j{} token {:?})", r.job, r.token)
            })
        }
        _ => what.to_string(),
    }
}

fn key_name(k: u8) -> char {
    (b'A' + k) as char
}

/// Rows, key rows and the processes' attempts, on one line.
pub fn summary(cfg: &Config, s: &State) -> String {
    let mut out = String::new();
    for (j, r) in s.rows.iter().enumerate() {
        let key = match cfg.key_of(j as u8) {
            Some(k) => format!("{}#{}", key_name(k), r.key_seq),
            None => "-".into(),
        };
        let st = match r.state {
            JobState::Unborn => "unborn",
            JobState::Pending => "pending",
            JobState::Waiting => "waiting",
            JobState::Running => "running",
            JobState::Held => "held",
            JobState::Done => "done",
            JobState::Dead => "dead",
            JobState::Cancelled => "cancelled",
            JobState::Pruned => "pruned",
        };
        let _ = write!(out, "j{j} {key} {st}");
        if r.state == JobState::Running {
            let _ = write!(
                out,
                " p{} g{} lease{:+}",
                r.owner, r.generation, r.lease_left
            );
            if r.cancel_requested {
                out.push_str(" cancel_requested");
            }
        } else if r.state == JobState::Pending && r.due_in > 0 {
            let _ = write!(out, " due+{}", r.due_in);
        }
        out.push_str("; ");
    }
    for (k, kr) in s.keys.iter().enumerate() {
        let lock = if s.key_locked(cfg, Some(k as u8)) {
            " locked"
        } else {
            ""
        };
        let _ = write!(out, "{} open={}{lock}; ", key_name(k as u8), kr.open_jobs);
    }
    for (p, proc) in s.procs.iter().enumerate() {
        let up = match proc.up {
            Up::Running => "",
            Up::Stopping => " STOPPING",
            Up::Crashed => " CRASHED",
        };
        let renewer = match proc.renewer {
            Renewer::Ok => "",
            Renewer::Paused => " PAUSED",
            Renewer::Blocked { .. } => " renew-waits",
        };
        let _ = write!(out, "p{p}{up}{renewer}[");
        for (i, a) in proc.attempts.iter().enumerate() {
            if i > 0 {
                out.push(' ');
            }
            let phase = match a.phase {
                Phase::ReadyQueue { .. } => "waits-for-slot",
                Phase::Queued => "queued",
                Phase::Ready => "ready",
                Phase::Handler(Effect::Awaiting) => "handler:acting",
                Phase::Handler(Effect::Answered) => "handler:acted",
                Phase::Handler(Effect::Refused) => "handler:refused",
                Phase::Ending(Ending::Complete { .. }) => "returned:ok",
                Phase::Ending(Ending::Fail) => "returned:err",
                Phase::Writing { .. } => "ending-waits-key",
                Phase::GivenBack { .. } => "given-back",
            };
            let _ = write!(out, "j{}g{} {phase}", a.job, a.gen);
            match a.phase {
                Phase::ReadyQueue { waited } => {
                    let _ = write!(out, " waited{waited}");
                }
                Phase::GivenBack { give_up } => {
                    let _ = write!(out, " gives-up-in{give_up}");
                    continue;
                }
                _ => {}
            }
            if !cfg.defects.no_local_deadline {
                let _ = write!(out, " dl{:+}", a.deadline);
            }
            if a.cancelled {
                out.push_str(" cancelled");
            }
        }
        out.push_str("] ");
    }
    if !s.store.in_flight.is_empty() || s.store.applied.iter().any(|n| *n > 0) {
        let _ = write!(out, "| effects applied {:?}", s.store.applied);
    }
    out
}
