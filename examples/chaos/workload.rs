//! The seeded workload: a mix of keyed and unkeyed jobs, hot keys, external effects,
//! failures that retry, and bad input. Every enqueue is logged with its outcome
//! (`ok` with the id, `info` when the outcome is unknown, `refused` for a typed error).
//! The scenarios that need a shape rather than a mix (floods, chains, poison) are in
//! [`crate::scenarios`].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold::{Error, NewJob, Store};
use rand::rngs::StdRng;
use rand::Rng;
use serde_json::json;

use crate::harness::Harness;
use crate::kinds::Work;
use crate::model::{now_us, EnqueueRecord, Jsonl};
use crate::profile::Profile;

pub const UNKNOWN_KIND: &str = "no_such_kind";

/// One job to enqueue, with what the checker should expect of it.
pub struct Spec {
    pub cid: u64,
    pub kind: String,
    pub key: Option<String>,
    pub payload: serde_json::Value,
    pub max_attempts: i32,
    pub delay_ms: u64,
    /// Claim order: lower first (0 unless a scenario says otherwise).
    pub priority: i16,
    pub expect: &'static str,
    /// The scenario that made it (see [`crate::scenarios`]).
    pub scenario: Option<&'static str>,
}

impl Spec {
    pub fn new(cid: u64, kind: &str, payload: serde_json::Value, expect: &'static str) -> Spec {
        Spec {
            cid,
            kind: kind.into(),
            key: None,
            payload,
            max_attempts: 12,
            delay_ms: 0,
            priority: 0,
            expect,
            scenario: None,
        }
    }

    fn job(&self) -> NewJob {
        let mut j = NewJob::from_json(self.kind.clone(), self.payload.clone())
            .with_max_attempts(self.max_attempts);
        if let Some(k) = &self.key {
            j = j.with_key(k.clone());
        }
        if self.delay_ms > 0 {
            j = j.with_delay(Duration::from_millis(self.delay_ms));
        }
        if self.priority != 0 {
            j = j.with_priority(self.priority);
        }
        j
    }

    fn record(&self, status: &str, id: Option<i64>, error: Option<String>) -> EnqueueRecord {
        EnqueueRecord {
            cid: self.cid,
            kind: self.kind.clone(),
            key: self.key.clone(),
            status: status.into(),
            id,
            error,
            expect: self.expect.into(),
            max_attempts: self.max_attempts,
            t_us: now_us(),
            scenario: self.scenario.map(str::to_string),
        }
    }
}

pub fn work(cid: u64) -> Work {
    Work {
        cid,
        ..Default::default()
    }
}

pub fn to_json(w: &Work) -> serde_json::Value {
    serde_json::to_value(w).unwrap()
}

pub struct Generator {
    pub profile: Profile,
    next_cid: u64,
}

impl Generator {
    pub fn new(profile: Profile) -> Self {
        Generator {
            profile,
            next_cid: 1,
        }
    }

    pub fn cid(&mut self) -> u64 {
        let c = self.next_cid;
        self.next_cid += 1;
        c
    }

    pub fn key(&self, rng: &mut StdRng) -> String {
        let p = &self.profile;
        if rng.gen_bool(0.3) {
            format!("hot-{}", rng.gen_range(0..p.hot_keys))
        } else {
            format!("acct-{}", rng.gen_range(0..p.keys))
        }
    }

    /// The fixed bad-input set enqueued at the start (so every guarded path is reached
    /// whatever the random mix does), plus one of each hard case.
    pub fn bad_input(&mut self) -> Vec<Spec> {
        let mut out = Vec::new();
        for i in 0..4 {
            let cid = self.cid();
            out.push(Spec {
                cid,
                kind: "strict".into(),
                key: None,
                payload: json!({ "cid": cid, "amount": "lots" }),
                max_attempts: 12,
                delay_ms: 0,
                priority: 0,
                expect: "dead",
                scenario: None,
            });
            let cid = self.cid();
            out.push(Spec {
                cid,
                kind: UNKNOWN_KIND.into(),
                key: None,
                payload: json!({ "cid": cid }),
                max_attempts: 12,
                delay_ms: 0,
                priority: 0,
                expect: "unknown_kind",
                scenario: None,
            });
            let cid = self.cid();
            let mut w = work(cid);
            w.fail_first = if i % 2 == 0 { 1 } else { 99 };
            out.push(Spec {
                cid,
                kind: "panicky".into(),
                key: None,
                payload: to_json(&w),
                max_attempts: 3,
                delay_ms: 0,
                priority: 0,
                expect: if i % 2 == 0 { "done" } else { "dead" },
                scenario: None,
            });
            let cid = self.cid();
            let mut w = work(cid);
            w.fail_first = 1;
            out.push(Spec {
                cid,
                kind: "hang".into(),
                key: None,
                payload: to_json(&w),
                max_attempts: 12,
                delay_ms: 0,
                priority: 0,
                expect: "done",
                scenario: None,
            });
            let cid = self.cid();
            let mut w = work(cid);
            w.fail_first = 1;
            w.permanent = true;
            out.push(Spec {
                cid,
                kind: "flaky".into(),
                key: None,
                payload: to_json(&w),
                max_attempts: 12,
                delay_ms: 0,
                priority: 0,
                expect: "dead",
                scenario: None,
            });
        }
        out
    }

