//! The store tests' handler, and checks on what the library did with its effects.
//!
//! A store test claims jobs with `Store::claim` itself and then plays the worker. The
//! handler here does what a real handler does with such a job: it runs its effect
//! through the library's [`JobContext::once`] (the context `testkit::attempt_context`
//! gives it), under the stable key `<schema identity>/<job>/run`, and the act inserts one row into
//! `test_effects` — a store with no unique constraint, so an effect the library lets
//! happen twice is a second row. The handler keeps its own execution log: start and end
//! on the monotonic clock, and which way the step went (the ledger had the outcome, the
//! effect store had it, or it acted).
//!
//! Tests run it for every attempt that executes, stale ones included, before they try
//! to complete, and then assert on the library's doing: one row per effect key, the
//! ledger's record of it, and the order and overlap of the handler's own runs.
//!
//! Include it next to `common` with `#[path = "common/handler.rs"] mod handler;`.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use leasehold::store::EffectRecord;
use leasehold::testkit::attempt_context;
use leasehold::{ClaimedJob, EffectKey, Generation, JobError, JobId, Store};
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::common::TestDb;

/// The handler's one effect step.
pub const STEP: &str = "run";

/// The stable effect key of `job`'s step in `db`'s schema: what the ledger and
/// `test_effects` use.
pub async fn effect_key(db: &TestDb, job: JobId) -> String {
    db.effect_key(job, STEP).await
}

/// Which way a run's effect step went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// The library's ledger had the outcome: neither lookup nor act ran.
    Ledger,
    /// The ledger had nothing; the reconciling lookup found the effect in the store.
    Reconciled,
    /// The act ran: a row was inserted into `test_effects`.
    Acted,
}

/// One execution of the handler, as the handler saw it.
#[derive(Clone, Debug)]
pub struct Run {
    pub job: JobId,
    pub generation: Generation,
    pub key: Option<String>,
    pub key_seq: Option<i64>,
    pub start: Instant,
    pub end: Instant,
    pub path: Path,
    /// What the step returned: the effect's outcome `{"applied_by": <generation>}`, or
    /// the library's error.
    pub result: Result<Value, JobError>,
}

impl Run {
    /// The generation whose act produced the outcome this run got back.
    pub fn applied_by(&self) -> Option<i64> {
        self.result.as_ref().ok()?.get("applied_by")?.as_i64()
    }
}

/// Something to wait for inside the act, just before the effect lands (a stall, or a
/// barrier that makes a round's runs overlap).
pub type Pause = Pin<Box<dyn Future<Output = ()> + Send>>;

/// How a run goes.
#[derive(Default)]
pub struct Opts {
    /// Use `once_reconciled`, looking the key up in `test_effects` before acting: what
    /// a handler of a store with neither idempotency keys nor fencing must do when its
    /// act may land after its attempt lost the fence (the ledger cannot have it then).
    pub reconcile: bool,
    pub pause: Option<Pause>,
}

/// The handler, with its execution log. Cheap to clone into tasks.
#[derive(Clone)]
pub struct TestHandler {
    pool: PgPool,
    effects: String,
    log: Arc<Mutex<Vec<Run>>>,
}

impl TestHandler {
    /// A handler applying effects to `db`'s `test_effects` (created here).
    pub async fn new(db: &TestDb) -> TestHandler {
        db.create_effects_table().await;
        TestHandler {
            pool: db.pool.clone(),
            effects: db.table("test_effects"),
            log: Arc::default(),
        }
    }

    /// Run claimed job `j` with the context its handler would get (effects recorded
    /// through `store`).
    pub async fn run(&self, store: &Store, j: &ClaimedJob) -> Run {
        self.run_with(store, j, Opts::default()).await
    }

    pub async fn run_with(&self, store: &Store, j: &ClaimedJob, opts: Opts) -> Run {
        let ctx = attempt_context(j.clone(), store.clone());
        let acted = Arc::new(AtomicBool::new(false));
        let found = Arc::new(AtomicBool::new(false));
        // The same request on every attempt: the ledger binds its fingerprint to the key.
        let request = json!({ "job": j.id.0, "step": STEP });
        let start = Instant::now();
        let act = {
            let (pool, table, acted) = (self.pool.clone(), self.effects.clone(), acted.clone());
            let generation = j.generation;
            let job = j.id;
            move |key: EffectKey| async move {
                if let Some(pause) = opts.pause {
                    pause.await;
                }
                acted.store(true, SeqCst);
                sqlx::query(&format!(
                    "INSERT INTO {table} (effect_key, job_id, generation) VALUES ($1, $2, $3)"
                ))
                .bind(key.as_str())
                .bind(job.0)
                .bind(generation.0)
                .execute(&pool)
                .await
                .map_err(|e| JobError::retry(format!("effect store: {e}")))?;
                Ok(json!({ "applied_by": generation.0 }))
            }
        };
        let result = if opts.reconcile {
            let (pool, table, found) = (self.pool.clone(), self.effects.clone(), found.clone());
            let lookup = move |key: EffectKey| async move {
                let applied: Option<i64> = sqlx::query_scalar(&format!(
                    "SELECT generation FROM {table} WHERE effect_key = $1 ORDER BY applied_at LIMIT 1"
                ))
                .bind(key.as_str())
                .fetch_optional(&pool)
                .await
                .map_err(|e| JobError::retry(format!("effect store lookup: {e}")))?;
                found.store(applied.is_some(), SeqCst);
                Ok(applied.map(|g| json!({ "applied_by": g })))
            };
            ctx.once_reconciled(STEP, &request, lookup, act).await
        } else {
            ctx.once(STEP, &request, act).await
        };
        let end = Instant::now();
        let path = if acted.load(SeqCst) {
            Path::Acted
        } else if found.load(SeqCst) {
            Path::Reconciled
        } else {
            Path::Ledger
        };
        let run = Run {
            job: j.id,
            generation: j.generation,
            key: j.key.clone(),
            key_seq: j.key_seq,
            start,
            end,
            path,
            result,
        };
        self.log.lock().unwrap().push(run.clone());
        run
    }

