//! Attack: "Jobs enqueued before schema version 21 keep their old keys."
//!
//! A job enqueued by an older build whose attempt reached the payment gateway (the
//! reply was lost, so nothing was recorded in the ledger) is retried after the upgrade.
//! The gateway deduplicates by idempotency key: if the retry sends the key the job had
//! before the upgrade, the gateway answers with the receipt of the first charge; if the
//! key changed, the account is charged twice.
//!
//! The schema is brought to the old version with the library's own migration files
//! (plain SQL, exactly as `migrate` applies them), the old build's job row and the old
//! attempt's charge are made by hand, then the current build migrates and runs the job.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::*;
use leasehold::testkit::gateway::{
    ChargeRequest, Decision, Gateway, GatewayClient, GatewayConfig, Receipt,
};
use leasehold::{Handler, JobContext, JobError, JobId, JobState, Scheduler, StoreOptions};
use worker::{fast_config, run_in_system, wait_until};

struct Charge {
    gateway: GatewayClient,
}

impl Handler for Charge {
    type Payload = ChargeRequest;
    type Output = Receipt;
    const KIND: &'static str = "charge";

    async fn run(&self, ctx: JobContext, req: ChargeRequest) -> Result<Receipt, JobError> {
        let gw = &self.gateway;
        let token = ctx.fencing_token();
        let r = &req;
        ctx.once("charge", &req, |key| async move {
            gw.charge(key.as_str(), Some(token), r)
                .await?
                .into_job_result()
        })
        .await
    }
}

fn req() -> ChargeRequest {
    ChargeRequest {
        account: "acct-legacy".into(),
        amount_cents: 4_200,
        reference: "order-77".into(),
    }
}

/// Apply the library's migration files with version <= `upto` to `db`'s (fresh) schema,
/// and record them in its version table, as the build that shipped them did.
async fn migrate_to(db: &TestDb, upto: i32) {
    let quoted = format!("\"{}\"", db.schema);
    let mut sql = format!(
        "CREATE SCHEMA {quoted};
         CREATE TABLE {quoted}.leasehold_migrations (
             version integer PRIMARY KEY, description text NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now());\n"
    );
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for f in files {
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        let version: i32 = name[..4].parse().unwrap();
        if version > upto {
            continue;
        }
        sql.push_str(
            &std::fs::read_to_string(&f)
                .unwrap()
                .replace("__SCHEMA__", &quoted),
        );
        sql.push_str(&format!(
            "\n;INSERT INTO {quoted}.leasehold_migrations (version, description) VALUES ({version}, '{name}');\n"
        ));
    }
    let mut tx = db.owner.begin().await.unwrap();
    sqlx::raw_sql(&sql).execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
}

/// A job as the old build enqueued it: pending again after one attempt that failed
/// retryably (the gateway's reply was lost).
async fn old_build_job(db: &TestDb) -> JobId {
    let payload = serde_json::to_value(req()).unwrap();
    let id: i64 = sqlx::query_scalar(&format!(
        "INSERT INTO {} (queue, kind, state, payload, payload_bytes, attempts, max_attempts, generation, last_error)
         VALUES ($1, 'charge', 'pending', $2, octet_length($2::text), 1, 5, 1, 'gateway: reply lost (timeout)')
         RETURNING id",
        db.table("jobs")
    ))
    .bind(leasehold::config::DEFAULT_QUEUE)
    .bind(&payload)
    .fetch_one(&db.owner)
    .await
    .unwrap();
    JobId(id)
}

/// Migrate `db` (at an old version, one job from the old build, whose attempt charged
/// under `old_key`) with the current build, run the job, and return the gateway's
/// applied charges (idempotency keys) and the job's state.
async fn upgrade_and_run(db: &TestDb, gw: &Gateway, id: JobId) -> (Vec<String>, JobState, String) {
    db.store.migrate().await.unwrap();
    if runtime_role().is_some() {
        grant_runtime_role(&db.owner, &db.schema).await;
    }
    let mut config = fast_config(&db.schema);
    config.concurrency = 1;
    let s = Scheduler::builder(db.pool.clone(), config)
        .register(Charge {
            gateway: gw.client().with_timeout(Duration::from_secs(5)),
        })
        .start()
        .await
        .unwrap();
    wait_until(20, "the retried payment to end", || async {
        matches!(
            db.store.job(id).await.unwrap().state,
            JobState::Done | JobState::Dead
        )
    })
    .await;
    s.shutdown().await.unwrap();
    let rec = db.store.job(id).await.unwrap();
    let applied = gw
        .log()
        .into_iter()
        .filter(|e| e.decision == Decision::Applied)
        .map(|e| e.idempotency_key)
        .collect();
    (applied, rec.state, format!("{:?}", rec.last_error))
}

#[ignore = "open (issue 31 note): an effect of a job enqueued before schema 18 that happened without being recorded is applied again under the job's new key after the upgrade; no such database exists outside this repository (nothing was published before 21)"]
#[test]
fn a_payment_enqueued_before_version_18_is_charged_once_after_upgrading_to_version_21() {
    run_in_system(async {
        within(90, "legacy v17 payment", async {
            let gw = Gateway::start(GatewayConfig::default()).unwrap();
            let db = TestDb::unmigrated("legacy_v17", StoreOptions::default(), 2).await;
            migrate_to(&db, 17).await;
            let id = old_build_job(&db).await;
            // The old build's attempt: key `<job id>/<step>`, applied by the gateway, the
            // reply lost, nothing recorded.
            let old_key = format!("{id}/charge");
            let first = gw.client().charge(&old_key, Some(1), &req()).await.unwrap();
            assert!(first.receipt().is_some(), "{first:?}");
            let (applied, state, err) = upgrade_and_run(&db, &gw, id).await;
            assert_eq!(state, JobState::Done, "{err}");
            assert_eq!(
                applied,
                vec![old_key.clone()],
                "the account was charged {} times for one payment: the retry after the \
                 upgrade did not keep the job's old key {old_key:?}",
                applied.len()
            );
            db.drop().await;
        })
        .await
    });
}

#[test]
fn a_payment_enqueued_at_version_18_is_charged_once_after_upgrading_to_version_21() {
    run_in_system(async {
        within(90, "legacy v18 payment", async {
            let gw = Gateway::start(GatewayConfig::default()).unwrap();
            let db = TestDb::unmigrated("legacy_v18", StoreOptions::default(), 2).await;
            migrate_to(&db, 18).await;
            let id = old_build_job(&db).await;
            let schema_identity: String = sqlx::query_scalar(&format!(
                "SELECT id::text FROM {}",
                db.table("schema_identity")
            ))
            .fetch_one(&db.owner)
            .await
            .unwrap();
            let old_key = format!("{schema_identity}/{id}/charge");
            let first = gw.client().charge(&old_key, Some(1), &req()).await.unwrap();
            assert!(first.receipt().is_some(), "{first:?}");
            let (applied, state, err) = upgrade_and_run(&db, &gw, id).await;
            assert_eq!(state, JobState::Done, "{err}");
            assert_eq!(
                applied,
                vec![old_key],
                "charged once, under the job's old key"
            );
            db.drop().await;
        })
        .await
    });
}
