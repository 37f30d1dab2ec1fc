//! A throwaway primary and streaming standby (never the shared server on 5432), and a
//! loopback TCP proxy that can be pointed at another server.
//!
//! The server binaries and the user they run as (`postgres` under root: initdb refuses
//! root) come from the chaos harness's `PgServer`. The postmasters run as our children,
//! started directly (no `pg_ctl` wrapper), so `kill` is a real SIGKILL of the postmaster:
//! a crash, not a shutdown. Everything is removed on drop.
//!
//! Include it with `#[path = "common/replica.rs"] mod replica;` next to
//! `#[path = "../examples/chaos/pgbin.rs"] mod pgbin;`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::pgbin::PgServer;

/// One PostgreSQL server of the pair.
pub struct Server {
    pub port: u16,
    pub data: PathBuf,
    sock: PathBuf,
    pg: PgServer,
    child: Option<Child>,
    log: PathBuf,
}

fn run(cmd: &mut Command, what: &str) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().unwrap().port()
}

fn owned_dir(path: &Path, pg: &PgServer) {
    std::fs::create_dir_all(path).unwrap();
    if let Some((uid, gid)) = pg.owner() {
        std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap();
    }
}

impl Server {
    fn new(root: &Path, name: &str, pg: &PgServer) -> Server {
        let dir = root.join(name);
        owned_dir(&dir, pg);
        let sock = dir.join("sock");
        owned_dir(&sock, pg);
        Server {
            port: free_port(),
            data: dir.join("data"),
            sock,
            pg: pg.clone(),
            child: None,
            log: dir.join("postgres.log"),
        }
    }

    /// The settings of this server's own: its port and socket directory.
    fn append_conf(&self, extra: &str) {
        use std::io::Write;
        let conf = format!(
            "\nlisten_addresses = '127.0.0.1'\nport = {}\nunix_socket_directories = '{}'\n{extra}\n",
            self.port,
            self.sock.display()
        );
        std::fs::OpenOptions::new()
            .append(true)
            .open(self.data.join("postgresql.conf"))
            .and_then(|mut f| f.write_all(conf.as_bytes()))
            .unwrap();
    }

