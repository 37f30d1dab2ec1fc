//! The simulator's server: its state, the accept loop, and the decision on each charge.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::BufReader;
use tokio::net::{TcpListener, TcpStream};

use super::wire::{read_line, write_line, WireReply, WireRequest};
use super::{
    ChargeRequest, Decision, Fault, FaultSchedule, GatewayClient, GatewayConfig, GatewayCounts,
    LogEntry, Receipt,
};

/// The server closes a connection that sends nothing for this long.
pub const SERVER_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Default)]
struct State {
    config: GatewayConfig,
    /// The first charge applied under each key, with its request.
    charges: HashMap<String, (ChargeRequest, Receipt)>,
    /// Highest token seen per account.
    highest: HashMap<String, u64>,
    /// Charge requests seen per reference (for the fault schedule).
    occurrences: HashMap<String, u32>,
    log: Vec<LogEntry>,
    counts: GatewayCounts,
}

#[derive(Clone, Default)]
struct Shared(Arc<Mutex<State>>);

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the state half-written in a way
        // that matters for a simulator; keep serving.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A running gateway. Stops when dropped.
pub struct Gateway {
    addr: SocketAddr,
    shared: Shared,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Gateway {
    /// Bind `127.0.0.1:0` and serve on a thread of its own.
    pub fn start(config: GatewayConfig) -> io::Result<Gateway> {
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Shared::default();
        shared.lock().config = config;
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let serving = shared.clone();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new()
            .name("gateway-sim".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!(error = %e, "gateway simulator cannot listen");
                            return;
                        }
                    };
                    tokio::select! {
                        _ = accept_loop(listener, serving) => {}
                        _ = stopped => {}
                    }
                });
                // Dropping the runtime drops every open connection and stalled request.
                drop(runtime);
            })?;
        Ok(Gateway {
            addr,
            shared,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The loopback address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A client with the default timeout.
    pub fn client(&self) -> GatewayClient {
        GatewayClient::new(self.addr)
    }

    /// Its figures so far.
    pub fn counts(&self) -> GatewayCounts {
        self.shared.lock().counts
    }

    /// Every charge request decided so far, in decision order.
    pub fn log(&self) -> Vec<LogEntry> {
        self.shared.lock().log.clone()
    }

    /// Applied charges per account, as references in the order they were applied.
    pub fn applied_by_account(&self) -> BTreeMap<String, Vec<String>> {
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for e in self.shared.lock().log.iter() {
            if e.decision == Decision::Applied {
                out.entry(e.request.account.clone())
                    .or_default()
                    .push(e.request.reference.clone());
            }
        }
        out
    }

    /// Applied charges per reference.
    pub fn applied_by_reference(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for e in self.shared.lock().log.iter() {
            if e.decision == Decision::Applied {
                *out.entry(e.request.reference.clone()).or_insert(0) += 1;
            }
        }
        out
    }

    /// Wait until every charge request received so far has been decided (stalled ones
    /// included), for at most `limit`. False if some are still undecided.
    pub async fn wait_decided(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            {
                let s = self.shared.lock();
                if s.log.len() as u64 == s.counts.requested {
                    return true;
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Turn deduplication by idempotency key on or off from the next request (see
    /// [`GatewayConfig::idempotency`]).
    pub fn set_idempotency(&self, on: bool) {
        self.shared.lock().config.idempotency = on;
    }

    /// Turn fencing on or off from the next request (see [`GatewayConfig::fencing`]).
    pub fn set_fencing(&self, on: bool) {
        self.shared.lock().config.fencing = on;
    }

    /// Replace the fault schedule (occurrences already counted stay counted).
    pub fn set_faults(&self, faults: FaultSchedule) {
        self.shared.lock().config.faults = faults;
    }

    /// Stop serving and wait for the gateway's thread to end.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

async fn accept_loop(listener: TcpListener, shared: Shared) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(serve(stream, shared.clone()));
            }
            Err(e) => {
                // Out of descriptors and the like: back off rather than spin.
                tracing::warn!(error = %e, "gateway simulator accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn serve(stream: TcpStream, shared: Shared) {
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    loop {
        let line = match tokio::time::timeout(SERVER_IDLE_TIMEOUT, read_line(&mut reader)).await {
            Ok(Ok(Some(line))) => line,
            _ => return,
        };
        let reply = match serde_json::from_slice::<WireRequest>(&line) {
            Err(e) => WireReply::Invalid {
                reason: e.to_string(),
            },
            Ok(WireRequest::Lookup { key }) => WireReply::Found {
                receipt: shared.lock().charges.get(&key).map(|(_, r)| r.clone()),
            },
            Ok(WireRequest::Charge {
                key,
                token,
                request,
                fault,
            }) => match charge(&shared, key, token, request, fault).await {
                Some(reply) => reply,
                // Decided, and the reply is dropped: close without answering.
                None => return,
            },
        };
        if write_line(&mut write, &reply).await.is_err() {
            // The client went away (it timed out): nothing to do.
            return;
        }
    }
}

/// Decide one charge. `None`: the reply is to be dropped.
async fn charge(
    shared: &Shared,
    key: String,
    token: Option<u64>,
    request: ChargeRequest,
    fault: Option<Fault>,
) -> Option<WireReply> {
    let fault = {
        let mut s = shared.lock();
        s.counts.requested += 1;
        let seen = s.occurrences.entry(request.reference.clone()).or_insert(0);
        *seen += 1;
        let occurrence = *seen;
        fault.or_else(|| s.config.faults.pick(&request.reference, occurrence))
    };
    if let Some(Fault::Stall(d)) = &fault {
        shared.lock().counts.stalled += 1;
        tokio::time::sleep(*d).await;
    }
    let mut s = shared.lock();
    let s = &mut *s;
    let n = s.log.len() as u64 + 1;
    let (decision, charge_id, reply) = decide(s, &key, token, &request, &fault);
    match decision {
        Decision::Applied => s.counts.applied += 1,
        Decision::Duplicate => s.counts.duplicates += 1,
        Decision::Fenced => s.counts.fenced += 1,
        Decision::Mismatch => s.counts.mismatches += 1,
        Decision::Failed => s.counts.failed += 1,
    }
    let drop_reply = fault == Some(Fault::DropReply);
    if drop_reply {
        s.counts.replies_dropped += 1;
    }
    s.log.push(LogEntry {
        n,
        idempotency_key: key,
        request,
        fencing_token: token,
        decision,
        charge_id,
        fault,
    });
    (!drop_reply).then_some(reply)
}

fn decide(
    s: &mut State,
    key: &str,
    token: Option<u64>,
    request: &ChargeRequest,
    fault: &Option<Fault>,
) -> (Decision, Option<u64>, WireReply) {
    if let Some(Fault::Fail(reason)) = fault {
        let reply = WireReply::Failed {
            reason: reason.clone(),
        };
        return (Decision::Failed, None, reply);
    }
    if let Some(got) = token {
        let seen = s.highest.entry(request.account.clone()).or_insert(0);
        if s.config.fencing && got < *seen {
            let seen = *seen;
            return (Decision::Fenced, None, WireReply::Fenced { seen, got });
        }
        // Every request that passes the fence raises it, applied or not.
        *seen = (*seen).max(got);
    }
    if s.config.idempotency {
        if let Some((first, receipt)) = s.charges.get(key) {
            if first != request {
                let reply = WireReply::Mismatch {
                    key: key.to_string(),
                };
                return (Decision::Mismatch, None, reply);
            }
            let reply = WireReply::Duplicate {
                receipt: receipt.clone(),
            };
            return (Decision::Duplicate, Some(receipt.charge_id), reply);
        }
    }
    let receipt = Receipt {
        charge_id: s.counts.applied + 1,
        idempotency_key: key.to_string(),
        account: request.account.clone(),
        amount_cents: request.amount_cents,
        reference: request.reference.clone(),
        fencing_token: token,
    };
    s.charges
        .entry(key.to_string())
        .or_insert_with(|| (request.clone(), receipt.clone()));
    let id = receipt.charge_id;
    (Decision::Applied, Some(id), WireReply::Applied { receipt })
}
