//! actix-web front ends over the scheduler: the `/metrics` route and, with the
//! `dashboard` feature, the dashboard scope ([`dashboard()`], see [the module](mod@dashboard)).

use actix_web::http::header;
use actix_web::{web, HttpRequest, HttpResponse, Resource};

use crate::prometheus::{encode, render_with, Format};
use crate::{Scheduler, Store};

#[cfg(feature = "dashboard")]
pub mod dashboard;
#[cfg(feature = "dashboard")]
pub use dashboard::{dashboard, AuthorizeHook, Dashboard};

/// What a metrics route reads, under its own type so it never shadows the host's own
/// `Data<Scheduler>`.
struct MetricsSource {
    scheduler: Scheduler,
    /// Reads the per-queue gauges.
    store: Store,
}

/// `GET /metrics`: this scheduler's figures and the database's per-queue gauges, in
/// OpenMetrics text when the scraper asks for it (Prometheus does) and in the classic
/// Prometheus text otherwise. Mount it with `App::new().service(metrics_route(handle))`.
///
/// Each scrape runs one database statement (see
/// [`Store::queue_gauges`](crate::Store::queue_gauges)). If it fails, the process
/// figures are still served and the failure is logged: a scrape never goes blank
/// because the database is away, which is when the other figures matter most.
///
/// The gauges are read through the handle's store, over the pool the scheduler was
/// built with. actix-web runs each worker on a runtime of its own and a connection
/// belongs to the runtime that opened it: a service whose workers have their own pool
/// passes a store over it to [`metrics_route_with`].
pub fn metrics_route(scheduler: Scheduler) -> Resource {
    let store = scheduler.store().clone();
    metrics_route_with(scheduler, store)
}

/// [`metrics_route`], reading the per-queue gauges through `store` (on the scheduler's
/// schema, e.g. `Store::new(web_pool, &config.schema, options)`).
pub fn metrics_route_with(scheduler: Scheduler, store: Store) -> Resource {
    web::resource("/metrics")
        .app_data(web::Data::new(MetricsSource { scheduler, store }))
        .route(web::get().to(serve_metrics))
}

async fn serve_metrics(source: web::Data<MetricsSource>, req: HttpRequest) -> HttpResponse {
    let accept = req
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok());
    let format = Format::from_accept(accept);
    let scheduler = &source.scheduler;
    let text = match render_with(scheduler, &source.store, format).await {
        Ok(text) => text,
        Err(e) => {
            tracing::warn!(error = %e, "leasehold /metrics: the per-queue gauges could not be read; serving this process' figures only");
            encode(scheduler.metrics(), Vec::new(), format)
        }
    };
    HttpResponse::Ok()
        .content_type(format.content_type())
        .body(text)
}
