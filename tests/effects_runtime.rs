//! Exactly-once effects at runtime: two schedulers (lease 1 s, renewal 300 ms, reaper
//! 200 ms) run keyed payments through the gateway simulator while faults are injected —
//! a handler that panics after charging, a gateway that applies a charge and drops the
//! reply, a worker stalled past its lease right after charging. Every payment is charged
//! once, in enqueue order per account. The negative control runs the same faults with a
//! new effect key per attempt and sees the duplicate charges.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use leasehold::testkit::fencing_token;
use leasehold::testkit::gateway::{
    ChargeRequest, Fault, FaultSchedule, Gateway, GatewayClient, GatewayConfig, Receipt,
};
use leasehold::{
    Backoff, Config, Generation, Handler, JobContext, JobError, JobId, JobState, NewJob, Scheduler,
    Store,
};

const ACCOUNTS: u32 = 3;
const PAYMENTS: u32 = 3;

#[derive(Clone, Copy, Debug, PartialEq)]
enum WorkerFault {
    CrashAfterCharge,
    StallPastLease,
}

#[derive(Clone)]
struct Pay {
    gateway: GatewayClient,
    per_attempt_keys: bool,
    faults: Arc<HashMap<String, WorkerFault>>,
    /// The test's own connection, to make a stalled worker's lease pass.
    expirer: Store,
}

impl Handler for Pay {
    type Payload = ChargeRequest;
    type Output = Receipt;
    const KIND: &'static str = "pay";

    async fn run(&self, ctx: JobContext, req: ChargeRequest) -> Result<Receipt, JobError> {
        let step = if self.per_attempt_keys {
            format!("charge-g{}", ctx.generation())
        } else {
            "charge".to_string()
        };
        let token = fencing_token(ctx.job());
        let fault = (ctx.attempt() == 1)
            .then(|| self.faults.get(&req.reference).copied())
            .flatten();
        let (ctx_ref, r) = (&ctx, &req);
        ctx.once(&step, &req, |key| async move {
            let receipt = self
                .gateway
                .charge(key.as_str(), Some(token), r)
                .await?
                .into_job_result()?;
            match fault {
                Some(WorkerFault::CrashAfterCharge) => panic!("crash after charging"),
                Some(WorkerFault::StallPastLease) => {
                    expire(&self.expirer, ctx_ref.job_id(), ctx_ref.generation()).await;
                    // Stalled until lease renewal finds the lease gone.
                    let _ = tokio::time::timeout(Duration::from_secs(5), ctx_ref.cancelled()).await;
                }
                None => {}
            }
            Ok(receipt)
        })
        .await
    }
}

