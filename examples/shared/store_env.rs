//! The store settings the examples take from the environment (each includes this file
//! with `#[path]`), under the names the README documents:
//!
//! - `DATABASE_URL`; without it `PGHOST`, `PGPORT` and `PGUSER` (127.0.0.1, 5432 and
//!   `root` by default), database `postgres`;
//! - behind a transaction-mode pooler (PgBouncer `pool_mode = transaction`),
//!   `LEASEHOLD_STORE__TRANSACTION_POOLER=true`, and `LEASEHOLD_LISTEN_URL`: a URL
//!   straight to PostgreSQL for LISTEN (without it new jobs are found by polling).
//!
//! A scheduler started behind such a pooler without the switch refuses to start, with an
//! error that names `store.transaction_pooler` and `listen_url`.
#![allow(dead_code, reason = "each example uses the part it needs")]

use sqlx::postgres::PgConnectOptions;

/// Where to connect: `DATABASE_URL`, else the `PG*` variables.
pub fn connect_options() -> Result<PgConnectOptions, sqlx::Error> {
    if let Ok(url) = std::env::var("DATABASE_URL") {
        return url.parse();
    }
    let host = std::env::var("PGHOST").unwrap_or_else(|_| "127.0.0.1".into());
    let port = std::env::var("PGPORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(5432);
    let user = std::env::var("PGUSER").unwrap_or_else(|_| "root".into());
    Ok(PgConnectOptions::new()
        .host(&host)
        .port(port)
        .username(&user)
        .database("postgres"))
}

/// Set `store.transaction_pooler` and `listen_url` from their variables, where set.
///
/// These two are read by name, as `Config::set_from_env("LEASEHOLD")` would read
/// them, rather than through it: that refuses every unknown variable under its prefix
/// (right for a deployment), and the tests that run the examples have `LEASEHOLD_TEST_*`
/// variables of their own in the environment the examples inherit.
pub fn store_settings(config: &mut leasehold::Config) -> leasehold::Result<()> {
    for (var, field) in [
        (
            "LEASEHOLD_STORE__TRANSACTION_POOLER",
            "store.transaction_pooler",
        ),
        ("LEASEHOLD_LISTEN_URL", "listen_url"),
    ] {
        if let Ok(value) = std::env::var(var) {
            config.set(field, &value)?;
        }
    }
    Ok(())
}
