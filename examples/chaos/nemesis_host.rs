//! Faults a host service makes without meaning any harm: the things a library inside
//! someone else's service must survive.
//!
//! - `host_enqueue_commit` / `host_enqueue_rollback`: a host transaction calls
//!   `enqueue_in` for a hot key and stays open longer than a lease (then commits, or
//!   rolls back). It holds the key row's lock all that time: the key's head cannot
//!   promote its successor, and a completion that waits on that lock holds its own job
//!   row locked meanwhile. Renewal must not wait behind it.
//! - `row_lock`: a session locks some running job rows (`SELECT … FOR UPDATE`) for
//!   longer than a lease, as a report or a migration might. Those jobs cannot be renewed;
//!   the worker's other jobs must be, and the locked jobs' handlers must be stopped by
//!   their local lease deadline before the lease can pass.
//!
//! Each is recorded with the jobs or key it touched, so the checker can tell the lease
//! expiries it explains (only those jobs, that key) from the ones it does not.

use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::Duration;

use leasehold::NewJob;
use rand::rngs::StdRng;
use rand::Rng;
use tokio::task::JoinHandle;

use crate::harness::Harness;
use crate::model::{now_us, EnqueueRecord, FaultRecord};
use crate::nemesis::{pick_preferring, record_with, Planned, Start};

pub async fn inject(h: &Arc<Harness>, p: &Planned, rng: &mut StdRng) -> Option<JoinHandle<()>> {
    match p.kind {
        "host_enqueue_commit" | "host_enqueue_rollback" => {
            let key = format!("hot-{}", rng.gen_range(0..h.profile.hot_keys));
            Some(tokio::spawn(host_enqueue(h.clone(), p.clone(), key)))
        }
        "row_lock" => row_lock(h, p).await,
        _ => unreachable!("not a host fault: {}", p.kind),
    }
}

/// A host transaction: enqueue one job for a hot key, hold, then commit or roll back.
async fn host_enqueue(h: Arc<Harness>, p: Planned, key: String) {
    let start = Start::now();
    let commit = p.kind == "host_enqueue_commit";
    let cid = h.next_cid.fetch_add(1, SeqCst);
    let job = NewJob::from_json("charge", serde_json::json!({ "cid": cid, "steps": 1 }))
        .with_key(key.clone())
        .with_max_attempts(12);
    let mut rec = EnqueueRecord {
        cid,
        kind: "charge".into(),
        key: Some(key.clone()),
        status: "info".into(),
        id: None,
        error: None,
        expect: "done".into(),
        max_attempts: 12,
        t_us: now_us(),
        scenario: Some(p.kind.to_string()),
    };
    let outcome: Result<(), String> = async {
        let mut tx = h.host.begin().await.map_err(|e| format!("begin: {e}"))?;
        let id = h
            .store
            .enqueue_in(&mut tx, job)
            .await
            .map_err(|e| format!("enqueue_in: {e}"))?;
        rec.id = Some(id.0);
        tokio::time::sleep(Duration::from_millis(p.dur_ms)).await;
        if commit {
            tx.commit().await.map_err(|e| format!("commit: {e}"))?;
            rec.status = "ok".into();
        } else {
            tx.rollback().await.map_err(|e| format!("rollback: {e}"))?;
            rec.status = "rolled_back".into();
            rec.id = None;
        }
        Ok(())
    }
    .await;
    if let Err(e) = &outcome {
        // The outcome of a failed commit is unknown: the checker treats it like any
        // enqueue whose reply was lost (a row may or may not exist).
        rec.error = Some(e.clone());
        rec.status = "info".into();
    }
    rec.t_us = now_us();
    h.enqueue_log.lock().unwrap().write(&rec);
    let mut fr = FaultRecord::new(
        p.kind,
        "host".into(),
        start.us,
        outcome.is_ok(),
        format!(
            "enqueue_in for {key} held open {}ms (lease {}ms), then {}: {outcome:?}",
            p.dur_ms,
            h.profile.lease_ms,
            if commit { "commit" } else { "rollback" }
        ),
    );
    fr.key = Some(key);
    record_with(&h, start, fr);
}

/// Lock `p.n` running rows of one worker for `p.dur_ms`, then roll back.
async fn row_lock(h: &Arc<Harness>, p: &Planned) -> Option<JoinHandle<()>> {
    let busiest: Vec<String> = sqlx::query_scalar(
        "SELECT owner FROM leasehold.jobs WHERE state = 'running' GROUP BY owner ORDER BY count(*) DESC",
    )
    .fetch_all(&h.admin)
    .await
    .unwrap_or_default();
    let preferred = busiest.first().and_then(|o| {
        h.slots
            .iter()
            .position(|s| h.owner_of(s).as_deref() == Some(o.as_str()))
    });
    let slot = pick_preferring(h, preferred, p.target, false).await?;
    let Some(owner) = h.owner_of(&slot) else {
        slot.busy.store(false, SeqCst);
        return None;
    };
    let h = h.clone();
    let p = p.clone();
    Some(tokio::spawn(async move {
        let start = Start::now();
        let locked: Result<Vec<i64>, String> = async {
            let mut tx = h.host.begin().await.map_err(|e| format!("begin: {e}"))?;
            // SKIP LOCKED: a row being completed right now is not worth waiting for.
            let ids: Vec<i64> = sqlx::query_scalar(
                "SELECT id FROM leasehold.jobs WHERE state = 'running' AND owner = $1 \
                 ORDER BY random() LIMIT $2 FOR UPDATE SKIP LOCKED",
            )
            .bind(&owner)
            .bind(p.n as i64)
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| format!("lock: {e}"))?;
            if !ids.is_empty() {
                tokio::time::sleep(Duration::from_millis(p.dur_ms)).await;
            }
            let _ = tx.rollback().await;
            Ok(ids)
        }
        .await;
        slot.busy.store(false, SeqCst);
        let ids = locked.clone().unwrap_or_default();
        let mut fr = FaultRecord::new(
            p.kind,
            format!("w{}", slot.id),
            start.us,
            !ids.is_empty(),
            format!(
                "locked running rows {ids:?} of w{} for {}ms (lease {}ms): {:?}",
                slot.id,
                p.dur_ms,
                h.profile.lease_ms,
                locked.err()
            ),
        );
        fr.jobs = ids;
        record_with(&h, start, fr);
    }))
}
