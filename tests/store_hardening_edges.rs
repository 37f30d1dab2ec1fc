//! Edges the hardening pass closed in the store: two generations of one job in one
//! completion batch, a strict byte budget, the longest schema name, run-at and delay
//! limits on every enqueue path, and a store made from a scheduler's config.

mod common;

use std::time::Duration;

use chrono::{TimeZone, Utc};
use common::*;
use leasehold::store::MAX_DELAY;
use leasehold::{
    CancelOutcome, ClaimedJob, CompleteOutcome, Config, Error, FailOutcome, Failure, JobState,
    NewJob, OwnerId, Store, StoreOptions,
};
use serde_json::json;

/// Claim a job as `w`, let its lease expire, claim it again as `w`: the same process
/// then holds an old attempt and the current one. Returns (old, current).
async fn two_generations(db: &TestDb, w: &OwnerId) -> (ClaimedJob, ClaimedJob) {
    let t0 = Utc::now();
    let old = db.store.claim(&claim_at(w, 1, t0)).await.unwrap().remove(0);
    let report = db
        .store
        .reap(&owner("r"), &fixed_backoff(1), 10, Some(secs_after(t0, 60)))
        .await
        .unwrap();
    assert_eq!(report.retried, vec![old.id]);
    let current = db
        .store
        .claim(&claim_at(w, 1, secs_after(t0, 120)))
        .await
        .unwrap()
        .remove(0);
    assert_eq!(current.id, old.id);
    assert_eq!(current.generation.0, old.generation.0 + 1);
    (old, current)
}

