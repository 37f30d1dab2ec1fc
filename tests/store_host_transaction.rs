//! A call that works inside the host's transaction (`enqueue_in`, `enqueue_many_in`,
//! `enqueue_outcomes_in`, `enqueue_copy_in`, `complete_in`, `JobContext::complete_in`)
//! and refuses its input leaves that transaction usable: a host row inserted before the
//! refused call and one inserted after it both commit (read back after the commit), the
//! refused call wrote nothing, and its error names the field and the limit. Input that
//! can be checked before anything is sent is; what only PostgreSQL can judge (an index
//! entry of long text that may or may not compress under its limit) runs in a
//! savepoint.

mod common;

use common::*;
use leasehold::testkit::attempt_context;
use leasehold::{CompleteOutcome, Error, NewJob, Store, StoreOptions, UniqueScope};

/// Builds a value afresh on each call (see `bad_results`).
type MakeValue = fn() -> serde_json::Value;
use sqlx::PgConnection;

/// Pseudo-random printable ASCII: pglz cannot shrink it, so it is as long in an index.
fn incompressible(len: usize) -> String {
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (b'!' + (x % 94) as u8) as char
        })
        .collect()
}

/// `levels` arrays nested around a number.
fn deep(levels: usize) -> serde_json::Value {
    let mut v = serde_json::json!(1);
    for _ in 0..levels {
        v = serde_json::Value::Array(vec![v]);
    }
    v
}

async fn host_table(db: &TestDb) -> String {
    let table = db.table("host_rows");
    sqlx::query(&format!("CREATE TABLE {table} (name text PRIMARY KEY)"))
        .execute(&db.owner)
        .await
        .unwrap();
    table
}

async fn host_insert(conn: &mut PgConnection, table: &str, name: &str) {
    sqlx::query(&format!("INSERT INTO {table} (name) VALUES ($1)"))
        .bind(name)
        .execute(conn)
        .await
        .unwrap_or_else(|e| panic!("host insert {name:?} after the refused call: {e}"));
}

