//! leasehold under faults: a seeded, self-stopping fault-injection harness with an
//! offline invariant checker (issue 5).
//!
//!     cargo run --example chaos -- short [--seed N]      # CI profile, a few minutes
//!     cargo run --release --example chaos -- long        # >= 100,000 jobs, >= 1,500 faults
//!     cargo run --example chaos -- check target/chaos/<seed>
//!     cargo run --example chaos -- selftest                   # the checker's own tests
//!
//! The harness starts its own PostgreSQL cluster (initdb into a temp dir, a free loopback
//! port; the server binaries from `$PG_BIN`, `pg_config --bindir`, the newest
//! `/usr/lib/postgresql/*/bin` or PATH, run as `postgres` under root), an effect server and one TCP fault proxy per worker, then
//! runs several worker processes (this binary again, `worker` mode: one real leasehold
//! `Scheduler` each). A seeded generator enqueues a mixed workload while a seeded
//! nemesis injects faults: SIGKILL, SIGSTOP past the lease, SIGTERM mid-job,
//! `pg_terminate_backend` on worker and LISTEN connections, PostgreSQL restarts (fast
//! and immediate), proxy delay/blackhole/cut, a reaper racing completions, lost effect
//! replies, operator hold/release/cancel. Then it heals, drains, saves the database and
//! every log under `target/chaos/<seed>/`, and runs the checker on them.
//!
//! Layout: `harness` (orchestration), `drain` (drain, artifacts), `nemesis` (faults), `workload`,
//! `periodic` (schedules under the faults, on shifted database clocks),
//! `worker`, `effects` (effect server), `proxy`, `cluster` (with `pgbin`, the server binaries), `procs` (child processes,
//! watchdog), `model` (artifact formats), `check` (the checker), `profile`.

mod attempt;
mod check;
mod cluster;
mod dbsetup;
mod drain;
mod effects;
mod harness;
mod kinds;
mod model;
mod nemesis;
mod nemesis_host;
mod nemesis_operator;
mod nemesis_plan;
mod operator;
mod periodic;
mod pgbin;
mod procs;
mod profile;
mod proxy;
mod scenarios;
mod worker;
mod workload;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("worker") => worker::main(&args[1..]),
        Some("check") => check::main(&args[1..]),
        Some("selftest") => check::selftest::main(),
        Some(p @ ("short" | "long")) => harness::main(p, &args[1..]),
        None => harness::main("short", &[]),
        Some(other) => {
            eprintln!(
                "chaos: unknown command {other:?}; use short, long, check, selftest or worker"
            );
            std::process::exit(2)
        }
    }
}
