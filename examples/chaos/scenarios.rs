//! Workload scenarios: shapes of work the random mix would hit too rarely, each aimed at
//! a defect class, on a seeded schedule through the fault phase.
//!
//! - `flood`: more long unkeyed jobs than there are slots, due all at once a moment
//!   after their enqueue, and chains of instant keyed jobs running when they fall due.
//!   The first claim after that reserves every free slot and fills it with long jobs;
//!   a chain whose job had just returned, with a slot to spare, has its successor
//!   claimed in its completion's transaction, and that successor then finds no slot
//!   and waits in-process for one — as long as a long job runs, past the lease, when no
//!   short job is left on that worker to free a slot. Its lease must be renewed
//!   meanwhile, and it must not start on a lease that is gone.
//! - `cancel_chain`: a long keyed head with quick successors, for the nemesis's
//!   `cancel_running_head`. First in claim order (priority -1), so that once the key
//!   moves on its next job starts at once, not behind the backlog.
//! - `dead_head`: a keyed head that fails permanently, with successors behind it: the
//!   key stays blocked by a dead job, which retention must keep.
//! - `poison`: a value with a NUL (PostgreSQL cannot store it), over the result cap or
//!   nested too deep to read back, as the returned result, as a result completed in the
//!   handler's own transaction, or as an effect's outcome; enqueued in one batch with
//!   quick neighbours that must not suffer for it.
//! - `deep`: a payload nested deeper than 128 levels, written with raw SQL (the enqueue
//!   API refuses it once hardened), with neighbours in the same statement so one claim
//!   takes them together.
//! - `txhold`: a handler that completes in its own transaction and holds it open past
//!   the lease on its first attempt; half of them return an error after the commit.
//!
//! Client ids come from the harness's own counter (above the random mix's range).

use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::Rng;
use serde_json::json;
use sqlx::Row;
use tokio::time::Instant;

use crate::harness::Harness;
use crate::model::{now_us, EnqueueRecord};
use crate::workload::{enqueue_batch, to_json, work, Spec};

/// Nesting of the `deep` payloads: past serde_json's recursion limit of 128.
pub const DEEP_NESTING: usize = 200;

/// (scenario, first run at s, every s): the schedule, from the start of the fault phase.
const SCHEDULE: [(&str, f64, f64); 6] = [
    ("flood", 9.0, 26.0),
    ("cancel_chain", 2.0, 2.5),
    ("dead_head", 3.0, 3.0),
    ("poison", 4.0, 5.0),
    ("deep", 5.0, 7.0),
    ("txhold", 6.0, 6.0),
];

