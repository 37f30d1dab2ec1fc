//! The dashboard's pages (GET): overview, jobs, one job, blocked keys, live schedulers.
//!
//! Each handler reads through the store calls the CLI uses, turns the records into the
//! strings of its template (see `view.rs`) and renders it. Every page sets the CSRF
//! cookie when the browser has none, so its forms can post.

use std::collections::BTreeMap;

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse};
use askama::Template;
use serde::Deserialize;

use super::view::{age, enc, line, ts, FilterForm, Frame};
use super::State;
use crate::error::Error;
use crate::job::JobState;
use crate::store::DEFAULT_PAGE;

/// Minutes of the overview's chart (and the current one).
const CHART_MINUTES: i32 = 15;
const BAR_WIDTH: u32 = 6;
const CHART_HEIGHT: u32 = 28;

/// Render `page` with its CSRF cookie set if the browser had none.
pub(crate) fn respond(
    state: &State,
    req: &HttpRequest,
    status: StatusCode,
    render: impl FnOnce(Frame) -> askama::Result<String>,
    title: String,
    flash: Option<String>,
) -> HttpResponse {
    let cookie_path = if state.base.is_empty() {
        "/".to_string()
    } else {
        state.base.clone()
    };
    let (csrf, cookie) = state.csrf.token_for(req, &cookie_path);
    let frame = Frame {
        base: state.base.clone(),
        title,
        who: state.who(req),
        csrf,
        flash,
    };
    let mut res = HttpResponse::build(status);
    res.insert_header((header::CACHE_CONTROL, "no-store"))
        .insert_header(("x-content-type-options", "nosniff"))
        // Nothing but this origin's stylesheet and images: no script runs, even one
        // that an escaping mistake let through.
        .insert_header((
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'",
        ));
    if let Some(cookie) = cookie {
        res.cookie(cookie);
    }
    match render(frame) {
        Ok(html) => res.content_type("text/html; charset=utf-8").body(html),
        Err(e) => {
            tracing::error!(error = %e, "leasehold dashboard: a page could not be rendered");
            HttpResponse::InternalServerError().body("the page could not be rendered")
        }
    }
}

#[derive(Template)]
#[template(path = "dashboard/error.html")]
struct ErrorPage {
    frame: Frame,
    message: String,
}

/// A failed read or refused request as a page: 404 for an unknown job, 400 for bad
/// input, 500 (logged) for the database.
pub(crate) fn error_page(state: &State, req: &HttpRequest, e: Error) -> HttpResponse {
    let status = match &e {
        Error::JobNotFound(_) => StatusCode::NOT_FOUND,
        Error::InvalidInput { .. } | Error::InvalidTransition { .. } => StatusCode::BAD_REQUEST,
        _ => {
            tracing::warn!(error = %e, "leasehold dashboard: a read failed");
            StatusCode::INTERNAL_SERVER_ERROR
        }
    };
    let message = e.to_string();
    respond(
        state,
        req,
        status,
        |frame| ErrorPage { frame, message }.render(),
        "Error".into(),
        None,
    )
}

/// `GET /style.css`: the one stylesheet, compiled in.
pub(crate) async fn stylesheet() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/css; charset=utf-8")
        .insert_header((header::CACHE_CONTROL, "max-age=3600"))
        .body(include_str!("../../../assets/dashboard/style.css"))
}

/// A one-line message an action left for the page it redirected to.
#[derive(Deserialize)]
pub(crate) struct Flash {
    #[serde(default)]
    pub(crate) msg: Option<String>,
    #[serde(default)]
    pub(crate) full: Option<String>,
}

struct Bar {
    x: u32,
    done_y: u32,
    done_h: u32,
    dead_y: u32,
    dead_h: u32,
    label: String,
}

struct QueueRow {
    name: String,
    href: String,
    dead_href: String,
    pause_action: String,
    pending: i64,
    waiting: i64,
    running: i64,
    held: i64,
    dead: i64,
    oldest_eligible: String,
    blocked: i64,
    expiries: i64,
    paused: bool,
    bars: Vec<Bar>,
    ended: i64,
    died: i64,
}

#[derive(Template)]
#[template(path = "dashboard/overview.html")]
struct Overview {
    frame: Frame,
    owner: String,
    stale: u64,
    in_flight: u64,
    minutes: i32,
    chart_width: u32,
    chart_height: u32,
    bar_width: u32,
    queues: Vec<QueueRow>,
}

