//! The empty string is not a key: every front end refuses it with the same words,
//! `invalid key: must not be empty` — the Rust enqueue calls (a job without a key has
//! `None`), the store's listing filters, and the operator CLI's `--key`. Nothing is
//! written, and nothing is silently taken as "no key" or "no filter".

mod common;

use std::process::{Command, Output, Stdio};

use common::*;
use leasehold::store::JobFilter;
use leasehold::{Error, JobState};
use sqlx::Connection;

const MESSAGE: &str = "invalid key: must not be empty";

/// Run the CLI binary on the test's schema (as tests/cli_operator.rs does).
async fn cli(db: &TestDb, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_leasehold"));
    cmd.args(["--schema", &db.schema])
        .args(args)
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .env("PGDATABASE", test_db_name());
    for (var, default) in [
        ("PGHOST", "127.0.0.1"),
        ("PGPORT", "5432"),
        ("PGUSER", "root"),
    ] {
        cmd.env(var, std::env::var(var).unwrap_or_else(|_| default.into()));
    }
    tokio::task::spawn_blocking(move || cmd.output().expect("run the leasehold binary"))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_empty_key_is_refused_with_the_same_message_everywhere() {
    bounded(async {
        let db = TestDb::new("empty_key").await;
        // Rust: every enqueue path.
        let mut errors = vec![
            db.store.enqueue(keyed("k", "", 1)).await.unwrap_err(),
            db.store
                .enqueue_many(vec![job("k"), keyed("k", "", 2)])
                .await
                .unwrap_err(),
        ];
        let mut conn = db.pool.acquire().await.unwrap();
        let mut tx = conn.begin().await.unwrap();
        errors.push(
            db.store
                .enqueue_in(&mut tx, keyed("k", "", 3))
                .await
                .unwrap_err(),
        );
        tx.rollback().await.unwrap();
        drop(conn);
        // The store's filters (what the CLI and the dashboard list and act through).
        let filter = JobFilter {
            key: Some(String::new()),
            ..JobFilter::default()
        };
        errors.push(db.store.list_jobs(&filter).await.unwrap_err());
        errors.push(
            db.store
                .job_ids(&filter, &[JobState::Dead], 10)
                .await
                .unwrap_err(),
        );
        for e in &errors {
            assert!(
                matches!(e, Error::InvalidInput { field: "key", .. }),
                "{e:?}"
            );
            assert_eq!(e.to_string(), MESSAGE);
        }
        assert_eq!(db.job_count().await, 0);

        // The CLI: refused (exit 1) with the same message, for a listing and an action.
        db.store.enqueue(keyed("k", "acct", 1)).await.unwrap();
        for args in [
            &["jobs", "--key", ""][..],
            &["cancel", "--key", "", "--yes"][..],
            &["--json", "jobs", "--key", ""][..],
        ] {
            let out = cli(&db, args).await;
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
            assert_eq!(stderr.trim(), format!("leasehold: {MESSAGE}"), "{args:?}");
        }
        assert_eq!(db.count_where("jobs", "state = 'pending'").await, 1);
        db.drop().await;
    })
    .await
}
