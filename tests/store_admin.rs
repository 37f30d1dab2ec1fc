//! Operator actions and key blocking: a dead or held head blocks its key (reported by
//! `blocked_keys`) unless its policy says continue; cancel, hold, release and retry keep
//! the key's one-at-a-time order; history records every transition.

mod common;
#[path = "common/handler.rs"]
mod handler;

use common::*;
use handler::{Path, TestHandler};
use leasehold::{
    ClaimedJob, CompleteOutcome, DeadKeyPolicy, Error, FailOutcome, Failure, JobId, JobState,
    OwnerId,
};

fn fatal() -> Failure {
    Failure {
        reason: "boom".into(),
        permanent: true,
        retry_after: None,
    }
}

async fn claim_one(db: &TestDb, w: &OwnerId) -> ClaimedJob {
    let mut got = db
        .store
        .claim(&claim_at(w, 10, far_future()))
        .await
        .unwrap();
    assert_eq!(
        got.len(),
        1,
        "expected exactly one claimable job, got {:?}",
        got.iter().map(|j| j.id).collect::<Vec<_>>()
    );
    got.remove(0)
}

/// The worker: run the handler (its effect through the ledger, logged), then complete.
async fn run(db: &TestDb, h: &TestHandler, j: &ClaimedJob) {
    assert_eq!(h.run(&db.store, j).await.path, Path::Acted);
    assert_eq!(
        db.store.complete(&j.fence(), None).await.unwrap(),
        CompleteOutcome::Completed
    );
}

async fn nothing_claimable(db: &TestDb, w: &OwnerId) {
    let got = db
        .store
        .claim(&claim_at(w, 10, far_future()))
        .await
        .unwrap();
    assert!(
        got.is_empty(),
        "nothing may be claimable, got {:?}",
        got.iter().map(|j| j.id).collect::<Vec<_>>()
    );
}

