//! "Behind a transaction-mode pooler without the switch, start fails with one
//! clear error". A real PgBouncer 1.18 in transaction mode, configured with the
//! documented `server_round_robin = 1` (hand out the least recently used server
//! connection: the load-balancing setting), with two server connections already open
//! (a pooler other clients use, as in production).

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use leasehold::{Handler, JobContext, JobError, NewJob, Scheduler, Store, StoreOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgPool};
use worker::{fast_config, run_in_system};

const BINARY: &str = "/usr/sbin/pgbouncer";

struct Bouncer {
    port: u16,
    dir: PathBuf,
    child: Child,
}

impl Bouncer {
    fn start(extra: &str, servers: u32) -> Bouncer {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let dir = std::env::temp_dir().join(format!("atk-pgbouncer-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("users.txt"), "\"root\" \"\"\n").unwrap();
        let ini = format!(
            "[databases]\n* = host=127.0.0.1 port=5432\n[pgbouncer]\nlisten_addr = 127.0.0.1\n\
             listen_port = {port}\nunix_socket_dir =\nauth_type = trust\nauth_file = {d}/users.txt\n\
             pool_mode = transaction\ndefault_pool_size = {servers}\nmax_client_conn = 500\n\
             ignore_startup_parameters = extra_float_digits\nlogfile = {d}/pgbouncer.log\n\
             pidfile = {d}/pgbouncer.pid\n{extra}\n",
            d = dir.display()
        );
        let ini_path = dir.join("pgbouncer.ini");
        std::fs::write(&ini_path, ini).unwrap();
        Command::new("chown")
            .args(["-R", "postgres"])
            .arg(&dir)
            .status()
            .unwrap();
        let child = Command::new("runuser")
            .args(["-u", "postgres", "--", BINARY])
            .arg(&ini_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let b = Bouncer { port, dir, child };
        let t = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "pgbouncer did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        b
    }

    fn options(&self) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username("root")
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
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Open `n` server connections in the pooler (n clients in a transaction at once).
async fn warm(b: &Bouncer, n: usize) -> Vec<i32> {
    let mut conns = Vec::new();
    for _ in 0..n {
        let mut c = sqlx::PgConnection::connect_with(&b.options())
            .await
            .unwrap();
        sqlx::raw_sql("BEGIN").execute(&mut c).await.unwrap();
        conns.push(c);
    }
    let mut pids = Vec::new();
    for c in conns.iter_mut() {
        use sqlx::Row;
        let row = sqlx::raw_sql("SELECT pg_backend_pid()")
            .fetch_one(&mut *c)
            .await
            .unwrap();
        pids.push(row.get::<i32, _>(0));
    }
    for mut c in conns {
        sqlx::raw_sql("COMMIT").execute(&mut c).await.unwrap();
        c.close().await.unwrap();
    }
    pids
}

struct Quick;
impl Handler for Quick {
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "quick";
    async fn run(&self, _: JobContext, _: serde_json::Value) -> Result<(), JobError> {
        Ok(())
    }
}

async fn pooled(b: &Bouncer) -> PgPool {
    PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(b.options())
        .await
        .unwrap()
}

#[test]
fn a_round_robin_transaction_pooler_without_the_switch_is_refused_at_start() {
    run_in_system(within(90, "round robin pooler", async {
        let db = TestDb::new("atk_pool_rr").await;
        let b = Bouncer::start("server_round_robin = 1", 2);
        let pids = warm(&b, 2).await;
        assert_ne!(pids[0], pids[1], "two server connections are open");
        let pool = pooled(&b).await;
        let store = Store::new(pool.clone(), &db.schema, StoreOptions::default()).unwrap();
        let verdict = store.migrate().await;
        let text = format!("{verdict:?}");
        assert!(
            text.contains("store.transaction_pooler"),
            "migrate through a transaction pooler without the switch was not refused: {text}"
        );
        pool.close().await;
        db.drop().await;
    }))
}

/// What a user then sees if it starts: the scheduler's statements through the pooler.
#[test]
fn a_round_robin_transaction_pooler_without_the_switch_runs_jobs_or_refuses() {
    run_in_system(within(90, "round robin pooler, scheduler", async {
        let db = TestDb::new("atk_pool_rr2").await;
        let ids = db
            .store
            .enqueue_many(
                (0..20)
                    .map(|_| NewJob::from_json("quick", serde_json::json!({})))
                    .collect(),
            )
            .await
            .unwrap();
        let b = Bouncer::start("server_round_robin = 1", 2);
        warm(&b, 2).await;
        let pool = pooled(&b).await;
        let mut c = fast_config(&db.schema);
        c.listen = false;
        let started = Scheduler::builder(pool.clone(), c)
            .register(Quick)
            .start()
            .await;
        match started {
            Err(e) => {
                assert!(e.to_string().contains("store.transaction_pooler"), "{e}");
            }
            Ok(s) => {
                tokio::time::sleep(Duration::from_secs(5)).await;
                let done = db.count_where("jobs", "state = 'done'").await;
                let _ = tokio::time::timeout(Duration::from_secs(15), s.shutdown()).await;
                panic!(
                    "started behind a transaction pooler without the switch; {done} of {} jobs done after 5 s",
                    ids.len()
                );
            }
        }
        pool.close().await;
        db.drop().await;
    }))
}
