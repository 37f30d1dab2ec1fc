//! A reaper racing a completion: whichever commits first wins, and a completed job is
//! never moved back to pending (the reaper skips locked rows and re-checks the state).
//! Every attempt that runs runs the handler (`common/handler.rs`) before it completes;
//! a reaped job's retry never repeats the effect.

mod common;
#[path = "common/handler.rs"]
mod handler;

use std::collections::{HashMap, HashSet};

use common::*;
use handler::{Opts, Path, Run, TestHandler};
use leasehold::{CompleteOutcome, FailOutcome, Failure, Generation, JobId, JobState, StoreOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_before_the_reap_keeps_an_expired_job_done() {
    bounded(async {
        let db = TestDb::new("reaper_after_completion").await;
        let h = TestHandler::new(&db).await;
        let id = db.store.enqueue(job("k")).await.unwrap();
        let w = owner("w");
        let j = db.store.claim(&claim_req(&w, 1)).await.unwrap().remove(0);
        let at = secs_after(j.lease_until, 60);

        // The lease has passed by the test clock, but the worker's handler and its
        // completion commit before any reaper ran: the generation still matches, so
        // both are accepted.
        assert_eq!(h.run(&db.store, &j).await.path, Path::Acted);
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
        db.assert_effect_once(id, 1, 1).await;
        assert_eq!(h.runs().len(), 1, "the job ran once");
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reap_before_the_completion_makes_the_completion_stale() {
    bounded(async {
        let db = TestDb::new("reaper_before_completion").await;
        let h = TestHandler::new(&db).await;
        let id = db.store.enqueue(job("k")).await.unwrap();
        let w = owner("w");
        let j = db.store.claim(&claim_req(&w, 1)).await.unwrap().remove(0);
        let at = secs_after(j.lease_until, 1);

        // The handler's effect happens and is recorded; the reaper commits before the
        // completion does.
        assert_eq!(h.run(&db.store, &j).await.path, Path::Acted);
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

        // The retry runs the handler again: the ledger gives it the first attempt's
        // outcome, and the effect does not happen a second time.
        let b = db
            .store
            .claim(&claim_at(&owner("b"), 1, secs_after(at, 2)))
            .await
            .unwrap()
            .remove(0);
        assert_eq!(b.generation, Generation(2));
        let rerun = h.run(&db.store, &b).await;
        assert_eq!(
            (rerun.path, rerun.applied_by()),
            (Path::Ledger, Some(1)),
            "the retry must reuse the recorded outcome, not act: {rerun:?}"
        );
        assert_eq!(
            db.store
                .complete(&b.fence(), rerun.result.clone().ok())
                .await
                .unwrap(),
            CompleteOutcome::Completed
        );
        assert_eq!(db.state_of(id).await, "done");
        db.assert_effect_once(id, 1, 1).await;
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
        let h = TestHandler::new(&db).await;
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

        // Half the handlers ran while the leases held; their completions are still to
        // be written. The effect store has no keys and no fencing, so the handler
        // reconciles (an act that lands after its fence is gone cannot be recorded).
        let reconcile = || Opts {
            reconcile: true,
            pause: None,
        };
        let mut ran_early: HashMap<JobId, serde_json::Value> = HashMap::new();
        for j in claimed.iter().step_by(2) {
            let run = h.run_with(&db.store, j, reconcile()).await;
            assert_eq!(run.path, Path::Acted);
            ran_early.insert(j.id, run.result.expect("the lease holds"));
        }

        // Reapers (their own pool) judge every lease expired; meanwhile the worker runs
        // the other handlers and completes every job. A reap may land before a
        // handler's effect, between the effect and its record, or between the record
        // and the completion.
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
            let h = h.clone();
            let ran_early = ran_early.clone();
            completers.push(tokio::spawn(async move {
                let mut completed = Vec::new();
                for j in chunk {
                    let result = match ran_early.get(&j.id) {
                        Some(outcome) => Ok(outcome.clone()),
                        None => h.run_with(&store, &j, reconcile()).await.result,
                    };
                    match result {
                        Ok(out) => match store.complete(&j.fence(), Some(out)).await.unwrap() {
                            CompleteOutcome::Completed => completed.push(j),
                            CompleteOutcome::Stale => {}
                            other => panic!("unexpected {other:?}"),
                        },
                        // The step failed; the executor writes the failure.
                        Err(e) => {
                            let failure = Failure {
                                reason: e.message().to_string(),
                                permanent: false,
                                retry_after: None,
                            };
                            let out = store
                                .fail(&j.fence(), &failure, &fixed_backoff(3600))
                                .await
                                .unwrap();
                            assert_eq!(
                                out,
                                FailOutcome::Stale,
                                "job {}: its step failed ({e}) while it still held the fence",
                                j.id
                            );
                        }
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
        // Every first attempt ran its handler; it acted unless its ledger lookup found
        // the lease already taken back (then it refused to act, and says so).
        let first_runs: HashMap<JobId, Run> =
            h.runs().into_iter().map(|r| (r.job, r)).collect();
        assert_eq!(first_runs.len() as i64, n);
        for r in first_runs.values() {
            assert!(
                r.path == Path::Acted
                    || (r.path == Path::Ledger
                        && r.result.as_ref().is_err_and(|e| e.message().contains("no longer runs"))),
                "job {}: {:?} {:?}",
                r.job,
                r.path,
                r.result
            );
        }
        // A step succeeded exactly when the ledger took its record under the fence.
        for run in first_runs.values() {
            let rec = db.ledger(run.job).await;
            match &run.result {
                Ok(_) => assert_eq!(
                    rec.map(|r| r.generation),
                    Some(Generation(1)),
                    "job {}: generation 1's step succeeded but the ledger has no record of it by generation 1",
                    run.job
                ),
                Err(e) => assert!(
                    rec.is_none()
                        && (e.message().contains("lost the lease")
                            || e.message().contains("no longer runs")),
                    "job {}: generation 1's step failed ({e}); ledger: {rec:?}",
                    run.job
                ),
            }
        }

        // The reaped jobs run again (generation 2) and complete. None may repeat its
        // effect: whose first attempt recorded it gets it from the ledger; whose first
        // attempt lost its fence before recording finds it by its key in the store.
        let retry_at = secs_after(far_future(), 7200);
        let w2 = owner("w2");
        let mut reruns = Vec::new();
        loop {
            let got = db.store.claim(&claim_at(&w2, 100, retry_at)).await.unwrap();
            if got.is_empty() {
                break;
            }
            for j in got {
                assert!(reaped_set.contains(&j.id.0), "job {} ran again", j.id);
                assert_eq!(j.generation, Generation(2));
                let run = h.run_with(&db.store, &j, reconcile()).await;
                let out = run.result.clone().unwrap_or_else(|e| panic!("job {}: {e}", j.id));
                assert_eq!(
                    db.store.complete(&j.fence(), Some(out)).await.unwrap(),
                    CompleteOutcome::Completed
                );
                reruns.push(run);
            }
        }
        assert_eq!(reruns.len(), reaped_set.len());
        assert_eq!(db.count_where("jobs", "state = 'done'").await, n);
        assert_eq!(db.assert_done_jobs_have_their_effects().await, n as usize);
        assert_eq!(db.assert_no_duplicate_effects().await, n as usize);
        for j in &completed {
            db.assert_effect_once(j.id, 1, 1).await;
        }
        let (mut from_ledger, mut reconciled) = (0, 0);
        for rerun in &reruns {
            let first = &first_runs[&rerun.job];
            let rec = db.ledger(rerun.job).await.unwrap();
            if first.result.is_ok() {
                assert_eq!(
                    (rerun.path, rec.generation),
                    (Path::Ledger, Generation(1)),
                    "job {}: generation 1 recorded its effect, so generation 2 must get it from the ledger: {rerun:?}",
                    rerun.job
                );
                from_ledger += 1;
            } else if first.path == Path::Acted {
                assert_eq!(
                    (rerun.path, rec.generation),
                    (Path::Reconciled, Generation(2)),
                    "job {}: generation 1 lost its fence before recording; generation 2 must find the effect by its key and record it: {rerun:?}",
                    rerun.job
                );
                assert_eq!(rerun.applied_by(), Some(1), "job {}", rerun.job);
                reconciled += 1;
            } else {
                // Generation 1 found its lease taken back before acting: nothing had
                // happened, so generation 2 acts, once.
                assert_eq!(
                    (rerun.path, rec.generation, rerun.applied_by()),
                    (Path::Acted, Generation(2), Some(2)),
                    "job {}: generation 1 never acted; generation 2 must: {rerun:?}",
                    rerun.job
                );
            }
        }
        eprintln!(
            "completed {} reaped {} (re-run from the ledger {from_ledger}, reconciled {reconciled})",
            done.len(),
            reaped_set.len()
        );
        reap_store.pool().close().await;
        db.drop().await;
    })
    .await
}