/// `GET /`: every queue's depth by state, oldest eligible job, blocked keys, recent
/// lease expiries, jobs ended per minute, paused or not.
pub(crate) async fn overview(
    state: web::Data<State>,
    req: HttpRequest,
    flash: web::Query<Flash>,
) -> HttpResponse {
    let stats = match state.store.queue_stats().await {
        Ok(s) => s,
        Err(e) => return error_page(&state, &req, e),
    };
    let minutes = match state.store.throughput(CHART_MINUTES).await {
        Ok(m) => m,
        Err(e) => return error_page(&state, &req, e),
    };
    let now_minute = chrono::Utc::now().timestamp() / 60;
    let slots = CHART_MINUTES as i64 + 1;
    let mut per_queue: BTreeMap<String, Vec<(i64, i64)>> = BTreeMap::new();
    for m in &minutes {
        let slot = slots - 1 - (now_minute - m.minute.timestamp() / 60);
        if (0..slots).contains(&slot) {
            per_queue
                .entry(m.queue.clone())
                .or_insert_with(|| vec![(0, 0); slots as usize])[slot as usize] = (m.done, m.dead);
        }
    }
    let mut names: Vec<String> = stats.iter().map(|s| s.queue.clone()).collect();
    names.extend(per_queue.keys().cloned());
    names.sort();
    names.dedup();
    let base = &state.base;
    let queues = names
        .into_iter()
        .map(|name| {
            let s = stats
                .iter()
                .find(|s| s.queue == name)
                .cloned()
                .unwrap_or_default();
            let n = |st: &str| s.by_state.get(st).copied().unwrap_or(0);
            let series = per_queue
                .remove(&name)
                .unwrap_or_else(|| vec![(0, 0); slots as usize]);
            let top = series.iter().map(|(d, x)| d + x).max().unwrap_or(0).max(1);
            let bars = series
                .iter()
                .enumerate()
                .map(|(i, &(done, dead))| {
                    let h = |v: i64| ((v * CHART_HEIGHT as i64) / top) as u32;
                    let (done_h, dead_h) = (h(done), h(dead));
                    Bar {
                        x: i as u32 * (BAR_WIDTH + 1),
                        dead_y: CHART_HEIGHT - dead_h,
                        dead_h,
                        done_y: CHART_HEIGHT - dead_h - done_h,
                        done_h,
                        label: format!(
                            "{} min ago: {done} done, {dead} dead",
                            slots - 1 - i as i64
                        ),
                    }
                })
                .collect();
            QueueRow {
                href: format!("{base}/jobs?queue={}", enc(&name)),
                dead_href: format!("{base}/jobs?queue={}&state=dead", enc(&name)),
                pause_action: format!(
                    "{base}/queue/{}/{}",
                    enc(&name),
                    if s.paused { "resume" } else { "pause" }
                ),
                pending: n("pending"),
                waiting: n("waiting"),
                running: n("running"),
                held: n("held"),
                dead: n("dead"),
                oldest_eligible: age(s.oldest_eligible_age_secs),
                blocked: s.blocked_keys,
                expiries: s.recent_lease_expiries,
                paused: s.paused,
                ended: series.iter().map(|(d, _)| d).sum(),
                died: series.iter().map(|(_, x)| x).sum(),
                bars,
                name,
            }
        })
        .collect();
    let metrics = state.scheduler.metrics();
    let page = |frame| {
        Overview {
            frame,
            owner: state.scheduler.owner().to_string(),
            stale: metrics.counters.stale_completions,
            in_flight: metrics.in_flight,
            minutes: CHART_MINUTES,
            chart_width: slots as u32 * (BAR_WIDTH + 1),
            chart_height: CHART_HEIGHT,
            bar_width: BAR_WIDTH,
            queues,
        }
        .render()
    };
    respond(
        &state,
        &req,
        StatusCode::OK,
        page,
        "Queues".into(),
        flash.into_inner().msg,
    )
}

struct JobRow {
    id: i64,
    href: String,
    queue: String,
    kind: String,
    key: String,
    state: String,
    attempts: String,
    created: String,
    error: String,
}

struct StateOption {
    value: &'static str,
    selected: bool,
}

#[derive(Template)]
#[template(path = "dashboard/jobs.html")]
struct Jobs {
    frame: Frame,
    f: FilterForm,
    state_options: Vec<StateOption>,
    rows: Vec<JobRow>,
    next_href: Option<String>,
    /// Set when the search stopped at its time budget: the last id it searched.
    searched_to: Option<i64>,
    first_href: String,
}

/// How long the jobs page searches a filter that walks the table (a rare kind) before
/// it shows what it found and offers to search on: the page's answer stays well under
/// 200 ms at 10^6 jobs.
const SEARCH_BUDGET: std::time::Duration = std::time::Duration::from_millis(100);

/// `GET /jobs`: a keyset page of jobs by filter
/// ([`Store::list_jobs_page`](crate::Store::list_jobs_page)).
pub(crate) async fn jobs(
    state: web::Data<State>,
    req: HttpRequest,
    form: web::Query<FilterForm>,
) -> HttpResponse {
    let form = form.into_inner();
    let filter = match form.to_filter(DEFAULT_PAGE) {
        Ok(f) => f,
        Err(reason) => {
            return error_page(
                &state,
                &req,
                Error::InvalidInput {
                    field: "filter",
                    reason,
                },
            )
        }
    };
    let page = match state.store.list_jobs_page(&filter, SEARCH_BUDGET).await {
        Ok(p) => p,
        Err(e) => return error_page(&state, &req, e),
    };
    let base = &state.base;
    let next_href = page
        .next
        .map(|next| format!("{base}/jobs?{}", form.query(Some(next.0))));
    let searched_to = page.searched_to.map(|id| id.0);
    let rows = page
        .jobs
        .iter()
        .map(|j| JobRow {
            id: j.id.0,
            href: format!("{base}/job/{}", j.id.0),
            queue: j.queue.clone(),
            kind: j.kind.clone(),
            key: j.key.clone().unwrap_or_default(),
            state: j.state.to_string(),
            attempts: format!("{}/{}", j.attempts, j.max_attempts),
            created: ts(Some(j.created_at)),
            error: line(j.last_error.as_deref(), 120),
        })
        .collect();
    let state_options = JobState::ALL
        .iter()
        .map(|s| StateOption {
            value: s.as_str(),
            selected: form.state.trim() == s.as_str(),
        })
        .collect();
    let first_href = format!("{base}/jobs?{}", form.query(None));
    let title = "Jobs".to_string();
    let render = |frame| {
        Jobs {
            frame,
            f: form,
            state_options,
            rows,
            next_href,
            searched_to,
            first_href,
        }
        .render()
    };
    respond(&state, &req, StatusCode::OK, render, title, None)
}

pub(crate) use super::pages_job::{job, keys, schedulers};
