//! Effect keys and fencing tokens across schemas, schemas created again and schemas
//! restored from an older dump. Job ids start at 1 in every schema, again in a schema
//! dropped and created again, and rewind in a schema restored from a dump, so an effect
//! key made of job id and step meets another job in an effect store they share: two
//! services on two schemas, each running its job 1 against one payment gateway that
//! deduplicates by idempotency key, got one charge between them, and the second job's
//! result was the first one's receipt. The key starts with the job's own effect
//! identity, a random UUID minted with the job: the two job 1s are two charges, each
//! job gets its own receipt; job 1 of a schema created again, and a job that took a
//! lost job's id after a restore, charge again; a retry of one job keeps its key (the
//! gateway deduplicates it). And the fencing token is the claim's time, so a gateway
//! that fences per account keeps accepting the account's charges after a counter
//! would have started again.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use leasehold::testkit::attempt_context;
use leasehold::testkit::gateway::{
    ChargeRequest, Decision, Fault, FaultSchedule, Gateway, GatewayClient, GatewayConfig, Receipt,
};
use leasehold::{
    FailOutcome, Failure, Generation, Handler, JobContext, JobError, JobId, JobState, NewJob,
    Scheduler, Store, StoreOptions,
};
use worker::{fast_config, run_in_system, wait_until};

const KIND: &str = "charge";

fn eu() -> ChargeRequest {
    ChargeRequest {
        account: "acct-eu-1".into(),
        amount_cents: 1_999,
        reference: "billing_eu/1".into(),
    }
}

fn us() -> ChargeRequest {
    ChargeRequest {
        account: "acct-us-9".into(),
        amount_cents: 50_000,
        reference: "billing_us/1".into(),
    }
}

/// The charge step, once per effect key, with the effect key as the gateway's
/// idempotency key. `lookup_first`: ask the gateway for the key before charging
/// (`once_reconciled`), as a handler of a store without idempotency keys would.
async fn charge(
    ctx: &JobContext,
    gw: &GatewayClient,
    req: &ChargeRequest,
    lookup_first: bool,
) -> Result<Receipt, JobError> {
    let token = ctx.fencing_token();
    let act = |key: leasehold::EffectKey| async move {
        gw.charge(key.as_str(), Some(token), req)
            .await?
            .into_job_result()
    };
    if lookup_first {
        let lookup = |key: leasehold::EffectKey| async move { Ok(gw.lookup(key.as_str()).await?) };
        ctx.once_reconciled("charge", req, lookup, act).await
    } else {
        ctx.once("charge", req, act).await
    }
}

/// A billing service's payment handler.
struct Charge {
    gateway: GatewayClient,
    lookup_first: bool,
}

impl Handler for Charge {
    type Payload = ChargeRequest;
    type Output = Receipt;
    const KIND: &'static str = KIND;

    async fn run(&self, ctx: JobContext, req: ChargeRequest) -> Result<Receipt, JobError> {
        charge(&ctx, &self.gateway, &req, self.lookup_first).await
    }
}

