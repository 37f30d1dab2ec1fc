//! The run's database: the `chaos` database and the worker role, the audit tables that
//! keep what retention deletes, and the clock measurement.
//!
//! # No hidden server settings
//! The worker role is a plain login role. The first edition gave it
//! `statement_timeout` and `idle_in_transaction_session_timeout`; the library neither
//! sets nor documents those, so they hid exactly the failures a host would see (a
//! renewal hung on a lock, a session stalled in a transaction). Whatever timeouts the
//! library needs, it must set on its own sessions.
//!
//! # Audit of retention
//! The retention loop prunes every second with zero retention (above its floor), so the rows the checker
//! needs (jobs, their events and expiries, key rows) would be gone by the end. Statement
//! triggers on the library's tables copy every deleted row, with the time it was
//! deleted, into `chaos_audit.*`. They observe; they change nothing the library sees.
//! The checker reads live and deleted rows together, and judges what retention deleted
//! (a dead job is the dead-letter queue: deleting one is a violation).
//!
//! # Audit of leases
//! The database keeps only a running job's latest `lease_until`. A row trigger records
//! every value a running job's lease takes (claim, renewal), with the time it was
//! written, in `chaos_audit.leases`, so the checker knows which lease was in force when
//! a handler started (a successor waiting in-process unrenewed has a lease that ran
//! out, reaped or not).

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::model::{now_us, ClockInfo, DB_CLOCK_BOUND_US};

fn options(port: u16, app: &str) -> PgConnectOptions {
    PgConnectOptions::new()
        .host("127.0.0.1")
        .port(port)
        .username("postgres")
        .ssl_mode(PgSslMode::Disable)
        .application_name(app)
}

/// Create the database and the worker role; return the harness's admin pool.
pub async fn setup(port: u16) -> Result<PgPool, String> {
    let boot = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options(port, "chaos-harness").database("postgres"))
        .await
        .map_err(|e| format!("connect to the cluster: {e}"))?;
    for sql in [
        "CREATE DATABASE chaos",
        // Superuser only so the nemesis's pg_terminate_backend and the audit need no
        // grants; no session settings of any kind.
        "CREATE ROLE chaos_worker LOGIN SUPERUSER",
    ] {
        sqlx::query(sql)
            .execute(&boot)
            .await
            .map_err(|e| format!("{sql}: {e}"))?;
    }
    boot.close().await;
    PgPoolOptions::new()
        .max_connections(10)
        .acquire_timeout(Duration::from_secs(4))
        .connect_with(options(port, "chaos-harness").database("chaos"))
        .await
        .map_err(|e| format!("connect to chaos: {e}"))
}

/// A pool for the simulated host: its long transactions (enqueue for a hot key held
/// open) and the session that locks running rows. Direct to the database, not through
/// a worker's proxy: the host is another service, not a worker.
pub async fn host_pool(port: u16) -> Result<PgPool, String> {
    PgPoolOptions::new()
        .max_connections(6)
        .acquire_timeout(Duration::from_secs(4))
        .connect_with(options(port, "chaos-host").database("chaos"))
        .await
        .map_err(|e| format!("connect the host pool: {e}"))
}

/// The audited tables and the name of the copy of each.
pub const AUDITED: [&str; 4] = ["jobs", "job_events", "lease_expiries", "job_keys"];

/// After the library's migrations: one copy table per audited table (its columns, then
/// `deleted_at`) and an AFTER DELETE statement trigger that fills it.
pub async fn install_audit(admin: &PgPool) -> Result<(), String> {
    let mut stmts = vec!["CREATE SCHEMA chaos_audit".to_string()];
    for t in AUDITED {
        stmts.push(format!(
            "CREATE TABLE chaos_audit.{t} (LIKE leasehold.{t}, deleted_at timestamptz NOT NULL)"
        ));
        stmts.push(format!(
            "CREATE FUNCTION chaos_audit.keep_{t}() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN INSERT INTO chaos_audit.{t} SELECT g.*, clock_timestamp() FROM gone g; \
             RETURN NULL; END $$"
        ));
        stmts.push(format!(
            "CREATE TRIGGER chaos_keep_deleted AFTER DELETE ON leasehold.{t} \
             REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION chaos_audit.keep_{t}()"
        ));
    }
    stmts.push(
        "CREATE TABLE chaos_audit.leases (job_id bigint NOT NULL, generation bigint NOT NULL, \
         lease_until timestamptz NOT NULL, written_at timestamptz NOT NULL)"
            .into(),
    );
    stmts.push(
        "CREATE FUNCTION chaos_audit.keep_lease() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN INSERT INTO chaos_audit.leases VALUES (NEW.id, NEW.generation, NEW.lease_until, clock_timestamp()); \
         RETURN NULL; END $$"
            .into(),
    );
    stmts.push(
        "CREATE TRIGGER chaos_keep_lease AFTER UPDATE ON leasehold.jobs FOR EACH ROW \
         WHEN (NEW.state = 'running' AND NEW.lease_until IS DISTINCT FROM OLD.lease_until) \
         EXECUTE FUNCTION chaos_audit.keep_lease()"
            .into(),
    );
    for sql in stmts {
        sqlx::query(&sql)
            .execute(admin)
            .await
            .map_err(|e| format!("{sql}: {e}"))?;
    }
    Ok(())
}

/// Samples with a longer round trip are not used to estimate the offset.
const GOOD_RTT_US: i64 = 2_000;

/// One sample of the database's clock against ours: (offset µs, round trip µs).
async fn sample(admin: &PgPool) -> Option<(i64, i64)> {
    let before = now_us();
    let db: i64 =
        sqlx::query_scalar("SELECT (extract(epoch from clock_timestamp()) * 1000000)::bigint")
            .fetch_one(admin)
            .await
            .ok()?;
    let after = now_us();
    Some((db - (before + after) / 2, after - before))
}

/// Sample the clocks every second until `stop`; folds into `info`.
pub async fn watch_clock(
    admin: PgPool,
    info: std::sync::Arc<std::sync::Mutex<ClockInfo>>,
    stop: CancellationToken,
) {
    loop {
        if let Some((offset, rtt)) = sample(&admin).await {
            let mut c = info.lock().unwrap();
            c.samples += 1;
            c.bound_us = DB_CLOCK_BOUND_US;
            // A slow round trip says nothing about the offset (the server may have read
            // its clock anywhere in it): only quick samples count, as in NTP.
            if rtt <= GOOD_RTT_US {
                c.good_samples += 1;
                c.max_offset_us = c.max_offset_us.max(offset.abs());
                c.max_rtt_us = c.max_rtt_us.max(rtt);
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}
