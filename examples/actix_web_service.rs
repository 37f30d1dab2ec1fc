//! An actix-web service that takes orders: the order row and its fulfilment job are
//! written in one transaction, so the job exists exactly when the order does.
//!
//!     cargo run --example actix_web_service            # serve on 127.0.0.1:$PORT (8080)
//!     cargo run --example actix_web_service -- --demo  # send itself a few requests, stop
//!
//! Endpoints:
//! - `POST /orders` `{"customer": "alice", "item": "book", "qty": 1}`: inserts the order
//!   and enqueues its `fulfil_order` job (keyed by customer, so a customer's orders are
//!   fulfilled in order) in ONE transaction. An order over the quantity limit is refused
//!   after both writes, and the rollback takes the job with it.
//! - `GET /orders/{id}`: the order and the state of its job.
//! - `GET /metrics`: Prometheus (or OpenMetrics) text, mounted by
//!   `leasehold::web::metrics_route_with`: attempts by queue, kind and outcome, latency
//!   histograms, mailbox figures, and per-queue gauges read from the database.
//! - `/jobs/`: the dashboard (`leasehold::web::dashboard`): queues, jobs, one job with
//!   its attempts and history, blocked keys, live schedulers. Actions (retry, cancel,
//!   hold, release, pause) are on for requests the `operator` hook accepts: here, those
//!   carrying the `x-operator` header that this service's authenticating proxy sets.
//!
//! The handler fulfils the order and completes its job in the same transaction
//! (`JobContext::complete_in`), fenced: a worker that lost its lease changes nothing.
//!
//! Two pools: actix-web runs each worker thread on its own runtime, and a sqlx
//! connection belongs to the runtime that opened it. The web workers get their own
//! pool (and a `Store` over it for reads); the scheduler's pool stays on the main
//! runtime, so stopping the web workers never leaves it with dead connections.
//!
//! Ctrl-C (or SIGTERM) stops the HTTP server first, by actix-web's own signal handling
//! (in-flight requests finish), then the scheduler (running jobs get their grace period,
//! the rest are released): `HttpServer::run().await`, then `scheduler.shutdown().await`.
//! The scheduler is a cheap handle in `web::Data`. `--demo` binds an ephemeral port
//! unless `PORT` is set, works in schemas of its own, and drops them at the end; it exits
//! non-zero if what it sees is wrong. `FULFIL_MS` sets how long picking takes (50 ms),
//! `SHOP` the schema (`shop`, the jobs in `shop_jobs`).
//!
//! Needs a local PostgreSQL (DATABASE_URL, or PGHOST/PGPORT/PGUSER; default
//! postgres://root@127.0.0.1:5432/postgres). It creates the database `leasehold_demo`.
//! The scheduler's store settings behind a transaction-mode pooler come from
//! `LEASEHOLD_STORE__TRANSACTION_POOLER` and `LEASEHOLD_LISTEN_URL` (`shared/store_env.rs`;
//! the example's own order queries are not written for such a pooler).

use std::error::Error;
use std::net::SocketAddr;
use std::time::Duration;

use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use leasehold::web::{dashboard, metrics_route_with};
use leasehold::{
    CompleteOutcome, Config, Handler, JobContext, JobError, JobId, NewJob, Scheduler, Store,
};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[path = "shared/env.rs"]
mod env;
#[path = "shared/log.rs"]
mod log;
#[path = "shared/store_env.rs"]
mod store_env;

/// Orders above this quantity are refused (after the writes, to show the rollback).
const MAX_QTY: i32 = 100;

// ---------------------------------------------------------------------------------
// The job.
// ---------------------------------------------------------------------------------

#[derive(Serialize, Deserialize)]
struct Fulfil {
    order_id: i64,
}

/// Marks the order fulfilled and completes the job in the same transaction.
struct FulfilOrder {
    pool: PgPool,
    orders: String,
}

impl Handler for FulfilOrder {
    type Payload = Fulfil;
    type Output = ();
    const KIND: &'static str = "fulfil_order";

