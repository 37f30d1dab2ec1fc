//! leasehold in a plain tokio service (no actix in the host: the same works under axum
//! or tonic): start, enqueue, run, stop on Ctrl-C or SIGTERM.
//!
//!     cargo run --example tokio_service            # until Ctrl-C / SIGTERM
//!     cargo run --example tokio_service -- --demo  # enqueue a few jobs, wait, stop
//!
//! The scheduler runs its actors on a thread of its own; its handlers run on this
//! runtime (`Config::handler_threads` gives them threads of their own instead).
//! Needs a PostgreSQL (DATABASE_URL, or PGHOST/PGPORT/PGUSER; default
//! postgres://root@127.0.0.1:5432/postgres); behind a transaction-mode pooler,
//! `LEASEHOLD_STORE__TRANSACTION_POOLER=true` and `LEASEHOLD_LISTEN_URL` (see
//! `shared/store_env.rs`).
//! `GREET_MS` sets how long a greeting takes (0 ms), to watch a stop release a job that
//! is still running; `SCHEMA` names the scheduler's schema and keeps it (by default a
//! schema of this process's own, dropped at exit).

use std::time::Duration;

use leasehold::{Config, Handler, JobContext, JobError, NewJob, Scheduler};
use serde::{Deserialize, Serialize};

#[path = "shared/env.rs"]
mod env;
#[path = "shared/log.rs"]
mod log;
#[path = "shared/store_env.rs"]
mod store_env;

#[derive(Serialize, Deserialize)]
struct Greet {
    name: String,
}

struct Greeter;

impl Handler for Greeter {
    type Payload = Greet;
    type Output = String;
    const KIND: &'static str = "greet";

    async fn run(&self, ctx: JobContext, g: Greet) -> Result<String, JobError> {
        let line = format!(
            "hello, {} (job {}, attempt {})",
            g.name,
            ctx.job_id(),
            ctx.attempt()
        );
        tokio::time::sleep(greeting_time()).await;
        println!("{line}");
        Ok(line)
    }
}

/// How long a greeting takes: `GREET_MS` milliseconds (default 0).
fn greeting_time() -> Duration {
    env::millis("GREET_MS", 0)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    log::init("leasehold=info", std::io::stdout);
    let demo = std::env::args().any(|a| a == "--demo");
    let pool = sqlx::PgPool::connect_with(store_env::connect_options()?).await?;
    let kept_schema = std::env::var("SCHEMA").ok();
    let mut config = Config {
        schema: kept_schema
            .clone()
            .unwrap_or_else(|| format!("tokio_example_{}", std::process::id())),
        ..Config::default()
    };
    store_env::store_settings(&mut config)?;
    // Listen for SIGTERM before any job can start: a signal that came before the
    // handler was installed would kill the process with the job still running.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let scheduler = Scheduler::builder(pool.clone(), config.clone())
        .register(Greeter)
        .start()
        .await?;
    for name in ["ada", "grace", "edsger"] {
        scheduler
            .enqueue_job(NewJob::new("greet", &Greet { name: name.into() })?.with_key("greetings"))
            .await?;
    }
    if demo {
        tokio::time::sleep(Duration::from_secs(1)).await;
    } else {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    let report = scheduler.shutdown().await?;
    println!(
        "stopped: {} completed, {} released",
        report.metrics.counters.completed, report.cancelled
    );
    if kept_schema.is_none() {
        // A simple query: it also works through a transaction-mode pooler.
        sqlx::raw_sql(&format!("DROP SCHEMA \"{}\" CASCADE", config.schema))
            .execute(&pool)
            .await?;
    }
    if demo && report.metrics.counters.completed != 3 {
        return Err("expected three greetings".into());
    }
    Ok(())
}
