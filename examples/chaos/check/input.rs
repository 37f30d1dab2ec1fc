//! Loading the artifacts, and the indexes every check shares.
//!
//! Rows deleted by retention come back from the audit copies with `deleted_at_us` set;
//! every check sees live and deleted rows together.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde::Deserialize;

use crate::model::{
    read_json, read_jsonl, EffectLog, EnqueueRecord, FaultRecord, HistoryLine, OperatorRecord,
    ProcessRecord, RunInfo,
};

/// A row of `db/jobs.jsonl`.
#[derive(Debug, Default, Deserialize)]
pub struct Job {
    pub id: i64,
    #[serde(default)]
    pub queue: String,
    pub kind: String,
    pub job_key: Option<String>,
    pub key_seq: Option<i64>,
    pub state: String,
    pub attempts: i32,
    pub max_attempts: i32,
    pub generation: i64,
    pub result: Option<serde_json::Value>,
    pub last_error: Option<String>,
    pub cid: Option<i64>,
    #[serde(default)]
    pub steps: Option<i32>,
    pub created_at_us: i64,
    #[serde(default)]
    pub owner: Option<String>,
    #[serde(default)]
    pub lease_until_us: Option<i64>,
    /// Deleted by retention at this time (from the audit copy); `None`: still there.
    #[serde(default)]
    pub deleted_at_us: Option<i64>,
}

/// A row of `db/job_events.jsonl`.
#[derive(Debug, Default, Deserialize)]
pub struct Event {
    pub id: i64,
    pub job_id: i64,
    pub generation: i64,
    pub event: String,
    pub at_us: i64,
    #[serde(default)]
    pub owner: Option<String>,
    #[serde(default)]
    pub detail: Option<String>,
}

/// A row of `db/job_keys.jsonl`: a key's sequence row, live or deleted by retention.
#[derive(Debug, Default, Deserialize)]
pub struct KeyRow {
    pub queue: String,
    pub job_key: String,
    pub next_seq: i64,
    #[serde(default)]
    pub deleted_at_us: Option<i64>,
}

/// A row of `db/leases.jsonl`: a value a running job's lease took (claim or renewal).
#[derive(Debug, Default, Deserialize)]
pub struct LeaseWrite {
    pub job_id: i64,
    pub generation: i64,
    pub lease_until_us: i64,
    pub written_at_us: i64,
}

/// A row of `db/lease_expiries.jsonl`.
#[derive(Debug, Default, Deserialize)]
pub struct Expiry {
    pub job_id: i64,
    pub generation: i64,
    pub owner: String,
    pub lease_until_us: i64,
    pub reaped_at_us: i64,
    pub reaped_by: String,
}

/// A row of `db/effects.jsonl` (the library's effect ledger).
#[derive(Debug, Default, Deserialize)]
pub struct Ledger {
    pub effect_key: String,
    pub job_id: i64,
    pub generation: i64,
    pub recorded_at_us: i64,
}

pub struct Input {
    pub run: RunInfo,
    pub enq: Vec<EnqueueRecord>,
    pub faults: Vec<FaultRecord>,
    pub processes: Vec<ProcessRecord>,
    pub effects: Vec<EffectLog>,
    pub jobs: Vec<Job>,
    pub events: Vec<Event>,
    pub expiries: Vec<Expiry>,
    pub ledger: Vec<Ledger>,
    pub leases: Vec<LeaseWrite>,
    pub operator: Vec<OperatorRecord>,
    pub history: Vec<HistoryLine>,
    /// Attempts a worker refused as stale (its log's "no longer owns the job" lines).
    pub stale_reports: Vec<StaleReport>,
    /// The periodic episodes' fires (`db/periodic.jsonl`; empty in older artifacts).
    pub periodic: super::periodic::Periodic,
    /// Worker counters summed over every incarnation's last snapshot.
    pub metrics: BTreeMap<String, u64>,
    /// Each keyed job's epoch within its key (see [`key_epochs`]); absent when its key's
    /// epochs could not be told apart.
    pub epoch: HashMap<i64, u32>,
    /// Keys whose epochs could not be told apart (their order checks are skipped and
    /// the report says how many).
    pub ambiguous_keys: Vec<String>,
    /// Job index in `jobs`, by id.
    by_id: HashMap<i64, usize>,
    /// Enqueue index in `enq`, by client id.
    by_cid: HashMap<i64, usize>,
    /// Expiry index in `expiries`, by (job, generation).
    by_expiry: HashMap<(i64, i64), usize>,
}

