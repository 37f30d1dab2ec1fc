//! The nemesis: a fault schedule drawn from the seed, applied during the fault phase.
//!
//! The schedule opens with every fault kind once (in a seeded order), then draws from
//! a weighted menu. Faults on one worker never overlap, at least one worker is always
//! left running, and only one database-wide fault runs at a time. A fault that found
//! nothing to hit (no listener connected at that moment, no holdable job) is retried
//! until its kind has been hit once: a run that misses a kind fails the check.
//!
//! The faults a host makes (a long transaction holding a hot key, a session locking
//! running rows) are in [`crate::nemesis_host`]; an operator's (hold, cancel, cancel of
//! a running head) in [`crate::nemesis_operator`].

use std::collections::VecDeque;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::Duration;

use leasehold::OwnerId;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::harness::{Harness, WorkerSlot};
use crate::model::FaultRecord;
use crate::procs;
use crate::proxy::Mode;

pub use crate::nemesis_plan::{plan, Planned, Start, FAULTS};

/// Run the schedule until `phase_end`. Returns the tasks still healing (SIGCONT, end
/// of a blackhole...), for the caller to await.
pub async fn run(h: Arc<Harness>, mut rng: StdRng, phase_end: Instant) -> Vec<JoinHandle<()>> {
    let schedule = plan(&mut rng, h.profile.lease_ms, h.profile.gap_ms, 20_000);
    let mut background = Vec::new();
    // Faults that found nothing to hit, retried (interleaved with the schedule, a few
    // times each) until their kind has been hit once.
    let mut retry: VecDeque<(Planned, u32)> = VecDeque::new();
    let mut planned = schedule.into_iter();
    let mut turn = 0u64;
    // Let the workers come up and the queue fill first.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    while Instant::now() < phase_end {
        turn += 1;
        let (p, tries) = match turn.is_multiple_of(2).then(|| retry.pop_front()).flatten() {
            Some(r) => r,
            None => match planned.next() {
                Some(p) => (p, 0),
                None => break,
            },
        };
        tokio::time::sleep(Duration::from_millis(p.gap_ms)).await;
        let hits = |h: &Harness| {
            h.fault_counts
                .lock()
                .unwrap()
                .get(p.kind)
                .map(|c| c.1)
                .unwrap_or(0)
        };
        match inject(&h, &p, &mut rng).await {
            Some(task) => background.push(task),
            None => {
                if hits(&h) == 0 && tries < 3 {
                    retry.push_back((p.clone(), tries + 1));
                }
            }
        }
        background.retain(|t: &JoinHandle<()>| !t.is_finished());
    }
    background
}

pub fn record(h: &Harness, kind: &str, target: String, start: Start, hit: bool, detail: String) {
    record_with(
        h,
        start,
        FaultRecord::new(kind, target, start.us, hit, detail),
    );
}

/// Record a fault built by the caller (with the jobs or key it acted on).
pub fn record_with(h: &Harness, start: Start, mut rec: FaultRecord) {
    rec.start_us = start.us;
    rec.start_mono_ns = start.mono;
    if std::env::var("CHAOS_QUIET").is_err() {
        println!(
            "chaos: fault {:<22} {:<4} hit={} {}",
            rec.kind, rec.target, rec.hit, rec.detail
        );
    }
    h.record_fault(rec);
}

