//! A throwaway PgBouncer in transaction mode (or session mode, `start_session`) in front
//! of the test database: Debian's `pgbouncer` (installed by `.ci/run`), its own ini in a
//! temporary directory, a free loopback port, and few server connections so clients
//! really share them. Stopped when dropped.
//!
//! Include it with `#[path = "common/pgbouncer.rs"] mod pgbouncer;` (the bench crate
//! includes it too). Upstream: `PGHOST`, `PGPORT`, `PGUSER`, else 127.0.0.1:5432 as
//! `root`, trusted.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;

/// Where Debian installs it.
const BINARY: &str = "/usr/sbin/pgbouncer";

/// A running PgBouncer; killed on drop.
pub struct PgBouncer {
    pub port: u16,
    dir: PathBuf,
    child: Child,
}

impl PgBouncer {
    /// Start one with `server_connections` server connections per database and user
    /// (`default_pool_size`), in `pool_mode = transaction`, and wait until it accepts.
    pub fn start(server_connections: u32) -> PgBouncer {
        Self::start_in_mode("transaction", server_connections)
    }

    /// As [`PgBouncer::start`], in `pool_mode = session`: each client connection keeps
    /// its server connection, so `server_connections` bounds the clients served at once.
    pub fn start_session(server_connections: u32) -> PgBouncer {
        Self::start_in_mode("session", server_connections)
    }

    fn start_in_mode(pool_mode: &str, server_connections: u32) -> PgBouncer {
        assert!(
            std::path::Path::new(BINARY).exists(),
            "{BINARY} is missing: `apt-get install pgbouncer` (.ci/run does)"
        );
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("leasehold-pgbouncer-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let user = std::env::var("PGUSER").unwrap_or_else(|_| "root".into());
        let upstream_host = std::env::var("PGHOST").unwrap_or_else(|_| "127.0.0.1".into());
        let upstream_port = std::env::var("PGPORT").unwrap_or_else(|_| "5432".into());
        std::fs::write(dir.join("users.txt"), format!("\"{user}\" \"\"\n")).unwrap();
        // The lines the README's "Running at scale" gives, plus the test's own port,
        // files and upstream.
        let ini = format!(
            "[databases]\n\
             * = host={upstream_host} port={upstream_port}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {dir}/users.txt\n\
             pool_mode = {pool_mode}\n\
             default_pool_size = {server_connections}\n\
             max_client_conn = 500\n\
             ignore_startup_parameters = extra_float_digits\n\
             logfile = {dir}/pgbouncer.log\n\
             pidfile = {dir}/pgbouncer.pid\n",
            dir = dir.display()
        );
        let ini_path = dir.join("pgbouncer.ini");
        std::fs::write(&ini_path, ini).unwrap();
        // PgBouncer refuses to run as root: run it as the postgres user then, as the
        // Debian service does.
        let mut cmd = if is_root() {
            Command::new("chown")
                .args(["-R", "postgres"])
                .arg(&dir)
                .status()
                .expect("chown the pgbouncer directory");
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", BINARY]);
            c
        } else {
            Command::new(BINARY)
        };
        let child = cmd
            .arg(&ini_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start pgbouncer");
        let bouncer = PgBouncer { port, dir, child };
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "pgbouncer did not listen on {port} within 10 s; log: {}",
                bouncer.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        bouncer
    }

    /// Connect options through this pooler, as the upstream user; name a database.
    pub fn options(&self) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username(&std::env::var("PGUSER").unwrap_or_else(|_| "root".into()))
    }

    /// PgBouncer's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        // runuser passes SIGTERM on; the pidfile names pgbouncer itself, in case not.
        let pid = std::fs::read_to_string(self.dir.join("pgbouncer.pid")).unwrap_or_default();
        if let Ok(pid) = pid.trim().parse::<i32>() {
            let _ = Command::new("kill").arg(pid.to_string()).status();
        }
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}