/// Everything [`Input`] is built from.
#[derive(Default)]
pub struct Parts {
    pub run: RunInfo,
    pub enq: Vec<EnqueueRecord>,
    pub faults: Vec<FaultRecord>,
    pub processes: Vec<ProcessRecord>,
    pub effects: Vec<EffectLog>,
    pub jobs: Vec<Job>,
    pub events: Vec<Event>,
    pub expiries: Vec<Expiry>,
    pub ledger: Vec<Ledger>,
    pub leases: Vec<LeaseWrite>,
    pub keys: Vec<KeyRow>,
    pub operator: Vec<OperatorRecord>,
    pub history: Vec<HistoryLine>,
    pub stale_reports: Vec<StaleReport>,
    pub periodic: super::periodic::Periodic,
    pub metrics: BTreeMap<String, u64>,
}

/// One attempt a worker counted as stale: its ending was refused because the worker
/// no longer owned the job (`stale_completions`), as its log says.
#[derive(Clone, Debug)]
pub struct StaleReport {
    /// The log it came from (`w<id>.<inc>.log`).
    pub log: String,
    pub job: i64,
    pub generation: i64,
    /// The ending refused: `completion`, `failure`, `abandoned attempt`.
    pub what: String,
}

/// The stale reports in a worker's log: lines
/// `… leasehold <what> refused: this worker no longer owns the job job=<id> generation=<g>`.
pub fn stale_reports(log: &str, text: &str) -> Vec<StaleReport> {
    const SAID: &str = " refused: this worker no longer owns the job";
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(at) = line.find(SAID) else { continue };
        let what = line[..at]
            .rsplit_once("leasehold ")
            .map(|(_, w)| w.to_string())
            .unwrap_or_default();
        let field = |name: &str| {
            line[at + SAID.len()..]
                .split_whitespace()
                .find_map(|t| t.strip_prefix(name))
                .and_then(|v| v.parse::<i64>().ok())
        };
        if let (Some(job), Some(generation)) = (field("job="), field("generation=")) {
            out.push(StaleReport {
                log: log.to_string(),
                job,
                generation,
                what,
            });
        }
    }
    out
}

