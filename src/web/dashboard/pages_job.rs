//! One job's page, the blocked keys and the live schedulers.
//!
//! A job's attempts are not a table of their own: they are read back from its
//! history (what each generation's owner wrote), its lease expiries (what the reaper
//! wrote) and the row itself (the attempt still running), the same records
//! `leasehold show` prints.

use std::collections::BTreeMap;

use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use askama::Template;

use super::pages::{error_page, respond, Flash};
use super::view::{line, ts, Clipped, Frame};
use super::State;
use crate::job::{JobEvent, JobId, JobRecord, JobState};
use crate::store::LeaseExpiry;

/// Events a worker or reaper writes when an attempt ends.
const ATTEMPT_ENDS: [&str; 6] = [
    "completed",
    "failed",
    "dead",
    "released",
    "snoozed",
    "cancelled",
];

/// Blocked keys a page lists at most.
const KEYS_SHOWN: i64 = 500;

#[derive(Default)]
struct Attempt {
    generation: i64,
    owner: String,
    start: String,
    end: String,
    outcome: String,
}

struct EventRow {
    at: String,
    generation: i64,
    event: String,
    owner: String,
    detail: String,
}

struct ExpiryRow {
    generation: i64,
    owner: String,
    lease_until: String,
    reaped_at: String,
    reaped_by: String,
    new_state: String,
}

struct EffectRow {
    key: String,
    generation: i64,
    outcome: String,
    at: String,
}

#[derive(Template)]
#[template(path = "dashboard/job.html")]
struct JobPage {
    frame: Frame,
    job: JobRecord,
    cancel_requested: bool,
    key: String,
    key_position: String,
    generation: i64,
    owner: String,
    created: String,
    available: String,
    lease_until: String,
    finished: String,
    last_error: String,
    actions: Vec<&'static str>,
    payload: Clipped,
    payload_error: Option<String>,
    result: Clipped,
    progress: Option<String>,
    full_href: String,
    attempts: Vec<Attempt>,
    expiries: Vec<ExpiryRow>,
    effects: Vec<EffectRow>,
    history: Vec<EventRow>,
}

/// The actions the job's state allows, by the names of the action routes.
pub(crate) fn allowed(state: JobState) -> Vec<&'static str> {
    match state {
        JobState::Dead => vec!["retry", "cancel"],
        JobState::Pending => vec!["hold", "cancel"],
        JobState::Held => vec!["release", "cancel"],
        JobState::Running | JobState::Waiting => vec!["cancel"],
        JobState::Done | JobState::Cancelled => vec![],
    }
}

/// Each generation's owner, start, end and outcome, oldest first.
fn attempts(job: &JobRecord, history: &[JobEvent], expiries: &[LeaseExpiry]) -> Vec<Attempt> {
    let mut by_gen: BTreeMap<i64, Attempt> = BTreeMap::new();
    fn entry(map: &mut BTreeMap<i64, Attempt>, g: i64) -> &mut Attempt {
        let a = map.entry(g).or_default();
        a.generation = g;
        a
    }
    for e in history.iter().filter(|e| e.generation.0 > 0) {
        let worker = e.owner.as_deref().filter(|o| *o != crate::store::OPERATOR);
        if e.event == "claimed" || (ATTEMPT_ENDS.contains(&e.event.as_str()) && worker.is_some()) {
            let a = entry(&mut by_gen, e.generation.0);
            if let Some(o) = worker {
                a.owner = o.to_string();
            }
            if e.event == "claimed" {
                a.start = ts(Some(e.at));
            } else {
                a.end = ts(Some(e.at));
                a.outcome = e.event.clone();
            }
        }
    }
    for x in expiries {
        let a = entry(&mut by_gen, x.generation.0);
        a.owner = x.owner.clone();
        a.end = ts(Some(x.reaped_at));
        a.outcome = format!("lease expired, became {}", x.new_state);
    }
    let g = job.generation.0;
    if g > 0 {
        let a = entry(&mut by_gen, g);
        if a.owner.is_empty() {
            a.owner = job.owner.clone().unwrap_or_default();
        }
        if a.outcome.is_empty() {
            a.outcome = match job.state {
                JobState::Running => "running".into(),
                JobState::Done => "completed".into(),
                s => s.to_string(),
            };
            if job.state != JobState::Running {
                a.end = ts(job.finished_at);
            }
        }
    }
    by_gen
        .into_values()
        .map(|mut a| {
            for f in [&mut a.start, &mut a.end] {
                if f.is_empty() {
                    *f = "—".into();
                }
            }
            a
        })
        .collect()
}

