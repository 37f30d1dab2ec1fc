//! The benchmark, from the root of the repository:
//!
//!     cargo run --release --example bench -- --only ceiling,peer --runs 3
//!
//! The benchmark itself is the `leasehold-bench` crate (`bench/`), because it measures
//! graphile_worker beside leasehold and that peer's dependencies (its own sqlx, a newer
//! rustc) must not reach the library's build, tests or users. This example only runs it:
//! `cargo run --release -p leasehold-bench -- <the same arguments>`, with this cargo and
//! this workspace, and exits as it does. Its flags and output are in `bench/src/main.rs`
//! and the README's Performance section.

use std::path::Path;
use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    // `cargo run` tells the program which cargo ran it; outside cargo, the one on PATH.
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let status = Command::new(cargo)
        .args([
            "run",
            "--release",
            "-p",
            "leasehold-bench",
            "--manifest-path",
        ])
        .arg(&manifest)
        .arg("--")
        .args(std::env::args_os().skip(1))
        .status();
    match status {
        Ok(s) if s.success() => ExitCode::SUCCESS,
        Ok(s) => {
            eprintln!("bench: leasehold-bench ended with {s}");
            ExitCode::from(s.code().map_or(1, |c| c.clamp(1, 255) as u8))
        }
        Err(e) => {
            eprintln!("bench: cannot run cargo to build and start leasehold-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
