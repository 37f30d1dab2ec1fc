//! The dashboard's actions (POST, mounted only with an authorization hook): one job,
//! a filtered set after a confirmation, and pausing or resuming a queue.
//!
//! Every action checks the CSRF token first and the hook second; either refusal is a
//! 403 that changes nothing. Who the hook names is recorded in the job's history (or
//! as the pause's author). The jobs go through [`Store::act`](crate::Store::act), the
//! call the CLI makes.
//!
//! # Confirmation of a bulk action
//!
//! The first POST counts the jobs the filter selects and answers with a page that
//! asks to confirm that count; the second carries the count back, and acts only if
//! the filter still selects exactly that many (otherwise it asks again with the new
//! count). No JavaScript is involved.

use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse};
use askama::Template;
use serde::Deserialize;

use super::pages::{error_page, respond};
use super::view::{enc, FilterForm, Frame};
use super::{csrf, State};
use crate::error::Error;
use crate::job::JobId;
use crate::store::{Action, MAX_PAGE};

/// Jobs one bulk action selects at most (as the CLI).
const MAX_SELECTED: usize = 100_000;

/// The reason a cancel from the dashboard records.
const CANCEL_REASON: &str = "cancelled from the dashboard";

/// A form with only the CSRF token.
#[derive(Deserialize)]
pub(crate) struct TokenForm {
    csrf: Option<String>,
}

/// The bulk form: an action, the filter, and the count being confirmed.
#[derive(Deserialize)]
pub(crate) struct BulkForm {
    csrf: Option<String>,
    #[serde(default)]
    action: String,
    #[serde(default)]
    confirm: Option<String>,
    #[serde(flatten)]
    filter: FilterForm,
}

/// The CSRF check, then the hook: who acts, or why the request is refused (a 403).
fn authorize(state: &State, req: &HttpRequest, token: Option<&str>) -> Result<String, String> {
    if !state.csrf.check(req, token) {
        tracing::warn!(path = %req.path(), "leasehold dashboard: an action without a valid CSRF token was refused");
        return Err(format!(
            "refused: the form's {} token is missing or wrong; reload the page",
            csrf::FIELD
        ));
    }
    state
        .who(req)
        .ok_or_else(|| "refused: you may not act on jobs here".to_string())
}

fn see_other(location: String) -> HttpResponse {
    HttpResponse::SeeOther()
        .insert_header((header::LOCATION, location))
        .finish()
}

/// `POST /job/{id}/{action}`: retry, cancel, hold or release one job, then back to its
/// page with what happened.
pub(crate) async fn one(
    state: web::Data<State>,
    req: HttpRequest,
    path: web::Path<(i64, String)>,
    form: web::Form<TokenForm>,
) -> HttpResponse {
    let who = match authorize(&state, &req, form.csrf.as_deref()) {
        Ok(who) => who,
        Err(why) => return HttpResponse::Forbidden().body(why),
    };
    let (id, name) = path.into_inner();
    let id = JobId(id);
    let Some(action) = Action::parse(&name, CANCEL_REASON) else {
        return HttpResponse::NotFound().body("no such action");
    };
    let msg = match state.store.act(id, &action, &who).await {
        Ok(note) => {
            tracing::info!(job = id.0, action = action.name(), by = %who, "leasehold dashboard action");
            format!(
                "{} done by {who}{}",
                action.name(),
                note.map(|n| format!(": {n}")).unwrap_or_default()
            )
        }
        Err(e @ Error::InvalidTransition { .. }) => format!("refused: {e}"),
        Err(e) => return error_page(&state, &req, e),
    };
    see_other(format!("{}/job/{}?msg={}", state.base, id.0, enc(&msg)))
}

#[derive(Template)]
#[template(path = "dashboard/confirm.html")]
struct Confirm {
    frame: Frame,
    action: &'static str,
    count: usize,
    sample: String,
    f: FilterForm,
    back: String,
}