async fn host_rows(db: &TestDb, table: &str) -> Vec<String> {
    sqlx::query_scalar(&format!("SELECT name FROM {table} ORDER BY name"))
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

/// The field an error names and its reason.
fn refusal(e: &Error) -> (&'static str, String) {
    match e {
        Error::InvalidInput { field, reason } => (field, reason.clone()),
        Error::InvalidPayload(reason) => ("payload", reason.clone()),
        Error::PayloadTooLarge { size, limit } => ("payload", format!("{size} over {limit}")),
        other => panic!("expected a refusal that names its field, got {other:?}"),
    }
}

#[derive(Clone, Copy, Debug)]
enum Call {
    One,
    Many,
    Outcomes,
    Copy,
}

async fn call(store: &Store, conn: &mut PgConnection, how: Call, bad: NewJob) -> Result<(), Error> {
    match how {
        Call::One => store.enqueue_in(conn, bad).await.map(drop),
        Call::Many => store
            .enqueue_many_in(conn, vec![job("k"), bad])
            .await
            .map(drop),
        Call::Outcomes => store
            .enqueue_outcomes_in(conn, vec![bad, job("k")])
            .await
            .map(drop),
        Call::Copy => store
            .enqueue_copy_in(conn, vec![job("k"), bad])
            .await
            .map(drop),
    }
}

/// (field named, a word of the reason naming the limit, the job, keyed).
fn bad_jobs() -> Vec<(&'static str, &'static str, NewJob, bool)> {
    let long = incompressible(3000);
    vec![
        ("key", "2704", keyed("k", &long, 1), true),
        ("queue", "2704", job("k").with_queue(long.clone()), false),
        (
            "queue",
            "2704",
            keyed("k", "acct", 1).with_queue(long.clone()),
            true,
        ),
        (
            "unique key",
            "2704",
            job("k").unique(long.clone(), UniqueScope::WhileOpen),
            false,
        ),
        (
            "kind",
            "2704",
            job(&long).unique("u", UniqueScope::Forever),
            false,
        ),
        ("key", "NUL", keyed("k", "a\0b", 1), true),
        ("key", "empty", keyed("k", "", 1), true),
        ("queue", "NUL", job("k").with_queue("q\0"), false),
        ("payload", "127", NewJob::from_json("k", deep(200)), false),
        (
            "payload",
            "NUL",
            NewJob::from_json("k", serde_json::json!({ "s": "\0" })),
            false,
        ),
        (
            "payload",
            "4096",
            NewJob::from_json("k", serde_json::json!("x".repeat(5000))),
            false,
        ),
        (
            "max_attempts",
            "at least 1",
            job("k").with_max_attempts(0),
            false,
        ),
        (
            "delay",
            "100 years",
            job("k").with_delay(std::time::Duration::from_secs(200 * 365 * 86_400)),
            false,
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_enqueue_leaves_the_host_transaction_usable() {
    bounded(async {
        let opts = StoreOptions {
            max_payload_bytes: 4096,
            ..StoreOptions::default()
        };
        let db = TestDb::with_options("host_tx_enqueue", opts, 4).await;
        let table = host_table(&db).await;
        let mut expected = Vec::new();
        for how in [Call::One, Call::Many, Call::Outcomes, Call::Copy] {
            for (n, (field, limit, bad, is_keyed)) in bad_jobs().into_iter().enumerate() {
                if matches!(how, Call::Copy) && is_keyed {
                    continue; // COPY takes unkeyed jobs only (refused for that, up front)
                }
                let what = format!("{how:?} #{n} ({field})");
                let mut tx = db.pool.begin().await.unwrap();
                host_insert(&mut tx, &table, &format!("{what} before")).await;
                let err = call(&db.store, &mut tx, how, bad)
                    .await
                    .expect_err(&format!("{what}: accepted"));
                host_insert(&mut tx, &table, &format!("{what} after")).await;
                let (named, reason) = refusal(&err);
                assert_eq!(named, field, "{what}: {err}");
                assert!(reason.contains(limit), "{what}: no {limit:?} in {reason:?}");
                tx.commit().await.unwrap();
                expected.push(format!("{what} after"));
                expected.push(format!("{what} before"));
            }
        }
        expected.sort();
        assert_eq!(
            host_rows(&db, &table).await,
            expected,
            "every host row committed"
        );
        assert_eq!(db.job_count().await, 0, "no refused call wrote a job");
        assert_eq!(db.count_where("job_keys", "true").await, 0, "nor a key row");

        // After a refusal the same transaction still enqueues; a long key that
        // compresses under the index limit goes in (through the savepoint), host rows too.
        let mut tx = db.pool.begin().await.unwrap();
        let long = incompressible(3000);
        assert!(db
            .store
            .enqueue_in(&mut tx, keyed("k", &long, 1))
            .await
            .is_err());
        let repetitive = "ab".repeat(5 * 1024);
        let id = db
            .store
            .enqueue_in(&mut tx, keyed("k", &repetitive, 1))
            .await
            .unwrap();
        host_insert(&mut tx, &table, "last").await;
        tx.commit().await.unwrap();
        assert_eq!(db.store.job(id).await.unwrap().key, Some(repetitive));
        assert!(host_rows(&db, &table).await.contains(&"last".to_string()));
        assert_eq!(db.job_count().await, 1);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_refusal_names_the_field_and_the_limit_outside_a_transaction_too() {
    bounded(async {
        let db = TestDb::new("host_tx_bare").await;
        let long = incompressible(3000);
        for (field, bad) in [
            ("key", keyed("k", &long, 1)),
            ("queue", job("k").with_queue(long.clone())),
            (
                "unique key",
                job("k").unique(long.clone(), UniqueScope::WhileOpen),
            ),
        ] {
            let err = db.store.enqueue(bad.clone()).await.unwrap_err();
            let (named, reason) = refusal(&err);
            assert_eq!(named, field, "{err}");
            assert!(reason.contains("2704"), "{reason}");
            let err = db
                .store
                .enqueue_many(vec![job("k"), bad])
                .await
                .unwrap_err();
            assert_eq!(refusal(&err).0, field, "{err}");
        }
        let err = db
            .store
            .enqueue_copy(vec![job("k"), job("k").with_queue(long)])
            .await
            .unwrap_err();
        assert_eq!(refusal(&err).0, "queue", "{err}");
        assert_eq!(db.job_count().await, 0);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_completion_leaves_the_host_transaction_usable() {
    bounded(async {
        let opts = StoreOptions {
            max_result_bytes: 4096,
            ..StoreOptions::default()
        };
        let db = TestDb::with_options("host_tx_complete", opts, 4).await;
        let table = host_table(&db).await;
        let unkeyed = db.store.enqueue(job("k")).await.unwrap();
        let keyed_id = db.store.enqueue(keyed("k", "acct", 1)).await.unwrap();
        let w = owner("w");
        let claimed = db.store.claim(&claim_req(&w, 10)).await.unwrap();
        assert_eq!(claimed.len(), 2);
        // Built afresh for each call: serde_json clones (and compares) recursively, and a
        // clone of 10,000 levels would overflow the test's own stack.
        let bad_results: [(&str, MakeValue); 4] = [
            ("NUL", || serde_json::json!({ "note": "a\0b" })),
            ("127", || deep(200)),
            ("127", || deep(10_000)),
            ("4096", || serde_json::json!("x".repeat(5000))),
        ];
        for j in &claimed {
            let mut tx = db.pool.begin().await.unwrap();
            for (n, (limit, bad)) in bad_results.iter().enumerate() {
                let what = format!("job {} result #{n}", j.id);
                host_insert(&mut tx, &table, &format!("{what} before")).await;
                let err = db
                    .store
                    .complete_in(&mut tx, &j.fence(), Some(bad()))
                    .await
                    .expect_err(&what);
                host_insert(&mut tx, &table, &format!("{what} after")).await;
                let (named, reason) = refusal(&err);
                assert_eq!(named, "result", "{what}: {err}");
                assert!(reason.contains(limit), "{what}: no {limit:?} in {reason:?}");
            }
            // Through the handler's context: a permanent error (no retry can store it).
            let ctx = attempt_context(j.clone(), db.store.clone());
            let err = ctx.complete_in(&mut tx, Some(deep(200))).await.unwrap_err();
            assert!(err.is_permanent(), "{err}");
            assert!(err.message().contains("127"), "{err}");
            host_insert(&mut tx, &table, &format!("job {} ctx after", j.id)).await;
            let good = serde_json::json!({ "ok": j.id.0 });
            assert_eq!(
                db.store
                    .complete_in(&mut tx, &j.fence(), Some(good.clone()))
                    .await
                    .unwrap(),
                CompleteOutcome::Completed
            );
            tx.commit().await.unwrap();
            assert_eq!(db.store.job(j.id).await.unwrap().result, Some(good));
        }
        let rows = host_rows(&db, &table).await;
        assert_eq!(rows.len(), 2 * (2 * bad_results.len() + 1), "{rows:?}");
        for id in [unkeyed, keyed_id] {
            assert_eq!(db.state_of(id).await, "done");
        }
        db.drop().await;
    })
    .await
}