    /// A payload nested past serde_json's recursion limit, through the enqueue API: the
    /// library must refuse it (`Error::InvalidPayload`) rather than store a job no
    /// claim can decode. (The `deep` scenario writes such rows with raw SQL instead.)
    pub fn too_deep(&mut self) -> Spec {
        let cid = self.cid();
        let mut deep = json!(1);
        for _ in 0..crate::scenarios::DEEP_NESTING {
            deep = json!({ "a": deep });
        }
        Spec {
            cid,
            kind: "charge".into(),
            key: None,
            payload: json!({ "cid": cid, "deep": deep }),
            max_attempts: 3,
            delay_ms: 0,
            priority: 0,
            expect: "refused",
            scenario: Some("deep_via_api"),
        }
    }

    pub fn oversized(&mut self) -> Spec {
        let cid = self.cid();
        let mut w = work(cid);
        w.pad = Some("x".repeat(300 * 1024));
        Spec {
            cid,
            kind: "charge".into(),
            key: None,
            payload: to_json(&w),
            max_attempts: 12,
            delay_ms: 0,
            priority: 0,
            expect: "refused",
            scenario: None,
        }
    }

    pub fn probe(&mut self, i: usize) -> Spec {
        let cid = self.cid();
        let mut w = work(cid);
        w.steps = 1;
        Spec {
            cid,
            kind: "charge".into(),
            key: i.is_multiple_of(2).then(|| format!("probe-{}", i % 8)),
            payload: to_json(&w),
            max_attempts: 12,
            delay_ms: 0,
            priority: 0,
            expect: "probe",
            scenario: None,
        }
    }

    /// One job from the random mix.
    pub fn draw(&mut self, rng: &mut StdRng) -> Spec {
        let cid = self.cid();
        let mut w = work(cid);
        let lease = self.profile.lease_ms as f64;
        let roll = rng.gen_range(0..1000);
        let mut spec = Spec {
            cid,
            kind: "charge".into(),
            key: None,
            payload: json!(null),
            max_attempts: 12,
            delay_ms: 0,
            priority: 0,
            expect: "done",
            scenario: None,
        };
        match roll {
            0..=349 => {
                spec.key = Some(self.key(rng));
                w.steps = if rng.gen_bool(0.8) { 1 } else { 2 };
                w.sleep_ms = rng.gen_range(0..30);
                w.fail_first = rng.gen_bool(0.1) as i32;
            }
            350..=549 => {
                w.steps = rng.gen_range(0..=2);
                w.sleep_ms = rng.gen_range(0..40);
                w.fail_first = rng.gen_bool(0.1) as i32;
                if rng.gen_bool(0.25) {
                    spec.delay_ms = rng.gen_range(1000..4000);
                }
            }
            550..=659 => {
                spec.kind = "flaky".into();
                w.fail_first = rng.gen_range(1..=3);
                if rng.gen_bool(0.15) {
                    spec.max_attempts = w.fail_first;
                    spec.expect = "dead";
                }
            }
            660..=709 => {
                // Outlives its lease (renewal keeps it), stays within the max run time.
                // Half apply an effect at the end; the others go straight to completion,
                // so a stale attempt meets the completion fence, not the ledger's.
                spec.kind = "slow".into();
                w.sleep_ms = (lease * rng.gen_range(1.3..1.8)) as u64;
                w.steps = rng.gen_bool(0.5) as u8;
                w.effects_last = true;
                w.ignore_cancel = w.steps == 0 && rng.gen_bool(0.5);
                if rng.gen_bool(0.3) {
                    spec.key = Some(self.key(rng));
                }
            }
            710..=749 => {
                spec.kind = "panicky".into();
                if rng.gen_bool(0.8) {
                    w.fail_first = 1;
                } else {
                    w.fail_first = 99;
                    spec.max_attempts = 3;
                    spec.expect = "dead";
                }
            }
            750..=759 => {
                spec.kind = "hang".into();
                w.fail_first = 1;
            }
            760..=789 => {
                spec.kind = "strict".into();
                spec.expect = "dead";
                spec.payload = json!({ "cid": cid, "amount": "lots" });
                return spec;
            }
            790..=809 => {
                spec.kind = "strict".into();
                spec.payload = json!({ "cid": cid, "amount": 7 });
                return spec;
            }
            810..=819 => {
                spec.kind = UNKNOWN_KIND.into();
                spec.expect = "unknown_kind";
                spec.payload = json!({ "cid": cid });
                return spec;
            }
            820..=869 => {
                spec.delay_ms = rng.gen_range(1000..4000);
                w.steps = 1;
            }
            _ => {}
        }
        spec.payload = to_json(&w);
        spec
    }
}

