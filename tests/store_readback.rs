//! Whatever leasehold stores it can read back. Every JSON value a job or an effect
//! carries (payload, result, progress, effect outcome) is refused when written if it is
//! nested deeper than `MAX_PAYLOAD_DEPTH` (127) levels — the most serde_json reads —
//! or holds a NUL, through the Rust API with nothing written; results, progress and
//! effect outcomes through plain SQL and the schema's `complete_keyed` too (a payload
//! written around the enqueue is read per job, with its reason). A value 127 levels
//! deep is read back unchanged by `Store::job`, the listing and the claim. An effect
//! whose outcome is refused has happened once and is not done again: the attempt stops
//! for good with the reason.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use common::*;
use leasehold::store::JobFilter;
use leasehold::testkit::attempt_context;
use leasehold::{CompleteOutcome, Error, Failure, JobError, JobId, JobState, NewJob, StoreOptions};
use sqlx::Connection;

/// `levels` arrays nested around the number 1 (never cloned or compared in the tests
/// past 127 levels: serde_json does both recursively).
fn deep(levels: usize) -> serde_json::Value {
    let mut v = serde_json::json!(1);
    for _ in 0..levels {
        v = serde_json::Value::Array(vec![v]);
    }
    v
}

/// The same value as SQL text.
fn deep_sql(levels: usize) -> String {
    format!("{}1{}", "[".repeat(levels), "]".repeat(levels))
}

/// Builds a value afresh for each use (see [`deep`]).
type Make = fn() -> serde_json::Value;

/// The bad values of every JSON field: (a word naming the limit, the value).
fn unstorable() -> Vec<(&'static str, Make)> {
    vec![
        ("127", || deep(128)),
        ("127", || deep(200)),
        ("127", || deep(10_000)),
        ("NUL", || serde_json::json!({ "s": "a\0b" })),
        ("NUL", || serde_json::json!([{ "k\0": 1 }])),
    ]
}

