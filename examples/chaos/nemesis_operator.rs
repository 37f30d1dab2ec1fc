//! Faults an operator makes: hold (and release) pending jobs, cancel recent jobs, and
//! cancel running keyed heads that have successors waiting; and neighbours: cancel
//! notifications that no row backs (`neighbour_cancel_hint`), and another schema's jobs,
//! whose ids are this schema's, applying their effects at the same effect store
//! (`neighbour_schema_effects`).
//!
//! A cancel of a running job is a request (see the design): the key must not move on
//! while that attempt may still run. `cancel_running_head` aims at exactly that case,
//! preferring the cancel-chain scenario's long heads.

use std::sync::Arc;
use std::time::Duration;

use leasehold::JobId;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use tokio::task::JoinHandle;

use crate::harness::Harness;
use crate::model::FaultRecord;
use crate::nemesis::{record, record_with, Planned, Start};

pub async fn inject(h: &Arc<Harness>, p: &Planned, rng: &mut StdRng) -> Option<JoinHandle<()>> {
    let start = Start::now();
    let kind = p.kind;
    match kind {
        "manual_hold" => {
            let candidates: Vec<i64> = h
                .seen
                .lock()
                .unwrap()
                .delayed
                .iter()
                .rev()
                .take(30)
                .copied()
                .collect();
            let chosen: Vec<i64> = candidates
                .choose_multiple(rng, p.n as usize)
                .copied()
                .collect();
            let mut held = Vec::new();
            for id in chosen {
                let r = tokio::time::timeout(Duration::from_secs(5), h.store.hold(JobId(id))).await;
                if matches!(r, Ok(Ok(()))) {
                    held.push(id);
                }
            }
            record(
                h,
                kind,
                "jobs".into(),
                start,
                !held.is_empty(),
                format!("held {held:?}; release after {}ms", p.dur_ms),
            );
            // Nothing held: no release to wait for, and the nemesis tries the kind again
            // later (it only retries a fault that returns no task).
            if held.is_empty() {
                return None;
            }
            let h2 = h.clone();
            let after = p.dur_ms;
            Some(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(after)).await;
                let start = Start::now();
                let mut released = 0;
                for id in &held {
                    let r = tokio::time::timeout(
                        Duration::from_secs(5),
                        h2.store.release_hold(JobId(*id)),
                    )
                    .await;
                    released += matches!(r, Ok(Ok(()))) as u32;
                }
                record(
                    &h2,
                    "manual_release",
                    "jobs".into(),
                    start,
                    released > 0,
                    format!("released {released} of {}", held.len()),
                );
            }))
        }
        "manual_cancel" => {
            let candidates: Vec<i64> = h
                .seen
                .lock()
                .unwrap()
                .recent
                .iter()
                .rev()
                .take(200)
                .copied()
                .collect();
            let chosen: Vec<i64> = candidates
                .choose_multiple(rng, p.n as usize)
                .copied()
                .collect();
            let mut cancelled = Vec::new();
            for id in chosen {
                let r = tokio::time::timeout(
                    Duration::from_secs(5),
                    h.store.cancel(JobId(id), "chaos operator cancel"),
                )
                .await;
                // Ok(_): `()` today, a `CancelOutcome` after the hardening.
                if matches!(r, Ok(Ok(_))) {
                    cancelled.push(id);
                }
            }
            record(
                h,
                kind,
                "jobs".into(),
                start,
                !cancelled.is_empty(),
                format!("cancelled {cancelled:?}"),
            );
            None
        }
        "cancel_running_head" => {
            cancel_running_head(h, p).await;
            None
        }
        "neighbour_cancel_hint" => {
            neighbour_cancel_hint(h, p).await;
            None
        }
        "neighbour_schema_effects" => {
            neighbour_schema_effects(h, p).await;
            None
        }
        _ => unreachable!("not an operator fault: {kind}"),
    }
}

/// Cancel running keyed heads that have successors waiting (the cancel-chain workload
/// makes such heads long on purpose).
async fn cancel_running_head(h: &Arc<Harness>, p: &Planned) {
    let start = Start::now();
    let heads: Vec<i64> = sqlx::query_scalar(
        "SELECT j.id FROM leasehold.jobs j WHERE j.state = 'running' AND j.job_key IS NOT NULL \
         AND EXISTS (SELECT 1 FROM leasehold.jobs w WHERE w.queue = j.queue \
                     AND w.job_key = j.job_key AND w.state = 'waiting') \
         ORDER BY (j.job_key LIKE 'cx-%') DESC, random() LIMIT $1",
    )
    .bind(p.n.max(1) as i64)
    .fetch_all(&h.admin)
    .await
    .unwrap_or_default();
    let mut done = Vec::new();
    let mut outcomes = Vec::new();
    for id in heads {
        let r = tokio::time::timeout(
            Duration::from_secs(5),
            h.store
                .cancel(JobId(id), "chaos operator cancels a running head"),
        )
        .await;
        match r {
            Ok(Ok(outcome)) => {
                done.push(id);
                // A `CancelOutcome`: `Requested` for a running head.
                outcomes.push(format!("{id}: {outcome:?}"));
            }
            Ok(Err(e)) => outcomes.push(format!("{id}: {e}")),
            Err(_) => outcomes.push(format!("{id}: timed out")),
        }
    }
    let mut fr = FaultRecord::new(
        p.kind,
        "jobs".into(),
        start.us,
        !done.is_empty(),
        format!("cancelled running heads: {}", outcomes.join(", ")),
    );
    fr.jobs = done;
    record_with(h, start, fr);
}

