//! Bad input is refused before anything is written, or stored sanitized, and never
//! turns into a crash loop: oversized and NUL-carrying payloads, NUL and megabyte
//! failure reasons, permanent failures, and kinds no worker knows.

mod common;

use common::*;
use leasehold::{CompleteOutcome, Error, FailOutcome, Failure, JobState, NewJob, StoreOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_payload_is_refused_and_nothing_written() {
    bounded(async {
        let opts = StoreOptions {
            max_payload_bytes: 1024,
            ..StoreOptions::default()
        };
        let db = TestDb::with_options("bad_payload_too_large", opts, 4).await;
        let existing = db.store.enqueue(job("k")).await.unwrap();
        let big = NewJob::from_json("k", serde_json::json!({ "blob": "x".repeat(2000) }));
        match db.store.enqueue(big.clone()).await {
            Err(Error::PayloadTooLarge { size, limit }) => {
                assert_eq!(limit, 1024);
                assert!(size > 2000);
            }
            other => panic!("expected PayloadTooLarge, got {other:?}"),
        }
        match db
            .store
            .enqueue_many(vec![job("k"), keyed("k", "acct", 1), big])
            .await
        {
            Err(Error::PayloadTooLarge { .. }) => {}
            other => panic!("expected PayloadTooLarge, got {other:?}"),
        }
        // Exactly at the limit is fine.
        let fits = serde_json::json!({ "b": "y".repeat(1024 - 8) });
        assert_eq!(serde_json::to_string(&fits).unwrap().len(), 1024);
        let at_limit = db
            .store
            .enqueue(NewJob::from_json("k", fits))
            .await
            .unwrap();

        assert_eq!(db.job_count().await, 2);
        assert_eq!(db.count_where("job_keys", "true").await, 0);
        // The other jobs are unaffected.
        let w = owner("w");
        let got = db.store.claim(&claim_req(&w, 10)).await.unwrap();
        assert_eq!(
            got.iter().map(|j| j.id).collect::<Vec<_>>(),
            vec![existing, at_limit]
        );
        for j in &got {
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
async fn payload_with_nul_is_invalid_and_nothing_written() {
    bounded(async {
        let db = TestDb::new("bad_payload_nul").await;
        for payload in [
            serde_json::json!({ "s": "a\u{0000}b" }),
            serde_json::json!(["\u{0000}"]),
            serde_json::json!({ "k\u{0000}ey": 1 }),
        ] {
            match db
                .store
                .enqueue(NewJob::from_json("k", payload.clone()))
                .await
            {
                Err(Error::InvalidPayload(reason)) => assert!(reason.contains("NUL"), "{reason}"),
                other => panic!("expected InvalidPayload for {payload}, got {other:?}"),
            }
            match db
                .store
                .enqueue_many(vec![job("k"), NewJob::from_json("k", payload)])
                .await
            {
                Err(Error::InvalidPayload(_)) => {}
                other => panic!("expected InvalidPayload, got {other:?}"),
            }
        }
        // The escaped text "\\u0000" (a backslash, then u0000) is not a NUL and is stored.
        let literal = serde_json::json!({ "s": "\\u0000" });
        let id = db
            .store
            .enqueue(NewJob::from_json("k", literal.clone()))
            .await;
        match id {
            Ok(id) => assert_eq!(db.store.job(id).await.unwrap().payload, literal),
            Err(e) => panic!("a literal backslash-u0000 text was refused: {e}"),
        }
        assert_eq!(db.job_count().await, 1);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_reason_with_nul_and_a_megabyte_is_stored_sanitized_and_truncated() {
    bounded(async {
        let db = TestDb::new("bad_failure_reason").await;
        let id = db
            .store
            .enqueue(job("k").with_max_attempts(5))
            .await
            .unwrap();
        let w = owner("w");

        // NUL in the reason: stored, with the NUL made visible.
        let j = db.store.claim(&claim_req(&w, 1)).await.unwrap().remove(0);
        let out = db
            .store
            .fail(
                &j.fence(),
                &Failure {
                    reason: "bad\0byte".into(),
                    permanent: false,
                    retry_after: None,
                },
                &fixed_backoff(1),
            )
            .await
            .unwrap();
        assert!(matches!(out, FailOutcome::Retrying { .. }), "{out:?}");
        let rec = db.store.job(id).await.unwrap();
        assert_eq!(rec.state, JobState::Pending);
        let err = rec.last_error.unwrap();
        assert!(!err.contains('\0'));
        assert!(err.starts_with("bad") && err.ends_with("byte"), "{err:?}");

        // A 1 MB reason (multi-byte characters, so the cut must respect boundaries).
        let j = db
            .store
            .claim(&claim_at(&w, 1, far_future()))
            .await
            .unwrap()
            .remove(0);
        let huge = "é".repeat(512 * 1024) + "\0";
        assert_eq!(huge.len(), 1024 * 1024 + 1);
        let out = db
            .store
            .fail(
                &j.fence(),
                &Failure {
                    reason: huge,
                    permanent: false,
                    retry_after: None,
                },
                &fixed_backoff(1),
            )
            .await
            .unwrap();
        assert!(matches!(out, FailOutcome::Retrying { .. }));
        let err = db.store.job(id).await.unwrap().last_error.unwrap();
        assert!(err.len() <= 4096 + 64, "stored {} bytes", err.len());
        assert!(err.starts_with("éé"));
        assert!(!err.contains('\0'));
        let details: Vec<Option<String>> = db
            .store
            .history(id)
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.event == "failed")
            .map(|e| e.detail)
            .collect();
        assert_eq!(details.len(), 2);
        assert!(details.iter().all(|d| d
            .as_ref()
            .is_some_and(|d| d.len() <= 4096 + 64 && !d.contains('\0'))));
        assert_eq!(
            db.count_where("jobs", "state = 'pending' AND attempts = 2")
                .await,
            1
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_failure_makes_the_job_dead_at_once_with_its_reason() {
    bounded(async {
        let db = TestDb::new("bad_permanent_failure").await;
        // A payload that does not match the handler's type: the handler cannot decode it
        // and reports a permanent failure on the first attempt of 25.
        let id = db.store.enqueue(NewJob::from_json("charge", serde_json::json!({ "amount": "not a number" }))).await.unwrap();
        let w = owner("w");
        let j = db.store.claim(&claim_req(&w, 1)).await.unwrap().remove(0);
        let reason = "payload does not decode as Charge: invalid type: string \"not a number\", expected u64";
        let out = db.store.fail(&j.fence(), &Failure { reason: reason.into(), permanent: true , retry_after: None}, &fixed_backoff(1)).await.unwrap();
        assert_eq!(out, FailOutcome::Dead);
        let rec = db.store.job(id).await.unwrap();
        assert_eq!(rec.state, JobState::Dead);
        assert_eq!(rec.attempts, 1);
        assert_eq!(rec.max_attempts, 25);
        assert_eq!(rec.last_error.as_deref(), Some(reason));
        assert!(rec.finished_at.is_some());
        assert!(db.store.claim(&claim_at(&w, 10, far_future())).await.unwrap().is_empty(), "no crash loop");
        let events: Vec<String> = db.store.history(id).await.unwrap().into_iter().map(|e| e.event).collect();
        assert_eq!(events, vec!["claimed", "dead"]);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_never_claims_a_kind_it_does_not_know() {
    bounded(async {
        let db = TestDb::new("bad_unknown_kind").await;
        let unknown = db
            .store
            .enqueue(job("unknown").with_priority(-10))
            .await
            .unwrap();
        let unknown_keyed = db.store.enqueue(keyed("unknown", "acct", 1)).await.unwrap();
        let known = db
            .store
            .enqueue_many(vec![job("known"), job("known")])
            .await
            .unwrap();
        let w = owner("w");
        let mut ran = Vec::new();
        for _ in 0..5 {
            let mut req = claim_at(&w, 10, far_future());
            req.kinds = Some(vec!["known".into()]);
            let got = db.store.claim(&req).await.unwrap();
            for j in &got {
                assert_eq!(j.kind, "known");
                assert_eq!(
                    db.store.complete(&j.fence(), None).await.unwrap(),
                    CompleteOutcome::Completed
                );
                ran.push(j.id);
            }
            // The reaper has nothing to do with them either (not running).
            assert!(db
                .store
                .reap(&owner("r"), &fixed_backoff(1), 10, Some(far_future()))
                .await
                .unwrap()
                .is_empty());
        }
        assert_eq!(ran, known);
        for id in [unknown, unknown_keyed] {
            let rec = db.store.job(id).await.unwrap();
            assert_eq!(
                (rec.state, rec.attempts, rec.generation.0),
                (JobState::Pending, 0, 0)
            );
        }
        db.drop().await;
    })
    .await
}
