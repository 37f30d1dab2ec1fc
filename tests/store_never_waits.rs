//! Maintenance statements never wait on someone else's row lock: a renewal reports a
//! locked job as busy (still ours) and renews the rest at once; the reaper leaves a job
//! whose key row a host transaction holds for its next pass.

mod common;

use chrono::Utc;
use common::*;
use leasehold::{CancelOutcome, ClaimedJob, JobState};
use sqlx::{Connection, PgConnection};

/// Lock one job row in an open transaction on `conn` (a host's session, an operator's
/// `SELECT ... FOR UPDATE`).
async fn lock_job_row(db: &TestDb, conn: &mut PgConnection, id: leasehold::JobId) {
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {} WHERE id = $1 FOR UPDATE",
        db.table("jobs")
    ))
    .bind(id.0)
    .execute(&mut *conn)
    .await
    .unwrap();
}

fn ids(jobs: &[ClaimedJob]) -> Vec<leasehold::JobId> {
    jobs.iter().map(|j| j.id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_never_waits_for_a_locked_job_and_tells_busy_from_lost() {
    bounded(async {
        let db = TestDb::new("wait_renew").await;
        let w = owner("w");
        // `moved`: claimed by w, reaped, claimed again by w: generation 1 is lost.
        let moved = db.store.enqueue(job("k")).await.unwrap();
        let t0 = Utc::now();
        let g1 = db
            .store
            .claim(&claim_at(&w, 1, t0))
            .await
            .unwrap()
            .remove(0);
        db.store
            .reap(&owner("r"), &fixed_backoff(1), 10, Some(secs_after(t0, 60)))
            .await
            .unwrap();
        let g2 = db
            .store
            .claim(&claim_at(&w, 1, secs_after(t0, 120)))
            .await
            .unwrap()
            .remove(0);
        assert_eq!((g1.id, g2.id, g2.generation.0), (moved, moved, 2));
        db.store
            .enqueue_many(vec![job("k"), job("k")])
            .await
            .unwrap();
        let both = db.store.claim(&claim_req(&w, 10)).await.unwrap();
        let [held, free] = [both[0].clone(), both[1].clone()];

        let mut host = db.raw_conn("host").await;
        lock_job_row(&db, &mut host, held.id).await;
        let batch = [held.attempt(), free.attempt(), g1.attempt()];
        let report = within(5, "renewal with a job row locked elsewhere", async {
            db.store.renew(&w, &batch, LEASE).await.unwrap()
        })
        .await;
        assert_eq!(report.busy, vec![held.attempt()], "{report:?}");
        assert_eq!(
            report.renewed.iter().map(|r| r.0.job).collect::<Vec<_>>(),
            vec![free.id],
            "{report:?}"
        );
        assert_eq!(
            report.lost.iter().map(|a| a.job).collect::<Vec<_>>(),
            vec![moved],
            "{report:?}"
        );
        let now: chrono::DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert!(report.renewed[0].1 > now, "a renewed lease lies ahead");
        assert_eq!(
            db.store.job(held.id).await.unwrap().lease_until,
            Some(held.lease_until),
            "the busy job was not touched"
        );

        // The lock goes: the busy job renews like the rest; the new generation is ours.
        sqlx::query("ROLLBACK").execute(&mut host).await.unwrap();
        let report = db
            .store
            .renew(&w, &[held.attempt(), g2.attempt()], LEASE)
            .await
            .unwrap();
        assert!(
            report.busy.is_empty() && report.lost.is_empty(),
            "{report:?}"
        );
        assert_eq!(report.renewed.len(), 2, "{report:?}");
        host.close().await.unwrap();
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reap_never_waits_on_a_key_row_a_host_transaction_holds() {
    bounded(async {
        let db = TestDb::new("wait_reap_key").await;
        let w = owner("w");
        let keyed_ids = db
            .store
            .enqueue_many(vec![keyed("k", "acct", 1), keyed("k", "acct", 2)])
            .await
            .unwrap();
        let plain = db.store.enqueue(job("k")).await.unwrap();
        let t0 = Utc::now();
        let claimed = db.store.claim(&claim_at(&w, 10, t0)).await.unwrap();
        assert_eq!(ids(&claimed), vec![keyed_ids[0], plain]);
        let head = keyed_ids[0];
        assert_eq!(
            db.store.cancel(head, "stop").await.unwrap(),
            CancelOutcome::Requested
        );

        // A host transaction enqueues into the key and stays open: it holds the key row.
        let mut host = db.raw_conn("host").await;
        sqlx::query("BEGIN").execute(&mut host).await.unwrap();
        let late = db
            .store
            .enqueue_in(&mut host, keyed("k", "acct", 3))
            .await
            .unwrap();

        let expired = secs_after(t0, 60);
        let report = within(5, "a reap pass while a key row is locked", async {
            db.store
                .reap(&owner("r"), &fixed_backoff(1), 10, Some(expired))
                .await
                .unwrap()
        })
        .await;
        assert_eq!(
            report.retried,
            vec![plain],
            "the other expiries go on: {report:?}"
        );
        assert!(report.cancelled.is_empty(), "{report:?}");
        assert_eq!(db.store.job(head).await.unwrap().state, JobState::Running);

        sqlx::query("COMMIT").execute(&mut host).await.unwrap();
        let report = db
            .store
            .reap(&owner("r"), &fixed_backoff(1), 10, Some(expired))
            .await
            .unwrap();
        assert_eq!(report.cancelled, vec![head], "{report:?}");
        assert_eq!(db.store.job(head).await.unwrap().state, JobState::Cancelled);

        // The key runs on, in order: the successor, then the host's job.
        let mut ran = Vec::new();
        loop {
            let got = db
                .store
                .claim(&claim_at(&w, 10, far_future()))
                .await
                .unwrap();
            if got.is_empty() {
                break;
            }
            for j in got {
                ran.push(j.id);
                db.store.complete(&j.fence(), None).await.unwrap();
            }
        }
        assert_eq!(ran, vec![keyed_ids[1], plain, late]);
        host.close().await.unwrap();
        db.drop().await;
    })
    .await
}
