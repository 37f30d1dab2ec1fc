//! A throwaway PostgreSQL cluster: initdb into a temp dir, a free loopback port, a
//! private socket directory; restarted on demand; stopped (immediate) and removed on
//! drop. Never the shared server on 5432. The server binaries, and the user they run
//! as (`postgres` under root, else ourselves), come from [`PgServer::find`].
//!
//! The postmaster runs in the foreground as our child, with `PR_SET_PDEATHSIG =
//! SIGQUIT`, so it shuts down immediately if the harness dies. Restarts use
//! `pg_ctl stop -m fast|immediate` on it, then start it again.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::pgbin::PgServer;
use crate::procs;

pub struct Cluster {
    pub root: PathBuf,
    pub data: PathBuf,
    pub sock: PathBuf,
    pub port: u16,
    server: PgServer,
    postmaster: Mutex<Option<Child>>,
    keep: bool,
}

fn run(cmd: &mut Command, what: &str) -> Result<String, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("{what}: cannot run: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{what} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().unwrap().port()
}

fn chown(path: &Path, uid: u32, gid: u32) -> Result<(), String> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid))
        .map_err(|e| format!("chown {}: {e}", path.display()))
}

impl Cluster {
    /// initdb and start. `keep`: leave the directory behind (debugging).
    pub fn create(tag: &str, keep: bool) -> Result<Cluster, String> {
        let server = PgServer::find()?;
        let root =
            std::env::temp_dir().join(format!("leasehold-chaos-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).map_err(|e| format!("mkdir {}: {e}", root.display()))?;
        let data = root.join("data");
        let sock = root.join("sock");
        std::fs::create_dir_all(&sock).map_err(|e| format!("mkdir sock: {e}"))?;
        if let Some((uid, gid)) = server.owner() {
            chown(&root, uid, gid)?;
            chown(&sock, uid, gid)?;
        }
        let cluster = Cluster {
            root,
            data,
            sock,
            port: free_port(),
            server,
            postmaster: Mutex::new(None),
            keep,
        };
        run(
            cluster
                .server
                .command("initdb")
                .arg("-D")
                .arg(&cluster.data)
                .args([
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--no-locale",
                    "-E",
                    "UTF8",
                    "--no-sync",
                ])
                .current_dir(&cluster.root),
            "initdb",
        )?;
        let conf = format!(
            "\n# leasehold chaos harness\n\
             listen_addresses = '127.0.0.1'\n\
             port = {port}\n\
             unix_socket_directories = '{sock}'\n\
             fsync = off\n\
             synchronous_commit = on\n\
             full_page_writes = off\n\
             max_connections = 300\n\
             shared_buffers = 64MB\n\
             log_min_messages = warning\n\
             log_line_prefix = '%m [%p] %a '\n\
             tcp_keepalives_idle = 5\n\
             max_wal_size = 1GB\n\
             checkpoint_timeout = 30min\n",
            port = cluster.port,
            sock = cluster.sock.display()
        );
        use std::io::Write;
        std::fs::OpenOptions::new()
            .append(true)
            .open(cluster.data.join("postgresql.conf"))
            .and_then(|mut f| f.write_all(conf.as_bytes()))
            .map_err(|e| format!("write postgresql.conf: {e}"))?;
        cluster.start()?;
        Ok(cluster)
    }

    pub fn log_path(&self) -> PathBuf {
        self.root.join("postgres.log")
    }

    /// Start the postmaster and wait until it accepts connections.
    pub fn start(&self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .map_err(|e| format!("open postgres.log: {e}"))?;
        let mut cmd = self.server.command("postgres");
        cmd.arg("-D")
            .arg(&self.data)
            .current_dir(&self.root)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        let child = procs::spawn(cmd, libc::SIGQUIT).map_err(|e| format!("start postgres: {e}"))?;
        *self.postmaster.lock().unwrap() = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ready = self
                .server
                .command("pg_isready")
                .args(["-h", "127.0.0.1", "-U", "postgres", "-q", "-p"])
                .arg(self.port.to_string())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if ready {
                return Ok(());
            }
            if let Some(c) = self.postmaster.lock().unwrap().as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    return Err(format!(
                        "postgres exited at start ({status}); see {}",
                        self.log_path().display()
                    ));
                }
            }
            if Instant::now() > deadline {
                return Err("postgres did not become ready in 60s".into());
            }
            std::thread::sleep(Duration::from_millis(30));
        }
    }

    /// `pg_ctl stop -m <mode>` (fast or immediate), reap the postmaster.
    pub fn stop(&self, mode: &str) -> Result<(), String> {
        let mut guard = self.postmaster.lock().unwrap();
        let Some(mut child) = guard.take() else {
            return Ok(());
        };
        let stopped = run(
            self.server
                .command("pg_ctl")
                .arg("-D")
                .arg(&self.data)
                .args(["stop", "-m", mode, "-w", "-t", "30"]),
            "pg_ctl stop",
        );
        if stopped.is_err() {
            procs::signal(child.id(), libc::SIGQUIT);
        }
        if procs::wait_timeout(&mut child, Duration::from_secs(30)).is_none() {
            unsafe {
                libc::kill(-(child.id() as i32), libc::SIGKILL);
            }
            let _ = child.wait();
        }
        procs::forget(child.id());
        stopped.map(|_| ())
    }

    /// Restart with `pg_ctl stop -m <mode>` and a fresh start; returns how long the
    /// database was unreachable.
    pub fn restart(&self, mode: &str) -> Result<Duration, String> {
        let t = Instant::now();
        self.stop(mode)?;
        self.start()?;
        Ok(t.elapsed())
    }

    /// The server's `--version`, or empty when no server binaries are found (creating
    /// the cluster then fails with what is missing).
    pub fn version() -> String {
        PgServer::find().map(|s| s.version()).unwrap_or_default()
    }

    /// Remove the cluster directory (after the postmaster is gone).
    pub fn remove_dir(root: &Path) {
        let _ = std::fs::remove_dir_all(root);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.stop("immediate");
        if !self.keep {
            Cluster::remove_dir(&self.root);
        }
    }
}
