//! Complete in the business transaction: after the external charge, the handler posts
//! the payment to its own table and completes the job in the same transaction
//! (`JobContext::complete_in`), so both commit or neither does. With a fault between
//! the two writes and the commit (a rollback, a connection killed before COMMIT),
//! neither is visible; a stale worker's posting rolls back with its refused
//! completion. Each test asserts the job's state, the postings, and the gateway's
//! applied-charge count.
//!
//! Under a scheduler: once the handler's transaction that completed the job committed,
//! the job is done by that attempt, whatever the handler does next — returns an error,
//! panics, runs past its run time or its lease deadline, or is stopped by a shutdown.
//! The attempt ends completed (never stale, never failed), and no stale completion is
//! counted, so the stale-completion alert stays quiet for a healthy worker.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::*;
use leasehold::metrics::Outcome;
use leasehold::testkit::gateway::{ChargeRequest, Gateway, GatewayClient, GatewayConfig, Receipt};
use leasehold::testkit::{attempt_context, fencing_token};
use leasehold::{
    CompleteOutcome, Config, Generation, Handler, JobContext, JobError, JobId, JobState,
    KindPolicy, MetricsSnapshot, NewJob, Scheduler,
};
use serde::{Deserialize, Serialize};
use sqlx::{Connection, PgConnection, PgPool};
use worker::{fast_config, run_in_system, wait_until};

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

// ---------------------------------------------------------------------------
// Under a scheduler: what the handler does after its completion committed.
// ---------------------------------------------------------------------------

/// What the handler does once its transaction that completed the job has committed.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
enum After {
    Error,
    Panic,
    /// Sleeps for a minute, whatever it is told: stopped by its run time, its lease
    /// deadline or a shutdown.
    Hang,
    /// Deletes its own job (retention with nothing kept) before returning, as a retention
    /// pass of another process may between the commit and the scheduler's read-back:
    /// then returns ok, or (`PrunedThenError`) an error.
    Pruned,
    PrunedThenError,
}

/// Posts the job to `postings` and completes it in one transaction, commits, then does
/// `After`. `TIMED` jobs have a run time of 500 ms (`KindPolicy::max_run_time`).
struct CompleteThen<const TIMED: bool> {
    pool: PgPool,
    postings: String,
    store: leasehold::Store,
}

impl<const TIMED: bool> Handler for CompleteThen<TIMED> {
    type Payload = After;
    type Output = ();
    const KIND: &'static str = if TIMED {
        "complete_then_timed"
    } else {
        "complete_then"
    };

    fn policy() -> KindPolicy {
        KindPolicy {
            max_run_time: TIMED.then_some(Duration::from_millis(500)),
            ..KindPolicy::default()
        }
    }

    async fn run(&self, ctx: JobContext, after: After) -> Result<(), JobError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(&format!(
            "INSERT INTO {} (reference, charge_id, job_id, generation) VALUES ($1, 0, $2, $3)",
            self.postings
        ))
        .bind(format!("job-{}", ctx.job_id()))
        .bind(ctx.job_id().0)
        .bind(ctx.generation().0)
        .execute(&mut *tx)
        .await?;
        let outcome = ctx
            .complete_in(
                &mut tx,
                Some(serde_json::json!({ "posted": ctx.job_id().0 })),
            )
            .await?;
        assert_eq!(outcome, CompleteOutcome::Completed);
        tx.commit().await?;
        match after {
            After::Error => Err(JobError::retry(
                "the receipt e-mail failed after the commit",
            )),
            After::Panic => panic!("panicked after the commit"),
            After::Hang => {
                tokio::time::sleep(Duration::from_secs(60)).await;
                Ok(())
            }
            After::Pruned | After::PrunedThenError => {
                // An operator's pass with the floor lowered: the row goes while this
                // attempt's lease still runs.
                let pruned = common::prune_now(&self.store, 100).await?;
                assert!(pruned.jobs >= 1, "the done job was pruned: {pruned:?}");
                match after {
                    After::Pruned => Ok(()),
                    _ => Err(JobError::retry(
                        "the receipt e-mail failed after the commit",
                    )),
                }
            }
        }
    }
}

async fn start_complete_then(db: &TestDb, config: Config) -> Scheduler {
    Scheduler::builder(db.pool.clone(), config)
        .register(CompleteThen::<false> {
            pool: db.pool.clone(),
            postings: db.table("postings"),
            store: db.store.clone(),
        })
        .register(CompleteThen::<true> {
            pool: db.pool.clone(),
            postings: db.table("postings"),
            store: db.store.clone(),
        })
        .start()
        .await
        .unwrap()
}

/// Attempts ended, by outcome, over every kind.
fn outcomes(m: &MetricsSnapshot) -> Vec<(Outcome, u64)> {
    let mut all: std::collections::BTreeMap<&str, (Outcome, u64)> = Default::default();
    for j in &m.jobs {
        for (o, n) in &j.outcomes {
            all.entry(o.as_str()).or_insert((*o, 0)).1 += n;
        }
    }
    all.into_values().filter(|(_, n)| *n > 0).collect()
}

fn ended(m: &MetricsSnapshot) -> u64 {
    outcomes(m).iter().map(|(_, n)| n).sum()
}

/// The job is done by its one attempt, with the result its handler's transaction
/// stored, no error recorded, and its posting committed.
async fn assert_done_by_its_transaction(db: &TestDb, id: JobId) {
    let rec = db.store.job(id).await.unwrap();
    assert_eq!(
        (rec.state, rec.attempts, rec.last_error.as_deref()),
        (JobState::Done, 1, None),
        "job {id}"
    );
    assert_eq!(rec.result, Some(serde_json::json!({ "posted": id.0 })));
    assert_eq!(
        db.count_where("postings", &format!("job_id = {}", id.0))
            .await,
        1
    );
}