fn reason_of(e: &Error) -> String {
    match e {
        Error::InvalidPayload(r) => r.clone(),
        Error::InvalidInput { reason, .. } => reason.clone(),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// A plain SQL statement must be refused by the database.
async fn sql_refused(db: &TestDb, what: &str, sql: &str) {
    let res = sqlx::query(sql).execute(&db.pool).await;
    assert!(res.is_err(), "{what}: accepted by plain SQL");
}

async fn sql_insert_job(db: &TestDb, payload_sql: &str) -> Result<JobId, sqlx::Error> {
    let id: i64 = sqlx::query_scalar(&format!(
        "INSERT INTO {} (queue, kind, state, payload, payload_bytes, max_attempts)
         VALUES ('default', 'k', 'pending', {payload_sql}, 10, 3) RETURNING id",
        db.table("jobs")
    ))
    .fetch_one(&db.pool)
    .await?;
    Ok(JobId(id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_too_deep_or_with_nul_are_refused_on_every_path_and_127_levels_read_back() {
    bounded(async {
        let db = TestDb::new("readback_payload").await;
        for (limit, bad) in unstorable() {
            let errs = [
                db.store.enqueue(NewJob::from_json("k", bad())).await,
                db.store
                    .enqueue_many(vec![job("k"), NewJob::from_json("k", bad())])
                    .await
                    .map(|ids| ids[0]),
                db.store
                    .enqueue_copy(vec![NewJob::from_json("k", bad())])
                    .await
                    .map(|_| JobId(0)),
            ];
            for e in errs {
                let e = e.expect_err("an unreadable payload was accepted");
                assert!(reason_of(&e).contains(limit), "{e}");
            }
            let mut conn = db.pool.acquire().await.unwrap();
            let mut tx = conn.begin().await.unwrap();
            let e = db
                .store
                .enqueue_in(&mut tx, NewJob::from_json("k", bad()))
                .await
                .unwrap_err();
            assert!(reason_of(&e).contains(limit), "{e}");
            tx.rollback().await.unwrap();
        }
        // Plain SQL: jsonb refuses NUL itself.
        assert!(sql_insert_job(&db, r#"'{"s": "a\u0000b"}'::jsonb"#)
            .await
            .is_err());
        assert_eq!(db.job_count().await, 0, "nothing was written");

        // 127 levels, through every path, read back by every reader.
        let mut ids = vec![db
            .store
            .enqueue(NewJob::from_json("k", deep(127)))
            .await
            .unwrap()];
        ids.extend(
            db.store
                .enqueue_many(vec![NewJob::from_json("k", deep(127))])
                .await
                .unwrap(),
        );
        assert_eq!(
            db.store
                .enqueue_copy(vec![NewJob::from_json("k", deep(127))])
                .await
                .unwrap(),
            1
        );
        ids.push(
            sql_insert_job(&db, &format!("'{}'::jsonb", deep_sql(127)))
                .await
                .unwrap(),
        );
        assert_eq!(db.job_count().await, 4);
        let expected = deep(127);
        for id in &ids {
            let rec = db.store.job(*id).await.unwrap();
            assert_eq!(rec.payload_error, None, "job {id}");
            assert!(rec.payload == expected, "job {id}: payload read back");
        }
        let listed = db.store.list_jobs(&JobFilter::default()).await.unwrap();
        assert_eq!(listed.len(), 4);
        for rec in &listed {
            assert_eq!(rec.payload_error, None);
            assert!(rec.payload == expected, "listed job {}", rec.id);
        }
        let claimed = db.store.claim(&claim_req(&owner("w"), 10)).await.unwrap();
        assert_eq!(claimed.len(), 4);
        for j in &claimed {
            assert_eq!(j.payload_error, None, "claimed job {}", j.id);
            assert!(j.payload == expected, "claimed job {}", j.id);
        }

        // Deeper, written around the enqueue (leasehold has no enqueue in SQL): no reader
        // fails on it; each hands that job over with the reason, the job alone (see
        // store_poison_payload.rs for what then becomes of it).
        let mut deeper = Vec::new();
        for levels in [128, 200, 10_000] {
            deeper.push(
                sql_insert_job(&db, &format!("'{}'::jsonb", deep_sql(levels)))
                    .await
                    .unwrap(),
            );
        }
        for id in &deeper {
            let rec = db.store.job(*id).await.unwrap();
            assert!(rec.payload_error.unwrap().contains("recursion limit"));
        }
        let listed = db.store.list_jobs(&JobFilter::default()).await.unwrap();
        assert_eq!(
            listed.iter().filter(|r| r.payload_error.is_some()).count(),
            3
        );
        let claimed = db.store.claim(&claim_req(&owner("w"), 10)).await.unwrap();
        assert_eq!(claimed.iter().map(|j| j.id).collect::<Vec<_>>(), deeper);
        assert!(claimed.iter().all(|j| j.payload_error.is_some()));
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_too_deep_or_with_nul_are_refused_on_every_path_and_127_levels_read_back() {
    bounded(async {
        let opts = StoreOptions {
            max_result_bytes: 4096,
            ..StoreOptions::default()
        };
        let db = TestDb::with_options("readback_result", opts, 4).await;
        let ids = db
            .store
            .enqueue_many(vec![job("k"), keyed("k", "acct", 1), job("k"), job("k")])
            .await
            .unwrap();
        let w = owner("w");
        let claimed = db.store.claim(&claim_req(&w, 10)).await.unwrap();
        assert_eq!(claimed.len(), 4);
        let (plain, keyed_job, failing, via_sql) =
            (&claimed[0], &claimed[1], &claimed[2], &claimed[3]);
        assert_eq!(keyed_job.id, ids[1]);
        let mut cases = unstorable();
        cases.push(("4096", || serde_json::json!("x".repeat(5000))));
        for (limit, bad) in &cases {
            for j in [plain, keyed_job] {
                let e = db.store.complete(&j.fence(), Some(bad())).await.unwrap_err();
                assert!(
                    matches!(&e, Error::InvalidInput { field: "result", reason } if reason.contains(limit)),
                    "{e}"
                );
                let e = db
                    .store
                    .complete_many(&w, &[(j.attempt(), Some(bad()))])
                    .await
                    .unwrap_err();
                assert!(matches!(e, Error::InvalidInput { field: "result", .. }), "{e}");
            }
        }
        // Plain SQL, and the schema's own completion function, refuse the depth too.
        for levels in [128, 200, 10_000] {
            sql_refused(
                &db,
                "result by UPDATE",
                &format!(
                    "UPDATE {} SET result = '{}'::jsonb WHERE id = {}",
                    db.table("jobs"),
                    deep_sql(levels),
                    via_sql.id
                ),
            )
            .await;
            sql_refused(
                &db,
                "result by complete_keyed",
                &format!(
                    "SELECT * FROM \"{}\".complete_keyed(ARRAY[{}]::int8[], ARRAY[{}]::int8[],
                         ARRAY['{}'::jsonb], ARRAY['default'], ARRAY['acct'], ARRAY[false], 0,
                         '{}', NULL, 30, true, 'nobody')",
                    db.schema,
                    keyed_job.id,
                    keyed_job.generation,
                    deep_sql(levels),
                    w.as_str()
                ),
            )
            .await;
        }
        for j in &claimed {
            assert_eq!(db.state_of(j.id).await, "running", "nothing was written");
        }

        // 127 levels: stored and read back; a lost reply's read-back returns it too.
        let fine = deep(127);
        assert_eq!(
            db.store.complete(&plain.fence(), Some(deep(127))).await.unwrap(),
            CompleteOutcome::Completed
        );
        match db.store.completion_status(&plain.fence()).await.unwrap() {
            CompleteOutcome::AlreadyCompleted { result } => {
                assert!(result == Some(fine.clone()), "read back after a lost reply")
            }
            other => panic!("expected AlreadyCompleted, got {other:?}"),
        }
        let rows = sqlx::query(&format!(
            "SELECT * FROM \"{}\".complete_keyed(ARRAY[{}]::int8[], ARRAY[{}]::int8[],
                 ARRAY['{}'::jsonb], ARRAY['default'], ARRAY['acct'], ARRAY[false], 0,
                 '{}', NULL, 30, true, 'nobody')",
            db.schema,
            keyed_job.id,
            keyed_job.generation,
            deep_sql(127),
            w.as_str()
        ))
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(rows.len(), 1, "one completion");
        sqlx::query(&format!(
            "UPDATE {} SET result = '{}'::jsonb WHERE id = {}",
            db.table("jobs"),
            deep_sql(127),
            via_sql.id
        ))
        .execute(&db.pool)
        .await
        .unwrap();
        for id in [plain.id, keyed_job.id, via_sql.id] {
            let rec = db.store.job(id).await.unwrap();
            assert_eq!(rec.payload_error, None, "job {id}");
            assert!(rec.result == Some(fine.clone()), "job {id}: result read back");
        }
        let listed = db.store.list_jobs(&JobFilter::default()).await.unwrap();
        assert!(listed.iter().all(|r| r.payload_error.is_none()));
        assert_eq!(
            listed
                .iter()
                .filter(|r| r.result == Some(fine.clone()))
                .count(),
            3
        );

        // Error text with NUL and JSON-looking depth is text: stored escaped, read back.
        let reason = format!("upstream said \0 {}", deep_sql(300));
        db.store
            .fail(
                &failing.fence(),
                &Failure {
                    reason: reason.clone(),
                    permanent: true,
                    retry_after: None,
                },
                &fixed_backoff(1),
            )
            .await
            .unwrap();
        let rec = db.store.job(failing.id).await.unwrap();
        assert_eq!(rec.state, JobState::Dead);
        assert_eq!(rec.last_error, Some(reason.replace('\0', "\\0")));
        let history = db.store.history(failing.id).await.unwrap();
        assert!(history.iter().any(|e| e.detail == rec.last_error));
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_too_deep_or_with_nul_is_refused_on_every_path_and_127_levels_read_back() {
    bounded(async {
        let db = TestDb::new("readback_progress").await;
        let id = db.store.enqueue(job("k")).await.unwrap();
        let j = db
            .store
            .claim(&claim_req(&owner("w"), 1))
            .await
            .unwrap()
            .remove(0);
        for (limit, bad) in unstorable() {
            let e = db
                .store
                .record_progress(&j.fence(), &bad())
                .await
                .unwrap_err();
            assert!(
                matches!(&e, Error::InvalidInput { field: "progress", reason } if reason.contains(limit)),
                "{e}"
            );
        }
        for levels in [128, 200, 10_000] {
            sql_refused(
                &db,
                "progress by UPDATE",
                &format!(
                    "UPDATE {} SET progress = '{}'::jsonb WHERE id = {id}",
                    db.table("jobs"),
                    deep_sql(levels)
                ),
            )
            .await;
        }
        assert_eq!(db.store.job(id).await.unwrap().progress, None);
        db.store
            .record_progress(&j.fence(), &deep(127))
            .await
            .unwrap();
        let fine = Some(deep(127));
        let rec = db.store.job(id).await.unwrap();
        assert_eq!(rec.payload_error, None);
        assert!(rec.progress == fine);
        let listed = db.store.list_jobs(&JobFilter::default()).await.unwrap();
        assert!(listed[0].progress == fine && listed[0].payload_error.is_none());
        db.drop().await;
    })
    .await
}

/// Run `job`'s attempts as the executor would, each calling `once("step")` whose
/// effect counts in `applied` and yields `outcome()`: an `Ok` from `once` is followed by
/// a failure of a later step (so the next attempt must read its ledger entry), an error
/// fails the attempt (for good when permanent). Returns the last attempt's error.
async fn run_attempts(
    db: &TestDb,
    id: JobId,
    applied: &Arc<AtomicU32>,
    outcome: &(dyn Fn() -> serde_json::Value + Sync),
) -> Option<JobError> {
    let w = owner("w");
    let mut last = None;
    for _ in 0..5 {
        let Some(j) = db
            .store
            .claim(&claim_at(&w, 1, far_future()))
            .await
            .unwrap()
            .pop()
        else {
            break;
        };
        assert_eq!(j.id, id);
        let ctx = attempt_context(j.clone(), db.store.clone());
        let first_attempt = j.attempt == 1;
        let got: Result<serde_json::Value, JobError> = ctx
            .once("step", &"request", |_key| {
                let applied = applied.clone();
                let value = outcome();
                async move {
                    applied.fetch_add(1, Ordering::SeqCst);
                    Ok(value)
                }
            })
            .await;
        let failure = match got {
            Ok(_) if first_attempt => JobError::retry("a later step failed"),
            Ok(v) => {
                assert!(v == deep(127), "the recorded outcome came back");
                db.store.complete(&j.fence(), None).await.unwrap();
                return None;
            }
            Err(e) => e,
        };
        db.store
            .fail(
                &j.fence(),
                &Failure {
                    reason: failure.message().to_string(),
                    permanent: failure.is_permanent(),
                    retry_after: None,
                },
                &fixed_backoff(1),
            )
            .await
            .unwrap();
        last = Some(failure);
    }
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effect_outcome_that_cannot_be_read_back_is_refused_and_the_effect_not_repeated() {
    bounded(async {
        let opts = StoreOptions {
            max_result_bytes: 4096,
            ..StoreOptions::default()
        };
        let db = TestDb::with_options("readback_effect", opts, 4).await;
        let cases: [(&str, Make); 4] = [
            ("127", || deep(200)),
            ("NUL", || serde_json::json!({ "receipt": "ch_\0" })),
            ("4096", || serde_json::json!("x".repeat(5000))),
            ("127", || deep(128)),
        ];
        for (limit, outcome) in &cases {
            let id = db.store.enqueue(job("k").with_max_attempts(3)).await.unwrap();
            let applied = Arc::new(AtomicU32::new(0));
            let err = run_attempts(&db, id, &applied, outcome)
                .await
                .expect("the attempt failed");
            let rec = db.store.job(id).await.unwrap();
            assert_eq!(
                (rec.state, rec.attempts, applied.load(Ordering::SeqCst)),
                (JobState::Dead, 1, 1),
                "{limit}: dead at once, the effect applied once ({err})"
            );
            assert!(err.is_permanent(), "{err}");
            let last = rec.last_error.unwrap();
            assert!(last.contains(limit), "{last}");
            let key = db.effect_key(id, "step").await;
            assert!(last.contains(&key), "names the effect: {last}");
            assert_eq!(db.store.effect(&key).await.unwrap(), None);
        }

        // 127 levels: recorded, and the retry gets it from the ledger without acting.
        let id = db.store.enqueue(job("k").with_max_attempts(3)).await.unwrap();
        let applied = Arc::new(AtomicU32::new(0));
        assert!(run_attempts(&db, id, &applied, &|| deep(127)).await.is_none());
        let rec = db.store.job(id).await.unwrap();
        assert_eq!(
            (rec.state, rec.attempts, applied.load(Ordering::SeqCst)),
            (JobState::Done, 2, 1)
        );
        let key = db.effect_key(id, "step").await;
        let recorded = db.store.effect(&key).await.unwrap().unwrap();
        assert!(recorded.outcome == deep(127));
        assert_eq!(db.store.job_effects(id).await.unwrap().len(), 1);

        // The store's own call refuses too, 10,000 levels included, before writing; and
        // so does plain SQL.
        let other = db.store.enqueue(job("k")).await.unwrap();
        let j = db
            .store
            .claim(&claim_at(&owner("w"), 1, far_future()))
            .await
            .unwrap()
            .remove(0);
        assert_eq!(j.id, other);
        for (limit, bad) in unstorable() {
            let e = db
                .store
                .record_effect(&j.fence(), "x/step", "fp", &bad(), LEASE)
                .await
                .unwrap_err();
            assert!(
                matches!(&e, Error::InvalidInput { field: "effect outcome", reason } if reason.contains(limit)),
                "{e}"
            );
        }
        for levels in [128, 200, 10_000] {
            sql_refused(
                &db,
                "effect outcome by INSERT",
                &format!(
                    "INSERT INTO {} (effect_key, job_id, generation, fingerprint, outcome, keep_until)
                     VALUES ('sql/{levels}', {other}, 1, 'fp', '{}'::jsonb, now())",
                    db.table("effects"),
                    deep_sql(levels)
                ),
            )
            .await;
        }
        assert_eq!(db.count_where("effects", "true").await, 1);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effect_key_that_could_not_be_recorded_is_refused_before_acting() {
    bounded(async {
        let db = TestDb::new("readback_effect_key").await;
        let long: String = {
            let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
            (0..3000)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (b'!' + (x % 94) as u8) as char
                })
                .collect()
        };
        for step in [long.as_str(), "a\0b"] {
            db.store.enqueue(job("k")).await.unwrap();
            let j = db
                .store
                .claim(&claim_at(&owner("w"), 1, far_future()))
                .await
                .unwrap()
                .remove(0);
            let ctx = attempt_context(j.clone(), db.store.clone());
            let applied = Arc::new(AtomicU32::new(0));
            let a = applied.clone();
            let err = ctx
                .once(step, &"request", |_key| async move {
                    a.fetch_add(1, Ordering::SeqCst);
                    Ok(1)
                })
                .await
                .unwrap_err();
            assert!(err.is_permanent(), "{err}");
            assert!(err.message().contains("effect key"), "{err}");
            assert_eq!(applied.load(Ordering::SeqCst), 0, "not acted on: {err}");
            db.store.complete(&j.fence(), None).await.unwrap();
        }
        assert_eq!(db.count_where("effects", "true").await, 0);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_outcome_recorded_before_the_schema_refused_it_stops_the_retry() {
    bounded(async {
        let db = TestDb::new("readback_legacy_effect").await;
        let id = db.store.enqueue(job("k")).await.unwrap();
        let j = db
            .store
            .claim(&claim_req(&owner("w"), 1))
            .await
            .unwrap()
            .remove(0);
        // As an older version could: the trigger of migration 17 did not exist then.
        // (Under the key `once` makes now: migration 18 rewrote older keys to it.)
        let effects = db.table("effects");
        let key = db.effect_key(id, "step").await;
        sqlx::raw_sql(&format!(
            "ALTER TABLE {effects} DISABLE TRIGGER effects_outcome_readable;
             INSERT INTO {effects} (effect_key, job_id, generation, fingerprint, outcome, keep_until)
             VALUES ('{key}', {id}, 1, 'fp', '{}'::jsonb, now() + interval '1 day');
             ALTER TABLE {effects} ENABLE TRIGGER effects_outcome_readable;",
            deep_sql(200)
        ))
        .execute(&db.owner)
        .await
        .unwrap();

        // The operator still sees the job's effects, with the reason.
        let shown = db.store.job_effects(id).await.unwrap();
        assert_eq!(shown.len(), 1);
        assert_eq!(shown[0].outcome, serde_json::Value::Null);
        assert!(shown[0].outcome_error.as_deref().unwrap().contains("recursion limit"));
        // The handler's lookup refuses it; its retry stops for good and does not act.
        assert!(matches!(
            db.store.effect(&key).await,
            Err(Error::Decode { .. })
        ));
        let ctx = attempt_context(j, db.store.clone());
        let applied = Arc::new(AtomicU32::new(0));
        let a = applied.clone();
        let err = ctx
            .once("step", &"request", |_key| async move {
                a.fetch_add(1, Ordering::SeqCst);
                Ok(1)
            })
            .await
            .unwrap_err();
        assert!(err.is_permanent(), "{err}");
        assert!(err.message().contains("cannot be read"), "{err}");
        assert_eq!(applied.load(Ordering::SeqCst), 0);
        db.drop().await;
    })
    .await
}
