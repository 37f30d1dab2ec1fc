//! Attack on "a check that could not connect decides nothing, and the next call asks
//! again" and "A direct or session-mode connection is never refused": the database is
//! down at a store's first call and up later. The "database" here is a loopback TCP
//! proxy in front of the test server that this test starts late (nothing listens on its
//! port before), directly or behind a PgBouncer (transaction mode) whose upstream is
//! that proxy.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use leasehold::{Store, StoreOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use tokio::net::{TcpListener, TcpStream};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A loopback proxy on `port` to the test server; stops (and drops its connections)
/// when the returned handle is aborted.
async fn start_proxy(port: u16) -> tokio::task::JoinHandle<()> {
    let upstream_port: u16 = std::env::var("PGPORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(5432);
    let upstream_host = std::env::var("PGHOST").unwrap_or_else(|_| "127.0.0.1".into());
    let listener = TcpListener::bind(("127.0.0.1", port)).await.unwrap();
    tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        loop {
            let Ok((mut client, _)) = listener.accept().await else {
                return;
            };
            let host = upstream_host.clone();
            conns.spawn(async move {
                if let Ok(mut server) = TcpStream::connect((host.as_str(), upstream_port)).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    })
}

/// A PgBouncer in `mode` whose upstream is 127.0.0.1:`upstream`.
struct Bouncer {
    port: u16,
    dir: PathBuf,
    child: Child,
}

impl Bouncer {
    fn start(mode: &str, pool_size: u32, upstream: u16) -> Bouncer {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("lh-a2-bouncer-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let user = std::env::var("PGUSER").unwrap_or_else(|_| "root".into());
        std::fs::write(dir.join("users.txt"), format!("\"{user}\" \"\"\n")).unwrap();
        let ini = format!(
            "[databases]\n* = host=127.0.0.1 port={upstream}\n[pgbouncer]\nlisten_addr = 127.0.0.1\n\
             listen_port = {port}\nunix_socket_dir =\nauth_type = trust\nauth_file = {d}/users.txt\n\
             pool_mode = {mode}\ndefault_pool_size = {pool_size}\nmax_client_conn = 100\n\
             ignore_startup_parameters = extra_float_digits\nserver_login_retry = 1\n\
             logfile = {d}/pgbouncer.log\npidfile = {d}/pgbouncer.pid\n",
            d = dir.display()
        );
        let ini_path = dir.join("pgbouncer.ini");
        std::fs::write(&ini_path, ini).unwrap();
        let root = Command::new("id")
            .arg("-u")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
            .unwrap_or(false);
        let mut cmd = if root {
            Command::new("chown")
                .args(["-R", "postgres"])
                .arg(&dir)
                .status()
                .unwrap();
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", "/usr/sbin/pgbouncer"]);
            c
        } else {
            Command::new("/usr/sbin/pgbouncer")
        };
        let child = cmd
            .arg(&ini_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "pgbouncer did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Bouncer { port, dir, child }
    }

    fn options(&self) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username(&std::env::var("PGUSER").unwrap_or_else(|_| "root".into()))
            .database(&test_db_name())
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
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

fn lazy_pool(options: PgConnectOptions, size: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(3))
        .connect_lazy_with(options)
}

fn show<T: std::fmt::Debug>(r: &leasehold::Result<T>) -> String {
    format!("{r:?}").chars().take(220).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_store_whose_database_was_down_at_its_first_call_works_once_it_is_up() {
    bounded(async {
        let db = TestDb::new("a2_outage_direct").await;
        let port = free_port();
        let pool = lazy_pool(
            base_options()
                .host("127.0.0.1")
                .port(port)
                .database(&test_db_name()),
            2,
        );
        let store = Store::new(pool.clone(), &db.schema, StoreOptions::default()).unwrap();
        let down = within(30, "enqueue while down", store.enqueue(job("k"))).await;
        assert!(down.is_err(), "the database is down: {down:?}");
        let proxy = start_proxy(port).await;
        let up = within(30, "enqueue once up", store.enqueue(job("k"))).await;
        let up2 = within(30, "claim once up", store.claim(&claim_req(&owner("w"), 5))).await;
        proxy.abort();
        pool.close().await;
        assert!(
            up.is_ok() && up2.is_ok(),
            "down first: {}; once up: enqueue {}, claim {}",
            show(&down),
            show(&up),
            show(&up2)
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_behind_an_untold_transaction_pooler_whose_database_was_down_is_refused_once_it_is_up(
) {
    bounded(async {
        let db = TestDb::new("a2_outage_pooler").await;
        let upstream = free_port();
        let bouncer = Bouncer::start("transaction", 2, upstream);
        let pool = lazy_pool(bouncer.options(), 2);
        let store = Store::new(pool.clone(), &db.schema, StoreOptions::default()).unwrap();
        let t = Instant::now();
        let down = within(40, "enqueue while down", store.enqueue(job("k"))).await;
        let down_took = t.elapsed();
        let proxy = start_proxy(upstream).await;
        // pgbouncer retries its server login every second here.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let mut after = Vec::new();
        for _ in 0..3 {
            let r = within(40, "enqueue once up", store.enqueue(job("k"))).await;
            after.push(show(&r));
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        proxy.abort();
        pool.close().await;
        drop(bouncer);
        let jobs = db.job_count().await;
        assert!(
            after.iter().all(|a| a.contains("store.transaction_pooler")) && jobs == 0,
            "down first: {} (after {down_took:?}); once the database is up, through the untold \
             pooler: {after:#?}; {jobs} jobs written",
            show(&down)
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_behind_a_session_pooler_whose_database_was_down_works_once_it_is_up() {
    bounded(async {
        let db = TestDb::new("a2_outage_session").await;
        let upstream = free_port();
        let bouncer = Bouncer::start("session", 4, upstream);
        let pool = lazy_pool(bouncer.options(), 2);
        let store = Store::new(pool.clone(), &db.schema, StoreOptions::default()).unwrap();
        let down = within(40, "enqueue while down", store.enqueue(job("k"))).await;
        let proxy = start_proxy(upstream).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let t = Instant::now();
        let up = within(40, "enqueue once up", store.enqueue(job("k"))).await;
        let up_took = t.elapsed();
        proxy.abort();
        pool.close().await;
        drop(bouncer);
        assert!(
            up.is_ok(),
            "down first: {}; once up, through the session pooler: {} after {up_took:?}",
            show(&down),
            show(&up)
        );
        db.drop().await;
    })
    .await
}
