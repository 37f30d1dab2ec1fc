//! The dashboard: a scope the host mounts in its own actix-web `App` (cargo feature
//! `dashboard`).
//!
//! ```no_run
//! # fn demo(scheduler: leasehold::Scheduler) {
//! use actix_web::{App, HttpRequest};
//! let app = App::new().service(
//!     leasehold::web::dashboard(scheduler)
//!         .at("/jobs")
//!         // Who may act, from the host's own authentication; `None` refuses.
//!         .actions(|req: &HttpRequest| req.headers().get("x-user")?.to_str().ok().map(String::from)),
//! );
//! # }
//! ```
//!
//! # Pages
//!
//! Server-rendered ([askama] templates compiled into the binary, HTML-escaped by
//! default), one stylesheet compiled in too, no JavaScript: the throughput chart is
//! SVG drawn on the server and a bulk action's confirmation is a page of its own. The
//! pages read through the same [`Store`] calls as the CLI (`leasehold status`, `jobs`,
//! `show`, `keys`), so both always agree.
//!
//! # Actions
//!
//! Off unless the host supplies an authorization hook with [`Dashboard::actions`]:
//! without one no action route exists (404) and the pages show no buttons. With one,
//! every action is a POST that must carry the page's CSRF token (see `csrf.rs`) and
//! pass the hook; what the hook returns (who) is written into the job's history as the
//! action's owner. A refused request changes nothing.
//!
//! # Failure
//!
//! A database error renders a 500 page naming it (after escaping) and is logged; an
//! unknown job is a 404; an action the job's state does not allow is shown on the
//! job's page as refused.

mod actions;
mod csrf;
mod pages;
mod pages_job;
mod view;

use std::sync::Arc;

use actix_web::dev::{AppService, HttpServiceFactory};
use actix_web::{web, HttpRequest};

use crate::{Scheduler, Store};

/// Decides who may act: the name to record, or `None` to refuse the action.
pub type AuthorizeHook = dyn Fn(&HttpRequest) -> Option<String> + Send + Sync;

/// The dashboard before it is mounted: [`dashboard`], then [`Dashboard::at`] and
/// optionally [`Dashboard::actions`] and [`Dashboard::store`].
pub struct Dashboard {
    path: String,
    scheduler: Scheduler,
    store: Store,
    hook: Option<Arc<AuthorizeHook>>,
}

/// What every page and action reads.
pub(crate) struct State {
    /// The mount path without a trailing slash ("" at the root).
    pub(crate) base: String,
    pub(crate) scheduler: Scheduler,
    pub(crate) store: Store,
    pub(crate) hook: Option<Arc<AuthorizeHook>>,
    pub(crate) csrf: csrf::Csrf,
}

impl State {
    /// Who may act on this request: `None` without a hook, or when the hook refuses.
    pub(crate) fn who(&self, req: &HttpRequest) -> Option<String> {
        self.hook.as_ref().and_then(|hook| hook(req))
    }
}

/// The dashboard of `scheduler`, read-only and mounted at `/` until told otherwise. It
/// reads through the scheduler's store; a host whose web workers have a pool of their
/// own passes a store over it to [`Dashboard::store`] (see
/// [`metrics_route`](super::metrics_route) for why).
pub fn dashboard(scheduler: Scheduler) -> Dashboard {
    Dashboard {
        path: String::new(),
        store: scheduler.store().clone(),
        scheduler,
        hook: None,
    }
}

impl Dashboard {
    /// Mount under `path` (e.g. `/jobs`): the overview is `path/`, the rest below it.
    pub fn at(mut self, path: &str) -> Self {
        self.path = path.trim_end_matches('/').to_string();
        self
    }

    /// Read and act through `store` (on the scheduler's schema) instead of the
    /// scheduler's own.
    pub fn store(mut self, store: Store) -> Self {
        self.store = store;
        self
    }

    /// Turn actions on, behind `hook`: it sees each action's request (the host's
    /// session, headers, extensions its middleware set) and returns who is acting, or
    /// `None` to refuse (403, nothing changed). Pages show the buttons only to
    /// requests the hook accepts.
    pub fn actions<F>(mut self, hook: F) -> Self
    where
        F: Fn(&HttpRequest) -> Option<String> + Send + Sync + 'static,
    {
        self.hook = Some(Arc::new(hook));
        self
    }
}

impl HttpServiceFactory for Dashboard {
    fn register(self, config: &mut AppService) {
        let actions = self.hook.is_some();
        let state = web::Data::new(State {
            base: self.path.clone(),
            scheduler: self.scheduler,
            store: self.store,
            hook: self.hook,
            csrf: csrf::Csrf::new(),
        });
        let mut scope = web::scope(&self.path)
            .app_data(state)
            .route("/", web::get().to(pages::overview))
            .route("/style.css", web::get().to(pages::stylesheet))
            .route("/jobs", web::get().to(pages::jobs))
            .route("/job/{id}", web::get().to(pages::job))
            .route("/keys", web::get().to(pages::keys))
            .route("/schedulers", web::get().to(pages::schedulers));
        if self.path.is_empty() {
            // At the root the scope's own path is "", which "/" already answers.
        } else {
            scope = scope.route("", web::get().to(pages::overview));
        }
        if actions {
            scope = scope
                .route("/job/{id}/{action}", web::post().to(actions::one))
                .route("/bulk", web::post().to(actions::bulk))
                .route("/queue/{queue}/{action}", web::post().to(actions::queue));
        }
        scope.register(config)
    }
}
