//! The artifacts a run leaves behind, shared by the harness, the workers and the checker.
//!
//! Every file is JSON lines (one record a line) or one JSON document, under
//! `target/chaos/<seed>/`. Times are microseconds since the Unix epoch on the host clock,
//! which is also the database's clock (same machine), so the checker can line up fault
//! windows with `job_events.at`.

use std::io::{BufRead, Write};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Wall-clock microseconds since the epoch.
pub fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// `run.json`: what was run, with which timing, and when each phase ended.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RunInfo {
    pub seed: u64,
    pub profile: String,
    pub workers: usize,
    pub concurrency: usize,
    pub lease_ms: u64,
    pub renew_ms: u64,
    pub reaper_ms: u64,
    pub backoff_base_ms: u64,
    pub backoff_cap_ms: u64,
    pub backoff_jitter: f64,
    pub max_run_ms: u64,
    /// The profile's minimum number of faults hit.
    #[serde(default)]
    pub min_faults: usize,
    pub started_us: i64,
    /// The cluster was up and migrated.
    pub cluster_ready_us: i64,
    /// The last fault was healed (every worker running, the proxies passing).
    pub healed_us: i64,
    pub drained_us: i64,
    pub finished_us: i64,
    pub drain_complete: bool,
    pub wall_secs: f64,
    pub pg_version: String,
    /// Effect-server counters at the end.
    pub effect_server: EffectServerStats,
    /// Enqueues refused with a typed error, by error kind.
    pub refused: std::collections::BTreeMap<String, u64>,
    /// Operator actions the drain took (release holds, cancel unknown kinds, unblock keys).
    pub drain_actions: std::collections::BTreeMap<String, u64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct EffectServerStats {
    pub requests: u64,
    pub applied: u64,
    pub already: u64,
    pub fenced: u64,
    pub mismatch: u64,
    pub replies_dropped: u64,
}

/// `enqueue.jsonl`: one line per job the harness tried to enqueue.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EnqueueRecord {
    /// Client id, also in the payload (`cid`), so unknown outcomes can be matched.
    pub cid: u64,
    pub kind: String,
    pub key: Option<String>,
    /// `ok` (acknowledged, with id), `info` (outcome unknown: connection lost),
    /// `refused` (typed error, nothing written by contract).
    pub status: String,
    pub id: Option<i64>,
    pub error: Option<String>,
    /// What the job is expected to do: `done`, `dead`, `unknown_kind`, `probe`...
    pub expect: String,
    pub max_attempts: i32,
    pub t_us: i64,
}

/// `faults.jsonl`: one line per injected fault (or operator action).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FaultRecord {
    pub kind: String,
    /// `w<n>`, `pg`, `all`.
    pub target: String,
    pub start_us: i64,
    pub end_us: i64,
    /// The fault took effect (a process was signalled, a backend terminated, ...).
    pub hit: bool,
    pub detail: String,
}

/// `effects.jsonl`: the effect server's log, one line per request, in `seq` order.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EffectLog {
    pub seq: u64,
    pub t_us: i64,
    pub effect_key: String,
    pub job: i64,
    pub step: String,
    pub generation: i64,
    pub key: Option<String>,
    pub key_seq: Option<i64>,
    pub worker: String,
    /// `applied`, `already`, `fenced`, `mismatch`.
    pub decision: String,
    pub reply_dropped: bool,
}

/// A worker history line (`workers/w<n>.<inc>.jsonl`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct HistoryLine {
    pub t_us: i64,
    pub w: usize,
    pub inc: u32,
    /// `up` (with owner), `start`, `end`, `term`, `down`.
    pub ev: String,
    #[serde(default)]
    pub owner: Option<String>,
    #[serde(default)]
    pub job: i64,
    #[serde(default)]
    pub generation: i64,
    #[serde(default)]
    pub attempt: i32,
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub key_seq: Option<i64>,
    /// For `end`: `ok`, `err`, `panic`, `cancelled`.
    #[serde(default)]
    pub outcome: String,
    /// Effects whose recorded outcome was reused from the ledger (no call made).
    #[serde(default)]
    pub ledger_hits: u32,
    #[serde(default)]
    pub detail: String,
}

/// A worker process incarnation as the harness saw it (`processes.jsonl`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProcessRecord {
    pub w: usize,
    pub inc: u32,
    pub pid: u32,
    pub started_us: i64,
    pub ended_us: i64,
    /// `killed`, `terminated`, `stopped_at_end`, `exited(<code>)`.
    pub how: String,
}

/// Append-only JSON-lines writer, flushed per line so a killed process loses nothing
/// it already wrote.
pub struct Jsonl {
    file: std::fs::File,
}

impl Jsonl {
    pub fn create(path: &Path) -> std::io::Result<Jsonl> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Jsonl { file })
    }

    pub fn write<T: Serialize>(&mut self, record: &T) {
        let mut line = serde_json::to_vec(record).expect("serialize record");
        line.push(b'\n');
        // One write per line: lines from one process never interleave.
        let _ = self.file.write_all(&line);
    }
}

/// Read a JSON-lines file; a torn last line (a process killed mid-write) is skipped.
pub fn read_jsonl<T: DeserializeOwned>(path: &Path) -> std::io::Result<Vec<T>> {
    let file = std::fs::File::open(path)?;
    let mut out = Vec::new();
    for line in std::io::BufReader::new(file).lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(&line) {
            Ok(v) => out.push(v),
            Err(e) => eprintln!("{}: skipping unreadable line: {e}", path.display()),
        }
    }
    Ok(out)
}

pub fn write_json<T: Serialize>(path: &Path, value: &T) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(value).expect("serialize"))?;
    std::fs::rename(tmp, path)
}

pub fn read_json<T: DeserializeOwned>(path: &Path) -> std::io::Result<T> {
    let bytes = std::fs::read(path)?;
    serde_json::from_slice(&bytes)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}
