//! An example service (`examples/*.rs`) run as a child process, the way a user runs it:
//! its stdout read line by line, SIGTERM sent like a process manager does, its exit
//! status awaited; and the job table it writes, read from outside.
//! Included with `#[path = "common/example_process.rs"]` by the tests that need it.
#![allow(dead_code, reason = "each test uses the part its example needs")]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use sqlx::PgConnection;

/// An example's binary, built next to the test by `cargo test`.
pub fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let bin = dir.join("examples").join(name);
    assert!(
        bin.exists(),
        "{} is missing: build the examples (cargo test does)",
        bin.display()
    );
    bin
}

/// A running example, with every stdout line it printed so far.
pub struct ExampleProcess {
    child: Child,
    incoming: Receiver<String>,
    /// The lines read so far, for assertions and failure messages.
    pub lines: Vec<String>,
}

impl ExampleProcess {
    /// Start `cmd` with its stdout piped to us (stderr stays the test's).
    pub fn spawn(mut cmd: Command) -> ExampleProcess {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the example");
        let stdout = child.stdout.take().unwrap();
        let (tx, incoming) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        ExampleProcess {
            child,
            incoming,
            lines: Vec::new(),
        }
    }

    /// Wait for a line starting with `prefix`; returns the rest of it.
    pub fn wait_for_line(&mut self, prefix: &str, within: Duration) -> String {
        loop {
            let line = self
                .incoming
                .recv_timeout(within)
                .unwrap_or_else(|_| panic!("no line starting {prefix:?}: {:#?}", self.lines));
            self.lines.push(line.clone());
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.to_string();
            }
        }
    }

    /// Send SIGTERM, as a process manager stopping the service does.
    pub fn sigterm(&self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
    }

    /// Wait for the process to exit, then collect what it printed last.
    pub async fn exit_status(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "the example did not exit within {within:?}: {:#?}",
                self.lines
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        while let Ok(line) = self.incoming.recv_timeout(Duration::from_millis(200)) {
            self.lines.push(line);
        }
        status
    }
}

/// A test that fails midway does not leave its service running.
impl Drop for ExampleProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Wait until `jobs` (a schema-qualified job table) has exactly one running job, and
/// return its id. The table may not exist yet while the example starts: that counts as
/// none running.
pub async fn wait_for_one_running(db: &mut PgConnection, jobs: &str, within: Duration) -> i64 {
    let deadline = Instant::now() + within;
    loop {
        let running: Vec<i64> =
            sqlx::query_scalar(&format!("SELECT id FROM {jobs} WHERE state = 'running'"))
                .fetch_all(&mut *db)
                .await
                .unwrap_or_default();
        if let [id] = running[..] {
            return id;
        }
        assert!(Instant::now() < deadline, "no job of {jobs} started");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Wait for one job of `jobs` to run, stop the service with SIGTERM, and require a
/// clean exit; returns the id of the job that was running.
pub async fn sigterm_while_a_job_runs(
    service: &mut ExampleProcess,
    db: &mut PgConnection,
    jobs: &str,
) -> i64 {
    let running = wait_for_one_running(db, jobs, Duration::from_secs(60)).await;
    service.sigterm();
    let status = service.exit_status(Duration::from_secs(40)).await;
    assert_clean_exit(status, &service.lines);
    running
}

/// The example exited 0: a clean stop, not an abort (134) or a kill.
pub fn assert_clean_exit(status: ExitStatus, lines: &[String]) {
    assert!(
        status.success(),
        "exit {status:?} (134 would be an abort): {lines:#?}"
    );
}

/// Job `id` of `jobs` is pending again with its attempt not counted: released by the
/// stop, not left for its lease to expire.
pub async fn assert_released(db: &mut PgConnection, jobs: &str, id: i64) {
    let (state, attempts): (String, i32) =
        sqlx::query_as(&format!("SELECT state, attempts FROM {jobs} WHERE id = $1"))
            .bind(id)
            .fetch_one(db)
            .await
            .unwrap();
    assert_eq!(
        (state.as_str(), attempts),
        ("pending", 0),
        "released, its attempt not counted"
    );
}