#[derive(Template)]
#[template(path = "dashboard/done.html")]
struct Done {
    frame: Frame,
    summary: String,
    refused: Vec<String>,
    back: String,
}

/// `POST /bulk`: retry or cancel every job a filter selects, after confirming the
/// count (see the module docs).
pub(crate) async fn bulk(
    state: web::Data<State>,
    req: HttpRequest,
    form: web::Form<BulkForm>,
) -> HttpResponse {
    let form = form.into_inner();
    let who = match authorize(&state, &req, form.csrf.as_deref()) {
        Ok(who) => who,
        Err(why) => return HttpResponse::Forbidden().body(why),
    };
    let filter = match form.filter.to_filter(MAX_PAGE) {
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
    let action = match form.action.as_str() {
        "retry" => Action::Retry,
        "cancel" => Action::Cancel(CANCEL_REASON, filter.state),
        _ => return HttpResponse::NotFound().body("no such bulk action"),
    };
    let ids = match state
        .store
        .job_ids(&filter, &action.states(), MAX_SELECTED)
        .await
    {
        Ok(ids) => ids,
        Err(e) => return error_page(&state, &req, e),
    };
    let back = format!("{}/jobs?{}", state.base, form.filter.query(None));
    let confirmed = form
        .confirm
        .as_deref()
        .and_then(|c| c.parse::<usize>().ok());
    if confirmed != Some(ids.len()) || ids.is_empty() {
        let sample: Vec<String> = ids.iter().take(10).map(|id| id.0.to_string()).collect();
        let more = if ids.len() > 10 { ", …" } else { "" };
        let page = Confirm {
            frame: Frame::blank(),
            action: action.name(),
            count: ids.len(),
            sample: format!("{}{more}", sample.join(", ")),
            f: form.filter,
            back,
        };
        let title = format!("Confirm: {} {} jobs", action.name(), ids.len());
        return respond(
            &state,
            &req,
            StatusCode::OK,
            |frame| Confirm { frame, ..page }.render(),
            title,
            None,
        );
    }
    let mut done = 0;
    let mut refused = Vec::new();
    for &id in &ids {
        match state.store.act(id, &action, &who).await {
            Ok(_) => done += 1,
            Err(e @ (Error::InvalidTransition { .. } | Error::JobNotFound(_))) => {
                refused.push(format!("job {id} refused: {e}"))
            }
            Err(e) => return error_page(&state, &req, e),
        }
    }
    tracing::info!(action = action.name(), done, refused = refused.len(), by = %who, "leasehold dashboard bulk action");
    let summary = format!(
        "{}: {done} of {} selected jobs done by {who}",
        action.name(),
        ids.len()
    );
    let page = Done {
        frame: Frame::blank(),
        summary,
        refused,
        back,
    };
    respond(
        &state,
        &req,
        StatusCode::OK,
        |frame| Done { frame, ..page }.render(),
        "Done".into(),
        None,
    )
}

/// `POST /queue/{queue}/{pause|resume}`, then back to the overview.
pub(crate) async fn queue(
    state: web::Data<State>,
    req: HttpRequest,
    path: web::Path<(String, String)>,
    form: web::Form<TokenForm>,
) -> HttpResponse {
    let who = match authorize(&state, &req, form.csrf.as_deref()) {
        Ok(who) => who,
        Err(why) => return HttpResponse::Forbidden().body(why),
    };
    let (queue, action) = path.into_inner();
    let result = match action.as_str() {
        "pause" => state.store.pause_queue(&queue, Some(&who)).await,
        "resume" => state.store.resume_queue(&queue).await,
        _ => return HttpResponse::NotFound().body("no such queue action"),
    };
    let msg = match result {
        Ok(true) => format!("queue {queue}: {action}d by {who}"),
        Ok(false) => format!("queue {queue} was already {action}d"),
        Err(e) => return error_page(&state, &req, e),
    };
    tracing::info!(queue, action, by = %who, "leasehold dashboard queue action");
    see_other(format!("{}/?msg={}", state.base, enc(&msg)))
}