/// `GET /job/{id}`: everything known about one job. `?full=1` shows the payload and
/// result whole.
pub(crate) async fn job(
    state: web::Data<State>,
    req: HttpRequest,
    id: web::Path<i64>,
    flash: web::Query<Flash>,
) -> HttpResponse {
    let id = JobId(id.into_inner());
    let store = &state.store;
    let read = async {
        Ok::<_, crate::Error>((
            store.job(id).await?,
            store.history(id).await?,
            store.lease_expiries(id).await?,
            store.job_effects(id).await?,
            store.key_position(id).await?,
        ))
    };
    let (job, history, expiries, effects, position) = match read.await {
        Ok(r) => r,
        Err(e) => return error_page(&state, &req, e),
    };
    let flash = flash.into_inner();
    let full = flash.full.is_some();
    let key_position = match (&position, &job.key) {
        (None, _) | (_, None) => "not keyed".to_string(),
        (Some(p), Some(_)) => match (p.head, p.head_state) {
            (Some(head), Some(hs)) if matches!(hs, JobState::Dead | JobState::Held) => format!(
                "{} open jobs ahead; blocked: its head, job {head}, is {hs}",
                p.ahead
            ),
            (Some(head), Some(hs)) => {
                format!("{} open jobs ahead; the head is job {head} ({hs})", p.ahead)
            }
            _ => "at the head of its key".to_string(),
        },
    };
    let page = JobPage {
        frame: Frame::blank(),
        cancel_requested: job.cancel_requested_at.is_some(),
        key: job.key.clone().unwrap_or_else(|| "—".into()),
        key_position,
        generation: job.generation.0,
        owner: job.owner.clone().unwrap_or_else(|| "—".into()),
        created: ts(Some(job.created_at)),
        available: ts(Some(job.available_at)),
        lease_until: ts(job.lease_until),
        finished: ts(job.finished_at),
        last_error: job.last_error.clone().unwrap_or_else(|| "—".into()),
        actions: allowed(job.state),
        payload: Clipped::json(Some(&job.payload), full),
        payload_error: job.payload_error.clone(),
        result: Clipped::json(job.result.as_ref(), full),
        progress: job.progress.as_ref().map(|p| p.to_string()),
        full_href: format!("{}/job/{}?full=1", state.base, id.0),
        attempts: attempts(&job, &history, &expiries),
        expiries: expiries
            .iter()
            .map(|x| ExpiryRow {
                generation: x.generation.0,
                owner: x.owner.clone(),
                lease_until: ts(Some(x.lease_until)),
                reaped_at: ts(Some(x.reaped_at)),
                reaped_by: x.reaped_by.clone(),
                new_state: x.new_state.clone(),
            })
            .collect(),
        effects: effects
            .iter()
            .map(|e| EffectRow {
                key: e.effect_key.clone(),
                generation: e.generation.0,
                outcome: Clipped::text(e.outcome.to_string(), full).text,
                at: ts(Some(e.recorded_at)),
            })
            .collect(),
        history: history
            .iter()
            .map(|e| EventRow {
                at: ts(Some(e.at)),
                generation: e.generation.0,
                event: e.event.clone(),
                owner: e.owner.clone().unwrap_or_default(),
                detail: e.detail.clone().unwrap_or_default(),
            })
            .collect(),
        job,
    };
    let title = format!("Job {}", id.0);
    let render = |frame| JobPage { frame, ..page }.render();
    respond(&state, &req, StatusCode::OK, render, title, flash.msg)
}

struct KeyRow {
    queue: String,
    key: String,
    head: i64,
    head_href: String,
    head_state: String,
    reason: String,
    since: String,
    waiting: i64,
}

#[derive(Template)]
#[template(path = "dashboard/keys.html")]
struct Keys {
    frame: Frame,
    keys: Vec<KeyRow>,
}

/// `GET /keys`: keys blocked by a dead or held head, with the reason.
pub(crate) async fn keys(state: web::Data<State>, req: HttpRequest) -> HttpResponse {
    let blocked = match state.store.blocked_keys(KEYS_SHOWN).await {
        Ok(b) => b,
        Err(e) => return error_page(&state, &req, e),
    };
    let keys = blocked
        .into_iter()
        .map(|k| KeyRow {
            head_href: format!("{}/job/{}", state.base, k.head.0),
            head: k.head.0,
            queue: k.queue,
            key: k.key,
            head_state: k.head_state,
            reason: line(k.reason.as_deref(), 200),
            since: ts(k.since),
            waiting: k.waiting,
        })
        .collect();
    let render = |frame| Keys { frame, keys }.render();
    respond(
        &state,
        &req,
        StatusCode::OK,
        render,
        "Blocked keys".into(),
        None,
    )
}

struct SchedulerRow {
    owner: String,
    host: String,
    pid: i32,
    queues: String,
    concurrency: i32,
    started: String,
    last_seen: String,
}

#[derive(Template)]
#[template(path = "dashboard/schedulers.html")]
struct Schedulers {
    frame: Frame,
    rows: Vec<SchedulerRow>,
}

/// `GET /schedulers`: the schedulers whose heartbeat is recent.
pub(crate) async fn schedulers(state: web::Data<State>, req: HttpRequest) -> HttpResponse {
    let live = match state.store.live_schedulers().await {
        Ok(l) => l,
        Err(e) => return error_page(&state, &req, e),
    };
    let rows = live
        .into_iter()
        .map(|s| SchedulerRow {
            owner: s.owner,
            host: s.host,
            pid: s.pid,
            queues: s.queues.join(", "),
            concurrency: s.concurrency,
            started: ts(Some(s.started_at)),
            last_seen: format!("{} ({:.0}s ago)", ts(Some(s.last_seen)), s.seen_secs_ago),
        })
        .collect();
    let render = |frame| Schedulers { frame, rows }.render();
    respond(
        &state,
        &req,
        StatusCode::OK,
        render,
        "Live schedulers".into(),
        None,
    )
}
