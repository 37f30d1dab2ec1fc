//! The main demo: 200 payments through leasehold under injected faults, checked against
//! the payment gateway's own books — then the same run with a new effect key per
//! attempt, to show the duplicate charges the design prevents.
//!
//!     cargo run --example payments
//!
//! Needs a local PostgreSQL (DATABASE_URL, or PGHOST/PGPORT/PGUSER; default
//! postgres://root@127.0.0.1:5432/postgres). It creates the database `leasehold_demo` if
//! missing, works in a schema of its own per run, and drops the schema at the end. The
//! schedulers' store settings come from `LEASEHOLD_STORE__TRANSACTION_POOLER` and
//! `LEASEHOLD_LISTEN_URL` where set (`shared/store_env.rs`).
//!
//! # What happens
//! A payment gateway simulator (`leasehold::testkit::gateway`) listens on loopback. It
//! deduplicates charges by idempotency key and fences per account, like real gateways.
//! 20 accounts get 10 payments each, keyed by account so each account's payments run in
//! order. Three schedulers (three workers with their own owners, pools, lease renewers
//! and reapers; lease 1 s, renewal every 300 ms, reaper every 200 ms) run them. Each
//! payment job charges through `JobContext::once("charge", ..)`: the effect key
//! `<schema identity>/<job id>/charge` is the gateway's idempotency key, the job's
//! fencing token goes with it, and the receipt is recorded in the effect ledger.
//!
//! Faults, the same in both runs: a worker stalls right after charging until its lease
//! has expired and the job was reaped and claimed again; a worker crashes (its handler
//! panics) after charging, before recording; the gateway applies a charge and drops the
//! reply; the gateway fails a request; the gateway stalls past the client's timeout.
//!
//! The second run changes one thing: the handler names its step per attempt
//! (`charge-g<generation>`), so every attempt presents a new idempotency key.
//!
//! # Where to look
//! `payments/handler.rs` holds the payment job and its handler (the part a service
//! would write), the fault injector and the fault plan; `payments/run.rs` runs one
//! pass and reads the books; `payments/report.rs` prints them and the verdict.
//!
//! # Exit status
//! 0 when the leasehold run charged every payment exactly once, in enqueue order per
//! account, and the per-attempt run showed duplicate charges (the demo can see the
//! failure it guards against); 1 otherwise.

#[path = "payments/handler.rs"]
mod handler;
#[path = "shared/log.rs"]
mod log;
#[path = "payments/report.rs"]
mod report;
#[path = "payments/run.rs"]
mod run;
#[path = "shared/store_env.rs"]
mod store_env;

use std::error::Error;
use std::process::ExitCode;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::ConnectOptions;

use handler::{account, fault_plan, reference, KeyScheme};
use report::{exactly_once_problems, print_plan, print_table};
use run::run;

const ACCOUNTS: u32 = 20;
const PAYMENTS_PER_ACCOUNT: u32 = 10;
const WORKERS: usize = 3;
const LEASE: Duration = Duration::from_secs(1);
const RENEW_INTERVAL: Duration = Duration::from_millis(300);
const REAPER_INTERVAL: Duration = Duration::from_millis(200);
/// How long a worker waits for the gateway's reply.
const CLIENT_TIMEOUT: Duration = Duration::from_millis(500);
/// How long an injected gateway stall lasts (past the client's timeout).
const GATEWAY_STALL: Duration = Duration::from_millis(1200);
/// A run that has not finished by then is reported with its unfinished jobs.
const RUN_DEADLINE: Duration = Duration::from_secs(25);
const SIMULATED_CRASH: &str = "simulated crash";

// ---------------------------------------------------------------------------------
// Setup.
// ---------------------------------------------------------------------------------

/// Connect to the server's maintenance database, create `leasehold_demo` if missing,
/// and return options for it.
async fn demo_database(server: PgConnectOptions) -> Result<PgConnectOptions, Box<dyn Error>> {
    let mut admin = server.connect().await?;
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = 'leasehold_demo')",
    )
    .fetch_one(&mut admin)
    .await?;
    if !exists {
        // Two demos starting at once may race here; the loser's error is harmless.
        let _ = sqlx::query("CREATE DATABASE leasehold_demo")
            .execute(&mut admin)
            .await;
    }
    sqlx::Connection::close(admin).await?;
    Ok(server
        .database("leasehold_demo")
        .log_statements(tracing::log::LevelFilter::Trace))
}

/// The crash fault is a panic in the handler: leasehold catches it and fails the
/// attempt. Keep its message off the terminal; other panics print as usual.
fn quiet_simulated_crashes() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if !msg.starts_with(SIMULATED_CRASH) {
            default(info);
        }
    }));
}

#[actix::main]
async fn main() -> Result<ExitCode, Box<dyn Error>> {
    log::init(
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| "leasehold=error".into()),
        std::io::stdout,
    );
    quiet_simulated_crashes();
    let options = demo_database(store_env::connect_options()?).await?;
    print_plan();

    let leasehold = run(&options, KeyScheme::Stable).await?;
    let control = run(&options, KeyScheme::PerAttempt).await?;
    print_table(&leasehold, &control);
    println!();
    let (a, s, f) = fault_plan()[0];
    println!(
        "one payment, {} ({}), in the leasehold run:",
        reference(&account(a), s),
        f.describe()
    );
    for line in &leasehold.trace {
        println!("  {line}");
    }
    println!();

    let problems = exactly_once_problems(&leasehold);
    let control_duplicates = control.duplicate_charges;
    for p in &problems {
        println!("FAIL (leasehold run): {p}");
    }
    if control_duplicates == 0 {
        println!("FAIL (control run): per-attempt keys produced no duplicate charge, so this demo cannot see the failure it guards against");
    }
    if problems.is_empty() && control_duplicates > 0 {
        println!(
            "OK: leasehold charged each of the {} payments exactly once, in order per account; \
             with per-attempt keys the same faults charged {} payments twice.",
            leasehold.payments, control_duplicates
        );
        Ok(ExitCode::SUCCESS)
    } else {
        Ok(ExitCode::FAILURE)
    }
}
