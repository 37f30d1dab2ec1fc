//! Enqueue a few kinds of jobs, keyed and unkeyed, run them, print what happened.
//!
//!     cargo run --example quickstart
//!
//! Needs a local PostgreSQL (DATABASE_URL, default postgres://root@127.0.0.1:5432/postgres);
//! it creates the database `leasehold_quickstart` and works in its own schema.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold::{Config, Handler, JobContext, JobError, NewJob, Scheduler};
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::{ConnectOptions, Connection};

#[path = "shared/log.rs"]
mod log;

#[derive(Serialize, Deserialize)]
struct Greet {
    name: String,
}

struct GreetHandler;

impl Handler for GreetHandler {
    type Payload = Greet;
    type Output = String;
    const KIND: &'static str = "greet";

    async fn run(&self, ctx: JobContext, p: Greet) -> Result<String, JobError> {
        Ok(format!(
            "hello {} (job {}, attempt {})",
            p.name,
            ctx.job_id(),
            ctx.attempt()
        ))
    }
}

#[derive(Serialize, Deserialize)]
struct Posting {
    account: String,
    entry: u32,
}

/// Ledger postings: keyed by account, so each account's entries run in order.
struct PostHandler {
    log: Arc<Mutex<Vec<(String, u32)>>>,
}

impl Handler for PostHandler {
    type Payload = Posting;
    type Output = ();
    const KIND: &'static str = "post";

    async fn run(&self, _ctx: JobContext, p: Posting) -> Result<(), JobError> {
        tokio::time::sleep(Duration::from_millis(5)).await;
        self.log.lock().unwrap().push((p.account, p.entry));
        Ok(())
    }
}

/// Fails on its first attempt, then succeeds: shows retry with backoff.
struct Flaky;

impl Handler for Flaky {
    type Payload = ();
    type Output = ();
    const KIND: &'static str = "flaky";

    async fn run(&self, ctx: JobContext, _: ()) -> Result<(), JobError> {
        if ctx.attempt() == 1 {
            return Err(JobError::retry("first attempt always fails"));
        }
        Ok(())
    }
}

async fn database() -> sqlx::PgPool {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/postgres".into());
    let opts: sqlx::postgres::PgConnectOptions = url.parse().expect("DATABASE_URL");
    let mut admin = opts.connect().await.expect("connect to PostgreSQL");
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = 'leasehold_quickstart')",
    )
    .fetch_one(&mut admin)
    .await
    .unwrap();
    if !exists {
        let _ = sqlx::query("CREATE DATABASE leasehold_quickstart")
            .execute(&mut admin)
            .await;
    }
    admin.close().await.ok();
    PgPoolOptions::new()
        .max_connections(8)
        .connect_with(opts.database("leasehold_quickstart"))
        .await
        .unwrap()
}

#[actix::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    log::init("leasehold=warn", std::io::stdout);
    let pool = database().await;
    let schema = format!("quickstart_{}", std::process::id());
    let mut config = Config {
        schema: schema.clone(),
        ..Config::default()
    };
    config.retry.backoff.base = Duration::from_millis(100);
    let log = Arc::new(Mutex::new(Vec::new()));
    let scheduler = Scheduler::builder(pool.clone(), config)
        .register(GreetHandler)
        .register(PostHandler { log: log.clone() })
        .register(Flaky)
        .start()
        .await?;

    let greet = scheduler
        .enqueue::<GreetHandler>(&Greet {
            name: "world".into(),
        })
        .await?;
    let mut postings = Vec::new();
    for entry in 1..=5 {
        for account in ["alice", "bob"] {
            postings.push(
                NewJob::new(
                    "post",
                    &Posting {
                        account: account.into(),
                        entry,
                    },
                )?
                .with_key(account),
            );
        }
    }
    scheduler.enqueue_many(postings).await?;
    let flaky = scheduler.enqueue::<Flaky>(&()).await?;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while scheduler.metrics().counters.completed < 12 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let g = scheduler.store().job(greet).await?;
    println!("greet: {} -> {}", g.state, g.result.unwrap_or_default());
    println!("postings in the order they ran: {:?}", log.lock().unwrap());
    let f = scheduler.store().job(flaky).await?;
    println!("flaky: {} after {} attempts", f.state, f.attempts);
    for e in scheduler.store().history(flaky).await? {
        println!(
            "  {} g{} {}",
            e.event,
            e.generation,
            e.detail.unwrap_or_default()
        );
    }
    let m = scheduler.metrics();
    println!(
        "claimed {} completed {} failed {} empty claims {}",
        m.counters.claimed, m.counters.completed, m.counters.failed, m.counters.empty_claims
    );
    for mb in &m.mailboxes {
        println!(
            "mailbox {:<14} handled {:>5} high-water {:>3}",
            mb.actor, mb.handled, mb.high_water
        );
    }
    scheduler.shutdown().await?;
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&pool)
        .await?;
    Ok(())
}
