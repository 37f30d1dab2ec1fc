//! "A refused enqueue inside the host's transaction no longer aborts it", and
//! "if it rolls back, the job never existed", for a host whose transaction is open on
//! the connection but was not begun through sqlx's `Connection::begin` (a plain `BEGIN`
//! statement, as a host migrating from another driver or a SQL-first codebase writes),
//! and at the exact edges of `INDEXED_TEXT_ALWAYS_FITS`.

mod common;

use common::*;
use leasehold::store::INDEXED_TEXT_ALWAYS_FITS;
use leasehold::{Error, NewJob, UniqueScope};
use sqlx::PgConnection;

fn incompressible(len: usize) -> String {
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

async fn host_table(db: &TestDb) -> String {
    let table = db.table("host_rows");
    sqlx::query(&format!("CREATE TABLE {table} (name text PRIMARY KEY)"))
        .execute(&db.owner)
        .await
        .unwrap();
    table
}

async fn host_insert(conn: &mut PgConnection, table: &str, name: &str) -> Result<(), sqlx::Error> {
    sqlx::query(&format!("INSERT INTO {table} (name) VALUES ($1)"))
        .bind(name)
        .execute(conn)
        .await
        .map(|_| ())
}

async fn host_rows(db: &TestDb, table: &str) -> Vec<String> {
    sqlx::query_scalar(&format!("SELECT name FROM {table} ORDER BY name"))
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

/// A host transaction opened with a plain `BEGIN` (invisible to sqlx); an enqueue that
/// would need a savepoint (a key too long to be sure it fits an index entry): refused,
/// naming the connection, with nothing written; the host's own insert and `COMMIT`
/// then work, and both host rows are there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_needing_a_savepoint_inside_a_plain_begin_is_refused_and_leaves_the_host_transaction_usable(
) {
    bounded(async {
        let db = TestDb::new("atk_tx_plainbegin").await;
        let table = host_table(&db).await;
        let mut conn = db.raw_conn("host").await;
        sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
        host_insert(&mut conn, &table, "before").await.unwrap();
        let bad = job("k").with_key(incompressible(3000));
        let err = db.store.enqueue_in(&mut conn, bad).await.unwrap_err();
        assert!(
            matches!(&err, Error::InvalidInput { field: "connection", reason } if reason.contains("plain `BEGIN`")),
            "{err:?}"
        );
        let after = host_insert(&mut conn, &table, "after").await;
        sqlx::query("COMMIT").execute(&mut conn).await.unwrap();
        assert!(after.is_ok(), "the host's next statement failed: {after:?}");
        assert_eq!(host_rows(&db, &table).await, vec!["after", "before"]);
        assert_eq!(db.count_where("jobs", "true").await, 0);
        db.drop().await;
    })
    .await
}

/// A unique job enqueued inside a plain `BEGIN` (its check-and-insert needs a
/// transaction of its own): refused rather than committing the host's transaction
/// early; the host's rollback then undoes the host's row, and no job exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unique_enqueue_inside_a_plain_begin_is_refused_and_the_hosts_rollback_undoes_everything()
{
    bounded(async {
        let db = TestDb::new("atk_tx_plainuniq").await;
        let table = host_table(&db).await;
        let mut conn = db.raw_conn("host").await;
        sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
        host_insert(&mut conn, &table, "order-1").await.unwrap();
        let err = db
            .store
            .enqueue_in(
                &mut conn,
                job("charge").unique("order-1", UniqueScope::Forever),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidInput {
                    field: "connection",
                    ..
                }
            ),
            "{err:?}"
        );
        sqlx::query("ROLLBACK").execute(&mut conn).await.unwrap();
        assert_eq!(
            host_rows(&db, &table).await,
            Vec::<String>::new(),
            "the host rolled back, yet its row was committed"
        );
        assert_eq!(
            db.count_where("jobs", "true").await,
            0,
            "the host rolled back, yet the job exists"
        );
        db.drop().await;
    })
    .await
}

