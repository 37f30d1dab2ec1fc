//! Guards (expected to pass): `JobContext::effect_key` needs no round trip, and an
//! outcome that cannot be read back stops the job with its key in the error.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::sync::Arc;

use common::*;
use leasehold::testkit::attempt_context;
use leasehold::{Handler, JobContext, JobError, JobState, NewJob, Scheduler};
use worker::{fast_config, run_in_system, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effect_key_is_made_without_the_database_as_identity_job_and_step() {
    bounded(async {
        let db = TestDb::new("guard_key_offline").await;
        let id = db
            .store
            .enqueue(NewJob::new("k", &serde_json::json!({})).unwrap())
            .await
            .unwrap();
        let job = db
            .store
            .claim(&claim_req(&owner("a"), 1))
            .await
            .unwrap()
            .remove(0);
        let identity: String = sqlx::query_scalar(&format!(
            "SELECT effect_identity::text FROM {} WHERE id = $1",
            db.table("jobs")
        ))
        .bind(id.0)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        let ctx = attempt_context(job, db.store.clone());
        let schema = db.schema.clone();
        db.pool.close().await;
        let key = within(2, "effect_key with the pool closed", async {
            ctx.effect_key("charge/eu")
        })
        .await;
        assert_eq!(key.as_str(), format!("{identity}/{id}/charge/eu"));
        let mut conn = sqlx::ConnectOptions::connect(&base_options().database(&test_db_name()))
            .await
            .unwrap();
        let _ = sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
            .execute(&mut conn)
            .await;
    })
    .await
}

struct NanRate {
    acted: Arc<AtomicU32>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Rate {
    rate: f64,
}

impl Handler for NanRate {
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "nan";

    async fn run(&self, ctx: JobContext, req: serde_json::Value) -> Result<(), JobError> {
        let acted = self.acted.clone();
        let _: Rate = ctx
            .once("quote", &req, |_k| async move {
                acted.fetch_add(1, SeqCst);
                Ok(Rate { rate: f64::NAN })
            })
            .await?;
        Ok(())
    }
}

#[test]
fn an_unreadable_outcome_stops_the_job_once_with_the_effect_key_in_its_error() {
    run_in_system(async {
        within(60, "nan key in error", async {
            let db = TestDb::new("guard_nan_key").await;
            let acted = Arc::new(AtomicU32::new(0));
            let s = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
                .register(NanRate {
                    acted: acted.clone(),
                })
                .start()
                .await
                .unwrap();
            let id = s
                .enqueue_job(
                    NewJob::new("nan", &serde_json::json!({}))
                        .unwrap()
                        .with_max_attempts(5),
                )
                .await
                .unwrap();
            wait_until(20, "the job to end", || async {
                db.store.job(id).await.unwrap().state.is_terminal()
            })
            .await;
            s.shutdown().await.unwrap();
            let identity: String = sqlx::query_scalar(&format!(
                "SELECT effect_identity::text FROM {} WHERE id = $1",
                db.table("jobs")
            ))
            .bind(id.0)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            let rec = db.store.job(id).await.unwrap();
            let err = rec.last_error.clone().unwrap_or_default();
            assert_eq!(rec.state, JobState::Dead, "{err}");
            assert_eq!(rec.attempts, 1, "{err}");
            assert_eq!(acted.load(SeqCst), 1);
            assert!(err.contains(&format!("{identity}/{id}/quote")), "{err}");
            assert!(db.store.job_effects(id).await.unwrap().is_empty());
            db.drop().await;
        })
        .await
    });
}