/// Enqueue the random mix through the fault phase (and the bad input first), at the
/// profile's rate; returns the generator for the probes after the faults.
pub async fn run(
    h: Arc<Harness>,
    mut gen: Generator,
    mut rng: StdRng,
    phase_end: tokio::time::Instant,
) -> Generator {
    let profile = h.profile.clone();
    let bad = gen.bad_input();
    enqueue_batch(&h.store, bad, &h.enqueue_log, &h.seen).await;
    enqueue_batch(&h.store, vec![gen.too_deep()], &h.enqueue_log, &h.seen).await;
    let ticks = (profile.fault_phase.as_millis() / 100).max(1) as f64;
    let per_tick = profile.jobs as f64 / ticks;
    let mut owed = 0.0;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    while tokio::time::Instant::now() < phase_end {
        tick.tick().await;
        owed += per_tick;
        let n = owed.floor() as usize;
        owed -= n as f64;
        let specs: Vec<_> = (0..n).map(|_| gen.draw(&mut rng)).collect();
        let (single, batch): (Vec<_>, Vec<_>) = specs.into_iter().partition(|_| rng.gen_bool(0.05));
        enqueue_batch(&h.store, batch, &h.enqueue_log, &h.seen).await;
        for s in single {
            enqueue_batch(&h.store, vec![s], &h.enqueue_log, &h.seen).await;
        }
        if rng.gen_bool(0.01) {
            enqueue_batch(&h.store, vec![gen.oversized()], &h.enqueue_log, &h.seen).await;
        }
    }
    enqueue_batch(&h.store, vec![gen.oversized()], &h.enqueue_log, &h.seen).await;
    gen
}

/// Shared by the generator and the nemesis: ids the operator may act on.
#[derive(Default)]
pub struct Enqueued {
    /// Recently acknowledged ids (bounded).
    pub recent: std::collections::VecDeque<i64>,
    /// Recently acknowledged delayed ids (pending for a while: holdable).
    pub delayed: std::collections::VecDeque<i64>,
    pub refused: std::collections::BTreeMap<String, u64>,
    pub ok: u64,
    pub unknown: u64,
}

/// Enqueue a batch (all or none) and log each job's outcome.
pub async fn enqueue_batch(
    store: &Store,
    specs: Vec<Spec>,
    log: &Mutex<Jsonl>,
    seen: &Arc<Mutex<Enqueued>>,
) {
    if specs.is_empty() {
        return;
    }
    let jobs: Vec<NewJob> = specs.iter().map(Spec::job).collect();
    let res = tokio::time::timeout(Duration::from_secs(8), store.enqueue_many(jobs)).await;
    let mut log = log.lock().unwrap();
    let mut seen = seen.lock().unwrap();
    match res {
        Ok(Ok(ids)) => {
            for (s, id) in specs.iter().zip(ids) {
                log.write(&s.record("ok", Some(id.0), None));
                seen.ok += 1;
                seen.recent.push_back(id.0);
                if seen.recent.len() > 400 {
                    seen.recent.pop_front();
                }
                if s.delay_ms > 0 {
                    seen.delayed.push_back(id.0);
                    if seen.delayed.len() > 100 {
                        seen.delayed.pop_front();
                    }
                }
            }
        }
        Ok(Err(e)) => {
            let typed = !matches!(e, Error::Database(_));
            for s in &specs {
                if typed {
                    *seen.refused.entry(error_kind(&e)).or_default() += 1;
                    log.write(&s.record("refused", None, Some(e.to_string())));
                } else {
                    seen.unknown += 1;
                    log.write(&s.record("info", None, Some(e.to_string())));
                }
            }
        }
        Err(_) => {
            for s in &specs {
                seen.unknown += 1;
                log.write(&s.record("info", None, Some("enqueue timed out".into())));
            }
        }
    }
}

pub fn error_kind(e: &Error) -> String {
    match e {
        Error::PayloadTooLarge { .. } => "payload_too_large".into(),
        Error::InvalidPayload(_) => "invalid_payload".into(),
        Error::InvalidInput { .. } => "invalid_input".into(),
        Error::UnknownKind(_) => "unknown_kind".into(),
        other => format!("other: {other}"),
    }
}