    async fn run(&self, ctx: JobContext, f: Fulfil) -> Result<(), JobError> {
        // Picking and packing.
        tokio::time::sleep(picking_time()).await;
        let mut tx = self.pool.begin().await?;
        sqlx::query(&format!(
            "UPDATE {} SET status = 'fulfilled', fulfilled_at = now() WHERE id = $1 AND status = 'new'",
            self.orders
        ))
        .bind(f.order_id)
        .execute(&mut *tx)
        .await?;
        let result = serde_json::json!({ "order_id": f.order_id });
        match ctx.complete_in(&mut tx, Some(result)).await? {
            CompleteOutcome::Stale => {
                // Another worker owns the job now; it fulfils the order.
                tx.rollback().await?;
                Err(JobError::retry("lost the lease before fulfilling"))
            }
            CompleteOutcome::Completed => {
                tx.commit().await?;
                Ok(())
            }
            CompleteOutcome::AlreadyCompleted { .. } => {
                // An earlier call of this attempt committed the order with its
                // completion (its reply was lost): this transaction's writes are a
                // second copy, so they go.
                tx.rollback().await?;
                Ok(())
            }
        }
    }
}

// ---------------------------------------------------------------------------------
// The HTTP service.
// ---------------------------------------------------------------------------------

struct AppState {
    /// The web workers' pool.
    pool: PgPool,
    /// The scheduler: enqueue (it checks the kind) and metrics. A cheap handle.
    scheduler: Scheduler,
    /// The job tables over the web workers' pool, for reads.
    jobs: Store,
    orders: String,
}

#[derive(Deserialize)]
struct OrderRequest {
    customer: String,
    item: String,
    qty: i32,
}

enum OrderError {
    Refused(String),
    Internal(Box<dyn Error>),
}

impl<E: Error + 'static> From<E> for OrderError {
    fn from(e: E) -> Self {
        OrderError::Internal(Box::new(e))
    }
}

/// Insert the order and enqueue its job in one transaction.
async fn place_order(state: &AppState, r: OrderRequest) -> Result<(i64, JobId), OrderError> {
    let mut tx = state.pool.begin().await?;
    let order_id: i64 = sqlx::query_scalar(&format!(
        "INSERT INTO {} (customer, item, qty) VALUES ($1, $2, $3) RETURNING id",
        state.orders
    ))
    .bind(&r.customer)
    .bind(&r.item)
    .bind(r.qty)
    .fetch_one(&mut *tx)
    .await?;
    let job = NewJob::new(FulfilOrder::KIND, &Fulfil { order_id })?
        .with_key(format!("customer:{}", r.customer));
    let job_id = state.scheduler.enqueue_in(&mut tx, job).await?;
    if r.qty < 1 || r.qty > MAX_QTY {
        // Nothing of this order remains, its job included.
        tx.rollback().await?;
        return Err(OrderError::Refused(format!(
            "qty must be 1..={MAX_QTY}, got {}",
            r.qty
        )));
    }
    sqlx::query(&format!(
        "UPDATE {} SET job_id = $2 WHERE id = $1",
        state.orders
    ))
    .bind(order_id)
    .bind(job_id.0)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok((order_id, job_id))
}

async fn create_order(state: web::Data<AppState>, body: web::Json<OrderRequest>) -> HttpResponse {
    match place_order(&state, body.into_inner()).await {
        Ok((order_id, job_id)) => HttpResponse::Created()
            .json(serde_json::json!({ "order_id": order_id, "job_id": job_id.0 })),
        Err(OrderError::Refused(reason)) => {
            HttpResponse::UnprocessableEntity().json(serde_json::json!({ "error": reason }))
        }
        Err(OrderError::Internal(e)) => {
            tracing::error!(error = %e, "order failed");
            HttpResponse::InternalServerError().json(serde_json::json!({ "error": e.to_string() }))
        }
    }
}

#[derive(sqlx::FromRow)]
struct OrderRow {
    customer: String,
    item: String,
    qty: i32,
    status: String,
    job_id: Option<i64>,
}

