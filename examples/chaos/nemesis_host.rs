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
//! - `host_bad_input`: a host transaction makes calls the library refuses (a payload
//!   nested too deep, a key too long to index, a NUL in a kind), then a good
//!   `enqueue_in`, and commits. The refused calls must write nothing and leave the
//!   transaction usable: the good job must exist (`lost`), the refused ones must not
//!   (`bad_input`), and the commit must not fail for them (`host_tx_broken`).
//! - `informational_write_fails`: the database refuses every write to the schedulers'
//!   heartbeat table for a while (a trigger, as a DBA's audit or a revoked grant would).
//!   The heartbeat is informational: the reapers must go on reaping expired leases on
//!   time (`reap_late`).
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
        "host_bad_input" => {
            let key = format!("hot-{}", rng.gen_range(0..h.profile.hot_keys));
            let long_key: String = (0..3000)
                .map(|_| char::from(rng.gen_range(b'!'..=b'~')))
                .collect();
            host_bad_input(h, p, key, long_key).await;
            None
        }
        "informational_write_fails" => Some(tokio::spawn(refuse_heartbeats(h.clone(), p.clone()))),
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

/// The calls a host makes that the library must refuse, each with what makes it bad.
fn refused_calls(
    cid: &mut impl FnMut() -> u64,
    long_key: &str,
) -> Vec<(u64, &'static str, NewJob)> {
    let mut deep = serde_json::json!(1);
    for _ in 0..crate::scenarios::DEEP_NESTING {
        deep = serde_json::json!({ "a": deep });
    }
    let (a, b, c) = (cid(), cid(), cid());
    vec![
        (
            a,
            "payload nested too deep",
            NewJob::from_json("charge", serde_json::json!({ "cid": a, "deep": deep })),
        ),
        (
            b,
            "key of 3,000 bytes that does not compress",
            NewJob::from_json("charge", serde_json::json!({ "cid": b, "steps": 1 }))
                .with_key(long_key.to_string()),
        ),
        (
            c,
            "NUL in the kind",
            NewJob::from_json("char\0ge", serde_json::json!({ "cid": c, "steps": 1 })),
        ),
    ]
}

/// A host transaction: calls the library refuses, then one good `enqueue_in` for a hot
/// key, then commit. Every call is logged as an enqueue (the refused ones `refused`, the
/// good one `ok` once committed).
async fn host_bad_input(h: &Arc<Harness>, p: &Planned, key: String, long_key: String) {
    let start = Start::now();
    let mut next = || h.next_cid.fetch_add(1, SeqCst);
    let bad = refused_calls(&mut next, &long_key);
    let good_cid = next();
    let good = NewJob::from_json("charge", serde_json::json!({ "cid": good_cid, "steps": 1 }))
        .with_key(key.clone())
        .with_max_attempts(12);
    let record = |cid: u64, kind: &str, key: Option<String>, expect: &str| EnqueueRecord {
        cid,
        kind: kind.into(),
        key,
        status: "info".into(),
        id: None,
        error: None,
        expect: expect.into(),
        max_attempts: 12,
        t_us: now_us(),
        scenario: Some(p.kind.to_string()),
    };
    let mut records = Vec::new();
    let outcome: Result<(), String> = async {
        let mut tx = h.host.begin().await.map_err(|e| format!("begin: {e}"))?;
        for (cid, what, job) in bad {
            let mut rec = record(cid, "charge", None, "refused");
            match h.store.enqueue_in(&mut tx, job).await {
                Ok(id) => {
                    rec.status = "ok".into();
                    rec.id = Some(id.0);
                    rec.error = Some(format!("{what}: accepted"));
                }
                Err(e) => {
                    rec.status = "refused".into();
                    rec.error = Some(format!("{what}: {e}"));
                }
            }
            records.push(rec);
        }
        let mut rec = record(good_cid, "charge", Some(key.clone()), "done");
        let enqueued = h.store.enqueue_in(&mut tx, good).await;
        let committed = match enqueued {
            Ok(id) => {
                rec.id = Some(id.0);
                tx.commit().await.map_err(|e| format!("commit: {e}"))
            }
            Err(e) => Err(format!("enqueue_in after the refused calls: {e}")),
        };
        match &committed {
            Ok(()) => rec.status = "ok".into(),
            Err(e) => {
                rec.error = Some(e.clone());
                rec.id = None;
            }
        }
        records.push(rec);
        committed
    }
    .await;
    {
        let mut log = h.enqueue_log.lock().unwrap();
        for mut rec in records {
            rec.t_us = now_us();
            log.write(&rec);
        }
    }
    let mut fr = FaultRecord::new(
        p.kind,
        "host".into(),
        start.us,
        outcome.is_ok(),
        format!("refused calls, then enqueue_in for {key} and commit: {outcome:?}"),
    );
    fr.key = Some(key);
    record_with(h, start, fr);
}

/// Refuse every write to the heartbeat table for `p.dur_ms` (a trigger), then allow
/// them again.
async fn refuse_heartbeats(h: Arc<Harness>, p: Planned) {
    let start = Start::now();
    let s = h.store.schema().quoted().to_string();
    let refuse = format!(
        "CREATE OR REPLACE FUNCTION {s}.chaos_refuse_write() RETURNS trigger LANGUAGE plpgsql AS \
         $f$BEGIN RAISE EXCEPTION 'chaos: this write is refused'; END$f$; \
         CREATE TRIGGER chaos_refuse_heartbeat BEFORE INSERT OR UPDATE OR DELETE \
         ON {s}.schedulers FOR EACH ROW EXECUTE FUNCTION {s}.chaos_refuse_write()"
    );
    let armed = sqlx::raw_sql(&refuse).execute(&h.admin).await;
    if armed.is_ok() {
        tokio::time::sleep(Duration::from_millis(p.dur_ms)).await;
    }
    // Disarmed whatever happened (a database restart meanwhile included), tried until it
    // takes.
    let mut disarmed = false;
    for _ in 0..50 {
        let drop = format!(
            "DROP TRIGGER IF EXISTS chaos_refuse_heartbeat ON {s}.schedulers; \
             DROP FUNCTION IF EXISTS {s}.chaos_refuse_write()"
        );
        if sqlx::raw_sql(&drop).execute(&h.admin).await.is_ok() {
            disarmed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let fr = FaultRecord::new(
        p.kind,
        "schedulers".into(),
        start.us,
        armed.is_ok(),
        format!(
            "heartbeat writes refused for {}ms ({:?}); allowed again: {disarmed}",
            p.dur_ms,
            armed.err()
        ),
    );
    record_with(&h, start, fr);
}