/// Tell apart the epochs of each key.
///
/// Since the hardening (key floors, migration 2) a key's `key_seq` never goes backwards,
/// even when retention deletes its row: a key whose jobs all have distinct key_seqs is
/// one epoch, whatever rows were deleted. The library before it restarted a key at
/// `key_seq` 1 after retention deleted its row; for that case:
/// a deleted key row's `next_seq` is how many jobs its epoch had, and every job of a
/// later epoch has a larger id (its id is drawn after the key row is written, which is
/// after the old row's deletion committed). So the key's jobs in id order are cut into
/// runs of those sizes; each run must hold exactly the key_seqs 1..=n, or the key is
/// reported ambiguous rather than guessed.
pub fn key_epochs(jobs: &[Job], keys: &[KeyRow]) -> (HashMap<i64, u32>, Vec<String>) {
    let mut by_key: BTreeMap<(&str, &str), Vec<&Job>> = BTreeMap::new();
    for j in jobs {
        if let Some(k) = &j.job_key {
            by_key
                .entry((j.queue.as_str(), k.as_str()))
                .or_default()
                .push(j);
        }
    }
    let mut deleted: HashMap<(&str, &str), Vec<&KeyRow>> = HashMap::new();
    for k in keys.iter().filter(|k| k.deleted_at_us.is_some()) {
        deleted
            .entry((k.queue.as_str(), k.job_key.as_str()))
            .or_default()
            .push(k);
    }
    let mut epoch = HashMap::new();
    let mut ambiguous = Vec::new();
    for (key, mut js) in by_key {
        if seqs_distinct(&js) {
            epoch.extend(js.iter().map(|j| (j.id, 0)));
            continue;
        }
        js.sort_by_key(|j| j.id);
        let mut sizes: Vec<i64> = Vec::new();
        if let Some(rows) = deleted.get_mut(&key) {
            rows.sort_by_key(|r| r.deleted_at_us);
            sizes = rows.iter().map(|r| r.next_seq).collect();
        }
        let mut assigned = Vec::new();
        let mut rest: &[&Job] = &js;
        let mut ok = true;
        for (e, n) in sizes.iter().enumerate() {
            let n = (*n).max(0) as usize;
            if n > rest.len() {
                ok = false;
                break;
            }
            let (run, tail) = rest.split_at(n);
            let mut seqs: Vec<i64> = run.iter().filter_map(|j| j.key_seq).collect();
            seqs.sort_unstable();
            if seqs != (1..=n as i64).collect::<Vec<_>>() {
                ok = false;
                break;
            }
            assigned.extend(run.iter().map(|j| (j.id, e as u32)));
            rest = tail;
        }
        let mut last: Vec<i64> = rest.iter().filter_map(|j| j.key_seq).collect();
        last.sort_unstable();
        last.dedup();
        if ok && last.len() == rest.len() {
            assigned.extend(rest.iter().map(|j| (j.id, sizes.len() as u32)));
            epoch.extend(assigned);
        } else {
            ambiguous.push(format!("{}/{}", key.0, key.1));
        }
    }
    (epoch, ambiguous)
}

/// Every job of the key has a key_seq and no two share one.
fn seqs_distinct(js: &[&Job]) -> bool {
    let mut seqs: Vec<i64> = js.iter().filter_map(|j| j.key_seq).collect();
    let n = seqs.len();
    seqs.sort_unstable();
    seqs.dedup();
    n == js.len() && seqs.len() == n
}

fn load<T: serde::de::DeserializeOwned>(dir: &Path, name: &str) -> Result<Vec<T>, String> {
    read_jsonl(&dir.join(name)).map_err(|e| format!("{name}: {e}"))
}

