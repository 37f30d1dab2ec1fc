//! The CI profile of the fault-injection harness (issue 5): runs
//! `examples/chaos` in its `short` profile and requires zero violations and every fault
//! kind hit. The harness starts its own PostgreSQL cluster (PostgreSQL 15 binaries in
//! /usr/lib/postgresql/15/bin, run as the `postgres` user), so this test needs no
//! server of its own and never touches the one on 5432.
//!
//! The seed is fixed for CI (`CHAOS_SEED` overrides it); the schedule is the same on
//! every run, the OS interleavings are not. On failure, the artifacts are in
//! `target/chaos/<seed>/` and `cargo run --example chaos -- check target/chaos/<seed>`
//! re-runs the checker on them.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const DEFAULT_SEED: &str = "20240605";
/// The harness's own watchdog stops it at 285 s; this is the backstop.
const LIMIT: Duration = Duration::from_secs(320);

fn chaos_binary() -> PathBuf {
    // Bring the example up to date (a no-op under `cargo test --all-targets`, which
    // built it already).
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--example", "chaos"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        eprintln!("chaos_short: `cargo build --example chaos` did not succeed ({status:?}); using the binary as built");
    }
    // target/debug/deps/chaos_short-<hash> → target/debug/examples/chaos
    let exe = std::env::current_exe().expect("current exe");
    let debug = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let bin = debug.join("examples").join("chaos");
    assert!(
        bin.exists(),
        "{} missing: build it with `cargo build --example chaos`",
        bin.display()
    );
    bin
}

#[test]
fn chaos_short_profile_passes_with_zero_violations() {
    let bin = chaos_binary();
    let seed = std::env::var("CHAOS_SEED").unwrap_or_else(|_| DEFAULT_SEED.into());
    let started = Instant::now();
    let mut child = Command::new(&bin)
        .args(["short", "--seed", &seed])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("CHAOS_QUIET", "1")
        .stdin(Stdio::null())
        .spawn()
        .expect("start the chaos harness");
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the harness") {
            break status;
        }
        if started.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the chaos harness overran {LIMIT:?} (its watchdog should have stopped it)");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!(
        "chaos_short: seed {seed} took {:.0}s",
        started.elapsed().as_secs_f64()
    );
    assert!(
        status.success(),
        "chaos short --seed {seed} failed ({status}); see its report above and target/chaos/{seed}/"
    );
}