    pub fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = self
            .pg
            .command("postgres")
            .arg("-D")
            .arg(&self.data)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start postgres");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "postgres did not listen: {}",
                self.log()
            );
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!("postgres exited at start ({status}): {}", self.log());
            }
            std::thread::sleep(Duration::from_millis(30));
        }
    }

    /// SIGKILL the postmaster: a crash. Its backends notice and exit by themselves.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // The orphaned backends exit when they find the postmaster gone; the port must
        // not answer from here on.
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
            assert!(Instant::now() < deadline, "the killed server still listens");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `pg_ctl stop -m fast`, keeping the data directory.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = self
                .pg
                .command("pg_ctl")
                .arg("-D")
                .arg(&self.data)
                .args(["stop", "-m", "fast", "-w", "-t", "30"])
                .output();
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Connect options as the cluster's superuser, database `postgres`.
    pub fn options(&self) -> PgConnectOptions {
        options_at(self.port)
    }

    /// One statement's single value, on a connection of its own.
    pub async fn scalar<T>(&self, sql: &str) -> T
    where
        T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + Unpin,
    {
        let mut conn = sqlx::PgConnection::connect_with(&self.options())
            .await
            .expect("connect directly");
        let v = sqlx::query_scalar(sql).fetch_one(&mut conn).await.unwrap();
        let _ = conn.close().await;
        v
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A primary and a standby streaming from it.
pub struct Pair {
    root: PathBuf,
    pub primary: Server,
    pub standby: Server,
}

impl Pair {
    /// initdb the primary, start it, take a base backup for the standby (`-R`: it
    /// follows the primary) and start that. `synchronous`: a commit waits for the
    /// standby to flush it (`synchronous_standby_names = '*'`, `synchronous_commit = on`).
    pub fn start(tag: &str, synchronous: bool) -> Pair {
        let pg = PgServer::find().expect("PostgreSQL server binaries");
        let root = std::env::temp_dir().join(format!("leasehold-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        owned_dir(&root, &pg);
        let mut primary = Server::new(&root, "primary", &pg);
        run(
            pg.command("initdb")
                .arg("-D")
                .arg(&primary.data)
                .args([
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--no-locale",
                    "-E",
                    "UTF8",
                    "--no-sync",
                ])
                .current_dir(&root),
            "initdb",
        );
        let names = if synchronous { "'*'" } else { "''" };
        primary.append_conf(&format!(
            "wal_level = replica\nmax_wal_senders = 4\nhot_standby = on\n\
             synchronous_commit = on\nsynchronous_standby_names = {names}\n\
             fsync = off\nfull_page_writes = off\nmax_connections = 100\n\
             shared_buffers = 32MB\nlog_min_messages = warning\nwal_sender_timeout = 5s"
        ));
        primary.start();
        let mut standby = Server::new(&root, "standby", &pg);
        // The primary listens before it accepts connections ("the database system is
        // starting up"): the backup is retried until it does.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let _ = std::fs::remove_dir_all(&standby.data);
            let out = pg
                .command("pg_basebackup")
                .args(["-h", "127.0.0.1", "-U", "postgres", "-X", "stream", "-R"])
                .args(["--no-sync", "-p"])
                .arg(primary.port.to_string())
                .arg("-D")
                .arg(&standby.data)
                .output()
                .expect("run pg_basebackup");
            if out.status.success() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "pg_basebackup failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        // Promoted, it has no standby of its own: commits must not wait for one (the base
        // backup copied the primary's `synchronous_standby_names`).
        standby.append_conf(
            "wal_receiver_status_interval = 1s\nwal_retrieve_retry_interval = 200ms\n\
             synchronous_standby_names = ''",
        );
        standby.start();
        Pair {
            root,
            primary,
            standby,
        }
    }

    /// Wait until the primary sees its standby streaming (and, when `sync`, as its
    /// synchronous standby).
    pub async fn wait_streaming(&self, sync: bool) {
        let want = if sync { "sync" } else { "async" };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let states: Vec<String> = {
                let mut conn = sqlx::PgConnection::connect_with(&self.primary.options())
                    .await
                    .unwrap();
                sqlx::query_scalar("SELECT state || '/' || sync_state FROM pg_stat_replication")
                    .fetch_all(&mut conn)
                    .await
                    .unwrap()
            };
            if states.iter().any(|s| s == &format!("streaming/{want}")) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the standby is not streaming ({states:?}): {}",
                self.standby.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Wait until the standby has replayed everything the primary has written so far.
    pub async fn wait_caught_up(&self) {
        let lsn: String = self
            .primary
            .scalar("SELECT pg_current_wal_lsn()::text")
            .await;
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self
            .standby
            .scalar::<bool>(&format!(
                "SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn"
            ))
            .await
        {
            assert!(
                Instant::now() < deadline,
                "the standby did not catch up to {lsn}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Promote the standby and wait until it takes writes. A standby just (re)started
    /// is not in standby mode until it has replayed to a consistent point: `pg_ctl
    /// promote` refuses it until then, so it is asked again.
    pub async fn promote(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let out = self
                .standby
                .pg
                .command("pg_ctl")
                .arg("-D")
                .arg(&self.standby.data)
                .args(["promote", "-w", "-t", "60"])
                .output()
                .expect("run pg_ctl promote");
            if out.status.success() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "pg_ctl promote failed: {}{}",
                String::from_utf8_lossy(&out.stderr),
                self.standby.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        while self
            .standby
            .scalar::<bool>("SELECT pg_is_in_recovery()")
            .await
        {
            assert!(
                Instant::now() < deadline,
                "the standby did not leave recovery"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        self.standby.stop();
        self.primary.stop();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// A loopback TCP proxy to whichever server it points at. Repointing closes every
/// connection it holds, as a virtual IP moving to the new primary would.
pub struct Proxy {
    pub port: u16,
    upstream: Arc<AtomicU16>,
    cut: watch::Sender<u64>,
}

impl Proxy {
    pub async fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let upstream = Arc::new(AtomicU16::new(upstream));
        let (cut, cuts) = watch::channel(0u64);
        let to = upstream.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                let port = to.load(SeqCst);
                let mut cuts = cuts.clone();
                cuts.borrow_and_update();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(("127.0.0.1", port)).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cuts.changed() => {}
                    }
                });
            }
        });
        Proxy {
            port,
            upstream,
            cut,
        }
    }

    /// Point new connections at `port` and close every open one.
    pub fn repoint(&self, port: u16) {
        self.upstream.store(port, SeqCst);
        self.cut.send_modify(|n| *n += 1);
    }

    pub fn options(&self) -> PgConnectOptions {
        options_at(self.port)
    }
}

/// The pair's superuser and database at a loopback port.
fn options_at(port: u16) -> PgConnectOptions {
    PgConnectOptions::new()
        .host("127.0.0.1")
        .port(port)
        .username("postgres")
        .database("postgres")
        .log_statements(tracing::log::LevelFilter::Trace)
}