/// Pick an idle worker and mark it busy. `stopping`: the fault takes the worker out, so
/// at least one other worker must stay up.
pub async fn pick(h: &Harness, target: usize, stopping: bool) -> Option<Arc<WorkerSlot>> {
    for _ in 0..25 {
        let busy = h.slots.iter().filter(|s| s.busy.load(SeqCst)).count();
        if !(stopping && busy + 1 >= h.slots.len()) {
            let idle: Vec<_> = h
                .slots
                .iter()
                .filter(|s| !s.busy.load(SeqCst) && s.proc.lock().unwrap().is_some())
                .collect();
            if !idle.is_empty() {
                let s = idle[target % idle.len()].clone();
                if s.busy.compare_exchange(false, true, SeqCst, SeqCst).is_ok() {
                    return Some(s);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    None
}

/// The proxies recognise the lease renewer's connection by its application_name.
const RENEWER: &str = "leasehold-renewer";

/// A worker running a long job claimed within the last second, if any.
async fn fresh_long_job_worker(h: &Harness) -> Option<usize> {
    let owners: Vec<String> = sqlx::query_scalar(
        "SELECT owner FROM leasehold.jobs WHERE state = 'running' AND kind = 'slow' \
         AND claimed_at > now() - interval '1 second'",
    )
    .fetch_all(&h.admin)
    .await
    .unwrap_or_default();
    h.slots
        .iter()
        .position(|s| h.owner_of(s).map(|o| owners.contains(&o)).unwrap_or(false))
}

/// [`pick`], preferring the worker at index `preferred` when it is idle.
pub async fn pick_preferring(
    h: &Harness,
    preferred: Option<usize>,
    target: usize,
    stopping: bool,
) -> Option<Arc<WorkerSlot>> {
    if let Some(s) = preferred.and_then(|i| h.slots.get(i)) {
        let busy = h.slots.iter().filter(|s| s.busy.load(SeqCst)).count();
        let may = !(stopping && busy + 1 >= h.slots.len()) && s.proc.lock().unwrap().is_some();
        if may && s.busy.compare_exchange(false, true, SeqCst, SeqCst).is_ok() {
            return Some(s.clone());
        }
    }
    pick(h, target, stopping).await
}

fn pid_of(slot: &WorkerSlot) -> Option<u32> {
    slot.proc.lock().unwrap().as_ref().map(|r| r.child.id())
}

/// Apply one fault. Long faults return their healing task.
async fn inject(h: &Arc<Harness>, p: &Planned, rng: &mut StdRng) -> Option<JoinHandle<()>> {
    let start = Start::now();
    let kind = p.kind;
    match kind {
        "row_lock"
        | "host_enqueue_commit"
        | "host_enqueue_rollback"
        | "host_bad_input"
        | "informational_write_fails" => crate::nemesis_host::inject(h, p, rng).await,
        "manual_hold"
        | "manual_cancel"
        | "cancel_running_head"
        | "neighbour_cancel_hint"
        | "neighbour_schema_effects" => crate::nemesis_operator::inject(h, p, rng).await,
        "sigkill" => {
            let slot = pick(h, p.target, true).await?;
            let hit = h
                .stop_worker(&slot, libc::SIGKILL, "killed", Duration::from_secs(5))
                .await;
            tokio::time::sleep(Duration::from_millis(p.n)).await;
            let restarted = h.start_worker(&slot);
            slot.busy.store(false, SeqCst);
            record(
                h,
                kind,
                format!("w{}", slot.id),
                start,
                hit,
                format!("restarted after {}ms: {restarted:?}", p.n),
            );
            None
        }
        "sigterm" => {
            // Mid-job: prefer a worker running a long job, so shutdown has to release it.
            let owners: Vec<String> = sqlx::query_scalar(
                "SELECT owner FROM leasehold.jobs WHERE state = 'running' AND kind = 'slow'",
            )
            .fetch_all(&h.admin)
            .await
            .unwrap_or_default();
            let preferred = h
                .slots
                .iter()
                .position(|s| h.owner_of(s).map(|o| owners.contains(&o)).unwrap_or(false));
            let slot = pick(h, preferred.unwrap_or(p.target), true).await?;
            let had_slow = h
                .owner_of(&slot)
                .map(|o| owners.contains(&o))
                .unwrap_or(false);
            let limit = Duration::from_millis(1000 + h.profile.lease_ms + 8000);
            let hit = h
                .stop_worker(&slot, libc::SIGTERM, "terminated", limit)
                .await;
            let restarted = h.start_worker(&slot);
            slot.busy.store(false, SeqCst);
            record(
                h,
                kind,
                format!("w{}", slot.id),
                start,
                hit,
                format!("slow job running: {had_slow}; restarted: {restarted:?}"),
            );
            None
        }
        "proxy_blackhole_renewer" if p.n == 1 => {
            let h = h.clone();
            let p = p.clone();
            Some(tokio::spawn(async move {
                let mut held = 0;
                for slot in &h.slots {
                    held += slot.proxy.partition_app(Some(RENEWER));
                }
                tokio::time::sleep(Duration::from_millis(p.dur_ms)).await;
                let mut closed = 0;
                for slot in &h.slots {
                    closed += slot.proxy.partition_app(None);
                }
                let detail = format!(
                    "every renewer, {}ms (lease {}ms); {held} renewer connection(s) held open, {closed} closed while held",
                    p.dur_ms, h.profile.lease_ms
                );
                record(
                    &h,
                    p.kind,
                    "all".into(),
                    start,
                    held > 0 && closed == 0,
                    detail,
                );
            }))
        }
        "sigstop" | "proxy_blackhole" | "proxy_blackhole_renewer" | "proxy_delay" => {
            // A hung renewal matters while a handler outlives the lease: aim at a worker
            // that has just started a long job.
            let preferred = if kind == "proxy_blackhole_renewer" {
                fresh_long_job_worker(h).await
            } else {
                None
            };
            let slot = pick_preferring(h, preferred, p.target, kind != "proxy_delay").await?;
            let h = h.clone();
            let p = p.clone();
            Some(tokio::spawn(async move {
                let pid = pid_of(&slot);
                let (mut held, mut closed) = (0, 0);
                let hit = match p.kind {
                    "sigstop" => pid
                        .map(|pid| procs::signal(pid, libc::SIGSTOP))
                        .unwrap_or(false),
                    "proxy_blackhole" => {
                        slot.proxy.set(Mode::Blackhole);
                        true
                    }
                    // A partial partition: the worker claims and completes, but its
                    // renewals hang (the connection stays open, nothing comes back), so
                    // its leases expire while it believes it owns them.
                    "proxy_blackhole_renewer" => {
                        held = slot.proxy.partition_app(Some(RENEWER));
                        true
                    }
                    _ => {
                        slot.proxy.set(Mode::Delay(p.n));
                        true
                    }
                };
                tokio::time::sleep(Duration::from_millis(p.dur_ms)).await;
                match p.kind {
                    "sigstop" => {
                        if let Some(pid) = pid {
                            procs::signal(pid, libc::SIGCONT);
                        }
                    }
                    _ => {
                        slot.proxy.set(Mode::Pass);
                        closed = slot.proxy.partition_app(None);
                    }
                }
                slot.busy.store(false, SeqCst);
                let detail = if p.kind == "proxy_delay" {
                    format!("{}ms per chunk for {}ms", p.n, p.dur_ms)
                } else if p.kind == "proxy_blackhole_renewer" {
                    format!(
                        "{}ms (lease {}ms); {held} renewer connection(s) held open, {closed} closed while held",
                        p.dur_ms, h.profile.lease_ms
                    )
                } else {
                    format!("{}ms (lease {}ms)", p.dur_ms, h.profile.lease_ms)
                };
                let hit = hit && (p.kind != "proxy_blackhole_renewer" || (held > 0 && closed == 0));
                record(&h, p.kind, format!("w{}", slot.id), start, hit, detail);
            }))
        }
        "pg_terminate_worker" | "pg_terminate_listener" => {
            let _g = h.pg_lock.lock().await;
            let sql = if kind == "pg_terminate_listener" {
                "SELECT pid FROM pg_stat_activity WHERE datname = 'chaos' AND application_name LIKE 'leasehold-listener%'"
            } else {
                "SELECT pid FROM pg_stat_activity WHERE datname = 'chaos' AND pid <> pg_backend_pid() \
                 AND (application_name LIKE 'chaos-w%' OR application_name LIKE 'leasehold-renewer%' OR application_name LIKE 'leasehold-reaper%')"
            };
            let mut pids: Vec<i32> = sqlx::query_scalar(sql)
                .fetch_all(&h.admin)
                .await
                .unwrap_or_default();
            pids.shuffle(rng);
            let n = if kind == "pg_terminate_listener" {
                1
            } else {
                p.n.max(1) as usize
            };
            let mut killed = 0;
            for pid in pids.iter().take(n) {
                let ok: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
                    .bind(pid)
                    .fetch_one(&h.admin)
                    .await
                    .unwrap_or(false);
                killed += ok as u32;
            }
            record(
                h,
                kind,
                "pg".into(),
                start,
                killed > 0,
                format!("{killed} of {} backends", pids.len()),
            );
            None
        }
        "pg_restart_fast" | "pg_restart_immediate" => {
            let _g = h.pg_lock.lock().await;
            let mode = if kind == "pg_restart_fast" {
                "fast"
            } else {
                "immediate"
            };
            let c = h.cluster.clone();
            let res = tokio::task::spawn_blocking(move || c.restart(mode))
                .await
                .unwrap_or_else(|e| Err(e.to_string()));
            let detail = match &res {
                Ok(d) => format!("down for {}ms", d.as_millis()),
                Err(e) => format!("restart failed: {e}"),
            };
            if let Err(e) = &res {
                // Bring it back whatever happened: the run cannot continue without it.
                eprintln!("chaos: {e}; starting PostgreSQL again");
                let c = h.cluster.clone();
                let _ = tokio::task::spawn_blocking(move || c.start()).await;
            }
            record(h, kind, "pg".into(), start, res.is_ok(), detail);
            None
        }
        "proxy_cut" => {
            let mut cut = 0;
            let target = if p.n == 1 {
                for s in &h.slots {
                    cut += s.proxy.cut();
                }
                "all".to_string()
            } else {
                let s = &h.slots[p.target % h.slots.len()];
                cut += s.proxy.cut();
                format!("w{}", s.id)
            };
            record(
                h,
                kind,
                target,
                start,
                cut > 0,
                format!("{cut} connections cut"),
            );
            None
        }
        "reaper_race" => {
            let _g = h.pg_lock.lock().await;
            let owner = OwnerId::named(crate::check::RACE_REAPER);
            let prof = &h.profile;
            let backoff = leasehold::Backoff {
                base: Duration::from_millis(prof.backoff_base_ms),
                cap: Duration::from_millis(prof.backoff_cap_ms),
                jitter: prof.jitter,
            };
            let ahead = chrono::Duration::milliseconds((prof.lease_ms * 4 / 5) as i64);
            let until = Instant::now() + Duration::from_millis(p.dur_ms.max(500));
            let (mut reaped, mut errors) = (0, 0);
            while Instant::now() < until {
                let at = chrono::Utc::now() + ahead;
                match h.store.reap(&owner, &backoff, 20, Some(at)).await {
                    Ok(r) => reaped += r.retried.len() + r.dead.len(),
                    Err(_) => errors += 1,
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            record(h, kind, "all".into(), start, reaped > 0, format!("reaper with its clock {}ms ahead reaped {reaped} live leases ({errors} errors)", ahead.num_milliseconds()));
            None
        }
        "effect_reply_lost" => {
            let before = h.effects.stats().replies_dropped;
            h.effects.drop_replies(p.n);
            let until = Instant::now() + Duration::from_secs(3);
            while h.effects.stats().replies_dropped == before && Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let dropped = h.effects.stats().replies_dropped - before;
            record(
                h,
                kind,
                "effects".into(),
                start,
                dropped > 0,
                format!("armed {}, dropped {dropped} so far", p.n),
            );
            None
        }
        other => {
            record(
                h,
                other,
                "-".into(),
                start,
                false,
                "unknown fault kind".into(),
            );
            None
        }
    }
}
