//! Loading the artifacts, and the indexes every check shares.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde::Deserialize;

use crate::model::{
    read_json, read_jsonl, EffectLog, EnqueueRecord, FaultRecord, HistoryLine, ProcessRecord,
    RunInfo,
};

/// A row of `db/jobs.jsonl`.
#[derive(Debug, Deserialize)]
pub struct Job {
    pub id: i64,
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
}

/// A row of `db/job_events.jsonl`.
#[derive(Debug, Deserialize)]
pub struct Event {
    pub id: i64,
    pub job_id: i64,
    pub generation: i64,
    pub event: String,
    pub at_us: i64,
}

/// A row of `db/lease_expiries.jsonl`.
#[derive(Debug, Deserialize)]
pub struct Expiry {
    pub job_id: i64,
    pub generation: i64,
    pub owner: String,
    pub lease_until_us: i64,
    pub reaped_at_us: i64,
    pub reaped_by: String,
}

/// A row of `db/effects.jsonl` (the library's effect ledger).
#[derive(Debug, Deserialize)]
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
    pub history: Vec<HistoryLine>,
    /// Worker counters summed over every incarnation's last snapshot.
    pub metrics: BTreeMap<String, u64>,
    /// Job index in `jobs`, by id.
    by_id: HashMap<i64, usize>,
    /// Enqueue index in `enq`, by client id.
    by_cid: HashMap<i64, usize>,
    /// Expiry index in `expiries`, by (job, generation).
    by_expiry: HashMap<(i64, i64), usize>,
}

fn load<T: serde::de::DeserializeOwned>(dir: &Path, name: &str) -> Result<Vec<T>, String> {
    read_jsonl(&dir.join(name)).map_err(|e| format!("{name}: {e}"))
}

impl Input {
    pub fn load(dir: &Path) -> Result<Input, String> {
        let run: RunInfo =
            read_json(&dir.join("run.json")).map_err(|e| format!("run.json: {e}"))?;
        let mut history = Vec::new();
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
            } else if name.ends_with(".jsonl") {
                history
                    .extend(read_jsonl::<HistoryLine>(&path).map_err(|e| format!("{name}: {e}"))?);
            }
        }
        let enq: Vec<EnqueueRecord> = load(dir, "enqueue.jsonl")?;
        let jobs: Vec<Job> = load(dir, "db/jobs.jsonl")?;
        let by_id = jobs.iter().enumerate().map(|(i, j)| (j.id, i)).collect();
        let by_cid = enq
            .iter()
            .enumerate()
            .map(|(i, r)| (r.cid as i64, i))
            .collect();
        let expiries: Vec<Expiry> = load(dir, "db/lease_expiries.jsonl")?;
        let by_expiry = expiries
            .iter()
            .enumerate()
            .map(|(i, x)| ((x.job_id, x.generation), i))
            .collect();
        Ok(Input {
            run,
            faults: load(dir, "faults.jsonl")?,
            processes: load(dir, "processes.jsonl")?,
            effects: load(dir, "effects.jsonl")?,
            events: load(dir, "db/job_events.jsonl")?,
            expiries,
            by_expiry,
            ledger: load(dir, "db/effects.jsonl")?,
            enq,
            jobs,
            history,
            metrics,
            by_id,
            by_cid,
        })
    }

    pub fn job(&self, id: i64) -> Option<&Job> {
        self.by_id.get(&id).map(|i| &self.jobs[*i])
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
