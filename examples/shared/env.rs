//! Knobs the examples read from the environment (each includes this file with `#[path]`).

use std::time::Duration;

/// `var` as milliseconds, or `default_ms` when it is unset or not a number.
pub fn millis(var: &str, default_ms: u64) -> Duration {
    let ms = std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_ms);
    Duration::from_millis(ms)
}
