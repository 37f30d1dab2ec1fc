//! A plain tokio service (examples/tokio_service.rs: `#[tokio::main]`, no actix in the
//! host) in a child process: SIGTERM while a job runs stops the scheduler; the process
//! exits 0, and the running job is released at once (pending again, its attempt not
//! counted), not left for its lease to expire.

mod common;
#[path = "common/example_process.rs"]
mod example_process;

use std::process::Command;

use common::{base_options, ensure_database, test_db_name};
use example_process::{assert_released, example_binary, sigterm_while_a_job_runs, ExampleProcess};
use sqlx::{ConnectOptions, Connection};

/// The test database as a URL, for the example's `DATABASE_URL`.
fn database_url() -> String {
    let o = base_options();
    format!(
        "postgres://{}@{}:{}/{}",
        o.get_username(),
        o.get_host(),
        o.get_port(),
        test_db_name()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_a_tokio_service_cleanly_and_releases_its_running_job() {
    ensure_database().await;
    let schema = format!("tokio_sig_{:08x}", rand::random::<u32>());
    let mut cmd = Command::new(example_binary("tokio_service"));
    cmd.env("DATABASE_URL", database_url())
        .env("SCHEMA", &schema)
        .env("GREET_MS", "60000");
    let mut service = ExampleProcess::spawn(cmd);

    let mut db = base_options()
        .database(&test_db_name())
        .connect()
        .await
        .unwrap();
    let jobs = format!("\"{schema}\".jobs");
    let running = sigterm_while_a_job_runs(&mut service, &mut db, &jobs).await;
    let lines = &service.lines;
    assert!(
        lines
            .iter()
            .any(|l| l == "stopped: 0 completed, 1 released"),
        "{lines:#?}"
    );
    assert_released(&mut db, &jobs, running).await;
    let _ = sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(&mut db)
        .await;
    db.close().await.unwrap();
}