async fn state(db: &TestDb, id: JobId) -> JobState {
    db.store.job(id).await.unwrap().state
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_head_blocks_its_key_by_default() {
    bounded(async {
        let db = TestDb::new("admin_dead_blocks").await;
        let h = TestHandler::new(&db).await;
        let ids = db
            .store
            .enqueue_many((1..=3).map(|n| keyed("k", "acct", n)).collect())
            .await
            .unwrap();
        let w = owner("w");
        let head = claim_one(&db, &w).await;
        assert_eq!(head.id, ids[0]);
        assert_eq!(
            db.store
                .fail(&head.fence(), &fatal(), &fixed_backoff(1))
                .await
                .unwrap(),
            FailOutcome::Dead
        );

        assert_eq!(state(&db, ids[1]).await, JobState::Waiting);
        nothing_claimable(&db, &w).await;
        let blocked = db.store.blocked_keys(10).await.unwrap();
        assert_eq!(blocked.len(), 1);
        assert_eq!(
            (
                blocked[0].queue.as_str(),
                blocked[0].key.as_str(),
                blocked[0].head_state.as_str(),
                blocked[0].waiting
            ),
            ("default", "acct", "dead", 2)
        );
        // A new job of the key queues up behind the dead head too.
        let later = db.store.enqueue(keyed("k", "acct", 4)).await.unwrap();
        assert_eq!(state(&db, later).await, JobState::Waiting);
        nothing_claimable(&db, &w).await;
        assert_eq!(db.count_where("jobs", "state = 'dead'").await, 1);

        // The operator cancels the dead head: the key runs on, in order.
        db.store.cancel(ids[0], "written off").await.unwrap();
        assert!(db.store.blocked_keys(10).await.unwrap().is_empty());
        for _ in 0..3 {
            let j = claim_one(&db, &w).await;
            run(&db, &h, &j).await;
        }
        assert_eq!(h.assert_key_order()["acct"], vec![ids[1], ids[2], later]);
        assert_eq!(state(&db, ids[0]).await, JobState::Cancelled);
        assert_eq!(db.count_where("jobs", "state = 'done'").await, 3);
        assert_eq!(db.assert_done_jobs_have_their_effects().await, 3);
        assert_eq!(
            db.ledger(ids[0]).await,
            None,
            "the dead head never had its effect"
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_head_with_continue_policy_lets_its_key_continue() {
    bounded(async {
        let db = TestDb::new("admin_dead_continue").await;
        let h = TestHandler::new(&db).await;
        let first = db
            .store
            .enqueue(keyed("k", "acct", 1).with_dead_key_policy(DeadKeyPolicy::Continue))
            .await
            .unwrap();
        let second = db.store.enqueue(keyed("k", "acct", 2)).await.unwrap();
        let w = owner("w");
        let head = claim_one(&db, &w).await;
        assert_eq!(head.id, first);
        assert_eq!(
            db.store
                .fail(&head.fence(), &fatal(), &fixed_backoff(1))
                .await
                .unwrap(),
            FailOutcome::Dead
        );
        assert_eq!(state(&db, second).await, JobState::Pending);
        assert!(db.store.blocked_keys(10).await.unwrap().is_empty());
        let next = claim_one(&db, &w).await;
        assert_eq!(next.id, second);
        run(&db, &h, &next).await;
        assert_eq!(
            (state(&db, first).await, state(&db, second).await),
            (JobState::Dead, JobState::Done)
        );
        assert_eq!(db.count_where("job_keys", "open_jobs = 0").await, 1);
        assert_eq!(db.assert_done_jobs_have_their_effects().await, 1);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continue_policy_also_applies_when_the_reaper_kills_the_head() {
    bounded(async {
        let db = TestDb::new("admin_reaped_continue").await;
        let h = TestHandler::new(&db).await;
        let first = db
            .store
            .enqueue(
                keyed("k", "acct", 1)
                    .with_dead_key_policy(DeadKeyPolicy::Continue)
                    .with_max_attempts(1),
            )
            .await
            .unwrap();
        let second = db.store.enqueue(keyed("k", "acct", 2)).await.unwrap();
        let w = owner("w");
        let head = claim_one(&db, &w).await;
        // The head's handler starts (its renewal records that), then its worker dies.
        let renewed = db.store.renew(&w, &[head.attempt()], LEASE).await.unwrap();
        let at = secs_after(renewed.renewed[0].1, 1);
        assert_eq!(
            db.store
                .reap(&owner("r"), &fixed_backoff(1), 10, Some(at))
                .await
                .unwrap()
                .dead,
            vec![first]
        );
        let next = claim_one(&db, &w).await;
        assert_eq!(next.id, second);
        run(&db, &h, &next).await;
        assert_eq!(state(&db, first).await, JobState::Dead);
        assert_eq!(state(&db, second).await, JobState::Done);
        assert_eq!(db.assert_done_jobs_have_their_effects().await, 1);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_head_promotes_its_successor() {
    bounded(async {
        let db = TestDb::new("admin_cancel_head").await;
        let h = TestHandler::new(&db).await;
        let ids = db
            .store
            .enqueue_many((1..=5).map(|n| keyed("k", "acct", n)).collect())
            .await
            .unwrap();
        let w = owner("w");

        // A pending head.
        db.store.cancel(ids[0], "not needed").await.unwrap();
        assert_eq!(state(&db, ids[1]).await, JobState::Pending);
        // A waiting job: cancelled in place, nobody promoted, order kept.
        db.store.cancel(ids[2], "not needed").await.unwrap();
        assert_eq!(state(&db, ids[3]).await, JobState::Waiting);
        // A running head: a request. It stays running and its key does not move on
        // until the attempt ends; the renewal tells the worker; a failure cancels it.
        let running = claim_one(&db, &w).await;
        assert_eq!(running.id, ids[1]);
        assert_eq!(
            db.store.cancel(ids[1], "stop it").await.unwrap(),
            leasehold::CancelOutcome::Requested
        );
        // Its handler, not told yet, reaches its effect: the ledger lookup reads the
        // request from the row and the effect does not start.
        let stopped = h.run(&db.store, &running).await;
        assert_eq!(
            stopped.path,
            Path::Ledger,
            "no effect once a cancel is requested"
        );
        assert!(stopped.result.is_err(), "{:?}", stopped.result);
        assert_eq!(db.count_where("test_effects", "true").await, 0);
        assert_eq!(state(&db, ids[1]).await, JobState::Running);
        assert_eq!(
            state(&db, ids[3]).await,
            JobState::Waiting,
            "the key waits for the attempt"
        );
        assert!(
            db.store.claim(&claim_req(&w, 10)).await.unwrap().is_empty(),
            "nothing of the key is claimable while its head runs"
        );
        let renewal = db
            .store
            .renew(&w, &[running.attempt()], LEASE)
            .await
            .unwrap();
        assert_eq!(renewal.cancel_requested, vec![running.attempt()]);
        assert!(renewal.lost.is_empty());
        assert_eq!(
            db.store
                .fail(
                    &running.fence(),
                    &Failure {
                        reason: "stopped: cancelled".into(),
                        permanent: false,
                        retry_after: None,
                    },
                    &fixed_backoff(1)
                )
                .await
                .unwrap(),
            FailOutcome::Cancelled
        );
        let next = claim_one(&db, &w).await;
        assert_eq!(next.id, ids[3], "the cancelled waiting job is skipped");
        run(&db, &h, &next).await;
        // A held head.
        db.store.hold(ids[4]).await.unwrap();
        db.store.cancel(ids[4], "held, then dropped").await.unwrap();
        let after = db.store.enqueue(keyed("k", "acct", 6)).await.unwrap();
        assert_eq!(
            state(&db, after).await,
            JobState::Pending,
            "the key is free again"
        );
        let j = claim_one(&db, &w).await;
        run(&db, &h, &j).await;

        for (i, expected) in [
            JobState::Cancelled,
            JobState::Cancelled,
            JobState::Cancelled,
            JobState::Done,
            JobState::Cancelled,
        ]
        .into_iter()
        .enumerate()
        {
            assert_eq!(state(&db, ids[i]).await, expected, "job {i}");
        }
        assert_eq!(state(&db, after).await, JobState::Done);
        assert!(matches!(
            db.store.cancel(ids[0], "again").await,
            Err(Error::InvalidTransition { .. })
        ));
        assert!(matches!(
            db.store.cancel(after, "done").await,
            Err(Error::InvalidTransition { .. })
        ));
        assert_eq!(db.count_where("job_keys", "open_jobs = 0").await, 1);
        // The cancelled attempt never applied its effect (the cancel was recorded
        // before it reached it); the key's next job ran only after that attempt's
        // handler had ended.
        let key = handler::effect_key(&db, ids[1]).await;
        assert!(
            !db.effects_applied().await.contains_key(&key),
            "the cancelled attempt applied its effect"
        );
        assert_eq!(h.assert_key_order()["acct"], vec![ids[1], ids[3], after]);
        assert_eq!(db.assert_done_jobs_have_their_effects().await, 2);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_keeps_a_job_and_its_key_from_running_until_released() {
    bounded(async {
        let db = TestDb::new("admin_hold").await;
        let h = TestHandler::new(&db).await;
        let plain = db.store.enqueue(job("k")).await.unwrap();
        let head = db.store.enqueue(keyed("k", "acct", 1)).await.unwrap();
        let succ = db.store.enqueue(keyed("k", "acct", 2)).await.unwrap();
        let w = owner("w");
        db.store.hold(plain).await.unwrap();
        db.store.hold(head).await.unwrap();
        assert!(matches!(
            db.store.hold(succ).await,
            Err(Error::InvalidTransition {
                state: JobState::Waiting,
                ..
            })
        ));
        nothing_claimable(&db, &w).await;
        let blocked = db.store.blocked_keys(10).await.unwrap();
        assert_eq!(blocked.len(), 1);
        assert_eq!(
            (blocked[0].head_state.as_str(), blocked[0].waiting),
            ("held", 1)
        );

        db.store.release_hold(plain).await.unwrap();
        assert!(matches!(
            db.store.release_hold(plain).await,
            Err(Error::InvalidTransition { .. })
        ));
        let j = claim_one(&db, &w).await;
        assert_eq!(j.id, plain);
        assert!(matches!(
            db.store.hold(plain).await,
            Err(Error::InvalidTransition {
                state: JobState::Running,
                ..
            })
        ));
        run(&db, &h, &j).await;

        db.store.release_hold(head).await.unwrap();
        assert!(db.store.blocked_keys(10).await.unwrap().is_empty());
        let j = claim_one(&db, &w).await;
        assert_eq!(j.id, head);
        run(&db, &h, &j).await;
        let j = claim_one(&db, &w).await;
        assert_eq!(j.id, succ);
        run(&db, &h, &j).await;
        assert_eq!(db.count_where("jobs", "state = 'done'").await, 3);
        assert_eq!(h.order(), vec![plain, head, succ]);
        h.assert_key_order();
        assert_eq!(db.assert_done_jobs_have_their_effects().await, 3);
        let events: Vec<String> = db
            .store
            .history(head)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.event)
            .collect();
        assert_eq!(events, vec!["held", "unheld", "claimed", "completed"]);
        assert!(matches!(
            db.store.hold(JobId(i64::MAX)).await,
            Err(Error::JobNotFound(_))
        ));
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_dead_resumes_a_blocking_head_before_its_successors() {
    bounded(async {
        let db = TestDb::new("admin_retry_dead_block").await;
        let h = TestHandler::new(&db).await;
        let ids = db
            .store
            .enqueue_many(
                (1..=3)
                    .map(|n| keyed("k", "acct", n).with_max_attempts(2))
                    .collect(),
            )
            .await
            .unwrap();
        let w = owner("w");
        let j = claim_one(&db, &w).await;
        assert!(matches!(
            db.store
                .fail(
                    &j.fence(),
                    &Failure {
                        reason: "1".into(),
                        permanent: false,
                        retry_after: None,
                    },
                    &fixed_backoff(1)
                )
                .await
                .unwrap(),
            FailOutcome::Retrying { .. }
        ));
        let j = claim_one(&db, &w).await;
        assert_eq!(
            db.store
                .fail(
                    &j.fence(),
                    &Failure {
                        reason: "2".into(),
                        permanent: false,
                        retry_after: None,
                    },
                    &fixed_backoff(1)
                )
                .await
                .unwrap(),
            FailOutcome::Dead
        );
        assert!(matches!(
            db.store.retry_dead(ids[1]).await,
            Err(Error::InvalidTransition { .. })
        ));

        db.store.retry_dead(ids[0]).await.unwrap();
        let rec = db.store.job(ids[0]).await.unwrap();
        assert_eq!(
            (rec.state, rec.attempts, rec.key_seq),
            (JobState::Pending, 0, Some(1))
        );
        assert!(db.store.blocked_keys(10).await.unwrap().is_empty());
        for _ in 0..3 {
            let j = claim_one(&db, &w).await;
            run(&db, &h, &j).await;
        }
        assert_eq!(h.assert_key_order()["acct"], ids);
        let events: Vec<String> = db
            .store
            .history(ids[0])
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.event)
            .collect();
        assert_eq!(
            events,
            vec![
                "claimed",
                "failed",
                "claimed",
                "dead",
                "retried_by_operator",
                "claimed",
                "completed"
            ]
        );
        assert_eq!(db.count_where("jobs", "state = 'done'").await, 3);
        assert_eq!(db.assert_done_jobs_have_their_effects().await, 3);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_dead_of_a_continue_job_reenters_at_the_end_of_its_key() {
    bounded(async {
        let db = TestDb::new("admin_retry_dead_continue").await;
        let h = TestHandler::new(&db).await;
        let first = db
            .store
            .enqueue(keyed("k", "acct", 1).with_dead_key_policy(DeadKeyPolicy::Continue))
            .await
            .unwrap();
        let second = db.store.enqueue(keyed("k", "acct", 2)).await.unwrap();
        let third = db.store.enqueue(keyed("k", "acct", 3)).await.unwrap();
        let w = owner("w");
        let j = claim_one(&db, &w).await;
        db.store
            .fail(&j.fence(), &fatal(), &fixed_backoff(1))
            .await
            .unwrap();
        let running_second = claim_one(&db, &w).await;
        assert_eq!(running_second.id, second);

        // The key has moved on; the retried job goes to its end (behind third), even
        // though its id is the smallest.
        db.store.retry_dead(first).await.unwrap();
        let rec = db.store.job(first).await.unwrap();
        assert_eq!((rec.state, rec.key_seq), (JobState::Waiting, Some(4)));
        nothing_claimable(&db, &w).await;
        run(&db, &h, &running_second).await;
        for _ in 0..2 {
            let j = claim_one(&db, &w).await;
            run(&db, &h, &j).await;
        }
        assert_eq!(h.assert_key_order()["acct"], vec![second, third, first]);
        nothing_claimable(&db, &w).await;
        assert_eq!(db.count_where("jobs", "state = 'done'").await, 3);
        assert_eq!(db.count_where("job_keys", "open_jobs = 0").await, 1);
        assert_eq!(db.assert_done_jobs_have_their_effects().await, 3);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_lists_every_transition_with_its_generation_and_actor() {
    bounded(async {
        let db = TestDb::new("admin_history").await;
        let h = TestHandler::new(&db).await;
        let id = db.store.enqueue(job("k")).await.unwrap();
        let a = owner("a");
        let b = owner("b");
        let reaper = owner("reaper");
        let j = claim_one(&db, &a).await;
        db.store
            .fail(
                &j.fence(),
                &Failure {
                    reason: "flaky".into(),
                    permanent: false,
                    retry_after: None,
                },
                &fixed_backoff(1),
            )
            .await
            .unwrap();
        let j = claim_one(&db, &a).await;
        db.store
            .release_many(&a, &[j.attempt()], "shutting down")
            .await
            .unwrap();
        db.store.hold(id).await.unwrap();
        db.store.release_hold(id).await.unwrap();
        let j = db.store.claim(&claim_req(&a, 1)).await.unwrap().remove(0);
        db.store
            .reap(
                &reaper,
                &fixed_backoff(1),
                10,
                Some(secs_after(j.lease_until, 1)),
            )
            .await
            .unwrap();
        let j = claim_one(&db, &b).await;
        run(&db, &h, &j).await;

        let h = db.store.history(id).await.unwrap();
        let got: Vec<(&str, i64, Option<&str>)> = h
            .iter()
            .map(|e| (e.event.as_str(), e.generation.0, e.owner.as_deref()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("claimed", 1, Some(a.as_str())),
                ("failed", 1, Some(a.as_str())),
                ("claimed", 2, Some(a.as_str())),
                ("released", 2, Some(a.as_str())),
                ("held", 2, Some("operator")),
                ("unheld", 2, Some("operator")),
                ("claimed", 3, Some(a.as_str())),
                ("reaped", 3, Some(reaper.as_str())),
                ("claimed", 4, Some(b.as_str())),
                ("completed", 4, Some(b.as_str())),
            ]
        );
        assert_eq!(h[1].detail.as_deref(), Some("flaky"));
        assert_eq!(h[3].detail.as_deref(), Some("shutting down"));
        assert_eq!(state(&db, id).await, JobState::Done);
        // The one attempt that ran the handler, generation 4, is the one the ledger names.
        db.assert_effect_once(id, 4, 4).await;
        db.drop().await;
    })
    .await
}

#[tokio::test]
async fn a_refused_admin_action_leaves_no_row_locked() {
    bounded(async {
        // A refused action must not hold the job's (or its key's) row lock past its
        // return: a claim right after it would skip the job, an enqueue of the key wait.
        let db = TestDb::with_options("admin_refusal_locks", Default::default(), 3).await;
        let h = TestHandler::new(&db).await;
        let id = db.store.enqueue(keyed("k", "acct", 1)).await.unwrap();
        let mut probe = db.raw_conn("probe").await;
        let w = owner("w");
        for round in 0..20 {
            let refused = match round % 3 {
                0 => db.store.release_hold(id).await,
                1 => db.store.retry_dead(id).await,
                _ => db.store.release_hold(id).await,
            };
            assert!(matches!(
                refused,
                Err(Error::InvalidTransition {
                    state: JobState::Pending,
                    ..
                })
            ));
            let job_free = sqlx::query(&format!(
                "SELECT 1 FROM {} WHERE id = $1 FOR UPDATE NOWAIT",
                db.table("jobs")
            ))
            .bind(id.0)
            .execute(&mut probe)
            .await;
            assert!(
                job_free.is_ok(),
                "round {round}: the job row is still locked: {job_free:?}"
            );
            let key_free = sqlx::query(&format!(
                "SELECT 1 FROM {} WHERE job_key = 'acct' FOR UPDATE NOWAIT",
                db.table("job_keys")
            ))
            .execute(&mut probe)
            .await;
            assert!(
                key_free.is_ok(),
                "round {round}: the key row is still locked: {key_free:?}"
            );
        }
        let j = claim_one(&db, &w).await;
        run(&db, &h, &j).await;
        assert_eq!(state(&db, id).await, JobState::Done);
        assert!(matches!(
            db.store.cancel(id, "done").await,
            Err(Error::InvalidTransition { .. })
        ));
        let free = sqlx::query(&format!(
            "SELECT 1 FROM {} WHERE id = $1 FOR UPDATE NOWAIT",
            db.table("jobs")
        ))
        .bind(id.0)
        .execute(&mut probe)
        .await;
        assert!(free.is_ok(), "after a refused cancel: {free:?}");
        db.assert_effect_once(id, 1, 1).await;
        drop(probe);
        db.drop().await;
    })
    .await
}
