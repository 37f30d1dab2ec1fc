//! leasehold against the raw-SQL ceiling: throughput, enqueue, latency, keyed work,
//! table growth and memory, in one run.
//!
//!     cargo run --release -p leasehold-bench              # the full run (under 10 minutes)
//!     cargo run --release -p leasehold-bench -- --json    # the same, as JSON on stdout
//!     cargo run --release -p leasehold-bench -- --quick   # smaller sizes, a smoke run (targets not judged)
//!
//! Other flags: `--runs N` (default 3; every figure is the median of N runs, printed
//! with the spread), `--only ceiling,e2e,pooler,fresh,enqueue,notify,cpu,latency,keyed,hot,growth,memory,stats,dashboard,prune,peer`
//! (`micro`: a statement-cost diagnostic; `trips`: what sending the raw ceiling's claim and
//! completion as one statement instead of two buys, a diagnostic; `peer`: graphile_worker, the fastest peer, with its
//! documented throughput recipe, each figure right after leasehold's matching run — unkeyed
//! at concurrency 1 and 32, keyed, idle latency — see `bench/src/peer.rs`; `pooler`:
//! through a PgBouncer in transaction mode that it starts, see `bench/src/pooler.rs`),
//! `--pool N` (connections of the scheduler's pool, default 24), `--history` (write the
//! `claimed`/`completed` history events, `StoreOptions::full_history`), `--prune-rows
//! N,N,..` (the retained rows of the `prune` rows: default 10^5 and 10^6, 10^5 with
//! `--quick`; 10^7 takes minutes to insert).
//!
//! Needs a PostgreSQL on 127.0.0.1:5432 that lets the current user in (or
//! DATABASE_URL). It connects to the `postgres` database, creates `leasehold_bench` (or
//! `LEASEHOLD_BENCH_DB`),
//! and works in the schema `bench` there, which it drops and recreates (the peer: in
//! `bench_graphile_worker`, dropped before each of its measurements). `BENCH_DEBUG=1`
//! prints what each scheduler did (claims, batch sizes, process CPU, and how often the
//! queue of claimed jobs waiting for a slot was found empty while it drained). For
//! experiments only, these override one `Config` field of every leasehold run:
//! `LEASEHOLD_BENCH_CLAIM_AHEAD`, `LEASEHOLD_BENCH_CLAIM_BATCH_MAX`,
//! `LEASEHOLD_BENCH_COMPLETION_BATCH`, `LEASEHOLD_BENCH_COMPLETION_FLUSH_US`,
//! `LEASEHOLD_BENCH_HANDLER_THREADS`.

use std::time::Instant;

use serde_json::json;

#[path = "../../examples/shared/log.rs"]
mod log;

/// Progress goes to stderr; the table (or JSON) to stdout.
macro_rules! say {
    ($($t:tt)*) => {
        eprintln!(
            "[bench {:>6.1}s] {}",
            crate::START.with(|s| s.elapsed().as_secs_f64()),
            format!($($t)*)
        )
    };
}

thread_local! {
    static START: Instant = Instant::now();
}

mod dashboard;
mod footprint;
mod handlers;
mod latency;
mod notify;
mod peer;
mod pooler;
mod prune;
mod report;
mod sections;
mod setup;
mod stats;
mod throughput;

use sections::{Run, Sizes};

struct Args {
    json: bool,
    quick: bool,
    runs: usize,
    only: Option<Vec<String>>,
    pool: u32,
    history: bool,
    memory_child: Option<usize>,
    prune_rows: Option<Vec<i64>>,
}

fn args() -> Args {
    let mut a = Args {
        json: false,
        quick: false,
        runs: 3,
        only: None,
        pool: 24,
        history: false,
        memory_child: None,
        prune_rows: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().unwrap_or_else(|| panic!("{name} needs a value"));
        match arg.as_str() {
            "--json" => a.json = true,
            "--quick" => a.quick = true,
            "--history" => a.history = true,
            "--runs" => a.runs = value("--runs").parse().expect("--runs N"),
            "--pool" => a.pool = value("--pool").parse().expect("--pool N"),
            "--only" => {
                a.only = Some(
                    value("--only")
                        .split(',')
                        .map(|s| s.trim().to_string())
                        .collect(),
                )
            }
            "--prune-rows" => {
                a.prune_rows = Some(
                    value("--prune-rows")
                        .split(',')
                        .map(|s| s.trim().parse().expect("--prune-rows N,N,..."))
                        .collect(),
                )
            }
            "--memory-child" => {
                a.memory_child = Some(value("--memory-child").parse().expect("--memory-child N"))
            }
            "-h" | "--help" => {
                eprintln!("{}", HELP);
                std::process::exit(0);
            }
            other => panic!("unknown flag {other:?}\n{HELP}"),
        }
    }
    a
}

const HELP: &str = "usage: bench [--json] [--quick] [--runs N] [--pool N] [--history] \
[--only ceiling,e2e,pooler,fresh,enqueue,notify,cpu,latency,keyed,hot,growth,memory,stats,dashboard,prune,peer] \
[--prune-rows 100000,1000000,10000000]";

