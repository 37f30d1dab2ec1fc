//! Attack: the kind's policy (attempts, priority) on a scheduler's enqueue paths, and
//! "a job's own `with_max_attempts` / `with_priority` still win" (README, Policies per
//! kind) — also when the job's own priority is 0.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::{within, TestDb};
use leasehold::{
    Handler, JobContext, JobError, KindPolicy, NewJob, Periodic, Scheduler, StoreOptions,
};
use worker::{fast_config, run_in_system, wait_until, POOL};

/// A kind whose policy says 2 attempts, priority 7 (low urgency: lower runs first).
#[derive(Clone, Default)]
struct Ledger;

impl Handler for Ledger {
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "ledger";

    fn policy() -> KindPolicy {
        KindPolicy {
            max_attempts: Some(2),
            priority: Some(7),
            ..KindPolicy::default()
        }
    }

    async fn run(&self, _: JobContext, _: serde_json::Value) -> Result<(), JobError> {
        // Stay pending-free quickly; the rows are what is asserted.
        Ok(())
    }
}

fn ledger(tag: &str) -> NewJob {
    NewJob::from_json("ledger", serde_json::json!({ "tag": tag }))
}

async fn rows(db: &TestDb) -> Vec<(String, i32, i16)> {
    sqlx::query_as(&format!(
        "SELECT payload->>'tag', max_attempts, priority FROM {} WHERE kind = 'ledger' ORDER BY id",
        db.table("jobs")
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

#[test]
fn a_jobs_own_priority_zero_wins_over_its_kinds_priority_on_every_enqueue_path() {
    run_in_system(within(60, "own priority 0", async {
        let db = TestDb::with_options("atk_ppol_prio0", StoreOptions::default(), POOL).await;
        let s = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
            .register(Ledger)
            .periodic(
                Periodic::every(
                    "urgent",
                    Duration::from_secs(1),
                    ledger("periodic").with_priority(0),
                )
                .unwrap(),
            )
            .start()
            .await
            .unwrap();
        s.enqueue_job(ledger("handle").with_priority(0))
            .await
            .unwrap();
        s.store()
            .enqueue(ledger("store").with_priority(0))
            .await
            .unwrap();
        s.store()
            .enqueue_copy(vec![ledger("copy").with_priority(0)])
            .await
            .unwrap();
        wait_until(15, "a periodic fire", || async {
            db.count_where("jobs", "payload->>'tag' = 'periodic'").await >= 1
        })
        .await;
        s.shutdown().await.unwrap();
        let r = rows(&db).await;
        db.drop().await;
        let wrong: Vec<_> = r.iter().filter(|(_, _, p)| *p != 0).collect();
        assert!(
            wrong.is_empty(),
            "each job said with_priority(0), which should win over the kind's 7: {r:?}"
        );
    }))
}

#[test]
fn a_jobs_own_attempts_and_nonzero_priority_win_and_the_kinds_fill_in_the_rest_on_every_path() {
    run_in_system(within(60, "own attempts win", async {
        let db = TestDb::with_options("atk_ppol_own", StoreOptions::default(), POOL).await;
        let s = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
            .register(Ledger)
            .periodic(
                Periodic::every(
                    "own",
                    Duration::from_secs(1),
                    ledger("periodic-own")
                        .with_max_attempts(5)
                        .with_priority(-2),
                )
                .unwrap(),
            )
            .periodic(
                Periodic::every("kinds", Duration::from_secs(1), ledger("periodic-kind")).unwrap(),
            )
            .start()
            .await
            .unwrap();
        s.store()
            .enqueue_many(vec![
                ledger("many-kind"),
                ledger("many-own").with_max_attempts(5).with_priority(-2),
            ])
            .await
            .unwrap();
        s.store()
            .enqueue_copy(vec![
                ledger("copy-kind"),
                ledger("copy-own").with_max_attempts(5).with_priority(-2),
            ])
            .await
            .unwrap();
        wait_until(15, "both schedules fired", || async {
            db.count_where("jobs", "payload->>'tag' = 'periodic-own'")
                .await
                >= 1
                && db
                    .count_where("jobs", "payload->>'tag' = 'periodic-kind'")
                    .await
                    >= 1
        })
        .await;
        s.shutdown().await.unwrap();
        let r = rows(&db).await;
        db.drop().await;
        for (tag, attempts, priority) in &r {
            let want = if tag.ends_with("own") {
                (5, -2)
            } else {
                (2, 7)
            };
            assert_eq!((*attempts, *priority), want, "{tag}: {r:?}");
        }
    }))
}
