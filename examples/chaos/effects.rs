//! A minimal external effect store on loopback: a "gateway" that deduplicates by effect
//! key, fences by generation per job (the job as the key names it: its effect identity
//! and id, so jobs of two schemas with the same id are two jobs), and logs every request
//! with a server-side seq.
//!
//! Protocol: one JSON request per line, one JSON reply per line.
//! Decisions: `applied` (first time for this key), `already` (the key was applied
//! before: the stored receipt is returned), `fenced` (a newer generation of this job was
//! seen: refused), `mismatch` (same key, different request fingerprint: refused).
//! Fault: `drop_replies(n)` applies the next `n` requests and closes the connection
//! without answering (the crash-after-effect window as the worker sees it).

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use crate::model::{now_us, EffectLog, EffectServerStats, Jsonl};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ApplyRequest {
    pub effect_key: String,
    pub job: i64,
    pub step: String,
    pub generation: i64,
    pub key: Option<String>,
    pub key_seq: Option<i64>,
    pub fingerprint: String,
    pub worker: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ApplyReply {
    pub decision: String,
    pub seq: u64,
    /// Seq of the request that applied the effect (the "receipt").
    pub receipt: u64,
}

struct State {
    seq: u64,
    /// effect key → (fingerprint, receipt seq)
    applied: HashMap<String, (String, u64)>,
    /// (effect identity, job) → highest generation accepted
    fence: HashMap<(String, i64), i64>,
    log: Jsonl,
    stats: EffectServerStats,
}

pub struct EffectServer {
    pub addr: std::net::SocketAddr,
    state: Arc<Mutex<State>>,
    drop_next: Arc<AtomicU64>,
}

impl EffectServer {
    pub async fn start(log_path: &Path) -> std::io::Result<EffectServer> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State {
            seq: 0,
            applied: HashMap::new(),
            fence: HashMap::new(),
            log: Jsonl::create(log_path)?,
            stats: EffectServerStats::default(),
        }));
        let drop_next = Arc::new(AtomicU64::new(0));
        let (st, dn) = (state.clone(), drop_next.clone());
        tokio::spawn(async move {
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    continue;
                };
                let (st, dn) = (st.clone(), dn.clone());
                tokio::spawn(async move {
                    let _ = serve(sock, st, dn).await;
                });
            }
        });
        Ok(EffectServer {
            addr,
            state,
            drop_next,
        })
    }

    /// Apply the next `n` requests that would be applied, without replying.
    pub fn drop_replies(&self, n: u64) {
        self.drop_next.fetch_add(n, SeqCst);
    }

    pub fn stats(&self) -> EffectServerStats {
        self.state.lock().unwrap().stats.clone()
    }
}

async fn serve(
    sock: TcpStream,
    state: Arc<Mutex<State>>,
    drop_next: Arc<AtomicU64>,
) -> std::io::Result<()> {
    let (r, mut w) = sock.into_split();
    let mut lines = BufReader::new(r).lines();
    while let Some(line) = lines.next_line().await? {
        let Ok(req) = serde_json::from_str::<ApplyRequest>(&line) else {
            return Ok(());
        };
        let (reply, dropped) = decide(&state, &drop_next, &req);
        if dropped {
            return Ok(()); // close without answering
        }
        let mut out = serde_json::to_vec(&reply).unwrap();
        out.push(b'\n');
        w.write_all(&out).await?;
    }
    Ok(())
}

fn decide(state: &Mutex<State>, drop_next: &AtomicU64, req: &ApplyRequest) -> (ApplyReply, bool) {
    let mut s = state.lock().unwrap();
    s.seq += 1;
    let seq = s.seq;
    s.stats.requests += 1;
    let identity = leasehold::EffectKey::parse(&req.effect_key)
        .map(|k| k.identity().to_string())
        .unwrap_or_default();
    let job = (identity, req.job);
    let highest = s.fence.get(&job).copied().unwrap_or(i64::MIN);
    let (decision, receipt) = if req.generation < highest {
        s.stats.fenced += 1;
        ("fenced", 0)
    } else {
        s.fence.insert(job, req.generation);
        match s.applied.get(&req.effect_key).cloned() {
            Some((fp, _)) if fp != req.fingerprint => {
                s.stats.mismatch += 1;
                ("mismatch", 0)
            }
            Some((_, receipt)) => {
                s.stats.already += 1;
                ("already", receipt)
            }
            None => {
                s.applied
                    .insert(req.effect_key.clone(), (req.fingerprint.clone(), seq));
                s.stats.applied += 1;
                ("applied", seq)
            }
        }
    };
    let dropped = decision == "applied"
        && drop_next
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok();
    if dropped {
        s.stats.replies_dropped += 1;
    }
    let entry = EffectLog {
        seq,
        t_us: now_us(),
        effect_key: req.effect_key.clone(),
        job: req.job,
        step: req.step.clone(),
        generation: req.generation,
        key: req.key.clone(),
        key_seq: req.key_seq,
        worker: req.worker.clone(),
        decision: decision.to_string(),
        reply_dropped: dropped,
    };
    s.log.write(&entry);
    (
        ApplyReply {
            decision: decision.to_string(),
            seq,
            receipt,
        },
        dropped,
    )
}

/// Client side (in the worker): one connection per request, bounded in time.
pub async fn apply(addr: &str, req: &ApplyRequest) -> Result<ApplyReply, String> {
    let run = async {
        let sock = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let (r, mut w) = sock.into_split();
        let mut line = serde_json::to_vec(req).unwrap();
        line.push(b'\n');
        w.write_all(&line).await.map_err(|e| e.to_string())?;
        let mut lines = BufReader::new(r).lines();
        match lines.next_line().await.map_err(|e| e.to_string())? {
            Some(l) => serde_json::from_str(&l).map_err(|e| e.to_string()),
            None => Err("effect server closed the connection without a reply".into()),
        }
    };
    tokio::time::timeout(Duration::from_secs(3), run)
        .await
        .map_err(|_| "effect server timed out".to_string())?
}
