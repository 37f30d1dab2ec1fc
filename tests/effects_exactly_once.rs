//! Exactly-once effects across attempts, against real PostgreSQL and the gateway
//! simulator: the effect key is the job's and the step's, never the attempt's, so a
//! stale worker and its successor present the same key and the gateway charges once;
//! the ledger gives a retry the recorded outcome; a reused key with another request is
//! refused. Each test asserts the job's state and the gateway's applied-charge count.
//!
//! The negative controls run the same fault schedule with per-attempt keys (and with a
//! gateway that does not deduplicate) and see the duplicate charge: the tests can see
//! the failure they guard against.
//!
//! Workers are driven through the store (claim, reap with the `at` test clock,
//! complete) and the handler's real effect helpers (`JobContext::once`), so a test can
//! stop a worker between charging and recording.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use common::*;
use leasehold::testkit::gateway::{
    ChargeRequest, ChargeResult, Decision, Gateway, GatewayClient, GatewayConfig, Receipt,
};
use leasehold::testkit::{attempt_context, fencing_token};
use leasehold::{
    ClaimedJob, CompleteOutcome, FailOutcome, Failure, Generation, JobContext, JobError, JobId,
    JobState, NewJob, OwnerId, Store,
};
use tokio::sync::oneshot;

fn payment(cents: i64) -> ChargeRequest {
    ChargeRequest {
        account: "acct-1".into(),
        amount_cents: cents,
        reference: "acct-1/001".into(),
    }
}

/// How the handler names its charge step.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Keys {
    /// `once("charge")`: the key is `<schema identity>/<job id>/charge`, the same for
    /// every attempt.
    Stable,
    /// The negative control: a new key per attempt (`<schema identity>/<job
    /// id>/charge-g<generation>`).
    PerAttempt,
}

fn step(ctx: &JobContext, keys: Keys) -> String {
    match keys {
        Keys::Stable => "charge".to_string(),
        Keys::PerAttempt => format!("charge-g{}", ctx.generation()),
    }
}

/// The handler's charge step: at most once per effect key, with the effect key as the
/// gateway's idempotency key and the job's fencing token.
async fn charge(
    ctx: &JobContext,
    gw: &GatewayClient,
    req: &ChargeRequest,
    keys: Keys,
) -> Result<Receipt, JobError> {
    let token = fencing_token(ctx.job());
    ctx.once(&step(ctx, keys), req, |key| async move {
        gw.charge(key.as_str(), Some(token), req)
            .await?
            .into_job_result()
    })
    .await
}

/// Claim and release the job until its generation is `generation` (releases do not
/// count attempts): the honest way to a job at generation 7.
async fn advance_generation_to(db: &TestDb, id: JobId, generation: i64) {
    let warm = owner("warmup");
    for g in 1..=generation {
        let got = db.store.claim(&claim_req(&warm, 1)).await.unwrap();
        assert_eq!((got[0].id, got[0].generation), (id, Generation(g)));
        let released = db
            .store
            .release_many(&warm, &[got[0].attempt()], "warm-up")
            .await
            .unwrap();
        assert_eq!(released, vec![id]);
    }
    assert_eq!(
        db.store.job(id).await.unwrap().generation,
        Generation(generation)
    );
}

/// A's lease passes (test clock), the reaper takes the job back, `next` claims the next
/// generation.
async fn expire_and_reclaim(db: &TestDb, a_job: &ClaimedJob, next: &OwnerId) -> ClaimedJob {
    let at = secs_after(a_job.lease_until, 1);
    let report = db
        .store
        .reap(&owner("reaper"), &fixed_backoff(1), 10, Some(at))
        .await
        .unwrap();
    assert_eq!(report.retried, vec![a_job.id]);
    let mut got = db
        .store
        .claim(&claim_at(next, 1, secs_after(at, 2)))
        .await
        .unwrap();
    assert_eq!(got.len(), 1, "the next worker claims the job");
    let b_job = got.remove(0);
    assert_eq!(b_job.generation.0, a_job.generation.0 + 1);
    b_job
}

/// What the seed scenario left behind.
struct Seed {
    db: TestDb,
    gw: Gateway,
    id: JobId,
    a_charge: ChargeResult,
    /// A's fencing token (generation 7's), and B's (generation 8's).
    a_token: u64,
    b_token: u64,
    a_late: Result<Receipt, JobError>,
    b_result: Result<Receipt, JobError>,
}

