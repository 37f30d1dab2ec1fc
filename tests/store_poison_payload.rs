//! A payload that cannot be read back (nested past what serde_json reads) is refused at
//! enqueue; one that got into the table anyway (written around the checks, or by an
//! older version) fails alone: its claim batch, its neighbours and the operator's view
//! of it all still work.

mod common;

use common::*;
use leasehold::store::MAX_PAYLOAD_DEPTH;
use leasehold::{
    CancelOutcome, CompleteOutcome, Error, FailOutcome, Failure, JobId, JobState, NewJob,
};
use serde_json::{json, Value};

/// `depth` arrays, one inside the other, around a number.
fn nested_text(depth: usize) -> String {
    format!("{}1{}", "[".repeat(depth), "]".repeat(depth))
}

fn nested_arrays(depth: usize) -> Value {
    let mut v = json!(1);
    for _ in 0..depth {
        v = json!([v]);
    }
    v
}

fn nested_objects(depth: usize) -> Value {
    let mut v = json!(1);
    for _ in 0..depth {
        v = json!({ "a": v });
    }
    v
}

/// Insert a job the way the enqueue statement does (same columns), with a payload given
/// as JSON text: this is how a payload that enqueue refuses gets into the table.
async fn insert_raw(db: &TestDb, payload: &str) -> JobId {
    let id: i64 = sqlx::query_scalar(&format!(
        "INSERT INTO {} (queue, kind, job_key, key_seq, priority, state, payload,
                         payload_bytes, max_attempts, available_at, created_at, dead_blocks_key)
         VALUES ('default', 'k', NULL, NULL, 0, 'pending', $1::text::jsonb,
                 length($1), 25, now(), now(), true)
         RETURNING id",
        db.table("jobs")
    ))
    .bind(payload)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    JobId(id)
}

