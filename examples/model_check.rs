//! The protocol model checker, for configurations deeper than `cargo test` runs.
//!
//! ```sh
//! cargo run --release --example model_check -- --jobs 4 --keys 2 --procs 3
//! ```
//!
//! # Flags
//! `--jobs N` (the last one enqueued by a host transaction), `--keys N`, `--procs N`,
//! `--slots N`, `--ahead N` (claim-ahead: ready-queue room), `--attempts N` (max
//! attempts), `--lease N` (ticks); budgets `--crashes N --pauses N --failures N
//! --shutdowns N --lost-replies N --faults N` (faults of any kind in all)
//! `--cancels N --holds N --retries N --prunes N --operator N` (operator actions in all);
//! `--quiet` (all budgets 0; give it before the budget flags); `--no-liveness` (safety only,
//! on stateright's depth-first checker with `--threads`, keeping no state graph); `--store
//! dedup|fenced`; `--defect NAME` (repeatable: renewal-waits, registry-from-start,
//! cancel-promotes, prune-dead, prune-key-rows, no-deadline, promote-now, old-lock-order,
//! ahead-not-renewed, give-back-keeps, reap-never-requeues); `--threads N`; `--max-states
//! N` (stop after about N states; liveness is then not checked); `--shortest` (the shortest
//! counterexample of a safety property, breadth first, on stateright's checker).
//!
//! With liveness (the default) the check runs on one thread and keeps the fault-free
//! state graph (a few dozen bytes a state) for the fair-cycle check.
//!
//! Exit status 1 when a property fails, with its trace.

#[path = "../tests/model/mod.rs"]
mod model;

use model::config::EffectStore;

fn main() {
    let mut args = std::env::args().skip(1);
    let mut cfg = model::Config::bounded();
    let (mut jobs, mut keys, mut procs) = (cfg.jobs.len(), cfg.keys, cfg.procs);
    let mut rest = Vec::new();
    let mut threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut max_states = 0usize;
    let mut shortest = false;
    while let Some(flag) = args.next() {
        let mut value = || -> usize {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| usage(&flag))
        };
        match flag.as_str() {
            "--jobs" => jobs = value(),
            "--keys" => keys = value() as u8,
            "--procs" => procs = value() as u8,
            "--threads" => threads = value(),
            "--max-states" => max_states = value(),
            "--shortest" => shortest = true,
            _ => rest.push(flag),
        }
    }
    if (jobs, keys, procs) != (cfg.jobs.len(), cfg.keys, cfg.procs) {
        cfg = model::Config::sized(jobs, keys, procs);
    }
    let mut it = rest.into_iter();
    while let Some(flag) = it.next() {
        let mut value = || -> u8 {
            it.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| usage(&flag))
        };
        let b = &mut cfg.budget;
        match flag.as_str() {
            "--quiet" => cfg = cfg.quiet(),
            "--no-liveness" => cfg.liveness = false,
            "--faults" => b.faults = value(),
            "--operator" => b.operator = value(),
            "--slots" => cfg.slots = value(),
            "--ahead" => cfg.ahead = value(),
            "--shutdowns" => b.shutdowns = value(),
            "--lost-replies" => b.lost_replies = value(),
            "--attempts" => cfg.max_attempts = value(),
            "--lease" => cfg.lease = value() as i8,
            "--crashes" => b.crashes = value(),
            "--pauses" => b.pauses = value(),
            "--failures" => b.failures = value(),
            "--cancels" => b.cancels = value(),
            "--holds" => b.holds = value(),
            "--retries" => b.retries = value(),
            "--prunes" => b.prunes = value(),
            "--store" => {
                cfg.store = match it.next().as_deref() {
                    Some("dedup") => EffectStore::Dedup,
                    Some("fenced") => EffectStore::Fenced,
                    _ => usage(&flag),
                }
            }
            "--defect" => {
                let d = &mut cfg.defects;
                match it.next().as_deref() {
                    Some("renewal-waits") => d.renewal_waits_on_locks = true,
                    Some("registry-from-start") => d.renewal_from_handler_start = true,
                    Some("cancel-promotes") => d.cancel_promotes_running_head = true,
                    Some("prune-dead") => d.prune_deletes_dead = true,
                    Some("prune-key-rows") => d.prune_restarts_key_seq = true,
                    Some("no-deadline") => d.no_local_deadline = true,
                    Some("promote-now") => d.promote_lease_from_transaction_start = true,
                    Some("old-lock-order") => d.job_row_before_key_row = true,
                    Some("ahead-not-renewed") => d.ahead_not_renewed = true,
                    Some("give-back-keeps") => d.give_back_error_keeps_jobs = true,
                    Some("reap-never-requeues") => d.reap_never_requeues = true,
                    _ => usage(&flag),
                }
            }
            _ => usage(&flag),
        }
    }
    if let Err(e) = cfg.validate() {
        eprintln!("model_check: {e}");
        std::process::exit(2);
    }
    println!("checking {cfg:?}");
    let out = if shortest {
        model::counterexample(cfg, threads)
    } else {
        model::explore_up_to(cfg, threads, max_states, true)
    };
    println!(
        "explored {} states ({} unique), depth {}, in {:.1?} ({:.0} states/s)",
        out.states,
        out.unique,
        out.depth,
        out.elapsed,
        out.states as f64 / out.elapsed.as_secs_f64()
    );
    if let Some(l) = &out.liveness {
        println!("fair liveness: {}", l.summary());
    }
    for f in &out.failures {
        println!("FAILED: {} ({} steps)\n{}", f.property, f.steps, f.trace);
    }
    if !out.failures.is_empty() {
        std::process::exit(1);
    }
}

fn usage<T>(flag: &str) -> T {
    eprintln!(
        "model_check: bad or unknown flag {flag:?}; see the doc comment of examples/model_check.rs"
    );
    std::process::exit(2)
}