/// The stall outlasts the lease: move `lease_until` into the past and reap, until the
/// expiry of this generation is recorded (a renewal may slip in between).
async fn expire(store: &Store, job: JobId, generation: Generation) {
    let s = store.schema().quoted().to_string();
    // A real stall past the lease outlives the moment the owner records the attempt's
    // start (within 200 ms of it); moving time forward must not skip that, or the reaper
    // rightly treats the attempt as never started and does not count it.
    for _ in 0..100 {
        let recorded: bool = sqlx::query_scalar(&format!(
            "SELECT EXISTS (SELECT 1 FROM {s}.jobs WHERE id = $1 AND started_generation = $2)"
        ))
        .bind(job.0)
        .bind(generation.0)
        .fetch_one(store.pool())
        .await
        .unwrap();
        if recorded {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for _ in 0..100 {
        sqlx::query(&format!(
            "UPDATE {s}.jobs SET lease_until = now() - interval '1 second' WHERE id = $1 AND generation = $2 AND state = 'running'"
        ))
        .bind(job.0)
        .bind(generation.0)
        .execute(store.pool())
        .await
        .unwrap();
        store
            .reap(&owner("expirer"), &fixed_backoff(1), 10, None)
            .await
            .unwrap();
        let reaped: bool = sqlx::query_scalar(&format!(
            "SELECT EXISTS (SELECT 1 FROM {s}.lease_expiries WHERE job_id = $1 AND generation = $2)"
        ))
        .bind(job.0)
        .bind(generation.0)
        .fetch_one(store.pool())
        .await
        .unwrap();
        if reaped {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("could not expire the lease of job {job}");
}

fn reference(account: u32, seq: u32) -> String {
    format!("acct-{account}/{seq:03}")
}

fn config(schema: &str) -> Config {
    let mut c = Config {
        schema: schema.to_string(),
        concurrency: 4,
        lease: Duration::from_secs(1),
        renew_interval: Duration::from_millis(300),
        reaper_interval: Duration::from_millis(200),
        poll_interval_min: Duration::from_millis(20),
        poll_interval_max: Duration::from_millis(200),
        shutdown_grace: Duration::from_secs(2),
        max_run_time: Duration::from_secs(10),
        ..Config::default()
    };
    c.retry.max_attempts = 10;
    c.retry.backoff = Backoff {
        base: Duration::from_millis(50),
        cap: Duration::from_millis(500),
        jitter: 0.25,
    };
    c
}

/// Run the payments with the fault schedule; stop the schedulers; return the books.
async fn run_payments(db: &TestDb, per_attempt_keys: bool) -> (Gateway, Vec<JobId>) {
    let gateway = Gateway::start(GatewayConfig {
        faults: FaultSchedule::new().on(reference(2, 1), 1, Fault::DropReply),
        ..Default::default()
    })
    .unwrap();
    let faults = HashMap::from([
        (reference(1, 2), WorkerFault::CrashAfterCharge),
        (reference(3, 3), WorkerFault::StallPastLease),
    ]);
    let handler = Pay {
        gateway: gateway.client().with_timeout(Duration::from_secs(2)),
        per_attempt_keys,
        faults: Arc::new(faults),
        expirer: db.store.clone(),
    };
    let mut workers = Vec::new();
    for w in ["w1", "w2"] {
        let pool = db.other_pool(w, 3).await;
        let s = Scheduler::builder(pool, config(&db.schema))
            .register(handler.clone())
            .start()
            .await
            .unwrap();
        workers.push(s);
    }
    let mut jobs = Vec::new();
    for seq in 1..=PAYMENTS {
        for a in 1..=ACCOUNTS {
            let req = ChargeRequest {
                account: format!("acct-{a}"),
                amount_cents: i64::from(100 * a + seq),
                reference: reference(a, seq),
            };
            jobs.push(
                NewJob::new(Pay::KIND, &req)
                    .unwrap()
                    .with_key(req.account.clone()),
            );
        }
    }
    let ids = workers[0].enqueue_many(jobs).await.unwrap();
    within(30, "every payment to finish", async {
        while db.count_where("jobs", "state IN ('done', 'dead')").await < ids.len() as i64 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    for w in workers {
        w.shutdown().await.unwrap();
    }
    assert!(gateway.wait_decided(Duration::from_secs(5)).await);
    (gateway, ids)
}

fn applied_in_order(gateway: &Gateway) -> bool {
    let by_account = gateway.applied_by_account();
    (1..=ACCOUNTS).all(|a| {
        let mut got = by_account
            .get(&format!("acct-{a}"))
            .cloned()
            .unwrap_or_default();
        got.dedup();
        got == (1..=PAYMENTS).map(|s| reference(a, s)).collect::<Vec<_>>()
    })
}

#[actix_rt::test]
async fn every_payment_is_charged_once_in_order_under_crash_dropped_reply_and_stall() {
    if let Ok(f) = std::env::var("RUST_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(f)
            .with_test_writer()
            .try_init();
    }
    within(90, "runtime payments", async {
        let db = TestDb::new("effects_rt_once").await;
        let (gateway, ids) = run_payments(&db, false).await;
        for id in &ids {
            assert_eq!(db.store.job(*id).await.unwrap().state, JobState::Done);
        }
        let counts = gateway.counts();
        assert_eq!(counts.applied, ids.len() as u64, "{counts:?}");
        assert_eq!(
            counts.duplicates, 3,
            "crash, dropped reply and stall each came back with the same key: {counts:?}"
        );
        assert!(gateway.applied_by_reference().values().all(|n| *n == 1));
        assert!(
            applied_in_order(&gateway),
            "{:?}",
            gateway.applied_by_account()
        );
        assert_eq!(db.count_where("lease_expiries", "true").await, 1);
        assert_eq!(db.count_where("effects", "true").await, ids.len() as i64);
        // Each job's stored receipt is a charge the gateway applied.
        let applied: std::collections::HashSet<u64> =
            gateway.log().iter().filter_map(|e| e.charge_id).collect();
        for id in &ids {
            let result = db.store.job(*id).await.unwrap().result.unwrap();
            let receipt: Receipt = serde_json::from_value(result).unwrap();
            assert!(applied.contains(&receipt.charge_id));
        }
        db.drop().await;
    })
    .await
}

#[actix_rt::test]
async fn negative_control_per_attempt_keys_charge_the_faulted_payments_twice() {
    within(90, "runtime payments, per-attempt keys", async {
        let db = TestDb::new("effects_rt_control").await;
        let (gateway, ids) = run_payments(&db, true).await;
        for id in &ids {
            assert_eq!(db.store.job(*id).await.unwrap().state, JobState::Done);
        }
        let counts = gateway.counts();
        assert_eq!(
            counts.applied,
            ids.len() as u64 + 3,
            "each faulted payment charged twice: {counts:?}"
        );
        let twice: Vec<String> = gateway
            .applied_by_reference()
            .into_iter()
            .filter(|(_, n)| *n > 1)
            .map(|(r, _)| r)
            .collect();
        assert_eq!(
            twice,
            vec![reference(1, 2), reference(2, 1), reference(3, 3)]
        );
        db.drop().await;
    })
    .await
}
