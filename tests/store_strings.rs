//! Hostile and unusual strings as queue, kind and key are bound parameters and come
//! back byte for byte; NUL, which PostgreSQL text cannot hold, is refused up front with
//! a clear error and nothing written.

mod common;

use common::*;
use leasehold::{ClaimRequest, CompleteOutcome, Error, NewJob};

fn incompressible(len: usize) -> String {
    // Pseudo-random printable ASCII: pglz cannot shrink it, so it stays 10 kB in indexes.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (b'!' + (x % 94) as u8) as char
        })
        .collect()
}

fn hostile_strings() -> Vec<(&'static str, String)> {
    vec![
        ("sql injection", "x'); DROP TABLE jobs;--".to_string()),
        ("single quotes", "it's 'quoted'".to_string()),
        ("double quotes", "\"jobs\"\"".to_string()),
        ("backslashes", "C:\\path\\to\\n\\0 \\\\".to_string()),
        ("schema-like", "public.jobs; {s} $1 %s".to_string()),
        ("emoji", "👩‍👩‍👧‍👦 💸 🧾".to_string()),
        ("rtl", "حساب‏ עברית \u{202E}reversed\u{202C}".to_string()),
        ("control chars", "tab\there\nnewline\r\u{7}".to_string()),
        ("10 kB repetitive", "ab".repeat(5 * 1024)),
        ("10 kB, multi-byte", "€ש😀".repeat(1200)),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_queue_kind_and_key_strings_round_trip_unchanged() {
    bounded(async {
        let db = TestDb::new("strings_round_trip").await;
        let w = owner("w");
        let cases = hostile_strings();
        for (what, s) in &cases {
            let new = NewJob::from_json(s.clone(), serde_json::json!({ "s": s }))
                .with_queue(s.clone())
                .with_key(s.clone());
            let id = db
                .store
                .enqueue(new)
                .await
                .unwrap_or_else(|e| panic!("enqueue with {what}: {e}"));
            // A second job of that key waits behind it.
            let next = db
                .store
                .enqueue(
                    NewJob::from_json(s.clone(), serde_json::json!(2))
                        .with_queue(s.clone())
                        .with_key(s.clone()),
                )
                .await
                .unwrap();

            let mut req = ClaimRequest::new(w.clone(), vec![s.clone()], 10, LEASE);
            req.kinds = Some(vec![s.clone()]);
            let got = db
                .store
                .claim(&req)
                .await
                .unwrap_or_else(|e| panic!("claim with {what}: {e}"));
            assert_eq!(got.len(), 1, "{what}");
            let j = &got[0];
            assert_eq!(j.id, id, "{what}");
            assert_eq!(&j.queue, s, "{what}: queue");
            assert_eq!(&j.kind, s, "{what}: kind");
            assert_eq!(j.key.as_ref(), Some(s), "{what}: key");
            assert_eq!(j.payload, serde_json::json!({ "s": s }), "{what}: payload");
            let rec = db.store.job(id).await.unwrap();
            assert_eq!(
                (&rec.queue, &rec.kind, rec.key.as_ref()),
                (s, s, Some(s)),
                "{what}: read back"
            );

            // Every path that wakes workers of the queue (release, reap, promotion,
            // operator release) copes with the name.
            assert_eq!(
                db.store.release_many(&w, &[j.attempt()], s).await.unwrap(),
                vec![id],
                "{what}: release"
            );
            let j = db.store.claim(&req).await.unwrap().remove(0);
            let at = secs_after(j.lease_until, 1);
            assert_eq!(
                db.store
                    .reap(&w, &fixed_backoff(1), 10, Some(at))
                    .await
                    .unwrap()
                    .retried,
                vec![id],
                "{what}: reap"
            );
            req.at = Some(secs_after(at, 2));
            let j = db.store.claim(&req).await.unwrap().remove(0);
            assert_eq!(
                db.store.complete(&j.fence(), None).await.unwrap(),
                CompleteOutcome::Completed,
                "{what}"
            );
            db.store
                .hold(next)
                .await
                .unwrap_or_else(|e| panic!("hold with {what}: {e}"));
            db.store
                .release_hold(next)
                .await
                .unwrap_or_else(|e| panic!("release_hold with {what}: {e}"));
            let j2 = db
                .store
                .claim_key(&w, s, s, Some(std::slice::from_ref(s)), LEASE, None)
                .await
                .unwrap()
                .expect(what);
            assert_eq!(j2.id, next, "{what}: promoted successor");
            assert_eq!(
                db.store.complete(&j2.fence(), None).await.unwrap(),
                CompleteOutcome::Completed
            );
            assert_eq!(&db.store.job(next).await.unwrap().queue, s);
        }
        // The injection did nothing: the table is still there with every job done.
        assert_eq!(
            db.count_where("jobs", "state = 'done'").await,
            2 * cases.len() as i64
        );
        assert_eq!(db.job_count().await, 2 * cases.len() as i64);
        let counts = db.store.job_counts().await.unwrap();
        assert_eq!(counts.len(), cases.len(), "every queue name kept apart");
        let stats = db.store.queue_stats().await.unwrap();
        assert!(
            stats.iter().all(|q| q.by_state.is_empty()),
            "no queue has an open job (only the expiries the test caused): {stats:?}"
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incompressible_10kb_kind_round_trips_and_queue_or_key_never_half_writes() {
    bounded(async {
        let db = TestDb::new("strings_incompressible").await;
        let w = owner("w");
        let big = incompressible(10 * 1024);

        // The kind is not indexed: it round-trips whatever its content.
        let id = db.store.enqueue(job(&big)).await.unwrap();
        let j = db.store.claim(&claim_req(&w, 10)).await.unwrap().remove(0);
        assert_eq!((j.id, &j.kind), (id, &big));
        db.store.complete(&j.fence(), None).await.unwrap();
        assert_eq!(db.store.job(id).await.unwrap().kind, big);

        // Queue and key are indexed (claim, key order), and PostgreSQL cannot index
        // ~2.7 kB that does not compress. Whatever the store does with them, it must
        // round-trip them or refuse them with nothing written.
        for (what, new) in [
            ("queue", job("k").with_queue(big.clone())),
            ("key", keyed("k", &big, 1)),
        ] {
            let before = db.job_count().await;
            match db.store.enqueue(new).await {
                Ok(id) => {
                    let rec = db.store.job(id).await.unwrap();
                    assert!(
                        rec.queue == big || rec.key.as_deref() == Some(big.as_str()),
                        "{what}"
                    );
                    db.store.cancel(id, "test").await.unwrap();
                }
                Err(e) => {
                    eprintln!("{what} of 10 kB incompressible text refused: {e}");
                    assert_eq!(db.job_count().await, before, "{what}: nothing written");
                    assert_eq!(
                        db.count_where("job_keys", "true").await,
                        0,
                        "{what}: no key row"
                    );
                }
            }
        }
        assert_eq!(db.count_where("jobs", "state = 'done'").await, 1);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nul_in_queue_kind_or_key_is_refused_and_nothing_written() {
    bounded(async {
        let db = TestDb::new("strings_nul").await;
        let good = job("k");
        let cases = vec![
            ("queue", job("k").with_queue("q\0ueue")),
            ("kind", job("k\0ind")),
            ("key", keyed("k", "ke\0y", 1)),
            ("queue", job("k").with_queue("")),
            ("kind", job("")),
            ("key", keyed("k", "", 1)),
        ];
        for (field, bad) in cases {
            match db.store.enqueue(bad.clone()).await {
                Err(Error::InvalidInput { field: f, reason }) => {
                    assert_eq!(f, field);
                    assert!(!reason.is_empty());
                }
                other => panic!("{field}: expected InvalidInput, got {other:?}"),
            }
            // In a batch, one bad job refuses the whole batch.
            match db.store.enqueue_many(vec![good.clone(), bad]).await {
                Err(Error::InvalidInput { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: expected InvalidInput, got {other:?}"),
            }
        }
        assert_eq!(db.job_count().await, 0);
        assert_eq!(db.count_where("job_keys", "true").await, 0);
        assert!(db
            .store
            .claim(&claim_at(&owner("w"), 10, far_future()))
            .await
            .unwrap()
            .is_empty());
        db.drop().await;
    })
    .await
}
