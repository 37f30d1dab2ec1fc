//! The operator CLI behind the `leasehold` binary (cargo feature `cli`): what is stuck,
//! why, since when and who held it, and the actions on one job, over the same
//! [`Store`] calls a service uses.
//!
//! # Output
//!
//! Every command builds both a table for people and a JSON value for scripts
//! (`--json`); only one is printed, on stdout. Errors go to stderr.
//!
//! # Exit codes
//!
//! | code | meaning |
//! |------|---------|
//! | 0 | done |
//! | 1 | refused: an unknown job id, an action the job's state does not allow, a bulk action not confirmed (nothing changed) or refused for some of its jobs (the report lists them) |
//! | 2 | usage: an unknown command or a bad argument (clap's own code) |
//! | 3 | failed: the database could not be reached or refused a statement |

mod actions;
mod args;
mod commands;
mod show;
mod text;

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::error::Error;
use crate::store::{Store, StoreOptions};
use args::Cli;

/// What a command prints: a table for people, or JSON for scripts.
#[derive(Debug)]
pub(crate) struct Printed {
    /// Shown by default.
    pub text: String,
    /// Shown with `--json`.
    pub json: serde_json::Value,
}

/// Why a command did not do what it was asked.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The request was refused (unknown job, invalid transition): exit 1.
    Refused(String),
    /// Something went wrong on the way (database unreachable or failing): exit 3.
    Failed(String),
    /// Part of a bulk action was refused: its report is printed as usual, then exit 1.
    Partial(Printed),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        match e {
            Error::JobNotFound(_)
            | Error::InvalidTransition { .. }
            | Error::InvalidInput { .. }
            | Error::InvalidSchema(_) => Failure::Refused(e.to_string()),
            Error::Database(sqlx::Error::Database(db)) if db.code().as_deref() == Some("42P01") => {
                Failure::Failed(format!(
                    "{db}: is --schema right, and has `leasehold migrate` run on it?"
                ))
            }
            other => Failure::Failed(other.to_string()),
        }
    }
}

/// Run the CLI with the process's arguments and environment, and say how it ended.
/// The `leasehold` binary is just this.
pub fn main() -> ExitCode {
    // Exits with 2 on a usage error, 0 for --help and --version.
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(Failure::Failed(format!("cannot start a runtime: {e}"))),
    };
    match runtime.block_on(run(&cli)) {
        Ok(printed) => {
            print_out(&printed, cli.json);
            ExitCode::SUCCESS
        }
        Err(Failure::Partial(printed)) => {
            print_out(&printed, cli.json);
            ExitCode::from(1)
        }
        Err(failure) => fail(failure),
    }
}

fn print_out(printed: &Printed, json: bool) {
    if json {
        println!("{:#}", printed.json);
    } else {
        print!("{}", printed.text);
    }
}

fn fail(failure: Failure) -> ExitCode {
    let (message, code) = match failure {
        Failure::Refused(m) => (m, 1),
        Failure::Failed(m) => (m, 3),
        Failure::Partial(p) => (p.text, 1),
    };
    eprintln!("leasehold: {message}");
    ExitCode::from(code)
}

async fn run(cli: &Cli) -> Result<Printed, Failure> {
    let store = connect(cli).await?;
    let printed = commands::dispatch(&store, &cli.command).await;
    store.pool().close().await;
    printed
}

/// A small pool (one command runs at a time) tagged `leasehold-cli` in
/// `pg_stat_activity`.
async fn connect(cli: &Cli) -> Result<Store, Failure> {
    let options = match &cli.database_url {
        Some(url) => url
            .parse::<PgConnectOptions>()
            .map_err(|e| Failure::Refused(format!("invalid --database-url: {e}")))?,
        None => PgConnectOptions::new(),
    }
    .application_name("leasehold-cli");
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .map_err(|e| Failure::Failed(format!("cannot connect to PostgreSQL: {e}")))?;
    let options = StoreOptions {
        transaction_pooler: cli.transaction_pooler,
        ..StoreOptions::default()
    };
    Ok(Store::new(pool, &cli.schema, options)?)
}