/// The attempts' endings as the scheduler counted them: all completed, none stale or
/// failed, and no lost lease.
fn assert_all_completed(m: &MetricsSnapshot, n: u64) {
    assert_eq!(
        outcomes(m),
        vec![(Outcome::Completed, n)],
        "every attempt whose completion committed ends completed: {:?}",
        m.counters
    );
    let c = &m.counters;
    assert_eq!(
        (c.stale_completions, c.completed, c.failed, c.dead),
        (0, n, 0, 0),
        "{c:?}"
    );
    assert_eq!((c.leases_lost, c.lease_deadlines), (0, 0), "{c:?}");
}

/// One `complete_then` job per `after`, on a scheduler of `concurrency` slots and one
/// writer connection, run until every attempt has ended.
async fn run_each<const N: usize>(
    name: &str,
    concurrency: usize,
    afters: [After; N],
) -> (TestDb, Scheduler, Vec<JobId>) {
    let db = TestDb::with_options(name, Default::default(), 3).await;
    create_postings(&db).await;
    let mut config = fast_config(&db.schema);
    config.concurrency = concurrency;
    config.connections = 1;
    let s = start_complete_then(&db, config).await;
    let mut ids = Vec::new();
    for after in afters {
        ids.push(
            s.enqueue_job(NewJob::new(CompleteThen::<false>::KIND, &after).unwrap())
                .await
                .unwrap(),
        );
    }
    wait_until(20, "every attempt to end", || async {
        ended(&s.metrics()) >= N as u64
    })
    .await;
    (db, s, ids)
}

#[test]
fn an_error_or_a_panic_after_a_committed_complete_in_ends_completed_not_stale() {
    run_in_system(async {
        within(60, "errors after committed completions", async {
            let (db, s, ids) = run_each("cin_after_error", 2, [After::Error, After::Panic]).await;
            for &id in &ids {
                assert_done_by_its_transaction(&db, id).await;
            }
            let m = s.metrics();
            assert_all_completed(&m, 2);
            assert_eq!(m.counters.panics, 1, "{:?}", m.counters);
            s.shutdown().await.unwrap();
            db.drop().await;
        })
        .await
    })
}

/// Found by the fault harness's `false_stale` rule: with a short retention, a retention
/// pass deleted the done job between the handler's commit and the scheduler's read-back,
/// which then found no row and failed the attempt as "did not commit", counted stale.
#[test]
fn a_job_completed_in_its_transaction_and_pruned_before_the_read_back_ends_completed_not_stale() {
    run_in_system(async {
        within(60, "completions pruned before their read-back", async {
            let (db, s, ids) =
                run_each("cin_pruned", 1, [After::Pruned, After::PrunedThenError]).await;
            for &id in &ids {
                assert!(
                    matches!(
                        db.store.job(id).await,
                        Err(leasehold::Error::JobNotFound(_))
                    ),
                    "job {id} was pruned"
                );
                assert_eq!(
                    db.count_where("postings", &format!("job_id = {}", id.0))
                        .await,
                    1,
                    "job {id}'s posting committed once"
                );
            }
            assert_all_completed(&s.metrics(), 2);
            s.shutdown().await.unwrap();
            db.drop().await;
        })
        .await
    })
}

#[test]
fn a_timeout_a_lease_deadline_or_a_shutdown_after_a_committed_complete_in_ends_completed() {
    run_in_system(async {
        within(60, "stops after committed completions", async {
            let db = TestDb::with_options("cin_after_stop", Default::default(), 3).await;
            create_postings(&db).await;
            let mut config = fast_config(&db.schema);
            config.concurrency = 2;
            config.connections = 1;
            // Lease 2 s, renewal 500 ms: an attempt's local deadline is at most 1.75 s
            // after its last confirmed renewal; the shutdown's grace ends well before.
            config.shutdown_grace = Duration::from_millis(300);
            let s = start_complete_then(&db, config).await;

            // Past its run time (500 ms), and past its lease deadline (renewals find the
            // job done and confirm nothing more), each still hanging.
            let timed = s
                .enqueue_job(NewJob::new(CompleteThen::<true>::KIND, &After::Hang).unwrap())
                .await
                .unwrap();
            let leased = s
                .enqueue_job(NewJob::new(CompleteThen::<false>::KIND, &After::Hang).unwrap())
                .await
                .unwrap();
            wait_until(20, "both attempts to be stopped", || async {
                ended(&s.metrics()) >= 2
            })
            .await;
            assert_done_by_its_transaction(&db, timed).await;
            assert_done_by_its_transaction(&db, leased).await;
            let m = s.metrics();
            assert_all_completed(&m, 2);
            assert_eq!(m.counters.timeouts, 1, "{:?}", m.counters);

            // Hanging when the scheduler shuts down: given back after the grace, but
            // there is nothing to give back.
            let at_shutdown = s
                .enqueue_job(NewJob::new(CompleteThen::<false>::KIND, &After::Hang).unwrap())
                .await
                .unwrap();
            wait_until(10, "its completion to commit", || async {
                db.store.job(at_shutdown).await.unwrap().state == JobState::Done
            })
            .await;
            let report = s.shutdown().await.unwrap();
            assert_done_by_its_transaction(&db, at_shutdown).await;
            assert_all_completed(&report.metrics, 3);
            assert_eq!(
                report.metrics.counters.released, 0,
                "{:?}",
                report.metrics.counters
            );
            db.drop().await;
        })
        .await
    })
}