async fn get_order(state: web::Data<AppState>, id: web::Path<i64>) -> HttpResponse {
    let row: Result<Option<OrderRow>, _> = sqlx::query_as(&format!(
        "SELECT customer, item, qty, status, job_id FROM {} WHERE id = $1",
        state.orders
    ))
    .bind(*id)
    .fetch_optional(&state.pool)
    .await;
    match row {
        Ok(Some(OrderRow {
            customer,
            item,
            qty,
            status,
            job_id,
        })) => {
            let job_state = match job_id {
                Some(j) => match state.jobs.job(JobId(j)).await {
                    Ok(job) => Some(job.state.to_string()),
                    Err(e) => Some(format!("unknown ({e})")),
                },
                None => None,
            };
            HttpResponse::Ok().json(serde_json::json!({
                "order_id": *id, "customer": customer, "item": item, "qty": qty,
                "status": status, "job_id": job_id, "job_state": job_state,
            }))
        }
        Ok(None) => HttpResponse::NotFound().json(serde_json::json!({ "error": "no such order" })),
        Err(e) => {
            HttpResponse::InternalServerError().json(serde_json::json!({ "error": e.to_string() }))
        }
    }
}

// ---------------------------------------------------------------------------------
// Setup and the main loop.
// ---------------------------------------------------------------------------------

/// Create `leasehold_demo` if missing; options for it.
async fn database() -> Result<PgConnectOptions, Box<dyn Error>> {
    let server = store_env::connect_options()?;
    let mut admin = server.connect().await?;
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = 'leasehold_demo')",
    )
    .fetch_one(&mut admin)
    .await?;
    if !exists {
        // Two starts may race here; the loser's error is harmless.
        let _ = sqlx::query("CREATE DATABASE leasehold_demo")
            .execute(&mut admin)
            .await;
    }
    sqlx::Connection::close(admin).await?;
    Ok(server
        .database("leasehold_demo")
        .log_statements(tracing::log::LevelFilter::Trace))
}

async fn open_pool(
    options: &PgConnectOptions,
    name: &str,
    size: u32,
) -> Result<PgPool, Box<dyn Error>> {
    Ok(PgPoolOptions::new()
        .max_connections(size)
        .connect_with(options.clone().application_name(name))
        .await?)
}

/// The business schema: one table of orders.
async fn create_orders_table(pool: &PgPool, schema: &str) -> Result<String, Box<dyn Error>> {
    sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\""))
        .execute(pool)
        .await?;
    let orders = format!("\"{schema}\".orders");
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {orders} (
            id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            customer     text        NOT NULL,
            item         text        NOT NULL,
            qty          integer     NOT NULL,
            status       text        NOT NULL DEFAULT 'new',
            job_id       bigint,
            created_at   timestamptz NOT NULL DEFAULT now(),
            fulfilled_at timestamptz)"
    ))
    .execute(pool)
    .await?;
    Ok(orders)
}

/// The dashboard's authorization hook: who may act, from the host's own authentication.
/// This service sits behind a proxy that authenticates operators and names them in
/// `x-operator` (stripping the header from everyone else); without it, the dashboard is
/// read-only for that request. The name goes into the history of every job acted on.
fn operator(req: &HttpRequest) -> Option<String> {
    let name = req.headers().get("x-operator")?.to_str().ok()?;
    (!name.is_empty()).then(|| format!("ops:{name}"))
}

/// How long picking an order takes: `FULFIL_MS` milliseconds (default 50).
fn picking_time() -> Duration {
    env::millis("FULFIL_MS", 50)
}

