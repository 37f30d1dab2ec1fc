//! The CI profile of the fault-injection harness (issue 5; second edition, issue 11):
//! first the checker's self-test (every rule fires on a synthetic run that breaks it,
//! and only then), then `examples/chaos` in its `short` profile with two fixed seeds,
//! one after the other, each requiring zero violations and every fault kind and
//! scenario hit. The harness starts its own PostgreSQL cluster (the server binaries from
//! `$PG_BIN`, `pg_config --bindir`, the newest `/usr/lib/postgresql/*/bin` or PATH; run
//! as the `postgres` user under root, else as the current user), so this test needs no
//! server of its own and never touches the one on 5432.
//!
//! The seeds are fixed for CI (`CHAOS_SEED` overrides the first, `CHAOS_SEED_2` the
//! second); the schedule is the same on every run, the OS interleavings are not. On
//! failure, the artifacts are in `target/chaos/<seed>/` and
//! `cargo run --example chaos -- check target/chaos/<seed>` re-runs the checker on them
//! (`CHAOS_WITNESSES=50` prints more witnesses per invariant).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const SEED_1: &str = "20240605";
const SEED_2: &str = "20240606";
/// The harness's own watchdog stops it at 285 s; this is the backstop.
const LIMIT: Duration = Duration::from_secs(320);

/// Two chaos runs at once would share two cores and starve each other's lease renewals:
/// the tests of this file run one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

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

/// Run `chaos <args>` to its end (or kill it at `limit`); true if it exited 0.
fn run(args: &[&str], limit: Duration) -> bool {
    let started = Instant::now();
    let mut child = Command::new(chaos_binary())
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("CHAOS_QUIET", "1")
        .stdin(Stdio::null())
        .spawn()
        .expect("start the chaos harness");
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the harness") {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chaos {args:?} overran {limit:?} (its watchdog should have stopped it)");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!(
        "chaos_short: chaos {args:?} took {:.0}s ({status})",
        started.elapsed().as_secs_f64()
    );
    status.success()
}

fn short(seed_env: &str, default: &str) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    assert!(
        run(&["selftest"], Duration::from_secs(60)),
        "the checker's self-test failed: a rule does not fire on a run that breaks it (or fires on one that keeps it)"
    );
    let seed = std::env::var(seed_env).unwrap_or_else(|_| default.into());
    assert!(
        run(&["short", "--seed", &seed], LIMIT),
        "chaos short --seed {seed} failed; see its report above and target/chaos/{seed}/"
    );
}

#[test]
fn chaos_short_profile_passes_with_zero_violations() {
    short("CHAOS_SEED", SEED_1);
}

#[test]
fn chaos_short_profile_passes_with_a_second_seed() {
    short("CHAOS_SEED_2", SEED_2);
}
