//! A real actix-web service (examples/actix_web_service.rs) with actix-web's default
//! signal handling, in a child process: SIGTERM stops the HTTP server, then the
//! scheduler; the process exits 0 (not an abort), and the job that was running is
//! released at once, not left for its lease to expire.

mod common;
#[path = "common/example_process.rs"]
mod example_process;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use common::base_options;
use example_process::{assert_released, example_binary, sigterm_while_a_job_runs, ExampleProcess};
use sqlx::{ConnectOptions, Connection};

fn post_order(addr: &str) -> String {
    let body = r#"{"customer": "sig", "item": "book", "qty": 1}"#;
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /orders HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_an_actix_web_service_cleanly_and_releases_its_running_job() {
    let shop = format!("sig_{:08x}", rand::random::<u32>());
    let mut cmd = Command::new(example_binary("actix_web_service"));
    cmd.env("PORT", "0")
        .env("SHOP", &shop)
        .env("FULFIL_MS", "60000");
    let mut service = ExampleProcess::spawn(cmd);
    let addr = service.wait_for_line("listening on http://", Duration::from_secs(60));
    let reply = post_order(&addr);
    assert!(reply.starts_with("HTTP/1.1 2"), "{reply}");

    let mut db = base_options()
        .database("leasehold_demo")
        .connect()
        .await
        .unwrap();
    let jobs = format!("\"{shop}_jobs\".jobs");
    let running = sigterm_while_a_job_runs(&mut service, &mut db, &jobs).await;
    let lines = &service.lines;
    assert!(
        lines
            .iter()
            .any(|l| l.contains("scheduler stopped") && l.contains("1 released")),
        "{lines:#?}"
    );
    assert_released(&mut db, &jobs, running).await;
    for schema in [shop.clone(), format!("{shop}_jobs")] {
        let _ = sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
            .execute(&mut db)
            .await;
    }
    db.close().await.unwrap();
}