/// Run the scenarios until `phase_end`.
pub async fn run(h: Arc<Harness>, mut rng: StdRng, phase_end: Instant) {
    let t0 = Instant::now();
    let mut next: Vec<f64> = SCHEDULE.iter().map(|s| s.1).collect();
    while Instant::now() < phase_end {
        let now = t0.elapsed().as_secs_f64();
        for (i, (name, _, every)) in SCHEDULE.iter().enumerate() {
            if now < next[i] {
                continue;
            }
            next[i] = now + every * rng.gen_range(0.8..1.2);
            match *name {
                "flood" => flood(&h, &mut rng).await,
                "deep" => deep(&h, &mut rng).await,
                other => {
                    let specs = build(&h, other, &mut rng);
                    enqueue_batch(&h.store, specs, &h.enqueue_log, &h.seen).await;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn cid(h: &Harness) -> u64 {
    h.next_cid.fetch_add(1, SeqCst)
}

fn spec(kind: &str, w: crate::kinds::Work, scenario: &'static str) -> Spec {
    let mut s = Spec::new(w.cid, kind, to_json(&w), "done");
    s.scenario = Some(scenario);
    s
}

/// A quick keyed job with one effect.
fn quick(h: &Harness, key: &str, scenario: &'static str, rng: &mut StdRng) -> Spec {
    let mut w = work(cid(h));
    w.steps = 1;
    w.sleep_ms = rng.gen_range(5..40);
    let mut s = spec("charge", w, scenario);
    s.key = Some(key.to_string());
    s
}

fn build(h: &Harness, scenario: &str, rng: &mut StdRng) -> Vec<Spec> {
    let lease = h.profile.lease_ms as f64;
    let n = h.next_cid.load(SeqCst);
    match scenario {
        "cancel_chain" => {
            let key = format!("cx-{n}");
            let mut w = work(cid(h));
            w.steps = 1;
            w.effects_last = rng.gen_bool(0.5);
            w.sleep_ms = (lease * rng.gen_range(1.2..1.7)) as u64;
            w.ignore_cancel = rng.gen_bool(0.4);
            let mut head = spec("slow", w, "cancel_chain");
            head.key = Some(key.clone());
            let mut out = vec![head];
            out.extend((0..3).map(|_| quick(h, &key, "cancel_chain", rng)));
            for s in &mut out {
                s.priority = -1;
            }
            out
        }
        "dead_head" => {
            let key = format!("dh-{n}");
            let mut w = work(cid(h));
            w.fail_first = 1;
            w.permanent = true;
            let mut head = spec("flaky", w, "dead_head");
            head.key = Some(key.clone());
            head.expect = "dead";
            let mut out = vec![head];
            out.extend((0..2).map(|_| quick(h, &key, "dead_head", rng)));
            out
        }
        "poison" => {
            let mut w = work(cid(h));
            let path = ["", "tx_", "effect_"][rng.gen_range(0..3)];
            let what = ["nul", "big", "deep"][rng.gen_range(0..3)];
            w.poison = Some(format!("{path}{what}"));
            let mut p = spec("poison", w, "poison");
            p.expect = if path == "effect_" {
                "poison_outcome"
            } else {
                "poison_result"
            };
            // Few attempts: a library that cannot contain the poison retries it.
            p.max_attempts = 3;
            let mut out = vec![p];
            for _ in 0..3 {
                let mut w = work(cid(h));
                w.sleep_ms = rng.gen_range(0..20);
                out.push(spec("charge", w, "neighbour"));
            }
            out
        }
        "txhold" => {
            let mut w = work(cid(h));
            // Past the lease, well within the max run time (whose abort could land
            // between the commit and the handler's last line).
            w.hold_ms = (lease * rng.gen_range(1.3..1.8)) as u64;
            w.err_after_commit = rng.gen_bool(0.5);
            let mut t = spec("txhold", w, "txhold");
            let mut out = Vec::new();
            if rng.gen_bool(0.5) {
                let key = format!("tx-{n}");
                t.key = Some(key.clone());
                out.push(t);
                out.push(quick(h, &key, "txhold", rng));
            } else {
                out.push(t);
            }
            out
        }
        other => unreachable!("no scenario {other}"),
    }
}

/// Long unkeyed jobs (a quarter more than the slots), due in a moment; then keyed
/// chains of instant jobs, running when they fall due; then a wake-up for every claimer.
async fn flood(h: &Arc<Harness>, rng: &mut StdRng) {
    let n = h.next_cid.load(SeqCst);
    let slots = h.profile.workers * h.profile.concurrency;
    let t0 = tokio::time::Instant::now();
    let long: Vec<Spec> = (0..slots + slots / 4)
        .map(|_| {
            let mut w = work(cid(h));
            w.sleep_ms = rng.gen_range(3300..3900);
            let mut s = spec("slow", w, "flood");
            s.delay_ms = FLOOD_DUE_MS;
            s
        })
        .collect();
    enqueue_batch(&h.store, long, &h.enqueue_log, &h.seen).await;
    tokio::time::sleep_until(t0 + Duration::from_millis(FLOOD_DUE_MS - 100)).await;
    // Instant jobs (no sleep, no effect): a chain spends nearly all its time between a
    // handler's return and its completion's reply, the window in which a successor is
    // claimed and then finds its slot taken.
    let mut chains = Vec::new();
    for c in 0..h.profile.workers * 2 {
        let key = format!("chain-{n}-{c}");
        chains.extend((0..60).map(|_| {
            let mut s = quick(h, &key, "chain", rng);
            s.payload["steps"] = json!(0);
            s.payload["sleep_ms"] = json!(0);
            s
        }));
    }
    enqueue_batch(&h.store, chains, &h.enqueue_log, &h.seen).await;
    // Delayed jobs come due without a NOTIFY; a claimer between polls would find them
    // up to a poll interval late, by when the chains may be over. Any enqueue at that
    // moment would wake them all; this is that wake-up, without the job.
    tokio::time::sleep_until(t0 + Duration::from_millis(FLOOD_DUE_MS + 20)).await;
    let _ = sqlx::query("SELECT pg_notify($1, 'default')")
        .bind(h.store.schema().channel())
        .execute(&h.admin)
        .await;
}

/// When the flood's long jobs fall due, after their enqueue.
const FLOOD_DUE_MS: u64 = 400;

/// `{"a": {"a": ... 1 ...}}`, `depth` objects deep.
fn nested(depth: usize) -> serde_json::Value {
    let mut v = json!(1);
    for _ in 0..depth {
        v = json!({ "a": v });
    }
    v
}

/// A deep payload and three neighbours, inserted by one raw statement with the column
/// list of the library's enqueue, due together a moment later so one claim takes them.
async fn deep(h: &Arc<Harness>, rng: &mut StdRng) {
    let mut rows: Vec<(u64, serde_json::Value, i32, &'static str, &'static str)> = Vec::new();
    let c = cid(h);
    rows.push((
        c,
        json!({ "cid": c, "deep": nested(DEEP_NESTING) }),
        3,
        "poison_payload",
        "deep",
    ));
    for _ in 0..3 {
        let c = cid(h);
        let sleep: u64 = rng.gen_range(0..20);
        rows.push((
            c,
            json!({ "cid": c, "sleep_ms": sleep }),
            12,
            "done",
            "neighbour",
        ));
    }
    let payloads: Vec<serde_json::Value> = rows.iter().map(|r| r.1.clone()).collect();
    let bytes: Vec<i32> = payloads
        .iter()
        .map(|p| serde_json::to_vec(p).map(|v| v.len() as i32).unwrap_or(0))
        .collect();
    let attempts: Vec<i32> = rows.iter().map(|r| r.2).collect();
    // Columns as in the library's enqueue statement (src/store/enqueue.rs):
    // queue, kind, job_key, key_seq, priority, state, payload, payload_bytes,
    // max_attempts, available_at, dead_blocks_key.
    let sql =
        "INSERT INTO leasehold.jobs (queue, kind, job_key, key_seq, priority, state, payload, \
               payload_bytes, max_attempts, available_at, dead_blocks_key) \
               SELECT 'default', 'charge', NULL, NULL, 0, 'pending', p, b, m, \
                      now() + interval '300 milliseconds', true \
               FROM unnest($1::jsonb[], $2::int4[], $3::int4[]) WITH ORDINALITY AS t(p, b, m, ord) \
               ORDER BY ord RETURNING id";
    let inserted = sqlx::query(sql)
        .bind(&payloads)
        .bind(&bytes)
        .bind(&attempts)
        .fetch_all(&h.admin)
        .await;
    let ids: Vec<Option<i64>> = match &inserted {
        Ok(r) => r.iter().map(|row| row.try_get::<i64, _>(0).ok()).collect(),
        Err(_) => vec![None; rows.len()],
    };
    let mut log = h.enqueue_log.lock().unwrap();
    for (r, id) in rows.iter().zip(ids) {
        log.write(&EnqueueRecord {
            cid: r.0,
            kind: "charge".into(),
            key: None,
            status: if inserted.is_ok() { "ok" } else { "info" }.into(),
            id,
            error: inserted.as_ref().err().map(|e| e.to_string()),
            expect: r.3.into(),
            max_attempts: r.2,
            t_us: now_us(),
            scenario: Some(r.4.into()),
        });
    }
}
