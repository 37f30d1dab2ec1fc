//! Progress a running handler records: kept on the job and shown after it ends, refused
//! for an attempt that lost its fence (the current attempt's value stays), refused when
//! too large or unstorable; and recorded through `JobContext` by a real handler.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::*;
use leasehold::store::MAX_PROGRESS_BYTES;
use leasehold::{Error, FenceOutcome, Handler, JobContext, JobError, JobState, NewJob, Scheduler};
use serde_json::json;
use worker::{fast_config, run_in_system, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_attempts_progress_is_refused_and_the_current_one_stays() {
    bounded(async {
        let db = TestDb::new("progress_fence").await;
        let id = db.store.enqueue(job("export")).await.unwrap();
        let old = owner("old");
        let first = db.store.claim(&claim_req(&old, 1)).await.unwrap().remove(0);
        assert_eq!(
            db.store
                .record_progress(&first.fence(), &json!({"rows": 10}))
                .await
                .unwrap(),
            FenceOutcome::Applied
        );
        // The lease expires and another worker claims the job.
        let at = secs_after(first.lease_until, 1);
        let reaped = db
            .store
            .reap(&owner("reaper"), &fixed_backoff(1), 10, Some(at))
            .await
            .unwrap();
        assert_eq!(reaped.retried, vec![id]);
        let new = owner("new");
        let second = db
            .store
            .claim(&claim_at(&new, 1, secs_after(at, 2)))
            .await
            .unwrap()
            .remove(0);
        assert_eq!(
            db.store
                .record_progress(&second.fence(), &json!({"rows": 3}))
                .await
                .unwrap(),
            FenceOutcome::Applied
        );
        assert_eq!(
            db.store
                .record_progress(&first.fence(), &json!({"rows": 99}))
                .await
                .unwrap(),
            FenceOutcome::Stale,
            "the attempt that lost its lease must not overwrite the current one"
        );
        assert_eq!(
            db.store.job(id).await.unwrap().progress,
            Some(json!({"rows": 3}))
        );
        // Kept after the job ends; no longer writable.
        db.store.complete(&second.fence(), None).await.unwrap();
        assert_eq!(
            db.store
                .record_progress(&second.fence(), &json!({"rows": 4}))
                .await
                .unwrap(),
            FenceOutcome::Stale
        );
        let row = db.store.job(id).await.unwrap();
        assert_eq!(
            (row.state, row.progress),
            (JobState::Done, Some(json!({"rows": 3})))
        );
        // Too large, or what jsonb cannot hold: refused with the reason.
        let big = json!("x".repeat(MAX_PROGRESS_BYTES));
        let err = db
            .store
            .record_progress(&second.fence(), &big)
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidInput {
                    field: "progress",
                    ..
                }
            ),
            "{err}"
        );
        let nul = json!({"s": "a\u{0}b"});
        assert!(db
            .store
            .record_progress(&second.fence(), &nul)
            .await
            .is_err());
        db.drop().await;
    })
    .await
}

#[derive(Clone)]
struct Exporter;

impl Handler for Exporter {
    type Payload = u32;
    type Output = ();
    const KIND: &'static str = "exporter";

    async fn run(&self, ctx: JobContext, batches: u32) -> Result<(), JobError> {
        for done in 1..=batches {
            let wrote = ctx
                .record_progress(&json!({ "batches_done": done }))
                .await?;
            assert_eq!(wrote, FenceOutcome::Applied);
        }
        Ok(())
    }
}

#[test]
fn a_handler_records_its_progress_through_its_context() {
    run_in_system(within(60, "progress through the context", async {
        let db = TestDb::new("progress_ctx").await;
        let s = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
            .register(Exporter)
            .start()
            .await
            .unwrap();
        let id = s
            .enqueue_job(NewJob::new("exporter", &3u32).unwrap())
            .await
            .unwrap();
        wait_until(10, "the export to finish", || async {
            db.store.job(id).await.unwrap().state == JobState::Done
        })
        .await;
        let row = db.store.job(id).await.unwrap();
        assert_eq!(row.progress, Some(json!({ "batches_done": 3 })));
        s.shutdown().await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        db.drop().await;
    }))
}
