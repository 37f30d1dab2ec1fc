//! Enqueue a few kinds of jobs, keyed and unkeyed, run them, print what happened.
//!
//!     cargo run --example quickstart
//!
//! Needs a PostgreSQL (DATABASE_URL, or PGHOST/PGPORT/PGUSER; default
//! postgres://root@127.0.0.1:5432/postgres); it creates the database
//! `leasehold_quickstart` on that server and works in its own schema. Behind a
//! transaction-mode pooler (PgBouncer `pool_mode = transaction`) set
//! `LEASEHOLD_STORE__TRANSACTION_POOLER=true`, and `LEASEHOLD_LISTEN_URL` to a URL
//! straight to PostgreSQL (see `shared/store_env.rs` and the README's "Behind PgBouncer
//! in transaction mode"); without the switch the start refuses with an error saying so.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold::{Config, Handler, JobContext, JobError, NewJob, Scheduler};
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::{ConnectOptions, Connection, Row};

#[path = "shared/log.rs"]
mod log;
#[path = "shared/store_env.rs"]
mod store_env;

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

/// The pool on `leasehold_quickstart`, created if missing. Its own statements are simple
/// queries (`raw_sql`: never a cached prepared statement), so they also work through a
/// transaction-mode pooler.
async fn database() -> sqlx::PgPool {
    let opts = store_env::connect_options().expect("DATABASE_URL");
    let mut admin = opts.connect().await.expect("connect to PostgreSQL");
    let exists: bool = sqlx::raw_sql(
        "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = 'leasehold_quickstart')",
    )
    .fetch_one(&mut admin)
    .await
    .and_then(|row| row.try_get(0))
    .unwrap();
    if !exists {
        let _ = sqlx::raw_sql("CREATE DATABASE leasehold_quickstart")
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
    store_env::store_settings(&mut config)?;
    let log = Arc::new(Mutex::new(Vec::new()));
    let started = Scheduler::builder(pool.clone(), config)
        .register(GreetHandler)
        .register(PostHandler { log: log.clone() })
        .register(Flaky)
        .start()
        .await;
    // A refused start says what to change (a transaction-mode pooler without
    // `store.transaction_pooler`, say): print it as text, not as `main`'s debug form.
    let scheduler = match started {
        Ok(s) => s,
        Err(e) => {
            eprintln!("leasehold did not start: {e}");
            std::process::exit(1);
        }
    };

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
    sqlx::raw_sql(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&pool)
        .await?;
    Ok(())
}