/// Job `id`'s effect identity, read as the database has it.
async fn identity_of(db: &TestDb, id: JobId) -> String {
    sqlx::query_scalar(&format!(
        "SELECT effect_identity::text FROM {} WHERE id = $1",
        db.table("jobs")
    ))
    .bind(id.0)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// The charges the gateway applied, as (account, cents, idempotency key), in order.
fn applied(gw: &Gateway) -> Vec<(String, i64, String)> {
    gw.log()
        .into_iter()
        .filter(|e| e.decision == Decision::Applied)
        .map(|e| (e.request.account, e.request.amount_cents, e.idempotency_key))
        .collect()
}

/// Job `id` of `db` is done, and its result is the receipt of a charge of `req`.
async fn assert_own_receipt(db: &TestDb, id: JobId, req: &ChargeRequest) -> Receipt {
    let rec = db.store.job(id).await.unwrap();
    assert_eq!(
        rec.state,
        JobState::Done,
        "job {id} of {}: {:?}",
        db.schema,
        rec.last_error
    );
    let receipt: Receipt = serde_json::from_value(rec.result.unwrap()).unwrap();
    assert_eq!(
        (
            receipt.account.as_str(),
            receipt.amount_cents,
            receipt.reference.as_str()
        ),
        (
            req.account.as_str(),
            req.amount_cents,
            req.reference.as_str()
        ),
        "job {id} of {}: its result is another job's receipt: {receipt:?}",
        db.schema
    );
    receipt
}

/// The books after both schemas' job 1 ran: two charges, each of its own account and
/// amount under a key of its own job's identity, and each job holding its own receipt.
async fn assert_two_charges(gw: &Gateway, eu_db: &TestDb, us_db: &TestDb) {
    let books = applied(gw);
    let charged: Vec<(String, i64)> = books.iter().map(|(a, c, _)| (a.clone(), *c)).collect();
    assert_eq!(
        charged,
        vec![
            ("acct-eu-1".to_string(), 1_999),
            ("acct-us-9".to_string(), 50_000)
        ],
        "the gateway's books: {:?}",
        gw.log()
    );
    let eu_receipt = assert_own_receipt(eu_db, JobId(1), &eu()).await;
    let us_receipt = assert_own_receipt(us_db, JobId(1), &us()).await;
    assert_ne!(eu_receipt.charge_id, us_receipt.charge_id);
    let (eu_id, us_id) = (
        identity_of(eu_db, JobId(1)).await,
        identity_of(us_db, JobId(1)).await,
    );
    assert_ne!(eu_id, us_id, "each job has an identity of its own");
    assert_eq!(books[0].2, format!("{eu_id}/1/charge"));
    assert_eq!(books[1].2, format!("{us_id}/1/charge"));
}

#[test]
fn two_services_on_two_schemas_each_charge_their_own_job_1() {
    run_in_system(async {
        within(60, "two billing services", async {
            let gw = Gateway::start(GatewayConfig::default()).unwrap();
            let eu_db = TestDb::with_options("across_billing_eu", StoreOptions::default(), 2).await;
            let us_db = TestDb::with_options("across_billing_us", StoreOptions::default(), 2).await;
            // One after the other, so the second job meets the first one's charge.
            for (db, req) in [(&eu_db, eu()), (&us_db, us())] {
                let mut config = fast_config(&db.schema);
                config.concurrency = 1;
                config.connections = 1;
                let s = Scheduler::builder(db.pool.clone(), config)
                    .register(Charge {
                        gateway: gw.client().with_timeout(Duration::from_secs(5)),
                        lookup_first: true,
                    })
                    .start()
                    .await
                    .unwrap();
                let id = s
                    .enqueue_job(NewJob::new(KIND, &req).unwrap())
                    .await
                    .unwrap();
                assert_eq!(id, JobId(1), "ids start at 1 in each schema");
                wait_until(20, "the payment to end", || async {
                    let state = db.store.job(id).await.unwrap().state;
                    matches!(state, JobState::Done | JobState::Dead)
                })
                .await;
                s.shutdown().await.unwrap();
            }
            assert_two_charges(&gw, &eu_db, &us_db).await;
            eu_db.drop().await;
            us_db.drop().await;
        })
        .await
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_1s_of_two_schemas_charging_through_once_are_two_charges() {
    bounded(async {
        let gw = Gateway::start(GatewayConfig::default()).unwrap();
        let eu_db = TestDb::with_options("across_once_eu", StoreOptions::default(), 2).await;
        let us_db = TestDb::with_options("across_once_us", StoreOptions::default(), 2).await;
        for (db, req) in [(&eu_db, eu()), (&us_db, us())] {
            let id = db
                .store
                .enqueue(NewJob::new(KIND, &req).unwrap())
                .await
                .unwrap();
            assert_eq!(id, JobId(1), "ids start at 1 in each schema");
            let j = db
                .store
                .claim(&claim_req(&owner("w"), 1))
                .await
                .unwrap()
                .remove(0);
            let ctx = attempt_context(j.clone(), db.store.clone());
            let receipt = charge(&ctx, &gw.client(), &req, false)
                .await
                .unwrap_or_else(|e| panic!("job 1 of {}: {e}", db.schema));
            db.store
                .complete(&j.fence(), Some(serde_json::to_value(&receipt).unwrap()))
                .await
                .unwrap();
        }
        assert_two_charges(&gw, &eu_db, &us_db).await;
        eu_db.drop().await;
        us_db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_keeps_its_key_and_a_schema_created_again_charges_again() {
    bounded(async {
        let req = ChargeRequest {
            account: "acct-1".into(),
            amount_cents: 1_999,
            reference: "acct-1/001".into(),
        };
        // The first request is applied and its reply dropped: nothing is recorded. The
        // gateway fences per account: the second life's job 1 must not be refused for a
        // token older than the first life's.
        let gw = Gateway::start(GatewayConfig {
            faults: FaultSchedule::new().on(req.reference.clone(), 1, Fault::DropReply),
            ..Default::default()
        })
        .unwrap();
        let client = gw.client().with_timeout(Duration::from_secs(5));
        let db = TestDb::with_options("across_recreate", StoreOptions::default(), 2).await;

        // First life: job 1's first attempt charges and loses the reply; its retry asks
        // again under the same key and gets the charge back.
        let id = db
            .store
            .enqueue(NewJob::new(KIND, &req).unwrap())
            .await
            .unwrap();
        assert_eq!(id, JobId(1));
        let a = db
            .store
            .claim(&claim_req(&owner("a"), 1))
            .await
            .unwrap()
            .remove(0);
        let err = charge(
            &attempt_context(a.clone(), db.store.clone()),
            &client,
            &req,
            false,
        )
        .await
        .unwrap_err();
        assert!(!err.is_permanent(), "{err}");
        // Retried at once, by the database clock: the tokens are claim times, and a claim
        // at a test time in the future would outrank the second life's real ones.
        let failure = Failure {
            reason: err.message().to_string(),
            permanent: false,
            retry_after: Some(Duration::ZERO),
        };
        let failed = db
            .store
            .fail(&a.fence(), &failure, &fixed_backoff(1))
            .await
            .unwrap();
        assert!(matches!(failed, FailOutcome::Retrying { .. }), "{failed:?}");
        let b = db
            .store
            .claim(&claim_req(&owner("b"), 1))
            .await
            .unwrap()
            .remove(0);
        assert_eq!((b.id, b.generation), (id, Generation(2)));
        let first = charge(
            &attempt_context(b.clone(), db.store.clone()),
            &client,
            &req,
            false,
        )
        .await
        .unwrap();
        db.store
            .complete(&b.fence(), Some(serde_json::to_value(&first).unwrap()))
            .await
            .unwrap();
        let log = gw.log();
        assert_eq!(
            log.iter().map(|e| e.decision).collect::<Vec<_>>(),
            vec![Decision::Applied, Decision::Duplicate],
            "the retry was answered with the first charge: {log:?}"
        );
        assert_eq!(
            log[0].idempotency_key, log[1].idempotency_key,
            "a retry keeps its key"
        );
        let first_key = log[0].idempotency_key.clone();

        // Second life: the schema is dropped and created again, the gateway remembers
        // the first life's keys. Job 1 again, with the same request, is another payment.
        create_schema_again(&db).await;
        let id = db
            .store
            .enqueue(NewJob::new(KIND, &req).unwrap())
            .await
            .unwrap();
        assert_eq!(id, JobId(1), "ids restart in a schema created again");
        let c = db
            .store
            .claim(&claim_req(&owner("c"), 1))
            .await
            .unwrap()
            .remove(0);
        // `db.store` served the first life too: nothing of it is kept for the second.
        let ctx = attempt_context(c.clone(), db.store.clone());
        let second = charge(&ctx, &client, &req, false).await.unwrap();
        let counts = gw.counts();
        assert_eq!(
            (counts.applied, counts.duplicates),
            (2, 1),
            "job 1 of the schema created again is charged again, not answered with the \
             first life's receipt: {:?}",
            gw.log()
        );
        assert_ne!(second.charge_id, first.charge_id);
        let second_identity = identity_of(&db, id).await;
        assert_eq!(
            second.idempotency_key,
            format!("{second_identity}/1/charge")
        );
        let first_identity = first_key.strip_suffix("/1/charge").unwrap();
        assert!(
            leasehold::EffectIdentity::parse(first_identity).is_some(),
            "{first_key}"
        );
        assert_ne!(first_identity, second_identity, "a new job, a new identity");
        // The ledger holds the key the gateway saw.
        let fresh = Store::new(db.pool.clone(), &db.schema, StoreOptions::default()).unwrap();
        let recorded = fresh.job_effects(id).await.unwrap();
        assert_eq!(
            recorded
                .iter()
                .map(|e| e.effect_key.as_str())
                .collect::<Vec<_>>(),
            vec![second.idempotency_key.as_str()]
        );
        let by_account: BTreeMap<String, Vec<String>> = gw.applied_by_account();
        assert_eq!(by_account["acct-1"].len(), 2, "{by_account:?}");
        db.drop().await;
    })
    .await
}

/// Drop `db`'s schema and restore `dump` into it with psql, as an operator restoring a
/// backup would; the runtime role gets its grants again.
async fn restore_schema(db: &TestDb, dump: &str) {
    sqlx::query(&format!("DROP SCHEMA \"{}\" CASCADE", db.schema))
        .execute(&db.owner)
        .await
        .unwrap();
    let o = base_options();
    let mut psql = std::process::Command::new("psql")
        .args(["--quiet", "--no-psqlrc", "-v", "ON_ERROR_STOP=1"])
        .args(["--host", o.get_host(), "--port", &o.get_port().to_string()])
        .args(["--username", o.get_username(), "--dbname", &test_db_name()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("psql runs");
    use std::io::Write;
    psql.stdin
        .take()
        .unwrap()
        .write_all(dump.as_bytes())
        .unwrap();
    let out = psql.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "psql restore: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    if runtime_role().is_some() {
        grant_runtime_role(&db.owner, &db.schema).await;
    }
}

/// Claim `db`'s next job as `worker`, charge it through `once` and complete it with the
/// receipt (or fail it with the error).
async fn run_one(
    db: &TestDb,
    gw: &GatewayClient,
    worker: &str,
) -> (JobId, Result<Receipt, JobError>) {
    let j = db
        .store
        .claim(&claim_req(&owner(worker), 1))
        .await
        .unwrap()
        .remove(0);
    let req: ChargeRequest = serde_json::from_value(j.payload.clone()).unwrap();
    let got = charge(
        &attempt_context(j.clone(), db.store.clone()),
        gw,
        &req,
        false,
    )
    .await;
    match &got {
        Ok(receipt) => {
            db.store
                .complete(&j.fence(), Some(serde_json::to_value(receipt).unwrap()))
                .await
                .unwrap();
        }
        Err(e) => {
            let failure = Failure {
                reason: e.message().to_string(),
                permanent: true,
                retry_after: None,
            };
            db.store
                .fail(&j.fence(), &failure, &fixed_backoff(1))
                .await
                .unwrap();
        }
    }
    (j.id, got)
}

fn payment(n: u32, cents: i64) -> ChargeRequest {
    ChargeRequest {
        account: "acct-restore".into(),
        amount_cents: cents,
        reference: format!("acct-restore/{n:03}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_restored_from_an_older_dump_charges_the_jobs_that_took_lost_ids() {
    bounded(async {
        // One account, charged in order (keyed jobs), through a gateway that deduplicates
        // by idempotency key and fences per account.
        let gw = Gateway::start(GatewayConfig::default()).unwrap();
        let client = gw.client().with_timeout(Duration::from_secs(5));
        let db = TestDb::with_options("across_restore", StoreOptions::default(), 2).await;
        let enqueue = |req: ChargeRequest| {
            let store = db.store.clone();
            async move {
                store
                    .enqueue(NewJob::new(KIND, &req).unwrap().with_key("acct-restore"))
                    .await
                    .unwrap()
            }
        };
        let first = enqueue(payment(1, 100)).await;
        assert!(run_one(&db, &client, "a").await.1.is_ok());
        // The backup: job 1 done.
        let dump = dump_schema(&db);
        // After it, two more payments are charged; then the database is lost and the
        // backup restored: those two jobs are gone, and the ids they had are free again.
        let lost = [
            enqueue(payment(2, 200)).await,
            enqueue(payment(3, 300)).await,
        ];
        for _ in lost {
            assert!(run_one(&db, &client, "a").await.1.is_ok());
        }
        restore_schema(&db, &dump).await;
        assert_eq!(db.store.job(first).await.unwrap().state, JobState::Done);
        // The customer's next payment, of another amount, takes the first lost id.
        let next = payment(4, 444);
        let id = enqueue(next.clone()).await;
        assert_eq!(
            id, lost[0],
            "a restored schema hands out the lost ids again"
        );
        let (ran, got) = run_one(&db, &client, "b").await;
        assert_eq!(ran, id);
        let receipt = got.unwrap_or_else(|e| {
            panic!(
                "the payment after the restore was refused: {e}; gateway: {:?}",
                gw.log()
            )
        });
        assert_eq!(
            (receipt.amount_cents, receipt.reference.as_str()),
            (444, "acct-restore/004"),
            "the payment after the restore got a lost job's receipt"
        );
        assert_own_receipt(&db, id, &next).await;
        let charged: Vec<i64> = applied(&gw).iter().map(|(_, c, _)| *c).collect();
        assert_eq!(
            charged,
            vec![100, 200, 300, 444],
            "the gateway's books: {:?}",
            gw.log()
        );
        db.drop().await;
    })
    .await
}
