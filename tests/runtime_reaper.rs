//! The reaper's protocol work (reaping expired leases, retention) never waits on an
//! informational write: a heartbeat the database refuses is counted, shown in the
//! metrics snapshot and logged, and the pass goes on.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::{job, owner, within, TestDb};
use leasehold::store::ClaimRequest;
use leasehold::{Handler, JobContext, JobError, JobState, Scheduler, StoreOptions};
use worker::{fast_config, run_in_system, wait_until, POOL};

struct Quick;

impl Handler for Quick {
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "quick";

    async fn run(&self, _: JobContext, _: serde_json::Value) -> Result<(), JobError> {
        Ok(())
    }
}

#[test]
fn a_refused_heartbeat_never_stops_reaping_or_retention() {
    run_in_system(within(60, "reaper with a failing heartbeat", async {
        let db = TestDb::with_options("rt_reaper_beat", StoreOptions::default(), POOL).await;
        // The heartbeat's table is gone (as for a role granted before the migration that
        // added it): every heartbeat fails.
        sqlx::query(&format!(
            "ALTER TABLE {} RENAME TO schedulers_gone",
            db.table("schedulers")
        ))
        .execute(&db.owner)
        .await
        .unwrap();
        // A job a crashed process claimed: its short lease will pass, unrenewed.
        let crashed = db.store.enqueue(job(Quick::KIND)).await.unwrap();
        let ghost = owner("ghost");
        let claimed = db
            .store
            .claim(&ClaimRequest::new(
                ghost,
                vec!["default".into()],
                1,
                Duration::from_millis(200),
            ))
            .await
            .unwrap();
        assert_eq!(claimed.len(), 1);
        // A finished job for retention to prune.
        let finished = db.store.enqueue(job("other")).await.unwrap();
        sqlx::query(&format!(
            "UPDATE {} SET state = 'done', finished_at = now() - interval '1 hour' WHERE id = $1",
            db.table("jobs")
        ))
        .bind(finished.0)
        .execute(&db.owner)
        .await
        .unwrap();

        let mut config = fast_config(&db.schema);
        config.retention = Some(leasehold::store::DEFAULT_PRUNE_FLOOR);
        let scheduler = Scheduler::builder(db.pool.clone(), config)
            .register(Quick)
            .start()
            .await
            .unwrap();
        wait_until(
            20,
            "the crashed process's job to be reaped and run",
            || async { db.store.job(crashed).await.unwrap().state == JobState::Done },
        )
        .await;
        wait_until(20, "retention to prune the finished job", || async {
            db.count_where("jobs", &format!("id = {}", finished.0))
                .await
                == 0
        })
        .await;
        // The pass's figures: it ran, read and deleted what was due (counted just after
        // its commit).
        wait_until(10, "the retention pass's figures", || async {
            let c = scheduler.metrics().counters;
            c.prune_passes >= 1 && c.prune_rows_deleted >= 1 && c.prune_rows_read >= 1
        })
        .await;
        let m = scheduler.metrics();
        assert!(
            m.counters.informational_write_failures >= 1,
            "{:?}",
            m.counters
        );
        let shown = m.informational_error.clone().unwrap_or_default();
        assert!(
            shown.contains("schedulers"),
            "informational_error: {shown:?}"
        );
        assert_eq!(
            db.count_where("lease_expiries", &format!("job_id = {}", crashed.0))
                .await,
            1
        );

        // Once the write works again, the snapshot says so.
        sqlx::query(&format!(
            "ALTER TABLE {} RENAME TO schedulers",
            db.table("schedulers_gone")
        ))
        .execute(&db.owner)
        .await
        .unwrap();
        wait_until(10, "the heartbeat to be written again", || async {
            scheduler.metrics().informational_error.is_none()
        })
        .await;
        scheduler.shutdown().await.unwrap();
        db.drop().await;
    }))
}
