//! Loopback TCP proxy between one worker and PostgreSQL, with injectable faults:
//! `delay` (each forwarded chunk waits), `blackhole` (nothing is forwarded either way,
//! sockets stay open: a partition), a partial blackhole of the connections of one
//! `application_name` (read from the startup packet; e.g. only the lease renewer's
//! connection is partitioned while claims and completions go through) and `cut` (every
//! open connection is closed).
//!
//! A blackhole hangs, it never closes: the sockets stay open and nothing is forwarded
//! either way, so the client sees a statement that never answers (not an error). The
//! partial blackhole counts the connections it holds and any that closed while held, so
//! the nemesis can record that the renewer's connection really hung.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Pass,
    Delay(u64),
    Blackhole,
}

pub struct Proxy {
    pub port: u16,
    mode: watch::Sender<Mode>,
    /// Connections whose application_name starts with this are blackholed (the scheduler
    /// names its own `leasehold-<role> <pid>:<nonce>`).
    partial: watch::Sender<Option<String>>,
    cuts: watch::Sender<u64>,
    open: Arc<std::sync::atomic::AtomicU64>,
    /// application_name of each open connection, by connection number.
    apps: Arc<Mutex<HashMap<u64, String>>>,
    /// Connections that ended while their partial blackhole held them.
    closed_held: Arc<AtomicU64>,
}

impl Proxy {
    pub async fn start(upstream_port: u16) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let (mode, mode_rx) = watch::channel(Mode::Pass);
        let (partial, partial_rx) = watch::channel(None);
        let (cuts, cuts_rx) = watch::channel(0u64);
        let open = Arc::new(AtomicU64::new(0));
        let apps: Arc<Mutex<HashMap<u64, String>>> = Arc::default();
        let closed_held = Arc::new(AtomicU64::new(0));
        let (open2, apps2, closed2) = (open.clone(), apps.clone(), closed_held.clone());
        tokio::spawn(async move {
            let mut conn = 0u64;
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                conn += 1;
                let (m, c, o) = (mode_rx.clone(), cuts_rx.clone(), open2.clone());
                let pm = partial_rx.clone();
                let seen = Seen {
                    conn,
                    apps: apps2.clone(),
                    closed_held: closed2.clone(),
                };
                tokio::spawn(async move {
                    o.fetch_add(1, SeqCst);
                    let _ = relay(client, upstream_port, m, pm.clone(), c, &seen).await;
                    if let Some(app) = seen.apps.lock().unwrap().remove(&seen.conn) {
                        if pm.borrow().as_deref().is_some_and(|p| app.starts_with(p)) {
                            seen.closed_held.fetch_add(1, SeqCst);
                        }
                    }
                    o.fetch_sub(1, SeqCst);
                });
            }
        });
        Ok(Proxy {
            port,
            mode,
            partial,
            cuts,
            open,
            apps,
            closed_held,
        })
    }

    pub fn set(&self, mode: Mode) {
        let _ = self.mode.send(mode);
    }

    /// Blackhole only the connections whose application_name starts with this. Returns how
    /// many such connections are open (and now held). `None` heals, and returns how
    /// many held connections closed while held (a hang must not turn into an error).
    pub fn partition_app(&self, app: Option<&str>) -> u64 {
        match app {
            Some(app) => {
                self.closed_held.store(0, SeqCst);
                let _ = self.partial.send(Some(app.to_string()));
                let apps = self.apps.lock().unwrap();
                apps.values().filter(|a| a.starts_with(app)).count() as u64
            }
            None => {
                let _ = self.partial.send(None);
                self.closed_held.swap(0, SeqCst)
            }
        }
    }

    /// Close every open connection; returns how many were open.
    pub fn cut(&self) -> u64 {
        let n = self.open.load(SeqCst);
        self.cuts.send_modify(|c| *c += 1);
        n
    }
}

/// What a relay reports about its connection.
struct Seen {
    conn: u64,
    apps: Arc<Mutex<HashMap<u64, String>>>,
    closed_held: Arc<AtomicU64>,
}

async fn relay(
    mut client: TcpStream,
    upstream_port: u16,
    mode: watch::Receiver<Mode>,
    partial: watch::Receiver<Option<String>>,
    mut cuts: watch::Receiver<u64>,
    seen: &Seen,
) -> std::io::Result<()> {
    cuts.borrow_and_update();
    // The startup packet (no SSLRequest: workers connect with sslmode=disable) names
    // the connection's application_name.
    let mut len = [0u8; 4];
    client.read_exact(&mut len).await?;
    let n = u32::from_be_bytes(len) as usize;
    if !(8..=10_000).contains(&n) {
        return Ok(());
    }
    let mut startup = vec![0u8; n - 4];
    client.read_exact(&mut startup).await?;
    let app = application_name(&startup);
    seen.apps.lock().unwrap().insert(seen.conn, app.clone());
    let mut server = TcpStream::connect(("127.0.0.1", upstream_port)).await?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    server.write_all(&len).await?;
    server.write_all(&startup).await?;
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let gate = Gate { mode, partial, app };
    tokio::select! {
        _ = pump(cr, sw, gate.clone()) => {}
        _ = pump(sr, cw, gate) => {}
        _ = cuts.changed() => {}
    }
    Ok(())
}

/// `application_name` from a StartupMessage body (after the length).
fn application_name(body: &[u8]) -> String {
    let mut parts = body.get(4..).unwrap_or_default().split(|b| *b == 0);
    while let Some(k) = parts.next() {
        let v = parts.next().unwrap_or_default();
        if k == b"application_name" {
            return String::from_utf8_lossy(v).into_owned();
        }
    }
    String::new()
}

/// Decides, per forwarded chunk, whether a connection may pass.
#[derive(Clone)]
struct Gate {
    mode: watch::Receiver<Mode>,
    partial: watch::Receiver<Option<String>>,
    app: String,
}

impl Gate {
    fn blocked(&mut self) -> bool {
        *self.mode.borrow_and_update() == Mode::Blackhole
            || self
                .partial
                .borrow_and_update()
                .as_deref()
                .is_some_and(|p| self.app.starts_with(p))
    }

    /// Wait until the connection may pass; then the delay to apply, if any.
    async fn open(&mut self) -> std::io::Result<u64> {
        while self.blocked() {
            let gone = || std::io::Error::other("proxy gone");
            tokio::select! {
                r = self.mode.changed() => r.map_err(|_| gone())?,
                r = self.partial.changed() => r.map_err(|_| gone())?,
            }
        }
        Ok(match *self.mode.borrow() {
            Mode::Delay(ms) => ms,
            _ => 0,
        })
    }
}

async fn pump(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    mut gate: Gate,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        gate.open().await?;
        let n = r.read(&mut buf).await?;
        if n == 0 {
            let _ = w.shutdown().await;
            return Ok(());
        }
        // Data read just before a blackhole began is held until it ends.
        let delay = gate.open().await?;
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        w.write_all(&buf[..n]).await?;
    }
}