async fn completed_generations(db: &TestDb, id: leasehold::JobId) -> Vec<i64> {
    db.store
        .history(id)
        .await
        .unwrap()
        .iter()
        .filter(|e| e.event == "completed")
        .map(|e| e.generation.0)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_batch_with_two_generations_of_a_job_completes_only_the_current_one() {
    bounded(async {
        let db = TestDb::new("edge_two_gens").await;
        let w = owner("w");
        let id = db.store.enqueue(job("k")).await.unwrap();
        let (old, current) = two_generations(&db, &w).await;
        let outcomes = db
            .store
            .complete_many(
                &w,
                &[
                    (old.attempt(), Some(json!("old"))),
                    (current.attempt(), Some(json!("current"))),
                ],
            )
            .await
            .unwrap();
        assert_eq!(
            outcomes,
            vec![CompleteOutcome::Stale, CompleteOutcome::Completed]
        );
        let rec = db.store.job(id).await.unwrap();
        assert_eq!(
            (rec.state, rec.generation, rec.result),
            (JobState::Done, current.generation, Some(json!("current")))
        );
        assert_eq!(
            completed_generations(&db, id).await,
            vec![current.generation.0]
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_batch_with_two_generations_of_a_keyed_job_completes_only_the_current_one() {
    bounded(async {
        let db = TestDb::new("edge_two_gens_keyed").await;
        let w = owner("w");
        let ids = db
            .store
            .enqueue_many(vec![keyed("k", "acct", 1), keyed("k", "acct", 2)])
            .await
            .unwrap();
        let (old, current) = two_generations(&db, &w).await;
        assert_eq!(current.id, ids[0]);
        // The current generation first this time: order must not matter.
        let outcomes = db
            .store
            .complete_many(
                &w,
                &[
                    (current.attempt(), Some(json!("current"))),
                    (old.attempt(), Some(json!("old"))),
                ],
            )
            .await
            .unwrap();
        assert_eq!(
            outcomes,
            vec![CompleteOutcome::Completed, CompleteOutcome::Stale]
        );
        let rec = db.store.job(ids[0]).await.unwrap();
        assert_eq!(
            (rec.state, rec.result),
            (JobState::Done, Some(json!("current")))
        );
        assert_eq!(
            completed_generations(&db, ids[0]).await,
            vec![current.generation.0]
        );
        let next = db
            .store
            .claim(&claim_at(&w, 10, far_future()))
            .await
            .unwrap();
        assert_eq!(
            next.iter().map(|j| j.id).collect::<Vec<_>>(),
            vec![ids[1]],
            "the key moved on exactly once"
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_budget_below_the_first_payload_claims_nothing_unless_first_over_budget() {
    bounded(async {
        let db = TestDb::new("edge_budget").await;
        let big = json!({ "s": "x".repeat(1000) });
        let size = serde_json::to_vec(&big).unwrap().len() as i64;
        let ids = db
            .store
            .enqueue_many(
                (0..3)
                    .map(|_| NewJob::from_json("k", big.clone()))
                    .collect(),
            )
            .await
            .unwrap();
        let w = owner("w");
        let claim = |budget: i64, first_over_budget: bool| {
            let mut req = claim_at(&w, 10, far_future());
            req.byte_budget = budget;
            req.first_over_budget = first_over_budget;
            req
        };

        let got = db.store.claim(&claim(size - 1, false)).await.unwrap();
        assert!(
            got.is_empty(),
            "a spent budget must claim nothing, got {:?}",
            got.iter().map(|j| j.id).collect::<Vec<_>>()
        );
        assert_eq!(db.count_where("jobs", "state = 'running'").await, 0);

        let got = db.store.claim(&claim(size - 1, true)).await.unwrap();
        assert_eq!(got.iter().map(|j| j.id).collect::<Vec<_>>(), vec![ids[0]]);
        assert_eq!(got[0].payload_bytes as i64, size);

        // Within budget the flag changes nothing: exactly what fits.
        let got = db.store.claim(&claim(size, false)).await.unwrap();
        assert_eq!(got.iter().map(|j| j.id).collect::<Vec<_>>(), vec![ids[1]]);
        db.drop().await;
    })
    .await
}

/// A TestDb over a schema whose name is exactly 63 bytes, PostgreSQL's identifier limit.
async fn longest_schema(test: &str) -> TestDb {
    ensure_database().await;
    let mut schema = format!("t_{test}_{:08x}_", rand::random::<u32>());
    while schema.len() < 63 {
        schema.push('x');
    }
    assert_eq!(schema.len(), 63);
    let app_name = format!("lh-{test}");
    let pool = owner_pool_for(&app_name, 4).await;
    let store = Store::new(pool.clone(), &schema, StoreOptions::default()).unwrap();
    TestDb {
        schema,
        owner: pool.clone(),
        pool,
        store,
        app_name,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_63_byte_schema_name_migrates_enqueues_wakes_claims_and_cancels() {
    bounded(async {
        let db = longest_schema("schema63").await;
        db.store.migrate().await.unwrap();
        let wake = db.store.schema().channel();
        let cancel = db.store.schema().cancel_channel();
        let mut listener = sqlx::postgres::PgListener::connect_with(&db.pool)
            .await
            .unwrap();
        listener
            .listen_all([wake.as_str(), cancel.as_str()])
            .await
            .unwrap();

        let id = db
            .store
            .enqueue(job("k"))
            .await
            .expect("enqueue (and its NOTIFY) on a 63-byte schema");
        let n = within(5, "the enqueue wake-up", listener.recv())
            .await
            .unwrap();
        assert_eq!((n.channel(), n.payload()), (wake.as_str(), "default"));

        let w = owner("w");
        let j = db.store.claim(&claim_req(&w, 10)).await.unwrap().remove(0);
        assert_eq!(j.id, id);
        assert_eq!(
            db.store.cancel(id, "stop").await.unwrap(),
            CancelOutcome::Requested
        );
        let n = within(5, "the cancel notification", listener.recv())
            .await
            .unwrap();
        assert_eq!(
            (n.channel(), n.payload()),
            (cancel.as_str(), id.0.to_string().as_str())
        );
        let stopped = db
            .store
            .fail(
                &j.fence(),
                &Failure {
                    reason: "cancelled".into(),
                    permanent: false,
                    retry_after: None,
                },
                &fixed_backoff(1),
            )
            .await
            .unwrap();
        assert_eq!(stopped, FailOutcome::Cancelled);
        assert!(wake.len() <= 63 && cancel.len() <= 63, "{wake} / {cancel}");
        assert_ne!(wake, cancel);
        drop(listener);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_at_past_year_9999_and_delays_over_100_years_are_refused_on_every_path() {
    bounded(async {
        let db = TestDb::new("edge_time_limits").await;
        let year_10000 = Utc.with_ymd_and_hms(10000, 1, 1, 0, 0, 0).unwrap();
        let late = NewJob::from_json("k", json!({})).with_run_at(year_10000);
        let long = NewJob::from_json("k", json!({})).with_delay(MAX_DELAY + Duration::from_secs(1));
        for (bad, field) in [(late, "run_at"), (long, "delay")] {
            let paths = [
                ("enqueue", db.store.enqueue(bad.clone()).await.map(|_| ())),
                (
                    "enqueue_many",
                    db.store
                        .enqueue_many(vec![job("k"), bad.clone()])
                        .await
                        .map(|_| ()),
                ),
                (
                    "enqueue_copy",
                    db.store
                        .enqueue_copy(vec![job("k"), bad.clone()])
                        .await
                        .map(|_| ()),
                ),
            ];
            for (path, result) in paths {
                match result {
                    Err(Error::InvalidInput { field: f, .. }) if f == field => {}
                    other => panic!("{path}: expected InvalidInput on {field}, got {other:?}"),
                }
            }
        }
        assert_eq!(db.job_count().await, 0, "nothing was written");

        // The limits themselves are accepted.
        let last = Utc.with_ymd_and_hms(9999, 12, 31, 23, 59, 59).unwrap();
        db.store
            .enqueue(job("k").with_run_at(last))
            .await
            .expect("run_at at the end of year 9999");
        db.store
            .enqueue_copy(vec![job("k").with_run_at(last)])
            .await
            .expect("run_at at the end of year 9999 through COPY");
        db.store
            .enqueue(job("k").with_delay(MAX_DELAY))
            .await
            .expect("a delay of exactly 100 years");
        assert_eq!(db.job_count().await, 3);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_for_a_config_gives_its_jobs_the_configs_attempts() {
    bounded(async {
        let db = TestDb::new("edge_for_config").await;
        let mut config = Config {
            schema: db.schema.clone(),
            ..Config::default()
        };
        config.retry.max_attempts = 3;
        let store = Store::for_config(db.pool.clone(), &config).unwrap();
        let id = store.enqueue(job("k")).await.unwrap();
        let explicit = store.enqueue(job("k").with_max_attempts(5)).await.unwrap();
        assert_eq!(store.job(id).await.unwrap().max_attempts, 3);
        assert_eq!(store.job(explicit).await.unwrap().max_attempts, 5);
        store.hold(explicit).await.unwrap();

        // And it shows: the third failure is the last.
        let w = owner("w");
        let mut outcomes = Vec::new();
        loop {
            let got = store.claim(&claim_at(&w, 1, far_future())).await.unwrap();
            let Some(j) = got.into_iter().next() else {
                break;
            };
            let failure = Failure {
                reason: "no".into(),
                permanent: false,
                retry_after: None,
            };
            outcomes.push(
                store
                    .fail(&j.fence(), &failure, &fixed_backoff(1))
                    .await
                    .unwrap(),
            );
        }
        assert_eq!(outcomes.len(), 3, "{outcomes:?}");
        assert_eq!(outcomes[2], FailOutcome::Dead);
        assert_eq!(store.job(id).await.unwrap().state, JobState::Dead);
        db.drop().await;
    })
    .await
}