#[actix_web::main]
async fn main() -> Result<(), Box<dyn Error>> {
    log::init("leasehold=warn,actix_web_service=info", std::io::stdout);
    let demo = std::env::args().any(|a| a == "--demo");
    let port: u16 = match std::env::var("PORT") {
        Ok(p) => p.parse()?,
        Err(_) if demo => 0,
        Err(_) => 8080,
    };
    let (shop, jobs) = if demo {
        let pid = std::process::id();
        (format!("shop_demo_{pid}"), format!("shop_demo_{pid}_jobs"))
    } else {
        // `SHOP` names the business schema (the jobs go to `<SHOP>_jobs`).
        let shop = std::env::var("SHOP").unwrap_or_else(|_| "shop".into());
        let jobs = format!("{shop}_jobs");
        (shop, jobs)
    };

    let options = database().await?;
    let pool = open_pool(&options, "leasehold-web-example", 8).await?;
    let web_pool = open_pool(&options, "leasehold-web-example-http", 8).await?;
    let orders = create_orders_table(&pool, &shop).await?;
    let mut config = Config {
        schema: jobs.clone(),
        shutdown_grace: Duration::from_secs(5),
        ..Config::default()
    };
    store_env::store_settings(&mut config)?;
    let scheduler = Scheduler::builder(pool.clone(), config.clone())
        .register(FulfilOrder {
            pool: pool.clone(),
            orders: orders.clone(),
        })
        .start()
        .await?;

    let state = web::Data::new(AppState {
        pool: web_pool.clone(),
        scheduler: scheduler.clone(),
        jobs: Store::for_config(web_pool.clone(), &config)?,
        orders: orders.clone(),
    });
    let server = HttpServer::new(move || {
        // `/metrics` reads its gauges through the web workers' pool, as the other routes do.
        let metrics = metrics_route_with(state.scheduler.clone(), state.jobs.clone());
        App::new()
            .app_data(state.clone())
            .route("/orders", web::post().to(create_order))
            .route("/orders/{id}", web::get().to(get_order))
            .service(metrics)
            .service(
                dashboard(state.scheduler.clone())
                    .at("/jobs")
                    .store(state.jobs.clone())
                    .actions(operator),
            )
    })
    .workers(2)
    .shutdown_timeout(10)
    .bind(("127.0.0.1", port))?;
    let addr = server.addrs()[0];
    // actix-web's own signal handling: Ctrl-C and SIGTERM stop the server gracefully
    // (requests in flight finish) and `server.await` returns.
    let server = server.run();
    println!("listening on http://{addr}");
    let stopper = if demo {
        let handle = server.handle();
        Some(actix_web::rt::spawn(async move {
            let outcome = run_demo(addr).await;
            handle.stop(true).await;
            outcome
        }))
    } else {
        None
    };
    server.await?;
    let mut outcome = match stopper {
        Some(demo) => demo.await?,
        None => Ok(0),
    };
    web_pool.close().await;
    println!("stopping: the HTTP server stopped; now the scheduler");
    let report = scheduler.shutdown().await?;
    println!(
        "scheduler stopped: {} attempts drained, {} released",
        report.drained, report.cancelled
    );
    if demo {
        if let Ok(placed) = outcome {
            outcome = check_demo_tables(&pool, &orders, &jobs, placed).await;
        }
        for schema in [&shop, &jobs] {
            sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
                .execute(&pool)
                .await?;
        }
    }
    pool.close().await;
    outcome
        .map(|_| ())
        .map_err(|e| -> Box<dyn Error> { e.into() })
}

/// The refused order left nothing: as many orders as jobs, all fulfilled and done.
async fn check_demo_tables(
    pool: &PgPool,
    orders: &str,
    jobs: &str,
    placed: usize,
) -> Result<usize, String> {
    let (n_orders, fulfilled): (i64, i64) = sqlx::query_as(&format!(
        "SELECT count(*), count(*) FILTER (WHERE status = 'fulfilled') FROM {orders}"
    ))
    .fetch_one(pool)
    .await
    .map_err(|e| e.to_string())?;
    let (n_jobs, done): (i64, i64) = sqlx::query_as(&format!(
        "SELECT count(*), count(*) FILTER (WHERE state = 'done') FROM \"{jobs}\".jobs"
    ))
    .fetch_one(pool)
    .await
    .map_err(|e| e.to_string())?;
    println!(
        "in the database: {n_orders} orders ({fulfilled} fulfilled), {n_jobs} jobs ({done} done)"
    );
    let p = placed as i64;
    if (n_orders, fulfilled, n_jobs, done) != (p, p, p, p) {
        return Err(format!("expected {placed} of each"));
    }
    println!("demo ok: the refused order left neither an order nor a job");
    Ok(placed)
}

