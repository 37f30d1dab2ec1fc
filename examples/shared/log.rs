//! Logging set-up the examples share (each includes this file with `#[path]`).

use std::io::{IsTerminal, Write};

use tracing_subscriber::EnvFilter;

/// Install a `fmt` subscriber with `filter`, writing to `stream` (`std::io::stdout` or
/// `std::io::stderr`), in colour only when that stream is a terminal: a log piped to a
/// file or another program stays plain text, without ANSI escapes.
pub fn init<S>(filter: impl Into<EnvFilter>, stream: fn() -> S)
where
    S: Write + IsTerminal + 'static,
{
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(stream().is_terminal())
        .with_writer(stream)
        .init();
}