/// Exactly at the edge: queue and key of exactly `INDEXED_TEXT_ALWAYS_FITS` bytes of
/// incompressible text together (no savepoint: "always fit"), twice on one key so the
/// second is `waiting` (its own index), inside the host's transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_and_key_of_exactly_the_always_fits_bytes_fit_in_every_index() {
    bounded(async {
        let db = TestDb::new("atk_tx_edge").await;
        let table = host_table(&db).await;
        for (qlen, label) in [(1usize, "q1"), (1300, "q1300"), (2599, "q2599")] {
            let queue = format!("{label}{}", incompressible(qlen));
            let queue = queue[..qlen].to_string();
            let key = incompressible(INDEXED_TEXT_ALWAYS_FITS - qlen + 7)[7..].to_string();
            assert_eq!(queue.len() + key.len(), INDEXED_TEXT_ALWAYS_FITS);
            let mut tx = db.pool.begin().await.unwrap();
            host_insert(&mut tx, &table, &format!("{label}-before"))
                .await
                .unwrap();
            for n in 0..2 {
                let r = db
                    .store
                    .enqueue_in(&mut tx, keyed("k", &key, n).with_queue(queue.clone()))
                    .await;
                assert!(r.is_ok(), "queue {qlen} + key {} bytes: {r:?}", key.len());
            }
            host_insert(&mut tx, &table, &format!("{label}-after"))
                .await
                .expect("host statement after the enqueues");
            tx.commit().await.unwrap();
        }
        assert_eq!(db.count_where("jobs", "true").await, 6);
        assert_eq!(host_rows(&db, &table).await.len(), 6);
        // Kind and unique key together at the limit, too.
        for klen in [1usize, 1300, 2599] {
            let kind = incompressible(klen + 3)[3..].to_string();
            let ukey = incompressible(INDEXED_TEXT_ALWAYS_FITS - klen);
            let mut tx = db.pool.begin().await.unwrap();
            let r = db
                .store
                .enqueue_in(
                    &mut tx,
                    NewJob::from_json(kind, serde_json::json!({}))
                        .unique(ukey, UniqueScope::Forever),
                )
                .await;
            assert!(r.is_ok(), "kind {klen} + unique key: {r:?}");
            tx.commit().await.unwrap();
        }
        db.drop().await;
    })
    .await
}

/// One past the edge, refused by PostgreSQL in the savepoint: the host's transaction
/// goes on, the error names the field and the limit (2,704).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_past_the_edge_refused_in_a_savepoint_names_the_field_and_limit() {
    bounded(async {
        let db = TestDb::new("atk_tx_past").await;
        let table = host_table(&db).await;
        let mut tx = db.pool.begin().await.unwrap();
        host_insert(&mut tx, &table, "before").await.unwrap();
        // The queue alone is long and the key too: 2,800 bytes that cannot compress.
        let bad = keyed("k", &incompressible(1400), 1).with_queue(incompressible(1400) + "x");
        let err = db.store.enqueue_in(&mut tx, bad).await.unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, Error::InvalidInput { .. }), "{err:?}");
        assert!(text.contains("2704"), "{text}");
        host_insert(&mut tx, &table, "after").await.expect("usable");
        tx.commit().await.unwrap();
        assert_eq!(host_rows(&db, &table).await, vec!["after", "before"]);
        db.drop().await;
    })
    .await
}

/// `enqueue_copy_in` with a bad job in the middle of the load and a long queue, inside a
/// plain `BEGIN`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_copy_inside_a_plain_begin_leaves_the_host_transaction_usable() {
    bounded(async {
        let db = TestDb::new("atk_tx_copyplain").await;
        let table = host_table(&db).await;
        let mut conn = db.raw_conn("host").await;
        sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
        host_insert(&mut conn, &table, "before").await.unwrap();
        let jobs = vec![
            job("k"),
            job("k").with_queue(incompressible(3000)),
            job("k"),
        ];
        let r = db.store.enqueue_copy_in(&mut conn, jobs).await;
        let after = host_insert(&mut conn, &table, "after").await;
        sqlx::query("COMMIT").execute(&mut conn).await.unwrap();
        let rows = host_rows(&db, &table).await;
        assert!(
            after.is_ok() && rows == vec!["after", "before"],
            "copy: {r:?}; host insert after: {after:?}; committed host rows: {rows:?}"
        );
        db.drop().await;
    })
    .await
}

/// In pooled mode (`transaction_pooler`), a direct connection, the host's sqlx
/// transaction: a refused long key leaves it usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_mode_refusal_inside_the_hosts_transaction_leaves_it_usable() {
    bounded(async {
        let opts = leasehold::StoreOptions {
            transaction_pooler: true,
            ..Default::default()
        };
        let db = TestDb::with_options("atk_tx_pooled", opts, 4).await;
        let table = host_table(&db).await;
        let mut tx = db.pool.begin().await.unwrap();
        host_insert(&mut tx, &table, "before").await.unwrap();
        let err = db
            .store
            .enqueue_in(&mut tx, job("k").with_key(incompressible(3000)))
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::InvalidInput { field: "key", .. }),
            "{err:?}"
        );
        host_insert(&mut tx, &table, "after").await.expect("usable");
        tx.commit().await.unwrap();
        assert_eq!(host_rows(&db, &table).await, vec!["after", "before"]);
        db.drop().await;
    })
    .await
}
