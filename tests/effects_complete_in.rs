//! Complete in the business transaction: after the external charge, the handler posts
//! the payment to its own table and completes the job in the same transaction
//! (`JobContext::complete_in`), so both commit or neither does. With a fault between
//! the two writes and the commit (a rollback, a connection killed before COMMIT),
//! neither is visible; a stale worker's posting rolls back with its refused
//! completion. Each test asserts the job's state, the postings, and the gateway's
//! applied-charge count.

mod common;

use common::*;
use leasehold::testkit::gateway::{ChargeRequest, Gateway, GatewayClient, GatewayConfig, Receipt};
use leasehold::testkit::{attempt_context, fencing_token};
use leasehold::{CompleteOutcome, Generation, JobContext, JobError, JobState, NewJob};
use sqlx::{Connection, PgConnection};

fn payment() -> ChargeRequest {
    ChargeRequest {
        account: "acct-1".into(),
        amount_cents: 4200,
        reference: "acct-1/001".into(),
    }
}

async fn create_postings(db: &TestDb) {
    sqlx::query(&format!(
        "CREATE TABLE {} (reference text PRIMARY KEY, charge_id bigint NOT NULL, job_id bigint NOT NULL, generation bigint NOT NULL)",
        db.table("postings")
    ))
    .execute(&db.owner)
    .await
    .unwrap();
}

/// The charge step, once per effect key.
async fn charge(ctx: &JobContext, gw: &GatewayClient, req: &ChargeRequest) -> Receipt {
    let token = fencing_token(ctx.job());
    ctx.once("charge", req, |key| async move {
        gw.charge(key.as_str(), Some(token), req)
            .await?
            .into_job_result()
    })
    .await
    .unwrap()
}

/// The business write and the completion, in the caller's open transaction.
async fn post_and_complete(
    db: &TestDb,
    ctx: &JobContext,
    tx: &mut PgConnection,
    receipt: &Receipt,
) -> Result<CompleteOutcome, JobError> {
    sqlx::query(&format!(
        "INSERT INTO {} (reference, charge_id, job_id, generation) VALUES ($1, $2, $3, $4)",
        db.table("postings")
    ))
    .bind(&receipt.reference)
    .bind(receipt.charge_id as i64)
    .bind(ctx.job_id().0)
    .bind(ctx.generation().0)
    .execute(&mut *tx)
    .await
    .unwrap();
    ctx.complete_in(tx, Some(serde_json::to_value(receipt).unwrap()))
        .await
}