#[actix::main]
async fn main() {
    let a = args();
    log::init(
        "leasehold=warn,sqlx=error,graphile_worker=warn",
        std::io::stderr,
    );
    if let Some(keys) = a.memory_child {
        footprint::memory_child(keys).await;
        return;
    }
    START.with(|_| ());
    let want = |s: &str| a.only.as_ref().is_none_or(|o| o.iter().any(|x| x == s));
    let opts = setup::bench_database().await;
    let pool = setup::pool(&opts, a.pool).await;
    let store = setup::fresh_schema(&pool, setup::SCHEMA, a.history).await;
    let machine = setup::machine();
    let settings = setup::settings(&pool).await;
    let mut run = Run {
        sizes: Sizes::new(a.quick),
        runs: a.runs.max(1),
        history: a.history,
        pool_conns: a.pool as usize,
        opts,
        pool,
        store,
        rows: Vec::new(),
        explains: Vec::new(),
        peer: None,
    };
    if want("peer") {
        run.peer = Some(peer::Peer::new(&run.opts, a.pool));
    }
    say!(
        "database {} schema {}, pool {} connections, {} runs per figure",
        setup::db(),
        setup::SCHEMA,
        a.pool,
        run.runs
    );

    if a.only
        .as_ref()
        .is_some_and(|o| o.iter().any(|x| x == "micro"))
    {
        run.micro().await;
    }
    if a.only
        .as_ref()
        .is_some_and(|o| o.iter().any(|x| x == "trips"))
    {
        run.trips().await;
    }
    let unkeyed_32 = run.ceiling_and_e2e(want("ceiling"), want("e2e")).await;
    if want("pooler") {
        run.pooler().await;
    }
    if want("enqueue") {
        run.enqueue().await;
    }
    if want("fresh") {
        run.fresh().await;
    }
    if want("cpu") {
        run.cpu().await;
    }
    if want("notify") {
        run.notify().await;
    }
    if want("latency") || want("peer") {
        run.latency(unkeyed_32, want("latency")).await;
    }
    if want("keyed") || want("peer") {
        run.keyed(want("keyed")).await;
    }
    if want("keyed") || want("hot") {
        run.hot_key().await;
    }
    if let Some(p) = &run.peer {
        let rows = p.rows();
        run.rows.extend(rows);
    }
    if want("growth") {
        run.growth().await;
    }
    if want("memory") {
        run.memory().await;
    }
    if want("stats") {
        run.stats().await;
    }
    if want("dashboard") {
        run.dashboard().await;
    }
    if want("prune") {
        let sizes = a.prune_rows.clone().unwrap_or(if a.quick {
            vec![100_000]
        } else {
            vec![100_000, 1_000_000]
        });
        run.prune(&sizes).await;
    }

    if a.quick {
        run.rows.iter_mut().for_each(|r| r.quick = true);
    }
    let total = START.with(|s| s.elapsed().as_secs_f64());
    say!("done in {total:.0} s");
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    if a.json {
        let kv = |v: &[(String, String)]| {
            v.iter()
                .map(|(k, v)| (k.clone(), json!(v)))
                .collect::<serde_json::Map<_, _>>()
        };
        let out = json!({
            "command": command,
            "machine": kv(&machine),
            "postgres": kv(&settings),
            "runs": run.runs,
            "pool": a.pool,
            "full_history": a.history,
            "peer": run.peer.as_ref().map(|p| p.describe()),
            "total_secs": total,
            "rows": report::rows_json(&run.rows),
            "explain": run
                .explains
                .iter()
                .map(|(k, v)| json!({"what": k, "plan": v}))
                .collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&out).unwrap());
        return;
    }
    println!(
        "leasehold bench: {} runs per figure (median, spread min-max), {total:.0} s",
        run.runs
    );
    println!("command: {command}");
    let line = |v: &[(String, String)], sep: &str| {
        v.iter()
            .map(|(k, v)| format!("{k}{sep}{v}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!("machine: {}", line(&machine, " "));
    println!("postgres: {}", line(&settings, "="));
    println!(
        "scheduler: Config::default() except concurrency; pool {} connections; full_history {}; \
         ratios are medians of per-run ratios (each pair ran back to back); a CHECKPOINT \
         opens each section",
        a.pool, a.history
    );
    if let Some(p) = &run.peer {
        let d = p.describe();
        println!(
            "peer: graphile_worker {} (a dependency of the bench crate only), its documented throughput \
             recipe: local_queue size {} (ttl {} ms), complete/fail_job_batch_delay {} ms, \
             poll_interval {} ms; its own pool of {} connections (its sqlx 0.9) and tokio \
             multi-thread runtime; schema {}; loaded with {}",
            d["version"].as_str().unwrap_or("?"),
            d["local_queue"]["size"],
            d["local_queue"]["ttl_ms"],
            d["complete_job_batch_delay_ms"],
            d["poll_interval_ms"],
            d["pool_connections"],
            d["schema"].as_str().unwrap_or("?"),
            d["load"].as_str().unwrap_or("?"),
        );
    }
    println!();
    report::print_table(&run.rows);
    for (what, plan) in &run.explains {
        println!("\nEXPLAIN (ANALYZE, BUFFERS), {what}\n{plan}");
    }
}