/// The seed scenario of the design: A claims generation 7, charges, and stalls before
/// recording; its lease expires; B claims generation 8 and runs the same charge step;
/// B completes; A wakes up and tries to record and complete.
async fn seed_scenario(test: &str, keys: Keys, gateway: GatewayConfig) -> Seed {
    let db = TestDb::new(test).await;
    let gw = Gateway::start(gateway).unwrap();
    let req = payment(1250);
    let id = db
        .store
        .enqueue(NewJob::new("charge", &req).unwrap())
        .await
        .unwrap();
    advance_generation_to(&db, id, 6).await;

    // A claims generation 7 with its own connections.
    let a_store = db.other_store_sized("a", 2).await;
    let a = owner("a");
    let a_job = a_store.claim(&claim_req(&a, 1)).await.unwrap().remove(0);
    assert_eq!(a_job.generation, Generation(7));

    // A charges, then stalls (a long GC pause) before `once` can record the outcome.
    let (charged_tx, charged_rx) = oneshot::channel::<ChargeResult>();
    let (wake_tx, wake_rx) = oneshot::channel::<()>();
    let a_ctx = attempt_context(a_job.clone(), a_store.clone());
    let client = gw.client();
    let a_req = req.clone();
    let a_task = tokio::spawn(async move {
        let token = fencing_token(a_ctx.job());
        let step = step(&a_ctx, keys);
        let sent = a_req.clone();
        a_ctx
            .once(&step, &a_req, |key| async move {
                let result = client.charge(key.as_str(), Some(token), &sent).await?;
                let _ = charged_tx.send(result.clone());
                let _ = wake_rx.await;
                result.into_job_result()
            })
            .await
    });
    let a_charge = within(10, "A's charge", charged_rx).await.unwrap();

    // A's lease expires; the reaper records it; B claims generation 8.
    let b = owner("b");
    let b_job = expire_and_reclaim(&db, &a_job, &b).await;
    assert_eq!(b_job.generation, Generation(8));
    assert_eq!(
        db.count_where(
            "lease_expiries",
            &format!("job_id = {} AND generation = 7", id.0)
        )
        .await,
        1
    );

    // B runs the same step and completes with what it got.
    let b_ctx = attempt_context(b_job.clone(), db.store.clone());
    let b_result = charge(&b_ctx, &gw.client(), &req, keys).await;
    let receipt = b_result.clone().expect("B's charge step succeeds");
    assert_eq!(
        db.store
            .complete(
                &b_job.fence(),
                Some(serde_json::to_value(&receipt).unwrap())
            )
            .await
            .unwrap(),
        CompleteOutcome::Completed
    );

    // A wakes up: its record and its completion come too late.
    wake_tx.send(()).unwrap();
    let a_late = within(10, "A to wake up", a_task).await.unwrap();
    assert_eq!(
        a_store
            .complete(&a_job.fence(), Some(serde_json::json!("A's late result")))
            .await
            .unwrap(),
        CompleteOutcome::Stale,
        "A's late completion is refused"
    );
    let failure = Failure {
        reason: "late".into(),
        permanent: false,
        retry_after: None,
    };
    assert_eq!(
        a_store
            .fail(&a_job.fence(), &failure, &fixed_backoff(1))
            .await
            .unwrap(),
        FailOutcome::Stale
    );
    a_store.pool().close().await;
    Seed {
        db,
        gw,
        id,
        a_charge,
        a_token: fencing_token(&a_job),
        b_token: fencing_token(&b_job),
        a_late,
        b_result,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_worker_and_its_successor_share_the_effect_key_and_the_gateway_charges_once() {
    bounded(async {
        let s = seed_scenario("effects_seed", Keys::Stable, GatewayConfig::default()).await;
        let ChargeResult::Applied(a_receipt) = &s.a_charge else {
            panic!("A's charge was applied: {:?}", s.a_charge)
        };
        assert_eq!(
            a_receipt.fencing_token,
            Some(s.a_token),
            "A charged with its own token"
        );
        let b_receipt = s.b_result.as_ref().unwrap();
        assert_eq!(b_receipt, a_receipt, "B got A's charge back, not a new one");
        let a_err = s.a_late.as_ref().unwrap_err();
        assert!(
            !a_err.is_permanent() && a_err.message().contains("lost the lease"),
            "{a_err}"
        );

        // The gateway applied one charge; B's request was a duplicate of A's.
        let counts = s.gw.counts();
        assert_eq!(
            (counts.requested, counts.applied, counts.duplicates),
            (2, 1, 1)
        );
        let log = s.gw.log();
        let key = s.db.effect_key(s.id, "charge").await;
        assert_eq!(
            log.iter()
                .map(|e| (e.decision, e.fencing_token, e.idempotency_key.clone()))
                .collect::<Vec<_>>(),
            vec![
                (Decision::Applied, Some(s.a_token), key.clone()),
                (Decision::Duplicate, Some(s.b_token), key.clone()),
            ]
        );

        // The job is done with B's result; the ledger holds one outcome, B's.
        let rec = s.db.store.job(s.id).await.unwrap();
        assert_eq!((rec.state, rec.generation), (JobState::Done, Generation(8)));
        assert_eq!(rec.result, Some(serde_json::to_value(b_receipt).unwrap()));
        assert_eq!(s.db.count_where("effects", "true").await, 1);
        let ledger =
            s.db.store
                .effect(&key)
                .await
                .unwrap()
                .expect("the ledger has the charge");
        assert_eq!((ledger.job, ledger.generation), (s.id, Generation(8)));
        assert_eq!(ledger.outcome, serde_json::to_value(a_receipt).unwrap());
        s.db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_per_attempt_keys_charge_twice_under_the_same_faults() {
    bounded(async {
        let s = seed_scenario(
            "effects_ctl_keys",
            Keys::PerAttempt,
            GatewayConfig::default(),
        )
        .await;
        let counts = s.gw.counts();
        assert_eq!(
            (counts.requested, counts.applied, counts.duplicates),
            (2, 2, 0),
            "a new key per attempt lets A and B both pay"
        );
        let keys: Vec<String> = s.gw.log().into_iter().map(|e| e.idempotency_key).collect();
        assert!(
            keys.len() == 2 && keys[0].ends_with("charge-g7") && keys[1].ends_with("charge-g8"),
            "{keys:?}"
        );
        assert_ne!(
            s.a_charge.receipt().unwrap().charge_id,
            s.b_result.as_ref().unwrap().charge_id
        );
        // The job row cannot tell: it is done, once.
        assert_eq!(s.db.state_of(s.id).await, "done");
        assert_eq!(s.gw.applied_by_reference()["acct-1/001"], 2);
        s.db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_a_gateway_without_deduplication_charges_twice() {
    bounded(async {
        // Stable keys and the ledger, but an effect store that neither deduplicates nor
        // sees A's token after B's: the ledger alone cannot stop A's unrecorded charge
        // from being repeated. This is why the effect store must deduplicate, fence, or
        // be looked up first.
        let gateway = GatewayConfig {
            idempotency: false,
            ..Default::default()
        };
        let s = seed_scenario("effects_ctl_nodedup", Keys::Stable, gateway).await;
        assert_eq!(s.gw.counts().applied, 2);
        assert_eq!(s.db.state_of(s.id).await, "done");
        s.db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciling_by_lookup_charges_once_even_without_deduplication() {
    bounded(async {
        let db = TestDb::new("effects_reconcile").await;
        let gw = Gateway::start(GatewayConfig {
            idempotency: false,
            ..Default::default()
        })
        .unwrap();
        let req = payment(990);
        let id = db
            .store
            .enqueue(NewJob::new("charge", &req).unwrap())
            .await
            .unwrap();
        let reconciled = |ctx: JobContext, client: GatewayClient, req: ChargeRequest| async move {
            let token = fencing_token(ctx.job());
            let lookup_client = client.clone();
            let sent = req.clone();
            ctx.once_reconciled(
                "charge",
                &req,
                |key| async move { Ok::<_, JobError>(lookup_client.lookup(key.as_str()).await?) },
                |key| async move {
                    client
                        .charge(key.as_str(), Some(token), &sent)
                        .await?
                        .into_job_result()
                },
            )
            .await
        };

        // A charges and dies before recording (the charge ran outside `once`).
        let a = owner("a");
        let a_job = db.store.claim(&claim_req(&a, 1)).await.unwrap().remove(0);
        let a_ctx = attempt_context(a_job.clone(), db.store.clone());
        let key = a_ctx.effect_key("charge");
        let applied = gw
            .client()
            .charge(key.as_str(), Some(fencing_token(&a_job)), &req)
            .await
            .unwrap();

        // B looks the key up first, finds A's charge, records it, and does not charge.
        let b_job = expire_and_reclaim(&db, &a_job, &owner("b")).await;
        let b_ctx = attempt_context(b_job.clone(), db.store.clone());
        let got = reconciled(b_ctx, gw.client(), req.clone()).await.unwrap();
        assert_eq!(Some(&got), applied.receipt());
        assert_eq!(
            db.store.complete(&b_job.fence(), None).await.unwrap(),
            CompleteOutcome::Completed
        );
        assert_eq!(gw.counts().applied, 1);
        assert_eq!(gw.counts().requested, 1, "B never sent a charge");
        assert_eq!(db.state_of(id).await, "done");
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_fencing_token_is_refused_by_the_gateway_with_a_typed_result() {
    bounded(async {
        let db = TestDb::new("effects_stale_token").await;
        let gw = Gateway::start(GatewayConfig::default()).unwrap();
        let req = payment(500);
        let id = db
            .store
            .enqueue(NewJob::new("charge", &req).unwrap())
            .await
            .unwrap();
        advance_generation_to(&db, id, 6).await;
        let a_store = db.other_store_sized("a", 2).await;
        let a_job = a_store
            .claim(&claim_req(&owner("a"), 1))
            .await
            .unwrap()
            .remove(0);

        // A finds nothing in the ledger, enters its charge step and stalls before
        // sending the request.
        let (entered_tx, entered_rx) = oneshot::channel::<()>();
        let (go_tx, go_rx) = oneshot::channel::<()>();
        let (seen_tx, seen_rx) = oneshot::channel::<ChargeResult>();
        let a_ctx = attempt_context(a_job.clone(), a_store.clone());
        let client = gw.client();
        let a_req = req.clone();
        let a_task = tokio::spawn(async move {
            let token = fencing_token(a_ctx.job());
            let sent = a_req.clone();
            a_ctx
                .once("charge", &a_req, |key| async move {
                    let _ = entered_tx.send(());
                    let _ = go_rx.await;
                    let result = client.charge(key.as_str(), Some(token), &sent).await?;
                    let _ = seen_tx.send(result.clone());
                    result.into_job_result()
                })
                .await
        });
        within(10, "A to enter its charge step", entered_rx)
            .await
            .unwrap();

        // Meanwhile B takes over with generation 8, charges and completes.
        let b_job = expire_and_reclaim(&db, &a_job, &owner("b")).await;
        let b_ctx = attempt_context(b_job.clone(), db.store.clone());
        let receipt = charge(&b_ctx, &gw.client(), &req, Keys::Stable)
            .await
            .unwrap();
        assert_eq!(receipt.fencing_token, Some(fencing_token(&b_job)));
        db.store
            .complete(
                &b_job.fence(),
                Some(serde_json::to_value(&receipt).unwrap()),
            )
            .await
            .unwrap();

        // A's request finally arrives with its older token and is fenced: a typed result.
        go_tx.send(()).unwrap();
        let seen = within(10, "A's gateway call", seen_rx).await.unwrap();
        assert_eq!(
            seen,
            ChargeResult::Fenced {
                seen: fencing_token(&b_job),
                got: fencing_token(&a_job)
            }
        );
        let a_err = within(10, "A's step", a_task).await.unwrap().unwrap_err();
        assert!(!a_err.is_permanent());
        assert!(
            a_err
                .message()
                .contains(&format!("fencing token {}", fencing_token(&a_job)))
                && a_err
                    .message()
                    .contains(&format!("seen {}", fencing_token(&b_job))),
            "{a_err}"
        );
        assert_eq!(
            a_store.complete(&a_job.fence(), None).await.unwrap(),
            CompleteOutcome::Stale
        );

        let counts = gw.counts();
        assert_eq!((counts.requested, counts.applied, counts.fenced), (2, 1, 1));
        assert_eq!(gw.log()[1].decision, Decision::Fenced);
        let rec = db.store.job(id).await.unwrap();
        assert_eq!((rec.state, rec.generation), (JobState::Done, Generation(8)));
        a_store.pool().close().await;
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effect_done_completion_write_fails_the_retry_reuses_the_recorded_outcome() {
    bounded(async {
        let db = TestDb::new("effects_ledger_hit").await;
        let gw = Gateway::start(GatewayConfig::default()).unwrap();
        let req = payment(700);
        let id = db
            .store
            .enqueue(NewJob::new("charge", &req).unwrap())
            .await
            .unwrap();

        // A charges and the ledger records it; then A's connection dies and its
        // completion write fails.
        let a_store = db.other_store_sized("a", 1).await;
        let a_job = a_store
            .claim(&claim_req(&owner("a"), 1))
            .await
            .unwrap()
            .remove(0);
        let a_ctx = attempt_context(a_job.clone(), a_store.clone());
        let a_receipt = charge(&a_ctx, &gw.client(), &req, Keys::Stable)
            .await
            .unwrap();
        db.kill_and_wait("a").await;
        a_store.pool().close().await;
        let err = a_store
            .complete(
                &a_job.fence(),
                Some(serde_json::to_value(&a_receipt).unwrap()),
            )
            .await
            .unwrap_err();
        assert!(err.is_connection(), "{err}");
        assert_eq!(db.state_of(id).await, "running");

        // The retry finds the outcome in the ledger and never calls the gateway.
        let b_job = expire_and_reclaim(&db, &a_job, &owner("b")).await;
        let b_ctx = attempt_context(b_job.clone(), db.store.clone());
        let acted = Arc::new(AtomicU32::new(0));
        let acted_in = acted.clone();
        let client = gw.client();
        let sent = req.clone();
        let b_receipt: Receipt = b_ctx
            .once("charge", &req, |key| async move {
                acted_in.fetch_add(1, Ordering::SeqCst);
                client
                    .charge(key.as_str(), Some(2), &sent)
                    .await?
                    .into_job_result()
            })
            .await
            .unwrap();
        assert_eq!(acted.load(Ordering::SeqCst), 0, "ledger hit: no second act");
        assert_eq!(b_receipt, a_receipt);
        assert_eq!(
            db.store
                .complete(
                    &b_job.fence(),
                    Some(serde_json::to_value(&b_receipt).unwrap())
                )
                .await
                .unwrap(),
            CompleteOutcome::Completed
        );

        let counts = gw.counts();
        assert_eq!((counts.requested, counts.applied), (1, 1));
        let rec = db.store.job(id).await.unwrap();
        assert_eq!(rec.state, JobState::Done);
        assert_eq!(rec.result, Some(serde_json::to_value(&a_receipt).unwrap()));
        let ledger = db
            .store
            .effect(&db.effect_key(id, "charge").await)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            ledger.generation,
            Generation(1),
            "recorded by A, reused by B"
        );
        db.drop().await;
    })
    .await
}

/// Fail the attempt (retryable) and claim the retry once its backoff has passed.
async fn fail_and_retry(db: &TestDb, j: &ClaimedJob, next: &OwnerId) -> ClaimedJob {
    let failure = Failure {
        reason: "the step after the charge failed".into(),
        permanent: false,
        retry_after: None,
    };
    let outcome = db
        .store
        .fail(&j.fence(), &failure, &fixed_backoff(1))
        .await
        .unwrap();
    let FailOutcome::Retrying { available_at } = outcome else {
        panic!("expected a retry, got {outcome:?}")
    };
    let mut got = db
        .store
        .claim(&claim_at(next, 1, secs_after(available_at, 1)))
        .await
        .unwrap();
    assert_eq!(got.len(), 1);
    got.remove(0)
}

async fn fail_permanently(store: &Store, j: &ClaimedJob, err: &JobError) {
    let failure = Failure {
        reason: err.message().to_string(),
        permanent: err.is_permanent(),
        retry_after: None,
    };
    assert_eq!(
        store
            .fail(&j.fence(), &failure, &fixed_backoff(1))
            .await
            .unwrap(),
        FailOutcome::Dead
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_effect_key_with_another_request_is_refused_by_the_ledger_and_nothing_is_charged() {
    bounded(async {
        let db = TestDb::new("effects_fp_mismatch").await;
        let gw = Gateway::start(GatewayConfig::default()).unwrap();
        let id = db
            .store
            .enqueue(NewJob::new("charge", &payment(1000)).unwrap())
            .await
            .unwrap();

        // Attempt 1 charges 10.00 and records it, then fails in a later step.
        let j1 = db
            .store
            .claim(&claim_req(&owner("w1"), 1))
            .await
            .unwrap()
            .remove(0);
        let ctx1 = attempt_context(j1.clone(), db.store.clone());
        charge(&ctx1, &gw.client(), &payment(1000), Keys::Stable)
            .await
            .unwrap();

        // Attempt 2 computes another amount (a non-deterministic handler) for the same
        // step: refused before acting, permanently, naming the key.
        let j2 = fail_and_retry(&db, &j1, &owner("w2")).await;
        let ctx2 = attempt_context(j2.clone(), db.store.clone());
        let acted = Arc::new(AtomicU32::new(0));
        let acted_in = acted.clone();
        let err = ctx2
            .once("charge", &payment(1010), |_key| async move {
                acted_in.fetch_add(1, Ordering::SeqCst);
                Ok::<_, JobError>(0u64)
            })
            .await
            .unwrap_err();
        assert!(err.is_permanent(), "{err}");
        assert!(
            err.message()
                .contains(&format!("{:?}", db.effect_key(id, "charge").await))
                && err.message().contains("different request"),
            "{err}"
        );
        assert_eq!(acted.load(Ordering::SeqCst), 0);
        fail_permanently(&db.store, &j2, &err).await;

        let rec = db.store.job(id).await.unwrap();
        assert_eq!(rec.state, JobState::Dead);
        assert!(rec.last_error.unwrap().contains("different request"));
        let counts = gw.counts();
        assert_eq!(
            (counts.requested, counts.applied),
            (1, 1),
            "nothing more charged"
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_idempotency_key_with_another_request_is_a_gateway_mismatch_and_nothing_is_charged() {
    bounded(async {
        let db = TestDb::new("effects_gw_mismatch").await;
        let gw = Gateway::start(GatewayConfig::default()).unwrap();
        let id = db
            .store
            .enqueue(NewJob::new("charge", &payment(1000)).unwrap())
            .await
            .unwrap();

        // Attempt 1 charges 10.00 and is killed before `once` records it.
        let a_job = db
            .store
            .claim(&claim_req(&owner("a"), 1))
            .await
            .unwrap()
            .remove(0);
        let a_ctx = attempt_context(a_job.clone(), db.store.clone());
        let (charged_tx, charged_rx) = oneshot::channel::<()>();
        let client = gw.client();
        let a_task = tokio::spawn(async move {
            let token = fencing_token(a_ctx.job());
            a_ctx
                .once("charge", &payment(1000), |key| async move {
                    let r = client
                        .charge(key.as_str(), Some(token), &payment(1000))
                        .await?;
                    let _ = charged_tx.send(());
                    std::future::pending::<()>().await;
                    r.into_job_result()
                })
                .await
        });
        within(10, "A's charge", charged_rx).await.unwrap();
        a_task.abort();
        assert!(a_task.await.unwrap_err().is_cancelled());

        // Attempt 2 asks for 10.10 under the same key: the ledger has nothing, the
        // gateway refuses the reuse, and the job is dead with that reason.
        let b_job = expire_and_reclaim(&db, &a_job, &owner("b")).await;
        let b_ctx = attempt_context(b_job.clone(), db.store.clone());
        let err = charge(&b_ctx, &gw.client(), &payment(1010), Keys::Stable)
            .await
            .unwrap_err();
        assert!(err.is_permanent(), "{err}");
        assert!(err.message().contains("different request"), "{err}");
        fail_permanently(&db.store, &b_job, &err).await;

        assert_eq!(db.state_of(id).await, "dead");
        let counts = gw.counts();
        assert_eq!(
            (counts.requested, counts.applied, counts.mismatches),
            (2, 1, 1)
        );
        assert_eq!(gw.log()[1].decision, Decision::Mismatch);
        assert_eq!(db.count_where("effects", "true").await, 0);
        db.drop().await;
    })
    .await
}