// ---------------------------------------------------------------------------------
// --demo: a few requests over loopback, with checks.
// ---------------------------------------------------------------------------------

/// One HTTP/1.1 request on its own connection; (status, body).
async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> Result<(u16, String), String> {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(req.as_bytes())
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .await
        .map_err(|e| format!("read: {e}"))?;
    let raw = String::from_utf8_lossy(&raw);
    let (head, body) = raw.split_once("\r\n\r\n").ok_or("no HTTP header")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("no HTTP status")?;
    Ok((status, body.to_string()))
}

fn field(body: &str, name: &str) -> Option<serde_json::Value> {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get(name).cloned())
}

/// Returns how many orders were placed.
async fn run_demo(addr: SocketAddr) -> Result<usize, String> {
    let orders = [
        ("alice", "book", 1),
        ("alice", "lamp", 2),
        ("bob", "chair", 4),
        ("bob", "piano", 500), // over the limit: refused, rolled back with its job
    ];
    let mut placed = Vec::new();
    for (customer, item, qty) in orders {
        let body = serde_json::json!({ "customer": customer, "item": item, "qty": qty });
        let (status, reply) = request(addr, "POST", "/orders", Some(body)).await?;
        println!("POST /orders {customer} {item} x{qty} -> {status} {reply}");
        match (qty <= MAX_QTY, status) {
            (true, 201) => placed.push(
                field(&reply, "order_id")
                    .and_then(|v| v.as_i64())
                    .ok_or("no order_id")?,
            ),
            (false, 422) => {}
            _ => return Err(format!("unexpected status {status} for {item} x{qty}")),
        }
    }

    // Every placed order gets fulfilled by its job.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    for id in &placed {
        loop {
            let (status, reply) = request(addr, "GET", &format!("/orders/{id}"), None).await?;
            let fulfilled = status == 200
                && field(&reply, "status").as_ref().and_then(|s| s.as_str()) == Some("fulfilled")
                && field(&reply, "job_state").as_ref().and_then(|s| s.as_str()) == Some("done");
            if fulfilled {
                println!("GET /orders/{id} -> {reply}");
                break;
            }
            if tokio::time::Instant::now() > deadline {
                return Err(format!(
                    "order {id} not fulfilled in time: {status} {reply}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    let (status, text) = request(addr, "GET", "/metrics", None).await?;
    println!("GET /metrics -> {status}");
    let completed_line =
        r#"leasehold_attempts_total{queue="default",kind="fulfil_order",outcome="completed"} "#;
    let mut completed = None;
    for line in text.lines() {
        if line.starts_with("leasehold_claimed_total ")
            || line.starts_with(completed_line)
            || line.starts_with("leasehold_jobs_in_flight ")
            || line.starts_with("leasehold_jobs{")
            || line.starts_with("leasehold_mailbox_handled_total")
        {
            println!("  {line}");
        }
        if let Some(v) = line.strip_prefix(completed_line) {
            completed = v.trim().parse::<usize>().ok();
        }
    }
    // Exactly the committed orders had jobs: the refused order's job never existed.
    if status != 200 || completed != Some(placed.len()) {
        return Err(format!(
            "metrics say {completed:?} jobs completed, expected {}",
            placed.len()
        ));
    }
    let (status, page) = request(addr, "GET", "/jobs/", None).await?;
    println!("GET /jobs/ (the dashboard) -> {status}");
    if status != 200 || !page.contains("data-queue=\"default\"") {
        return Err(format!(
            "the dashboard's overview: {status}, no row for the queue"
        ));
    }
    println!("{} orders placed and fulfilled", placed.len());
    Ok(placed.len())
}
