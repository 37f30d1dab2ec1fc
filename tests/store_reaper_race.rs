//! A reaper racing a completion: whichever commits first wins, and a completed job is
//! never moved back to pending (the reaper skips locked rows and re-checks the state).

mod common;

use std::collections::HashSet;

use common::*;
use leasehold::{CompleteOutcome, JobId, JobState, StoreOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_before_the_reap_keeps_an_expired_job_done() {
    bounded(async {
        let db = TestDb::new("reaper_after_completion").await;
        db.create_effects_table().await;
        let id = db.store.enqueue(job("k")).await.unwrap();
        let w = owner("w");
        let j = db.store.claim(&claim_req(&w, 1)).await.unwrap().remove(0);
        let at = secs_after(j.lease_until, 60);

        // The lease has passed by the test clock, but the worker's completion commits
        // before any reaper ran: the generation still matches, so it is accepted.
        db.apply_effect(&format!("{id}/run"), id, j.generation)
            .await;
        assert_eq!(
            db.store
                .complete(&j.fence(), Some(serde_json::json!("ok")))
                .await
                .unwrap(),
            CompleteOutcome::Completed
        );
        let report = db
            .store
            .reap(&owner("r"), &fixed_backoff(1), 100, Some(at))
            .await
            .unwrap();
        assert!(report.is_empty(), "{report:?}");

        let rec = db.store.job(id).await.unwrap();
        assert_eq!(rec.state, JobState::Done);
        assert_eq!(rec.result, Some(serde_json::json!("ok")));
        assert_eq!(db.count_where("lease_expiries", "true").await, 0);
        assert!(db
            .store
            .claim(&claim_at(&owner("b"), 10, far_future()))
            .await
            .unwrap()
            .is_empty());
        assert_eq!(db.effect_count(None).await, 1);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reap_before_the_completion_makes_the_completion_stale() {
    bounded(async {
        let db = TestDb::new("reaper_before_completion").await;
        db.create_effects_table().await;
        let id = db.store.enqueue(job("k")).await.unwrap();
        let w = owner("w");
        let j = db.store.claim(&claim_req(&w, 1)).await.unwrap().remove(0);
        let at = secs_after(j.lease_until, 1);
        assert_eq!(
            db.store
                .reap(&owner("r"), &fixed_backoff(1), 100, Some(at))
                .await
                .unwrap()
                .retried,
            vec![id]
        );
        assert_eq!(
            db.store.complete(&j.fence(), None).await.unwrap(),
            CompleteOutcome::Stale
        );
        let rec = db.store.job(id).await.unwrap();
        assert_eq!(rec.state, JobState::Pending);
        assert_eq!(rec.result, None);
        assert_eq!(db.count_where("lease_expiries", "true").await, 1);
        assert_eq!(db.effect_count(None).await, 0);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reaps_and_completions_never_move_a_completed_job_back() {
    bounded(async {
        let n: i64 = 300;
        let opts = StoreOptions::default();
        let db = TestDb::with_options("reaper_completion_storm", opts, 2).await;
        db.create_effects_table().await;
        db.store
            .enqueue_many((0..n).map(|_| job("k")).collect())
            .await
            .unwrap();
        let w = owner("w");
        let mut claimed = Vec::new();
        loop {
            let got = db.store.claim(&claim_req(&w, 100)).await.unwrap();
            if got.is_empty() {
                break;
            }
            claimed.extend(got);
        }
        assert_eq!(claimed.len() as i64, n);

        // Reapers (their own pool) judge every lease expired; completions run meanwhile.
        let reap_store = db.other_store_sized("reaper", 2).await;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut reapers = Vec::new();
        for r in 0..2 {
            let store = reap_store.clone();
            let stop = stop.clone();
            reapers.push(tokio::spawn(async move {
                let me = owner(&format!("reaper{r}"));
                let mut reaped = Vec::new();
                loop {
                    let report = store
                        .reap(&me, &fixed_backoff(3600), 2, Some(far_future()))
                        .await
                        .unwrap();
                    let empty = report.is_empty();
                    reaped.extend(report.retried);
                    assert!(report.dead.is_empty());
                    if empty && stop.load(std::sync::atomic::Ordering::SeqCst) {
                        break;
                    }
                    tokio::task::yield_now().await;
                }
                reaped
            }));
        }
        let mut completers = Vec::new();
        for chunk in claimed.chunks(claimed.len() / 2 + 1) {
            let chunk = chunk.to_vec();
            let store = db.store.clone();
            completers.push(tokio::spawn(async move {
                let mut completed = Vec::new();
                for j in chunk {
                    match store.complete(&j.fence(), None).await.unwrap() {
                        CompleteOutcome::Completed => completed.push(j),
                        CompleteOutcome::Stale => {}
                        other => panic!("unexpected {other:?}"),
                    }
                }
                completed
            }));
        }
        let mut completed = Vec::new();
        for c in completers {
            completed.extend(within(60, "completers", c).await.unwrap());
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut reaped: Vec<JobId> = Vec::new();
        for r in reapers {
            reaped.extend(within(60, "reapers", r).await.unwrap());
        }
        // The handler's effect for every job whose completion was accepted.
        for j in &completed {
            db.apply_effect(&format!("{}/run", j.id), j.id, j.generation)
                .await;
        }

        // A final reap after everything: still nothing completed comes back.
        db.store
            .reap(
                &owner("late"),
                &fixed_backoff(3600),
                1000,
                Some(far_future()),
            )
            .await
            .unwrap();
        let done: HashSet<i64> = completed.iter().map(|j| j.id.0).collect();
        let reaped_set: HashSet<i64> = reaped.iter().map(|id| id.0).collect();
        assert_eq!(reaped.len(), reaped_set.len(), "a job was reaped twice");
        assert!(done.is_disjoint(&reaped_set), "a completed job was reaped");
        assert_eq!(
            done.len() + reaped_set.len(),
            n as usize,
            "every job is either completed or reaped"
        );
        let done_rows: Vec<i64> = sqlx::query_scalar(&format!(
            "SELECT id FROM {} WHERE state = 'done'",
            db.table("jobs")
        ))
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(done_rows.into_iter().collect::<HashSet<_>>(), done);
        assert_eq!(
            db.count_where("jobs", "state = 'pending'").await,
            reaped_set.len() as i64
        );
        assert_eq!(db.count_where("jobs", "state = 'running'").await, 0);
        assert_eq!(
            db.count_where("lease_expiries", "true").await,
            reaped_set.len() as i64
        );
        assert_eq!(
            db.count_where(
                "lease_expiries e",
                &format!(
                    "e.job_id IN (SELECT id FROM {} WHERE state = 'done')",
                    db.table("jobs")
                )
            )
            .await,
            0
        );
        assert_eq!(db.effect_count(None).await, done.len() as i64);
        eprintln!("completed {} reaped {}", done.len(), reaped_set.len());
        reap_store.pool().close().await;
        db.drop().await;
    })
    .await
}
