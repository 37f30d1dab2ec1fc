//! Enqueue wake-ups under concurrent producers: when several enqueues of one store are in
//! flight, they commit without a NOTIFY each and are announced together after their
//! commits (a NOTIFY in every transaction serializes the commits). No job may go
//! unannounced, and no announcement may arrive before its job is visible.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{within, TestDb};
use leasehold::{NewJob, StoreOptions};
use serde_json::json;

const PRODUCERS: usize = 8;
const EACH: usize = 40;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_job_of_concurrent_producers_is_announced_after_it_is_visible() {
    within(120, "concurrent producers' wake-ups", async {
        let db = TestDb::with_options("wakeups", StoreOptions::default(), 10).await;
        let channel = db.store.schema().channel();
        let mut listener = sqlx::postgres::PgListener::connect_with(&db.pool)
            .await
            .unwrap();
        listener.listen(&channel).await.unwrap();
        // One queue per job, so each announcement names exactly one job.
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|p| {
                let store = db.store.clone();
                tokio::spawn(async move {
                    for i in 0..EACH {
                        let queue = format!("q-{p}-{i}");
                        store
                            .enqueue(NewJob::from_json("k", json!({ "i": i })).with_queue(&queue))
                            .await
                            .unwrap();
                    }
                })
            })
            .collect();
        let expected: BTreeSet<String> = (0..PRODUCERS)
            .flat_map(|p| (0..EACH).map(move |i| format!("q-{p}-{i}")))
            .collect();
        let jobs = db.table("jobs");
        let mut announced = BTreeSet::new();
        while announced.len() < expected.len() {
            let n = tokio::time::timeout(Duration::from_secs(10), listener.recv())
                .await
                .unwrap_or_else(|_| {
                    let missing: Vec<_> = expected.difference(&announced).take(5).collect();
                    panic!(
                        "{} of {} queues never announced, e.g. {missing:?}",
                        expected.len() - announced.len(),
                        expected.len()
                    )
                })
                .unwrap();
            // Announced after its commit: the job is already visible to another session.
            let visible: i64 =
                sqlx::query_scalar(&format!("SELECT count(*) FROM {jobs} WHERE queue = $1"))
                    .bind(n.payload())
                    .fetch_one(&db.pool)
                    .await
                    .unwrap();
            assert_eq!(
                visible,
                1,
                "queue {} announced before its job was visible",
                n.payload()
            );
            announced.insert(n.payload().to_string());
        }
        for p in producers {
            p.await.unwrap();
        }
        assert_eq!(announced, expected);
        db.drop().await;
    })
    .await
}
