//! A real actix-web service (examples/actix_web_service.rs) with actix-web's default
//! signal handling, in a child process: SIGTERM stops the HTTP server, then the
//! scheduler; the process exits 0 (not an abort), and the job that was running is
//! released at once, not left for its lease to expire.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::base_options;
use sqlx::{ConnectOptions, Connection};

/// The example binary, built next to this test by `cargo test`.
fn example_binary() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let bin = dir.join("examples").join("actix_web_service");
    assert!(
        bin.exists(),
        "{} is missing: build the examples (cargo test does)",
        bin.display()
    );
    bin
}

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
    let mut child = Command::new(example_binary())
        .env("PORT", "0")
        .env("SHOP", &shop)
        .env("FULFIL_MS", "60000")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the example");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut lines = Vec::new();
    let addr = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the service to listen");
        lines.push(line.clone());
        if let Some(a) = line.strip_prefix("listening on http://") {
            break a.to_string();
        }
    };
    let reply = post_order(&addr);
    assert!(reply.starts_with("HTTP/1.1 2"), "{reply}");

    let mut db = base_options()
        .database("leasehold_demo")
        .connect()
        .await
        .unwrap();
    let jobs = format!("\"{shop}_jobs\".jobs");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let running: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {jobs} WHERE state = 'running'"
        ))
        .fetch_one(&mut db)
        .await
        .unwrap();
        if running == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the job did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(40);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the service did not exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    while let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) {
        lines.push(line);
    }
    assert!(
        status.success(),
        "exit {status:?} (134 would be an abort): {lines:#?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("scheduler stopped") && l.contains("1 released")),
        "{lines:#?}"
    );
    let (state, attempts): (String, i32) =
        sqlx::query_as(&format!("SELECT state, attempts FROM {jobs}"))
            .fetch_one(&mut db)
            .await
            .unwrap();
    assert_eq!(
        (state.as_str(), attempts),
        ("pending", 0),
        "released, its attempt not counted"
    );
    for schema in [shop.clone(), format!("{shop}_jobs")] {
        let _ = sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
            .execute(&mut db)
            .await;
    }
    db.close().await.unwrap();
}
