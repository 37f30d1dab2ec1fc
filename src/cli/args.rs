//! The command line, declared with clap's derive: one variant per command.

use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::config::DEFAULT_SCHEMA;
use crate::job::JobState;

/// Operate a leasehold job queue: see what is stuck and why, and act on one job.
#[derive(Debug, Parser)]
#[command(name = "leasehold", version)]
pub(crate) struct Cli {
    /// PostgreSQL URL. Without it (and without DATABASE_URL) the PG* variables
    /// (PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE) say where to connect.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,
    /// The schema holding leasehold's tables (`Config::schema`).
    #[arg(long, default_value = DEFAULT_SCHEMA, global = true)]
    pub schema: String,
    /// The URL goes through a transaction-mode pooler (PgBouncer `pool_mode =
    /// transaction`): no named prepared statements, no session state
    /// (`StoreOptions::transaction_pooler`). Without it, a second command through the
    /// same server connection fails with "prepared statement ... already exists".
    #[arg(long, env = "LEASEHOLD_TRANSACTION_POOLER", global = true)]
    pub transaction_pooler: bool,
    /// Print JSON for scripts instead of tables for people.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Per queue: jobs by state, the oldest eligible job's wait, the oldest running
    /// job's time since its claim, lease expiries, blocked keys.
    Status,
    /// List jobs one page at a time: by ascending id, except pending jobs (in claim
    /// order: queue, priority, due time) and waiting jobs (by queue, key and position).
    Jobs(JobsArgs),
    /// One job: its row, history, expired leases and recorded effects.
    #[command(alias = "show")]
    Job {
        /// The job id.
        id: i64,
        /// Show payload, result, errors and history details whole (they are cut to
        /// one line otherwise).
        #[arg(long)]
        full: bool,
    },
    /// Retry a dead job from a fresh attempt count (or every dead job a filter selects).
    Retry(Target),
    /// Cancel a job that has not finished (a running job is asked to stop).
    Cancel {
        #[command(flatten)]
        target: Target,
        /// With filters: only jobs in this state (default: every state but done and
        /// cancelled).
        #[arg(long, value_parser = state, conflicts_with = "id")]
        state: Option<JobState>,
        /// Recorded in the job's history and last error.
        #[arg(long, default_value = "cancelled from the command line")]
        reason: String,
    },
    /// Hold a pending job: it is not claimed until released.
    Hold(Target),
    /// Release a held job: it is pending again.
    Release(Target),
    /// Keys blocked by a dead or held head, with the head and why it stopped.
    Keys {
        /// List the blocked keys (the only listing of keys there is).
        #[arg(long, required = true)]
        blocked: bool,
        /// At most this many keys.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Pause a queue in every process: nothing of it is claimed until it is resumed;
    /// running jobs finish, jobs claimed ahead are given back, enqueues still go in.
    Pause {
        /// The queue.
        queue: String,
        /// Who is pausing it and why (recorded, shown by `status --json` and `paused`).
        #[arg(long)]
        by: Option<String>,
    },
    /// Resume a paused queue: every scheduler claims its jobs again at once.
    Resume {
        /// The queue.
        queue: String,
    },
    /// Create or upgrade the schema.
    Migrate {
        /// Print the SQL that would run instead of running it (one transaction that
        /// records the versions it applies).
        #[arg(long, alias = "print-sql")]
        print: bool,
    },
    /// Delete done and cancelled jobs that finished long enough ago (dead jobs are kept).
    Prune {
        /// Keep jobs that finished more recently than this (e.g. 7d, 12h); never less than
        /// 5 minutes (a worker may still be reading a just-finished job back).
        #[arg(long, value_parser = duration)]
        older_than: Duration,
        /// Rows deleted per statement; prune repeats until nothing is left to delete.
        #[arg(long, default_value_t = 10_000)]
        batch: i64,
    },
}

#[derive(Debug, Args)]
pub(crate) struct JobsArgs {
    /// Only jobs of this queue.
    #[arg(long)]
    pub queue: Option<String>,
    /// Only jobs in this state.
    #[arg(long, value_parser = state)]
    pub state: Option<JobState>,
    /// Only jobs of this kind.
    #[arg(long)]
    pub kind: Option<String>,
    /// Only jobs of this ordering key.
    #[arg(long)]
    pub key: Option<String>,
    /// Only jobs enqueued at least this long ago (e.g. 10m, 2h).
    #[arg(long, value_parser = duration)]
    pub older_than: Option<Duration>,
    /// At most this many jobs.
    #[arg(long, default_value_t = crate::store::DEFAULT_PAGE)]
    pub limit: i64,
    /// Start after this job id (the `next page` hint of the previous page).
    #[arg(long)]
    pub after: Option<i64>,
}

/// The job an action is for: one id, or every job the filters select (in the states
/// the action applies to). More than one job needs a confirmation.
#[derive(Debug, Args)]
pub(crate) struct Target {
    /// The job id. Without it, the filters select the jobs.
    #[arg(required_unless_present_any = ["queue", "kind", "key"])]
    pub id: Option<i64>,
    /// Select the jobs of this queue.
    #[arg(long, conflicts_with = "id")]
    pub queue: Option<String>,
    /// Select the jobs of this kind (e.g. the dead letters of one kind).
    #[arg(long, conflicts_with = "id")]
    pub kind: Option<String>,
    /// Select the jobs of this ordering key (e.g. a blocked key).
    #[arg(long, conflicts_with = "id")]
    pub key: Option<String>,
    /// Act on every selected job without asking (needed for more than one job when
    /// standard input is not a terminal).
    #[arg(long)]
    pub yes: bool,
}

fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{e} (try 10m, 2h, 7d)"))
}

fn state(text: &str) -> Result<JobState, String> {
    JobState::parse(text).ok_or_else(|| {
        let all: Vec<&str> = JobState::ALL.iter().map(|s| s.as_str()).collect();
        format!("one of {}", all.join(", "))
    })
}
