//! Retention (`Store::prune`) deletes only what nobody can need again: dead jobs stay
//! (the dead-letter queue), a job an operator is retrying is never deleted under him,
//! a key row goes only when no job of its key is left and `key_seq` never restarts, and
//! the effect ledger keeps every outcome a job that may run again must find.

mod common;

use std::time::Duration;

use common::*;
use leasehold::store::RecordOutcome;
use leasehold::testkit::fencing_token;
use leasehold::{
    ClaimedJob, CompleteOutcome, DeadKeyPolicy, Error, FailOutcome, Failure, JobId, JobState,
    OwnerId,
};

const HOUR: Duration = Duration::from_secs(3600);

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

async fn complete(db: &TestDb, j: &ClaimedJob) {
    assert_eq!(
        db.store.complete(&j.fence(), None).await.unwrap(),
        CompleteOutcome::Completed
    );
}

async fn state(db: &TestDb, id: JobId) -> JobState {
    db.store.job(id).await.unwrap().state
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_keeps_a_dead_head_whose_key_then_runs_on_in_order_after_retry() {
    bounded(async {
        let db = TestDb::new("ret_dead_head").await;
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
        // Something prune may delete, so the pass below is not a no-op.
        db.store.enqueue(job("k")).await.unwrap();
        let plain = claim_one(&db, &w).await;
        complete(&db, &plain).await;

        let report = common::prune_now(&db.store, 100).await.unwrap();
        let dead = db
            .store
            .job(ids[0])
            .await
            .expect("retention must keep a dead job (the dead-letter queue)");
        assert_eq!((report.jobs, report.keys), (1, 0), "{report:?}");
        assert!(matches!(
            db.store.job(plain.id).await,
            Err(Error::JobNotFound(_))
        ));
        assert_eq!(
            (dead.state, dead.last_error.as_deref()),
            (JobState::Dead, Some("boom"))
        );
        let events: Vec<String> = db
            .store
            .history(ids[0])
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.event)
            .collect();
        assert_eq!(events, vec!["claimed", "dead"], "its history is kept too");
        let blocked = db.store.blocked_keys(10).await.unwrap();
        assert_eq!(
            blocked
                .iter()
                .map(|b| (b.key.as_str(), b.head_state.as_str(), b.waiting))
                .collect::<Vec<_>>(),
            vec![("acct", "dead", 2)]
        );

        db.store.retry_dead(ids[0]).await.unwrap();
        let ran = run_all(&db, &w).await;
        assert_eq!(ran.iter().map(|j| j.id).collect::<Vec<_>>(), ids);
        assert_eq!(
            ran.iter().map(|j| j.key_seq).collect::<Vec<_>>(),
            vec![Some(1), Some(2), Some(3)]
        );
        for id in &ids {
            assert_eq!(state(&db, *id).await, JobState::Done);
        }
        assert!(db.store.blocked_keys(10).await.unwrap().is_empty());
        db.drop().await;
    })
    .await
}

/// Whether a backend tagged `suffix` is waiting for a lock right now.
async fn lock_waiting(db: &TestDb, suffix: &str) -> bool {
    sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'",
    )
    .bind(db.app_name_of(suffix))
    .fetch_one(&db.pool)
    .await
    .unwrap()
        > 0
}