#[test]
fn serde_json_reads_max_payload_depth_levels_and_not_one_more() {
    // The limit enqueue enforces is the one the reader has: any lower would refuse
    // readable payloads, any higher would store unreadable ones.
    let at_limit: Result<Value, _> = serde_json::from_str(&nested_text(MAX_PAYLOAD_DEPTH));
    assert!(at_limit.is_ok(), "{at_limit:?}");
    let over = serde_json::from_str::<Value>(&nested_text(MAX_PAYLOAD_DEPTH + 1));
    assert!(
        over.is_err(),
        "one level more than MAX_PAYLOAD_DEPTH ({}) is readable too",
        MAX_PAYLOAD_DEPTH + 1
    );
    let over = over.unwrap_err();
    assert!(over.to_string().contains("recursion limit"), "{over}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_payload_fails_alone_in_its_claim_batch_and_can_be_shown_and_cancelled() {
    bounded(async {
        let db = TestDb::new("poison_batch").await;
        let before = db.store.enqueue(job("k")).await.unwrap();
        let poison = insert_raw(&db, &nested_text(200)).await;
        let after = db.store.enqueue(job("k")).await.unwrap();
        let w = owner("w");

        let got = db
            .store
            .claim(&claim_at(&w, 10, far_future()))
            .await
            .expect("a poison row must not fail the claim of its batch");
        assert_eq!(
            got.iter().map(|j| j.id).collect::<Vec<_>>(),
            vec![before, poison, after]
        );
        for j in [&got[0], &got[2]] {
            assert_eq!(
                (&j.payload, &j.payload_error),
                (&json!({ "n": 1 }), &None),
                "neighbour {} came back damaged",
                j.id
            );
        }
        let bad = &got[1];
        assert_eq!(bad.payload, Value::Null);
        let reason = bad
            .payload_error
            .as_deref()
            .expect("the poison job carries its decode error");
        assert!(reason.contains("recursion limit"), "{reason}");

        // The operator can look at it...
        let rec = db
            .store
            .job(poison)
            .await
            .expect("store.job must show a row whose payload cannot be decoded");
        assert_eq!(rec.state, JobState::Running);
        assert_eq!(rec.payload, Value::Null);
        assert!(rec.payload_error.is_some(), "{rec:?}");
        // ...and cancel it: running, so a request; the attempt's failure ends it.
        assert_eq!(
            db.store.cancel(poison, "poison").await.unwrap(),
            CancelOutcome::Requested
        );
        assert_eq!(
            db.store
                .fail(
                    &bad.fence(),
                    &Failure {
                        reason: reason.to_string(),
                        permanent: true,
                        retry_after: None,
                    },
                    &fixed_backoff(1)
                )
                .await
                .unwrap(),
            FailOutcome::Cancelled
        );
        assert_eq!(
            db.store.job(poison).await.unwrap().state,
            JobState::Cancelled
        );
        // A pending one is cancelled at once.
        let pending_poison = insert_raw(&db, &nested_text(200)).await;
        assert_eq!(
            db.store.cancel(pending_poison, "poison").await.unwrap(),
            CancelOutcome::Cancelled
        );
        let rec = db.store.job(pending_poison).await.unwrap();
        assert_eq!((rec.state, rec.payload), (JobState::Cancelled, Value::Null));

        // The neighbours complete as usual.
        for j in [&got[0], &got[2]] {
            assert_eq!(
                db.store.complete(&j.fence(), None).await.unwrap(),
                CompleteOutcome::Completed
            );
        }
        assert_eq!(db.count_where("jobs", "state = 'done'").await, 2);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_refuses_payloads_nested_past_max_payload_depth_and_accepts_the_limit() {
    bounded(async {
        let db = TestDb::new("poison_depth").await;
        let refused = |r: Result<(), Error>, what: &str| match r {
            Err(Error::InvalidPayload(reason)) => {
                assert!(reason.contains("nested deeper"), "{what}: {reason}")
            }
            other => panic!("{what}: expected InvalidPayload, got {other:?}"),
        };
        for (what, payload) in [
            ("200 arrays", nested_arrays(200)),
            ("one array too many", nested_arrays(MAX_PAYLOAD_DEPTH + 1)),
            ("one object too many", nested_objects(MAX_PAYLOAD_DEPTH + 1)),
        ] {
            let j = NewJob::from_json("k", payload);
            refused(db.store.enqueue(j.clone()).await.map(|_| ()), what);
            refused(
                db.store
                    .enqueue_many(vec![job("k"), j.clone()])
                    .await
                    .map(|_| ()),
                what,
            );
            refused(db.store.enqueue_copy(vec![j]).await.map(|_| ()), what);
        }
        assert_eq!(db.job_count().await, 0, "nothing was written");

        // Exactly at the limit: stored, claimed and shown as it was given.
        let limit = [
            nested_arrays(MAX_PAYLOAD_DEPTH),
            nested_objects(MAX_PAYLOAD_DEPTH),
        ];
        let ids = db
            .store
            .enqueue_many(
                limit
                    .iter()
                    .map(|p| NewJob::from_json("k", p.clone()))
                    .collect(),
            )
            .await
            .expect("a payload at MAX_PAYLOAD_DEPTH is accepted");
        let w = owner("w");
        let got = db
            .store
            .claim(&claim_at(&w, 10, far_future()))
            .await
            .unwrap();
        assert_eq!(got.iter().map(|j| j.id).collect::<Vec<_>>(), ids);
        for (j, payload) in got.iter().zip(&limit) {
            assert_eq!(j.payload_error, None);
            assert!(&j.payload == payload, "job {} came back changed", j.id);
            assert!(&db.store.job(j.id).await.unwrap().payload == payload);
        }
        // One level deeper, written around the check, cannot be read back: the limit
        // is exactly the reader's.
        let deeper = insert_raw(&db, &nested_text(MAX_PAYLOAD_DEPTH + 1)).await;
        let got = db
            .store
            .claim(&claim_at(&w, 10, far_future()))
            .await
            .unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].id, deeper);
        assert!(got[0].payload_error.is_some());
        db.drop().await;
    })
    .await
}
