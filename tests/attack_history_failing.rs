//! Attack: "a failing informational write (heartbeat, history) never stops the
//! reaper's protocol work". The history table refuses writes (here a trigger raising,
//! as a full tablespace or a DBA's mistake would); a job whose process died holding its
//! lease must still be taken back and run.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::*;
use leasehold::{ClaimRequest, Handler, JobContext, JobError, JobState, NewJob, Scheduler};
use worker::{fast_config, run_in_system};

struct Noop;

impl Handler for Noop {
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "noop";

    async fn run(&self, _ctx: JobContext, _p: serde_json::Value) -> Result<(), JobError> {
        Ok(())
    }
}

#[test]
fn a_lease_of_a_dead_process_is_taken_back_while_history_writes_fail() {
    run_in_system(async {
        within(60, "reap with failing history", async {
            let db = TestDb::new("history_failing").await;
            let id = db
                .store
                .enqueue(NewJob::new("noop", &serde_json::json!({})).unwrap())
                .await
                .unwrap();
            // A process claims it with a short lease and dies.
            let dead = db
                .store
                .claim(&ClaimRequest::new(
                    owner("dead"),
                    vec![leasehold::config::DEFAULT_QUEUE.to_string()],
                    1,
                    Duration::from_secs(1),
                ))
                .await
                .unwrap();
            assert_eq!(dead.len(), 1);
            sqlx::raw_sql(&format!(
                "CREATE FUNCTION \"{s}\".refuse_history() RETURNS trigger LANGUAGE plpgsql AS
                   $$ BEGIN RAISE EXCEPTION 'history tablespace is full'; END $$;
                 CREATE TRIGGER refuse_history BEFORE INSERT ON \"{s}\".job_events
                   FOR EACH ROW EXECUTE FUNCTION \"{s}\".refuse_history();",
                s = db.schema
            ))
            .execute(&db.owner)
            .await
            .unwrap();
            let mut config = fast_config(&db.schema);
            config.store.full_history = false;
            let s = Scheduler::builder(db.pool.clone(), config)
                .register(Noop)
                .start()
                .await
                .unwrap();
            let taken_back = tokio::time::timeout(Duration::from_secs(15), async {
                loop {
                    let st = db.store.job(id).await.unwrap().state;
                    if st != JobState::Running {
                        return st;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
            .await;
            s.shutdown().await.unwrap();
            let rec = db.store.job(id).await.unwrap();
            assert!(
                taken_back.is_ok(),
                "15 s after its 1 s lease ended, the dead process's job is still {:?}, lease until {:?}",
                rec.state,
                rec.lease_until
            );
            db.drop().await;
        })
        .await
    });
}
