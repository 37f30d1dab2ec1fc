//! Which clock stamps a job: `created_at` and a delay count from the enqueue statement,
//! not from the start of the transaction it runs in; a completion that waited for its
//! key row and claims the key's successor leases it from the moment of that claim, so
//! the successor is not born with an expired lease.

mod common;

use std::time::Duration;

use chrono::{DateTime, Utc};
use common::*;
use leasehold::{JobId, NewJob};
use sqlx::{Connection, Row};

const DELAY: Duration = Duration::from_secs(10);

async fn clock(conn: &mut sqlx::PgConnection) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(conn)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn created_at_and_delay_count_from_the_enqueue_statement_not_the_transaction_start() {
    bounded(async {
        let db = TestDb::new("ts_created").await;
        let mut conn = db.raw_conn("host").await;
        // Begun through sqlx, as leasehold's `_in` calls require (a plain `BEGIN` query
        // is refused: see store_host_transaction_edges).
        let mut host = sqlx::Connection::begin(&mut conn).await.unwrap();
        let began: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
            .fetch_one(&mut *host)
            .await
            .unwrap();
        // The host transaction is a second old when it enqueues.
        sqlx::query("SELECT pg_sleep(1)")
            .execute(&mut *host)
            .await
            .unwrap();
        let before = clock(&mut host).await;
        let delayed = || NewJob::from_json("k", serde_json::json!({})).with_delay(DELAY);
        let one = db.store.enqueue_in(&mut host, delayed()).await.unwrap();
        let many = db
            .store
            .enqueue_many_in(&mut host, vec![delayed()])
            .await
            .unwrap()[0];
        let copied = db
            .store
            .enqueue_copy_in(&mut host, vec![delayed()])
            .await
            .unwrap();
        assert_eq!(copied, 1);
        let after = clock(&mut host).await;
        host.commit().await.unwrap();
        let copy_id: i64 = sqlx::query_scalar(&format!("SELECT max(id) FROM {}", db.table("jobs")))
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert!(before - began >= chrono::Duration::milliseconds(1000));

        let mut wrong = Vec::new();
        for (path, id) in [
            ("enqueue_in", one),
            ("enqueue_many_in", many),
            ("enqueue_copy_in", JobId(copy_id)),
        ] {
            let rec = db.store.job(id).await.unwrap();
            if !(rec.created_at >= before && rec.created_at <= after) {
                wrong.push(format!(
                    "{path}: created_at {} is not the enqueue's time (transaction began {began}, \
                     enqueue ran between {before} and {after})",
                    rec.created_at
                ));
            }
            let delay = chrono::Duration::from_std(DELAY).unwrap();
            if !(rec.available_at >= before + delay && rec.available_at <= after + delay) {
                wrong.push(format!(
                    "{path}: available_at {} is not {}s after the enqueue",
                    rec.available_at,
                    DELAY.as_secs()
                ));
            }
        }
        assert!(wrong.is_empty(), "{wrong:#?}");
        conn.close().await.unwrap();
        db.drop().await;
    })
    .await
}

/// A completion that waits for its key row longer than a lease, in one transaction, and
/// then claims the key's successor (`complete_keyed`, as the completer calls it with a
/// wait of the session's own bound) leases it from the moment of that claim: the
/// successor is not born expired. Called directly: the completer itself waits for a busy
/// key in short turns, so through a scheduler this wait is never this long, but the
/// function must not depend on that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_successor_claimed_by_a_completion_that_waited_for_its_key_is_not_born_expired() {
    bounded(async {
        let db = TestDb::new("ts_chain_lease").await;
        let quick =
            |n: i64| NewJob::from_json("quick", serde_json::json!({ "n": n })).with_key("acct");
        let ids = db
            .store
            .enqueue_many(vec![quick(1), quick(2)])
            .await
            .unwrap();
        let w = owner("w");
        let claimed = db.store.claim(&claim_req(&w, 10)).await.unwrap();
        assert_eq!(
            claimed.iter().map(|j| j.id).collect::<Vec<_>>(),
            vec![ids[0]]
        );
        let head = &claimed[0];

        // A host transaction enqueues into the key and stays open: it holds the key row.
        let mut host_conn = db.raw_conn("host").await;
        let mut host = sqlx::Connection::begin(&mut host_conn).await.unwrap();
        db.store.enqueue_in(&mut host, quick(3)).await.unwrap();

        // The head's completion, one transaction, waits for the key row.
        let lease_secs = 2.0_f64;
        let mut completer = db.raw_conn("completer").await;
        let sql = format!(
            "SELECT id, lease_until, claimed_at FROM \"{}\".complete_keyed(
                 ARRAY[$1]::int8[], ARRAY[$2]::int8[], ARRAY[NULL::jsonb], ARRAY['default'],
                 ARRAY['acct'], ARRAY[true], 0, $3, ARRAY['quick'], $4, true, 'nobody')
             WHERE row_kind = 'next'",
            db.schema
        );
        let (id, generation, by) = (head.id.0, head.generation.0, w.as_str().to_string());
        let completion = tokio::spawn(async move {
            let mut tx = sqlx::Connection::begin(&mut completer).await.unwrap();
            let began: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            let next = sqlx::query(&sql)
                .bind(id)
                .bind(generation)
                .bind(by)
                .bind(lease_secs)
                .fetch_optional(&mut *tx)
                .await
                .unwrap()
                .map(|r| {
                    (
                        r.get::<i64, _>("id"),
                        r.get::<DateTime<Utc>, _>("lease_until"),
                        r.get::<DateTime<Utc>, _>("claimed_at"),
                    )
                });
            let returned = clock(&mut tx).await;
            tx.commit().await.unwrap();
            (began, next, returned)
        });
        db.wait_until_lock_waiting("completer").await;
        // Longer than a lease.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let released = clock(&mut host).await;
        host.commit().await.unwrap();
        let (began, next, returned) = within(30, "the completion", completion).await.unwrap();

        let (next_id, lease_until, claimed_at) =
            next.expect("the completion claimed the key's successor");
        assert_eq!(next_id, ids[1].0);
        assert!(
            (released - began).num_milliseconds() as f64 > lease_secs * 1000.0,
            "the completion's transaction did not wait longer than a lease (began {began}, \
             key released {released}): the test did not set up what it checks"
        );
        assert!(
            claimed_at >= released,
            "claimed_at {claimed_at} is before the key row was even free ({released})"
        );
        assert!(
            lease_until > returned,
            "the successor was born with an expired lease: lease_until {lease_until} <= \
             {returned}, when the completion returned"
        );
        assert!(
            (lease_until - claimed_at).num_milliseconds() >= (lease_secs * 1000.0) as i64 - 1,
            "the lease counts from the claim: claimed {claimed_at}, until {lease_until}"
        );
        host_conn.close().await.unwrap();
        db.drop().await;
    })
    .await
}
