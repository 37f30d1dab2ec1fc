//! The artifacts a run leaves behind, shared by the harness, the workers and the checker.
//!
//! Every file is JSON lines (one record a line) or one JSON document, under
//! `target/chaos/<seed>/`. Two clocks are recorded:
//!
//! - `*_us`: wall-clock microseconds since the Unix epoch. The database runs on the same
//!   machine, so this is also its clock, and the checker lines worker events up with
//!   `job_events.at` and `lease_expiries.lease_until` through it. The harness measures
//!   how far apart the two are (`RunInfo::clock`); the checker allows [`DB_CLOCK_BOUND_US`]
//!   and fails the run if the measurement exceeds it.
//! - `*mono_ns`: `CLOCK_MONOTONIC` nanoseconds. One clock for every process of one boot
//!   (the kernel's, not per process), never stepped: handler intervals of different
//!   processes are compared on it directly.

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

/// `CLOCK_MONOTONIC` in nanoseconds: the same clock in every process on this machine
/// (std's `Instant` is opaque, so it cannot be written down and compared across
/// processes).
pub fn now_mono_ns() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
    }
    // timespec fields are i64 on the 64-bit Linux this harness runs on.
    #[allow(clippy::unnecessary_cast)]
    let ns = ts.tv_sec as i64 * 1_000_000_000 + ts.tv_nsec as i64;
    ns
}

/// How far a worker's wall clock may be from the database's when the checker compares a
/// handler start with a database deadline (same machine: one clock, read through two
/// system calls and a network round trip). The harness measures the real figure every
/// second (`RunInfo::clock`); a run whose measurement exceeds this bound fails.
pub const DB_CLOCK_BOUND_US: i64 = 5_000;

/// Tolerance when comparing two `CLOCK_MONOTONIC` readings of different processes: the
/// clock is shared, so this only covers the time to write a log line.
pub const MONO_BOUND_NS: i64 = 1_000_000;

/// The harness's clock measurements: the database's clock against the harness's wall
/// clock (`clock_timestamp()` between two local readings), taken every second.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ClockInfo {
    pub samples: u64,
    /// Samples with a round trip under 2 ms, the ones the figures below come from.
    pub good_samples: u64,
    /// Largest |database - local midpoint| seen, µs.
    pub max_offset_us: i64,
    /// Largest round trip of a good sample, µs (each sample's uncertainty is half of it).
    pub max_rtt_us: i64,
    /// The bound the checker allows ([`DB_CLOCK_BOUND_US`]).
    pub bound_us: i64,
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
    /// Database clock against the harness's wall clock.
    #[serde(default)]
    pub clock: ClockInfo,
    /// The worker's result size cap (`StoreOptions::max_result_bytes`).
    #[serde(default)]
    pub max_result_bytes: usize,
    /// The drain stopped early: only keys nothing can move were left open.
    #[serde(default)]
    pub drain_stranded: bool,
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
    /// `refused` (typed error, nothing written by contract), `rolled_back` (enqueued in
    /// a host transaction that then rolled back: no row may exist).
    pub status: String,
    pub id: Option<i64>,
    pub error: Option<String>,
    /// What the job is expected to do: `done`, `dead`, `unknown_kind`, `probe`,
    /// `poison_result` (dead, reason names the result), `poison_payload` (dead, reason
    /// says the payload cannot be decoded)...
    pub expect: String,
    pub max_attempts: i32,
    pub t_us: i64,
    /// The workload scenario or fault that enqueued it (`flood`, `chain`, `cancel_chain`,
    /// `dead_head`, `poison`, `neighbour`, `txhold`, `deep`, `host_enqueue_*`), if any.
    #[serde(default)]
    pub scenario: Option<String>,
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
    /// Jobs the fault acted on (row locks, operator cancels), when it names them.
    #[serde(default)]
    pub jobs: Vec<i64>,
    /// The ordering key the fault acted on (host transactions), if any.
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub start_mono_ns: i64,
    #[serde(default)]
    pub end_mono_ns: i64,
}

impl FaultRecord {
    pub fn new(kind: &str, target: String, start_us: i64, hit: bool, detail: String) -> Self {
        FaultRecord {
            kind: kind.into(),
            target,
            start_us,
            end_us: now_us(),
            hit,
            detail,
            jobs: Vec::new(),
            key: None,
            start_mono_ns: 0,
            end_mono_ns: now_mono_ns(),
        }
    }
}

/// `operator.jsonl`: the retention loop's prunes and retries of dead jobs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OperatorRecord {
    pub t_us: i64,
    /// `prune` or `retry_dead`.
    pub action: String,
    pub ok: bool,
    /// Jobs deleted (prune) or the job retried (retry_dead).
    pub jobs: Vec<i64>,
    pub n: u64,
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
///
/// Per attempt: `start` when the handler begins (before any of its work), `effect` just
/// before each call to the effect server, `end` when the handler's future is dropped (a
/// drop guard, so an attempt that panicked or whose task was aborted still has one;
/// outcome `dropped` if the handler never said how it ended). A SIGKILLed process writes
/// no `end`: its open attempts end when the harness reaped the process.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct HistoryLine {
    pub t_us: i64,
    /// `CLOCK_MONOTONIC`, ns (0 in histories written before the second edition).
    #[serde(default)]
    pub mono_ns: i64,
    pub w: usize,
    pub inc: u32,
    #[serde(default)]
    pub pid: u32,
    /// `up` (with owner), `start`, `effect`, `end`, `term`, `down`.
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
    /// For `end`: `ok`, `err`, `panic`, `stale`, `dropped` (aborted, or ended without
    /// saying how).
    #[serde(default)]
    pub outcome: String,
    /// For `effect`: the step.
    #[serde(default)]
    pub step: String,
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
    /// When the harness had reaped the process (`waitpid` returned): after its last
    /// instruction.
    pub ended_us: i64,
    #[serde(default)]
    pub ended_mono_ns: i64,
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