async fn postings(db: &TestDb) -> Vec<(String, i64)> {
    sqlx::query_as(&format!(
        "SELECT reference, generation FROM {} ORDER BY reference",
        db.table("postings")
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn posting_and_completion_commit_together() {
    bounded(async {
        let db = TestDb::new("effects_cin_commit").await;
        create_postings(&db).await;
        let gw = Gateway::start(GatewayConfig::default()).unwrap();
        let id = db
            .store
            .enqueue(NewJob::new("charge", &payment()).unwrap())
            .await
            .unwrap();
        let j = db
            .store
            .claim(&claim_req(&owner("w"), 1))
            .await
            .unwrap()
            .remove(0);
        let ctx = attempt_context(j.clone(), db.store.clone());
        let receipt = charge(&ctx, &gw.client(), &payment()).await;

        let mut conn = db.raw_conn("w").await;
        let mut tx = conn.begin().await.unwrap();
        assert_eq!(
            post_and_complete(&db, &ctx, &mut tx, &receipt)
                .await
                .unwrap(),
            CompleteOutcome::Completed
        );
        // Before COMMIT, another session sees neither write.
        assert_eq!(db.state_of(id).await, "running");
        assert!(postings(&db).await.is_empty());
        tx.commit().await.unwrap();

        assert_eq!(db.state_of(id).await, "done");
        assert_eq!(postings(&db).await, vec![("acct-1/001".to_string(), 1)]);
        assert_eq!(
            db.store.job(id).await.unwrap().result,
            Some(serde_json::to_value(&receipt).unwrap())
        );
        assert_eq!(gw.counts().applied, 1);
        conn.close().await.unwrap();
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_between_the_writes_and_the_commit_leaves_neither_visible() {
    bounded(async {
        let db = TestDb::new("effects_cin_rollback").await;
        create_postings(&db).await;
        let gw = Gateway::start(GatewayConfig::default()).unwrap();
        let id = db
            .store
            .enqueue(NewJob::new("charge", &payment()).unwrap())
            .await
            .unwrap();
        let j = db
            .store
            .claim(&claim_req(&owner("w"), 1))
            .await
            .unwrap()
            .remove(0);
        let ctx = attempt_context(j.clone(), db.store.clone());
        let receipt = charge(&ctx, &gw.client(), &payment()).await;

        let mut conn = db.raw_conn("w").await;
        let mut tx = conn.begin().await.unwrap();
        assert_eq!(
            post_and_complete(&db, &ctx, &mut tx, &receipt)
                .await
                .unwrap(),
            CompleteOutcome::Completed
        );
        // A later step of the handler fails: the transaction rolls back.
        tx.rollback().await.unwrap();
        let rec = db.store.job(id).await.unwrap();
        assert_eq!(
            (rec.state, rec.generation),
            (JobState::Running, j.generation)
        );
        assert_eq!(rec.result, None);
        assert!(postings(&db).await.is_empty());

        // The attempt still holds its fence; doing it again commits both, and the
        // charge step is answered by the ledger.
        let again = charge(&ctx, &gw.client(), &payment()).await;
        assert_eq!(again, receipt);
        let mut tx = conn.begin().await.unwrap();
        post_and_complete(&db, &ctx, &mut tx, &again).await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(db.state_of(id).await, "done");
        assert_eq!(postings(&db).await.len(), 1);
        let counts = gw.counts();
        assert_eq!((counts.requested, counts.applied), (1, 1));
        conn.close().await.unwrap();
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_killed_before_commit_leaves_neither_and_the_retry_posts_once() {
    bounded(async {
        let db = TestDb::new("effects_cin_kill").await;
        create_postings(&db).await;
        let gw = Gateway::start(GatewayConfig::default()).unwrap();
        let id = db
            .store
            .enqueue(NewJob::new("charge", &payment()).unwrap())
            .await
            .unwrap();
        let a_job = db
            .store
            .claim(&claim_req(&owner("a"), 1))
            .await
            .unwrap()
            .remove(0);
        let a_ctx = attempt_context(a_job.clone(), db.store.clone());
        let receipt = charge(&a_ctx, &gw.client(), &payment()).await;

        // A writes both and dies before COMMIT.
        let mut a_conn = db.raw_conn("a").await;
        let mut tx = a_conn.begin().await.unwrap();
        assert_eq!(
            post_and_complete(&db, &a_ctx, &mut tx, &receipt)
                .await
                .unwrap(),
            CompleteOutcome::Completed
        );
        assert_eq!(db.kill_and_wait("a").await, 1);
        assert!(tx.commit().await.is_err(), "COMMIT on a killed session");
        drop(a_conn);
        assert_eq!(db.state_of(id).await, "running");
        assert!(postings(&db).await.is_empty());

        // The lease passes; B claims generation 2.
        let at = secs_after(a_job.lease_until, 1);
        db.store
            .reap(&owner("r"), &fixed_backoff(1), 10, Some(at))
            .await
            .unwrap();
        let b_job = db
            .store
            .claim(&claim_at(&owner("b"), 1, secs_after(at, 2)))
            .await
            .unwrap()
            .remove(0);
        assert_eq!(b_job.generation, Generation(2));

        // A, on a fresh connection, tries again: refused, and its posting rolls back.
        let mut a_conn = db.raw_conn("a2").await;
        let mut tx = a_conn.begin().await.unwrap();
        assert_eq!(
            post_and_complete(&db, &a_ctx, &mut tx, &receipt)
                .await
                .unwrap(),
            CompleteOutcome::Stale
        );
        tx.rollback().await.unwrap();
        assert!(postings(&db).await.is_empty());

        // B's charge step is a ledger hit; B posts and completes in one commit.
        let b_ctx = attempt_context(b_job.clone(), db.store.clone());
        let b_receipt = charge(&b_ctx, &gw.client(), &payment()).await;
        assert_eq!(b_receipt, receipt);
        let mut b_conn = db.raw_conn("b").await;
        let mut tx = b_conn.begin().await.unwrap();
        assert_eq!(
            post_and_complete(&db, &b_ctx, &mut tx, &b_receipt)
                .await
                .unwrap(),
            CompleteOutcome::Completed
        );
        tx.commit().await.unwrap();

        let rec = db.store.job(id).await.unwrap();
        assert_eq!((rec.state, rec.generation), (JobState::Done, Generation(2)));
        assert_eq!(postings(&db).await, vec![("acct-1/001".to_string(), 2)]);
        let counts = gw.counts();
        assert_eq!((counts.requested, counts.applied), (1, 1));
        a_conn.close().await.unwrap();
        b_conn.close().await.unwrap();
        db.drop().await;
    })
    .await
}