/// Make every operator retry pause, inside its transaction and right after it made the
/// job pending, until the test releases the advisory lock `gate`: a BEFORE INSERT
/// trigger on the history row `retry_dead` writes in the same statement.
async fn pause_retries_at(db: &TestDb, gate: i64) {
    let s = format!("\"{}\"", db.schema);
    for ddl in [
        format!(
            "CREATE FUNCTION {s}.pause_retry() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NEW.event = 'retried_by_operator' THEN
                     PERFORM pg_advisory_xact_lock({gate});
                 END IF;
                 RETURN NEW;
             END $$"
        ),
        format!(
            "CREATE TRIGGER pause_retry BEFORE INSERT ON {s}.job_events
             FOR EACH ROW EXECUTE FUNCTION {s}.pause_retry()"
        ),
    ] {
        sqlx::query(&ddl).execute(&db.pool).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_never_deletes_a_dead_job_that_an_operator_is_retrying_right_now() {
    bounded(async {
        let db = TestDb::new("ret_prune_vs_retry").await;
        let id = db.store.enqueue(job("k")).await.unwrap();
        let w = owner("w");
        let j = claim_one(&db, &w).await;
        db.store
            .fail(&j.fence(), &fatal(), &fixed_backoff(1))
            .await
            .unwrap();
        assert_eq!(state(&db, id).await, JobState::Dead);

        // The operator's retry runs up to the point where the job row is pending in its
        // open transaction (and locked), and stops there.
        let gate: i64 = rand::random();
        pause_retries_at(&db, gate).await;
        let mut gate_conn = db.raw_conn("gate").await;
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(gate)
            .execute(&mut gate_conn)
            .await
            .unwrap();
        let operator = db.other_store("operator").await;
        let retry = tokio::spawn(async move { operator.retry_dead(id).await });
        db.wait_until_lock_waiting("operator").await;

        // Prune with a snapshot in which the job is dead and long finished. Let it run
        // until it is done or waits for the job row; then the retry commits. Under READ
        // COMMITTED a DELETE that waited re-reads only its target row, not the subquery
        // that chose it, so whatever prune deletes it must re-check (or lock) on the row.
        let pruner = db.other_store("pruner").await;
        let prune = tokio::spawn(async move { common::prune_now(&pruner, 100).await });
        within(10, "prune to finish or wait for the job row", async {
            while !prune.is_finished() && !lock_waiting(&db, "pruner").await {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(gate)
            .execute(&mut gate_conn)
            .await
            .unwrap();
        within(10, "the retry", retry).await.unwrap().unwrap();
        let report = within(10, "prune", prune).await.unwrap().unwrap();
        let rec = db
            .store
            .job(id)
            .await
            .expect("prune deleted a job an operator had just retried");
        assert_eq!(report.jobs, 0, "{report:?}");
        assert_eq!((rec.state, rec.attempts), (JobState::Pending, 0));
        let ran = run_all(&db, &w).await;
        assert_eq!(ran.iter().map(|j| j.id).collect::<Vec<_>>(), vec![id]);
        let events: Vec<String> = db
            .store
            .history(id)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.event)
            .collect();
        assert_eq!(
            events,
            vec![
                "claimed",
                "dead",
                "retried_by_operator",
                "claimed",
                "completed"
            ]
        );
        drop(gate_conn);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_seq_and_fencing_token_keep_growing_after_retention_deleted_the_key_row() {
    bounded(async {
        let db = TestDb::new("ret_key_floor").await;
        let w = owner("w");
        for n in 1..=3 {
            db.store.enqueue(keyed("k", "acct", n)).await.unwrap();
        }
        let old = run_all(&db, &w).await;
        assert_eq!(
            old.iter().map(|j| j.key_seq).collect::<Vec<_>>(),
            vec![Some(1), Some(2), Some(3)]
        );
        let report = common::prune_now(&db.store, 100).await.unwrap();
        assert_eq!((report.jobs, report.keys), (3, 1), "{report:?}");
        assert_eq!(
            db.count_where("job_keys", "true").await,
            0,
            "the idle key row is gone"
        );

        // The key comes back: a new row, continuing the old sequence.
        db.store.enqueue(keyed("k", "acct", 4)).await.unwrap();
        db.store.enqueue(keyed("k", "acct", 5)).await.unwrap();
        let new = run_all(&db, &w).await;
        assert_eq!(
            new.iter().map(|j| j.key_seq).collect::<Vec<_>>(),
            vec![Some(4), Some(5)],
            "key_seq restarted after the key row was pruned"
        );
        let newest_old = old.iter().map(fencing_token).max().unwrap();
        for j in &new {
            assert!(
                fencing_token(j) > newest_old,
                "a later job of the key has a smaller fencing token: {:#x} <= {newest_old:#x}",
                fencing_token(j)
            );
        }
        db.drop().await;
    })
    .await
}

async fn key_rows(db: &TestDb, key: &str) -> i64 {
    db.count_where("job_keys", &format!("job_key = '{key}'"))
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_never_deletes_a_key_row_while_a_job_of_the_key_exists() {
    bounded(async {
        let db = TestDb::new("ret_key_rows").await;
        let w = owner("w");
        // An idle key whose jobs are pruned: its row goes (prune does delete key rows).
        db.store.enqueue(keyed("k", "gone", 1)).await.unwrap();
        run_all(&db, &w).await;
        let report = common::prune_now(&db.store, 100).await.unwrap();
        assert_eq!((report.jobs, report.keys), (1, 1), "{report:?}");
        assert_eq!(key_rows(&db, "gone").await, 0);

        // Done, not yet old enough to prune.
        db.store.enqueue(keyed("k", "done", 1)).await.unwrap();
        run_all(&db, &w).await;
        // Dead under the Continue policy: it left its key (no open job counted).
        let dead = db
            .store
            .enqueue(keyed("k", "dead", 1).with_dead_key_policy(DeadKeyPolicy::Continue))
            .await
            .unwrap();
        let j = claim_one(&db, &w).await;
        assert_eq!(j.id, dead);
        db.store
            .fail(&j.fence(), &fatal(), &fixed_backoff(1))
            .await
            .unwrap();
        // A running head with a waiting successor.
        db.store.enqueue(keyed("k", "busy", 1)).await.unwrap();
        let waiting = db.store.enqueue(keyed("k", "busy", 2)).await.unwrap();
        let running = claim_one(&db, &w).await;
        assert_eq!(state(&db, waiting).await, JobState::Waiting);

        let report = db.store.prune(HOUR, 100).await.unwrap();
        for key in ["done", "dead", "busy"] {
            assert_eq!(
                key_rows(&db, key).await,
                1,
                "the key row of {key:?} was pruned while a job of the key exists"
            );
        }
        assert_eq!((report.jobs, report.keys), (0, 0), "{report:?}");

        // The keys go on where they left off.
        complete(&db, &running).await;
        let next = claim_one(&db, &w).await;
        assert_eq!((next.id, next.key_seq), (waiting, Some(2)));
        complete(&db, &next).await;
        db.store.enqueue(keyed("k", "done", 2)).await.unwrap();
        let again = claim_one(&db, &w).await;
        assert_eq!(again.key_seq, Some(2));
        complete(&db, &again).await;
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_dead_of_a_continue_job_works_after_prune_passes() {
    bounded(async {
        let db = TestDb::new("ret_continue_retry").await;
        let w = owner("w");
        let first = db
            .store
            .enqueue(keyed("k", "acct", 1).with_dead_key_policy(DeadKeyPolicy::Continue))
            .await
            .unwrap();
        let second = db.store.enqueue(keyed("k", "acct", 2)).await.unwrap();
        let j = claim_one(&db, &w).await;
        assert_eq!(j.id, first);
        assert_eq!(
            db.store
                .fail(&j.fence(), &fatal(), &fixed_backoff(1))
                .await
                .unwrap(),
            FailOutcome::Dead
        );
        let ran = run_all(&db, &w).await;
        assert_eq!(ran.iter().map(|j| j.id).collect::<Vec<_>>(), vec![second]);

        // The reaper prunes every pass; the dead job must stay retryable through them.
        let report = common::prune_now(&db.store, 100).await.unwrap();
        assert_eq!(report.jobs, 1, "{report:?}");
        common::prune_now(&db.store, 100).await.unwrap();

        db.store
            .retry_dead(first)
            .await
            .expect("retry_dead of a Continue job after prune");
        let rec = db.store.job(first).await.unwrap();
        assert_eq!(
            (rec.state, rec.key_seq),
            (JobState::Pending, Some(3)),
            "it re-enters at the end of its key"
        );
        let ran = run_all(&db, &w).await;
        assert_eq!(ran.iter().map(|j| j.id).collect::<Vec<_>>(), vec![first]);
        assert_eq!(state(&db, first).await, JobState::Done);
        db.drop().await;
    })
    .await
}

async fn record(
    db: &TestDb,
    j: &ClaimedJob,
    key: &str,
    outcome: serde_json::Value,
) -> RecordOutcome {
    db.store
        .record_effect(&j.fence(), key, "fp", &outcome, Duration::ZERO)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effect_ledger_keeps_outcomes_of_jobs_that_may_run_again_past_keep_until() {
    bounded(async {
        let db = TestDb::new("ret_effects").await;
        let w = owner("w");
        // Each effect is recorded with keep = 0: its keep_until has passed at once.
        let dead = db.store.enqueue(job("k")).await.unwrap();
        let j = claim_one(&db, &w).await;
        assert_eq!(
            record(&db, &j, "dead/charge", serde_json::json!("tx-1")).await,
            RecordOutcome::Recorded
        );
        db.store
            .fail(&j.fence(), &fatal(), &fixed_backoff(1))
            .await
            .unwrap();
        let done = db.store.enqueue(job("k")).await.unwrap();
        let j = claim_one(&db, &w).await;
        assert_eq!(j.id, done);
        record(&db, &j, "done/charge", serde_json::json!("tx-2")).await;
        complete(&db, &j).await;
        let retrying = db.store.enqueue(job("k")).await.unwrap();
        let j = claim_one(&db, &w).await;
        assert_eq!(j.id, retrying);
        record(&db, &j, "retrying/charge", serde_json::json!("tx-3")).await;
        let failed = db
            .store
            .fail(
                &j.fence(),
                &Failure {
                    reason: "flaky".into(),
                    permanent: false,
                    retry_after: None,
                },
                &fixed_backoff(3600),
            )
            .await
            .unwrap();
        assert!(matches!(failed, FailOutcome::Retrying { .. }));

        let report = db.store.prune(HOUR, 100).await.unwrap();
        for key in ["dead/charge", "retrying/charge"] {
            assert!(
                db.store.effect(key).await.unwrap().is_some(),
                "{key} was pruned although its job may run again"
            );
        }
        assert!(db.store.effect("done/charge").await.unwrap().is_none());
        assert_eq!((report.jobs, report.effects), (0, 1), "{report:?}");

        // The retried attempts find what the earlier ones did, and do not act again.
        db.store.retry_dead(dead).await.unwrap();
        let j = db
            .store
            .claim(&claim_req(&w, 10))
            .await
            .unwrap()
            .pop()
            .expect("the retried job");
        assert_eq!(j.id, dead);
        match record(&db, &j, "dead/charge", serde_json::json!("tx-again")).await {
            RecordOutcome::AlreadyRecorded(rec) => {
                assert_eq!((rec.job, rec.generation.0), (dead, 1));
                assert_eq!(rec.outcome, serde_json::json!("tx-1"));
            }
            other => panic!("the retry must find the first outcome, got {other:?}"),
        }
        complete(&db, &j).await;
        let j = claim_one(&db, &w).await;
        assert_eq!(j.id, retrying);
        assert!(matches!(
            record(&db, &j, "retrying/charge", serde_json::json!("again")).await,
            RecordOutcome::AlreadyRecorded(_)
        ));
        complete(&db, &j).await;

        // Once their jobs are done, the outcomes go too.
        let report = db.store.prune(HOUR, 100).await.unwrap();
        assert_eq!(report.effects, 2, "{report:?}");
        assert_eq!(db.count_where("effects", "true").await, 0);
        db.drop().await;
    })
    .await
}

/// A worker whose completion reply was lost reads its row back to learn whether the
/// write committed: retention keeps every finished job at least the floor, whatever
/// `keep` says, so that read finds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_finished_within_the_floor_is_kept_by_a_pass_of_zero_retention_and_its_read_back_finds_it(
) {
    bounded(async {
        let db = TestDb::new("ret_floor").await;
        let recent = db.store.enqueue(job("k")).await.unwrap();
        let w = owner("w");
        let j = claim_one(&db, &w).await;
        assert_eq!(j.id, recent);
        complete(&db, &j).await;
        let older = db.store.enqueue(job("k")).await.unwrap();
        let o = claim_one(&db, &w).await;
        complete(&db, &o).await;
        sqlx::query(&format!(
            "UPDATE {} SET finished_at = now() - interval '6 minutes' WHERE id = $1",
            db.table("jobs")
        ))
        .bind(older.0)
        .execute(&db.owner)
        .await
        .unwrap();

        let report = db.store.prune(Duration::ZERO, 100).await.unwrap();
        assert_eq!(
            report.jobs, 1,
            "only the job past the floor goes: {report:?}"
        );
        assert!(matches!(
            db.store.job(older).await,
            Err(Error::JobNotFound(_))
        ));
        assert_eq!(state(&db, recent).await, JobState::Done);
        // The lost reply's read-back: this attempt's completion, found.
        assert!(matches!(
            db.store.completion_status(&j.fence()).await.unwrap(),
            CompleteOutcome::AlreadyCompleted { .. }
        ));
        db.drop().await;
    })
    .await
}
