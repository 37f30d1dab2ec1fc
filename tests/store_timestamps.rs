//! Which clock stamps a job: `created_at` and a delay count from the enqueue statement,
//! not from the start of the transaction it runs in; a completion that waited for its
//! key row and claims the key's successor leases it from the moment of that claim, so
//! the successor is not born with an expired lease.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use chrono::{DateTime, Utc};
use common::*;
use leasehold::{Handler, JobContext, JobError, JobId, JobState, NewJob, Scheduler, StoreOptions};
use sqlx::{Connection, Row};
use worker::{config_with_lease, run_in_system, wait_until, POOL};

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

/// Does nothing: what matters is how its jobs are claimed.
struct Quick;

impl Handler for Quick {
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "quick";

    async fn run(&self, _: JobContext, _: serde_json::Value) -> Result<(), JobError> {
        Ok(())
    }
}

/// Record every claim (any move into `running`) with the stamps the claim wrote, the
/// start of the transaction that claimed, and the clock when the row was written.
async fn audit_claims(db: &TestDb) {
    let s = format!("\"{}\"", db.schema);
    for ddl in [
        format!(
            "CREATE TABLE {s}.claim_audit (
                 n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                 job_id bigint, generation bigint, claimed_at timestamptz,
                 lease_until timestamptz, tx_start timestamptz, written timestamptz)"
        ),
        format!(
            "CREATE FUNCTION {s}.audit_claim() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 INSERT INTO {s}.claim_audit
                     (job_id, generation, claimed_at, lease_until, tx_start, written)
                 VALUES (NEW.id, NEW.generation, NEW.claimed_at, NEW.lease_until,
                         now(), clock_timestamp());
                 RETURN NULL;
             END $$"
        ),
        format!(
            "CREATE TRIGGER audit_claim AFTER UPDATE ON {s}.jobs FOR EACH ROW
             WHEN (NEW.state = 'running' AND OLD.state <> 'running')
             EXECUTE FUNCTION {s}.audit_claim()"
        ),
    ] {
        sqlx::query(&ddl).execute(&db.pool).await.unwrap();
    }
}

#[ignore = "open (issue 30 note): the completer now waits for a busy key in turns of at most 25 ms (a fresh transaction each), so this setup (one completion transaction waiting longer than a lease) can no longer be built through a scheduler; to be rewritten against complete_keyed directly"]
#[test]
fn a_successor_claimed_by_a_completion_that_waited_for_its_key_is_not_born_expired() {
    run_in_system(within(90, "chained successor lease test", async {
        let db = TestDb::with_options("ts_chain_lease", StoreOptions::default(), POOL).await;
        audit_claims(&db).await;
        let quick =
            |n: i64| NewJob::from_json("quick", serde_json::json!({ "n": n })).with_key("acct");
        let ids = db
            .store
            .enqueue_many(vec![quick(1), quick(2)])
            .await
            .unwrap();
        // A host transaction enqueues into the key and stays open: it holds the key row,
        // so the head's completion must wait for it.
        let mut host = db.raw_conn("host").await;
        sqlx::query("BEGIN").execute(&mut host).await.unwrap();
        let late = db.store.enqueue_in(&mut host, quick(3)).await.unwrap();

        let lease = Duration::from_secs(2);
        let mut config = config_with_lease(&db.schema, lease);
        // A completion claims its key's successor only while a slot is spare; a claim in
        // flight takes at most `claim_batch_max` slots, so with more than that there
        // always is one.
        config.concurrency = 8;
        config.claim_batch_max = 4;
        // The head's completion must wait in one transaction for the whole hold, longer
        // than a lease, so that a successor leased from the transaction's start (not
        // from the moment of its claim) would be born expired. The default lock wait
        // (250 ms) would end each try long before and start a fresh transaction.
        config.writer_lock_wait = Duration::from_secs(10);
        let scheduler = Scheduler::builder(db.pool.clone(), config)
            .register(Quick)
            .start()
            .await
            .unwrap();
        let waiting_sql = "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND query LIKE '%leasehold:complete_keyed%' AND query LIKE '%' || $1 || '%'";
        wait_until(
            20,
            "the head's completion to wait for the key row",
            || async {
                sqlx::query_scalar::<_, i64>(waiting_sql)
                    .bind(&db.schema)
                    .fetch_one(&db.pool)
                    .await
                    .unwrap()
                    > 0
            },
        )
        .await;
        // Longer than a lease (the head's own lease is renewed meanwhile).
        tokio::time::sleep(lease + Duration::from_secs(1)).await;
        let released = clock(&mut host).await;
        sqlx::query("COMMIT").execute(&mut host).await.unwrap();

        wait_until(30, "the key's three jobs to be done", || async {
            let mut done = 0;
            for id in [ids[0], ids[1], late] {
                if db.store.job(id).await.unwrap().state == JobState::Done {
                    done += 1;
                }
            }
            done == 3
        })
        .await;
        scheduler.shutdown().await.unwrap();

        let first_claim = sqlx::query(&format!(
            "SELECT generation, claimed_at, lease_until, tx_start, written
             FROM {} WHERE job_id = $1 ORDER BY n LIMIT 1",
            db.table("claim_audit")
        ))
        .bind(ids[1].0)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        let at = |c: &str| first_claim.get::<DateTime<Utc>, _>(c);
        let history: Vec<String> = db
            .store
            .history(ids[1])
            .await
            .unwrap()
            .into_iter()
            .map(|e| format!("{} g{} {:?}", e.event, e.generation.0, e.detail))
            .collect();
        assert_eq!(first_claim.get::<i64, _>("generation"), 1);
        assert!(
            at("tx_start") < released,
            "the successor was not claimed by the completion that waited (transaction began \
             {}, key released {released}): the test did not set up what it checks; \
             successor history: {history:?}",
            at("tx_start")
        );
        assert!(
            at("lease_until") > at("written"),
            "the successor was born with an expired lease: lease_until {} <= written {}",
            at("lease_until"),
            at("written")
        );
        assert!(
            at("claimed_at") >= released,
            "claimed_at {} is before the key row was even free ({released})",
            at("claimed_at")
        );
        host.close().await.unwrap();
        db.drop().await;
    }))
}