/// A neighbour that looks like a cancel: an enqueue into schema `cancel_leasehold` (once
/// the wake-up channel of that schema was this one's cancel channel) into queues named
/// like running jobs' ids, and a bare NOTIFY of those ids on this schema's own cancel
/// channel. No row records a cancel, so no handler may stop for it (the checker's
/// `cancelled_unasked` rule).
async fn neighbour_cancel_hint(h: &Arc<Harness>, p: &Planned) {
    let start = Start::now();
    let running: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM leasehold.jobs WHERE state = 'running' ORDER BY random() LIMIT $1",
    )
    .bind(p.n.max(1) as i64)
    .fetch_all(&h.admin)
    .await
    .unwrap_or_default();
    let neighbour = leasehold::Store::new(
        h.admin.clone(),
        "cancel_leasehold",
        leasehold::StoreOptions::default(),
    )
    .expect("a valid schema name");
    let mut sent = 0;
    if neighbour.migrate().await.is_ok() {
        for id in &running {
            let job = leasehold::NewJob::from_json("neighbour", serde_json::json!({}))
                .with_queue(id.to_string());
            sent += neighbour.enqueue(job).await.is_ok() as u32;
        }
    }
    for id in &running {
        let r = sqlx::query("SELECT pg_notify($1, $2)")
            .bind(h.store.schema().cancel_channel())
            .bind(id.to_string())
            .execute(&h.admin)
            .await;
        sent += r.is_ok() as u32;
    }
    let mut fr = FaultRecord::new(
        p.kind,
        "jobs".into(),
        start.us,
        sent > 0,
        format!("cancel hints without a cancel for running {running:?} ({sent} sent)"),
    );
    fr.jobs = running;
    record_with(h, start, fr);
}

/// The worker name a neighbour schema's effects carry at the effect server.
pub const NEIGHBOUR_WORKER: &str = "neighbour";

/// A service on schema `leasehold_neighbour` of the same database runs `p.n` jobs (ids
/// from 1, as this schema's) and applies each one's effect `s0` at the same effect
/// store, under the key the library makes for it. Each is a new effect: the checker's
/// `neighbour_effect_shared` rule wants every one applied, never answered with another
/// job's receipt, and keeps them out of this schema's rules.
async fn neighbour_schema_effects(h: &Arc<Harness>, p: &Planned) {
    let start = Start::now();
    let neighbour = leasehold::Store::new(
        h.admin.clone(),
        "leasehold_neighbour",
        leasehold::StoreOptions::default(),
    )
    .expect("a valid schema name");
    let owner = leasehold::OwnerId::named("neighbour");
    let mut decisions = Vec::new();
    let outcome: Result<(), String> = async {
        neighbour
            .migrate()
            .await
            .map_err(|e| format!("migrate: {e}"))?;
        for _ in 0..p.n.max(1) {
            let job = leasehold::NewJob::from_json("neighbour_charge", serde_json::json!({}));
            neighbour
                .enqueue(job)
                .await
                .map_err(|e| format!("enqueue: {e}"))?;
        }
        let req = leasehold::ClaimRequest::new(
            owner.clone(),
            vec!["default".to_string()],
            p.n.max(1) as i64,
            Duration::from_secs(30),
        );
        for job in neighbour
            .claim(&req)
            .await
            .map_err(|e| format!("claim: {e}"))?
        {
            let key = leasehold::EffectKey::new(&job.effect_identity, job.id, "s0");
            let reply = crate::effects::apply(
                &h.effects.addr.to_string(),
                &crate::effects::ApplyRequest {
                    effect_key: key.to_string(),
                    job: job.id.0,
                    step: "s0".into(),
                    generation: job.generation.0,
                    key: None,
                    key_seq: None,
                    fingerprint: format!("neighbour-{}", job.id),
                    worker: NEIGHBOUR_WORKER.into(),
                },
            )
            .await?;
            decisions.push(format!("{}: {}", job.id, reply.decision));
            let _ = neighbour.complete(&job.fence(), None).await;
        }
        Ok(())
    }
    .await;
    let fr = FaultRecord::new(
        p.kind,
        "neighbour".into(),
        start.us,
        outcome.is_ok() && !decisions.is_empty(),
        format!("neighbour schema's effects: {decisions:?} ({outcome:?})"),
    );
    record_with(h, start, fr);
}