    /// Every run so far, in the order they ended.
    pub fn runs(&self) -> Vec<Run> {
        self.log.lock().unwrap().clone()
    }

    /// The jobs run, in the order their runs started.
    pub fn order(&self) -> Vec<JobId> {
        let mut runs = self.runs();
        runs.sort_by_key(|r| r.start);
        runs.into_iter().map(|r| r.job).collect()
    }

    /// The runs of one key (or of all keys), checked against the key's promise: by the
    /// handler's own clock no two runs of a key overlap, and they started in `key_seq`
    /// order. Returns each key's jobs in the order they ran.
    pub fn assert_key_order(&self) -> BTreeMap<String, Vec<JobId>> {
        let mut by_key: BTreeMap<String, Vec<Run>> = BTreeMap::new();
        for run in self.runs() {
            if let Some(key) = run.key.clone() {
                by_key.entry(key).or_default().push(run);
            }
        }
        let mut order = BTreeMap::new();
        for (key, mut runs) in by_key {
            runs.sort_by_key(|r| r.start);
            for w in runs.windows(2) {
                let (a, b) = (&w[0], &w[1]);
                assert!(
                    b.start >= a.end,
                    "key {key:?}: job {} (key_seq {:?}) started {:?} before job {} (key_seq {:?}) ended: two runs of one key overlapped",
                    b.job,
                    b.key_seq,
                    a.end - b.start,
                    a.job,
                    a.key_seq,
                );
            }
            let seqs: Vec<Option<i64>> = runs.iter().map(|r| r.key_seq).collect();
            let mut sorted = seqs.clone();
            sorted.sort();
            sorted.dedup();
            assert_eq!(
                seqs, sorted,
                "key {key:?} ran out of key_seq order (key_seq of each run, by start)"
            );
            order.insert(key, runs.into_iter().map(|r| r.job).collect());
        }
        order
    }
}

impl TestDb {
    /// `test_effects` as (effect key, generations that applied it in apply order).
    pub async fn effects_applied(&self) -> BTreeMap<String, Vec<i64>> {
        let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
            "SELECT effect_key, generation FROM {} ORDER BY applied_at",
            self.table("test_effects")
        ))
        .fetch_all(&self.pool)
        .await
        .unwrap();
        let mut map: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for (key, generation) in rows {
            map.entry(key).or_default().push(generation);
        }
        map
    }

    /// No effect happened twice. Returns how many effect keys happened.
    pub async fn assert_no_duplicate_effects(&self) -> usize {
        let applied = self.effects_applied().await;
        let twice: Vec<_> = applied.iter().filter(|(_, g)| g.len() > 1).collect();
        assert!(
            twice.is_empty(),
            "effects applied more than once (effect key, applying generations): {twice:?}"
        );
        applied.len()
    }

    /// The library's ledger entry for `job`'s step.
    pub async fn ledger(&self, job: JobId) -> Option<EffectRecord> {
        self.store
            .effect(&effect_key(self, job).await)
            .await
            .unwrap()
    }

    /// `job`'s effect happened exactly once, by the act of generation `applied_by`, and
    /// the library's ledger holds that outcome, recorded by generation `recorded_by`.
    pub async fn assert_effect_once(&self, job: JobId, applied_by: i64, recorded_by: i64) {
        let key = effect_key(self, job).await;
        let applied = self
            .effects_applied()
            .await
            .remove(&key)
            .unwrap_or_default();
        assert_eq!(
            applied,
            vec![applied_by],
            "effect {key}: generations that applied it"
        );
        let rec = self
            .ledger(job)
            .await
            .unwrap_or_else(|| panic!("effect {key} happened but the ledger has no record of it"));
        assert_eq!(rec.job, job, "effect {key}: ledger job");
        assert_eq!(
            rec.generation,
            Generation(recorded_by),
            "effect {key}: the generation the ledger says recorded it"
        );
        assert_eq!(
            rec.outcome,
            json!({ "applied_by": applied_by }),
            "effect {key}: the recorded outcome is not the effect that happened"
        );
    }

    /// Every done job had its effect exactly once and the ledger holds it, with the
    /// outcome of the act that happened; no effect happened twice. Returns the number
    /// of done jobs.
    pub async fn assert_done_jobs_have_their_effects(&self) -> usize {
        self.assert_no_duplicate_effects().await;
        let applied = self.effects_applied().await;
        let done: Vec<i64> = sqlx::query_scalar(&format!(
            "SELECT id FROM {} WHERE state = 'done' ORDER BY id",
            self.table("jobs")
        ))
        .fetch_all(&self.pool)
        .await
        .unwrap();
        for &id in &done {
            let key = effect_key(self, JobId(id)).await;
            let by = applied
                .get(&key)
                .unwrap_or_else(|| panic!("job {id} is done but its effect never happened"));
            let rec = self
                .ledger(JobId(id))
                .await
                .unwrap_or_else(|| panic!("job {id} is done but the ledger has no effect {key}"));
            assert_eq!(
                rec.outcome,
                json!({ "applied_by": by[0] }),
                "job {id}: the ledger's outcome is not the effect that happened"
            );
        }
        done.len()
    }
}