impl Input {
    pub fn load(dir: &Path) -> Result<Input, String> {
        let run: RunInfo =
            read_json(&dir.join("run.json")).map_err(|e| format!("run.json: {e}"))?;
        let mut history = Vec::new();
        let mut stale = Vec::new();
        let mut metrics: BTreeMap<String, u64> = BTreeMap::new();
        let wdir = dir.join("workers");
        let mut entries: Vec<_> = std::fs::read_dir(&wdir)
            .map_err(|e| format!("{}: {e}", wdir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for path in entries {
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if name.ends_with(".metrics.json") {
                let m: BTreeMap<String, u64> =
                    read_json(&path).map_err(|e| format!("{name}: {e}"))?;
                for (k, v) in m {
                    *metrics.entry(k).or_default() += v;
                }
            } else if name.ends_with(".log") {
                let text = std::fs::read(&path).map_err(|e| format!("{name}: {e}"))?;
                stale.extend(stale_reports(&name, &String::from_utf8_lossy(&text)));
            } else if name.ends_with(".jsonl") {
                history
                    .extend(read_jsonl::<HistoryLine>(&path).map_err(|e| format!("{name}: {e}"))?);
            }
        }
        // Absent from first-edition artifacts.
        let optional = |name: &str| dir.join(name).exists();
        Ok(Input::assemble(Parts {
            run,
            enq: load(dir, "enqueue.jsonl")?,
            faults: load(dir, "faults.jsonl")?,
            processes: load(dir, "processes.jsonl")?,
            effects: load(dir, "effects.jsonl")?,
            jobs: load(dir, "db/jobs.jsonl")?,
            events: load(dir, "db/job_events.jsonl")?,
            expiries: load(dir, "db/lease_expiries.jsonl")?,
            ledger: load(dir, "db/effects.jsonl")?,
            leases: if optional("db/leases.jsonl") {
                load(dir, "db/leases.jsonl")?
            } else {
                Vec::new()
            },
            keys: if optional("db/job_keys.jsonl") {
                load(dir, "db/job_keys.jsonl")?
            } else {
                Vec::new()
            },
            operator: if optional("operator.jsonl") {
                load(dir, "operator.jsonl")?
            } else {
                Vec::new()
            },
            history,
            stale_reports: stale,
            periodic: if optional("db/periodic.jsonl") {
                let text = std::fs::read_to_string(dir.join("db/periodic.jsonl"))
                    .map_err(|e| format!("db/periodic.jsonl: {e}"))?;
                super::periodic::Periodic::parse(&text)
                    .map_err(|e| format!("db/periodic.jsonl: {e}"))?
            } else {
                Default::default()
            },
            metrics,
        }))
    }

    /// Build the indexes over loaded (or, in the self-test, synthetic) artifacts.
    pub fn assemble(p: Parts) -> Input {
        let by_id = p.jobs.iter().enumerate().map(|(i, j)| (j.id, i)).collect();
        let by_cid = p
            .enq
            .iter()
            .enumerate()
            .map(|(i, r)| (r.cid as i64, i))
            .collect();
        let by_expiry = p
            .expiries
            .iter()
            .enumerate()
            .map(|(i, x)| ((x.job_id, x.generation), i))
            .collect();
        let (epoch, ambiguous_keys) = key_epochs(&p.jobs, &p.keys);
        Input {
            run: p.run,
            enq: p.enq,
            faults: p.faults,
            processes: p.processes,
            effects: p.effects,
            jobs: p.jobs,
            events: p.events,
            expiries: p.expiries,
            ledger: p.ledger,
            leases: p.leases,
            operator: p.operator,
            history: p.history,
            stale_reports: p.stale_reports,
            periodic: p.periodic,
            metrics: p.metrics,
            epoch,
            ambiguous_keys,
            by_id,
            by_cid,
            by_expiry,
        }
    }

    pub fn job(&self, id: i64) -> Option<&Job> {
        self.by_id.get(&id).map(|i| &self.jobs[*i])
    }

    /// (key, epoch) of a keyed job, when known.
    pub fn key_epoch<'a>(&self, job: &'a Job) -> Option<(&'a str, u32)> {
        Some((job.job_key.as_deref()?, *self.epoch.get(&job.id)?))
    }

    /// The lease expiry recorded for this generation of the job.
    pub fn expiry(&self, job: i64, generation: i64) -> Option<&Expiry> {
        self.by_expiry
            .get(&(job, generation))
            .map(|i| &self.expiries[*i])
    }

    /// The enqueue record of a client id (the `cid` in the payload).
    pub fn enqueued(&self, cid: i64) -> Option<&EnqueueRecord> {
        self.by_cid.get(&cid).map(|i| &self.enq[*i])
    }

    /// What the workload expected of this job (`done`, `dead`, `probe`...).
    pub fn expect(&self, job: &Job) -> &str {
        job.cid
            .and_then(|c| self.enqueued(c))
            .map(|r| r.expect.as_str())
            .unwrap_or("")
    }

    pub fn metric(&self, name: &str) -> u64 {
        self.metrics.get(name).copied().unwrap_or(0)
    }

    /// The minimum backoff after the failure of attempt `attempts`, in µs.
    pub fn min_backoff_us(&self, attempts: i32) -> i64 {
        let run = &self.run;
        let exp = (attempts - 1).clamp(0, 30);
        let raw = (run.backoff_base_ms as f64) * 2f64.powi(exp);
        let capped = raw.min(run.backoff_cap_ms as f64);
        (capped * (1.0 - run.backoff_jitter) * 1000.0) as i64
    }
}
