//! Attack on "Forgetting the switch fails at start, with one error": a `Store` that is
//! never migrated makes the pooler check before its first statement, then refuses every
//! call with `invalid config: store.transaction_pooler: …`, having written nothing.
//!
//! Each public entry point is called on a *fresh* store (so its own first statement is
//! the one that must be preceded by the check) over a pool through PgBouncer in
//! transaction mode, without the switch. The caller's-transaction variants get a
//! transaction begun on that same pool. The operator CLI is run through the pooler too.

mod common;
#[path = "common/pgbouncer.rs"]
mod pgbouncer;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use leasehold::store::{JobFilter, PruneOptions};
use leasehold::{Backoff, ClaimRequest, Failure, JobState, NewJob, Store, StoreOptions};
use pgbouncer::PgBouncer;
use sqlx::PgPool;

async fn through(bouncer: &PgBouncer, app: &str, size: u32) -> PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(
            bouncer
                .options()
                .database(&test_db_name())
                .application_name(app),
        )
        .await
        .expect("connect through pgbouncer")
}

/// `Ok` when `r` is the pooler refusal, else what it was.
fn pooler_refusal<T: std::fmt::Debug>(r: leasehold::Result<T>) -> Result<(), String> {
    match r {
        Err(leasehold::Error::Config { field, reason })
            if field == "store.transaction_pooler" && reason.contains("Nothing was written") =>
        {
            Ok(())
        }
        Err(leasehold::Error::Config { field, reason }) => {
            Err(format!("Config {{ field: {field}, reason: {reason} }}"))
        }
        Err(e) => Err(format!(
            "Err({})",
            e.to_string().chars().take(160).collect::<String>()
        )),
        Ok(v) => Err(format!(
            "Ok({})",
            format!("{v:?}").chars().take(160).collect::<String>()
        )),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_entry_point_of_a_fresh_store_behind_an_untold_transaction_pooler_is_refused() {
    bounded(async {
        let db = TestDb::new("a2_pooler_entries").await;
        // Jobs in every state the calls need, made directly.
        let w = owner("w");
        let pending = db.store.enqueue(keyed("k", "acct", 1)).await.unwrap();
        let _waiting = db.store.enqueue(keyed("k", "acct", 2)).await.unwrap();
        let held = db.store.enqueue(job("k")).await.unwrap();
        db.store.hold(held).await.unwrap();
        let run = db
            .store
            .enqueue(NewJob::from_json("k", serde_json::json!({})).with_queue("busy"))
            .await
            .unwrap();
        let mut claimed = db
            .store
            .claim(&ClaimRequest::new(w.clone(), vec!["busy".into()], 1, LEASE))
            .await
            .unwrap();
        assert_eq!(claimed.len(), 1);
        let running = claimed.pop().unwrap();
        assert_eq!(running.id, run);
        let dead = db
            .store
            .enqueue(
                NewJob::from_json("k", serde_json::json!({}))
                    .with_queue("dl")
                    .with_max_attempts(1),
            )
            .await
            .unwrap();
        let d = db
            .store
            .claim(&ClaimRequest::new(w.clone(), vec!["dl".into()], 1, LEASE))
            .await
            .unwrap();
        db.store
            .fail(
                &d[0].fence(),
                &Failure {
                    reason: "x".into(),
                    permanent: true,
                    ..Failure::default()
                },
                &Backoff::default(),
            )
            .await
            .unwrap();
        assert_eq!(db.state_of(dead).await, "dead");
        let before_jobs = db.job_count().await;
        let before_events = db.count_where("job_events", "true").await;

        let bouncer = PgBouncer::start(2);
        let pool = through(&bouncer, &db.app_name_of("untold"), 3).await;
        let fresh = || Store::new(pool.clone(), &db.schema, StoreOptions::default()).unwrap();
        let fence = running.fence();
        let req = ClaimRequest::new(
            w.clone(),
            vec![leasehold::config::DEFAULT_QUEUE.into()],
            5,
            LEASE,
        );
        let mut results: Vec<(&str, Result<(), String>)> = Vec::new();

        macro_rules! call {
            ($name:expr, $e:expr) => {{
                let t = std::time::Instant::now();
                let r = within(30, $name, $e).await;
                eprintln!("{} took {:?}", $name, t.elapsed());
                results.push(($name, pooler_refusal(r)));
            }};
        }
        call!("enqueue", fresh().enqueue(job("web")));
        call!("enqueue_outcome", fresh().enqueue_outcome(job("web")));
        call!(
            "enqueue_many",
            fresh().enqueue_many(vec![job("web"), keyed("web", "k2", 1)])
        );
        call!(
            "enqueue_many_outcomes",
            fresh().enqueue_many_outcomes(vec![job("web")])
        );
        call!(
            "enqueue_copy",
            fresh().enqueue_copy(vec![job("web"), job("web")])
        );
        call!(
            "enqueue_copy(unique)",
            fresh().enqueue_copy(vec![
                job("web").unique("u1", leasehold::UniqueScope::WhileOpen)
            ])
        );
        call!("claim", fresh().claim(&req));
        call!(
            "claim_key",
            fresh().claim_key(&w, "default", "acct", None, LEASE, None)
        );
        call!("explain_claim", fresh().explain_claim(&req));
        call!("complete", fresh().complete(&fence, None));
        call!(
            "complete_many",
            fresh().complete_many(&w, &[(fence.attempt(), None)])
        );
        call!("completion_status", fresh().completion_status(&fence));
        call!(
            "fail",
            fresh().fail(&fence, &Failure::default(), &Backoff::default())
        );
        call!("snooze", fresh().snooze(&fence, Duration::from_secs(60), 5));
        call!(
            "release_many",
            fresh().release_many(&w, &[fence.attempt()], "r")
        );
        call!("renew", fresh().renew(&w, &[fence.attempt()], LEASE));
        call!(
            "renew_recording",
            fresh().renew_recording(&w, &[(fence.attempt(), true)], LEASE)
        );
        call!(
            "record_progress",
            fresh().record_progress(&fence, &serde_json::json!({"p": 1}))
        );
        call!(
            "record_effect",
            fresh().record_effect(
                &fence,
                &db.effect_key(run, "s").await,
                "fp",
                &serde_json::json!(1),
                Duration::from_secs(60)
            )
        );
        call!("effect", fresh().effect("x/1/s"));
        call!("job_effects", fresh().job_effects(run));
        call!(
            "reap",
            fresh().reap(&owner("r"), &Backoff::default(), 10, Some(far_future()))
        );
        call!("job", fresh().job(pending));
        call!("history", fresh().history(pending));
        call!("lease_expiries", fresh().lease_expiries(pending));
        call!("key_position", fresh().key_position(pending));
        call!("list_jobs", fresh().list_jobs(&JobFilter::default()));
        call!(
            "list_jobs_page",
            fresh().list_jobs_page(&JobFilter::default(), Duration::from_secs(5))
        );
        call!(
            "explain_list_jobs",
            fresh().explain_list_jobs(&JobFilter::default())
        );
        call!(
            "job_ids",
            fresh().job_ids(&JobFilter::default(), &[JobState::Pending], 10)
        );
        call!("queue_stats", fresh().queue_stats());
        call!("explain_queue_stats", fresh().explain_queue_stats());
        call!("queue_gauges", fresh().queue_gauges());
        call!("job_counts", fresh().job_counts());
        call!("blocked_keys", fresh().blocked_keys(10));
        call!("throughput", fresh().throughput(5));
        call!("live_schedulers", fresh().live_schedulers());
        call!("hold", fresh().hold(pending));
        call!("release_hold", fresh().release_hold(held));
        call!("cancel", fresh().cancel(pending, "no"));
        call!("cancel(running)", fresh().cancel(run, "no"));
        call!("retry_dead", fresh().retry_dead(dead));
        call!(
            "act",
            fresh().act(pending, &leasehold::store::Action::Hold, "op")
        );
        call!("pause_queue", fresh().pause_queue("default", Some("op")));
        call!("resume_queue", fresh().resume_queue("default"));
        call!("paused_queues", fresh().paused_queues());
        call!("prune", common::prune_now(&fresh(), 100));
        call!(
            "prune_with",
            fresh().prune_with(&PruneOptions::new(Duration::from_secs(0)))
        );
        call!("migration_script", fresh().migration_script());

        // The caller's transaction, begun on the same (pooled) pool.
        macro_rules! in_tx {
            ($name:expr, |$s:ident, $tx:ident| $e:expr) => {{
                let $s = fresh();
                let mut $tx = pool.begin().await.unwrap();
                let t = std::time::Instant::now();
                let r = within(30, $name, $e).await;
                eprintln!("{} took {:?}", $name, t.elapsed());
                results.push(($name, pooler_refusal(r)));
                let _ = $tx.rollback().await;
            }};
        }
        in_tx!("enqueue_in", |s, tx| s.enqueue_in(&mut tx, job("web")));
        in_tx!("enqueue_many_in", |s, tx| s.enqueue_many_in(
            &mut tx,
            vec![job("web"), keyed("web", "k3", 1)]
        ));
        in_tx!("enqueue_outcomes_in", |s, tx| s
            .enqueue_outcomes_in(&mut tx, vec![job("web")]));
        in_tx!("enqueue_copy_in", |s, tx| s
            .enqueue_copy_in(&mut tx, vec![job("web")]));
        in_tx!("complete_in", |s, tx| s.complete_in(&mut tx, &fence, None));

        pool.close().await;
        drop(bouncer);

        let after_jobs = db.job_count().await;
        let after_events = db.count_where("job_events", "true").await;
        let paused = db.count_where("paused_queues", "true").await;
        let states = (
            db.state_of(pending).await,
            db.state_of(held).await,
            db.state_of(run).await,
            db.state_of(dead).await,
        );
        let wrong: Vec<String> = results
            .iter()
            .filter_map(|(n, r)| r.as_ref().err().map(|e| format!("{n}: {e}")))
            .collect();
        assert!(
            wrong.is_empty(),
            "{} of {} entry points were not refused with the pooler error: {wrong:#?}",
            wrong.len(),
            results.len()
        );
        assert_eq!(
            (after_jobs, after_events, paused),
            (before_jobs, before_events, 0),
            "nothing written"
        );
        assert_eq!(
            states,
            (
                "pending".into(),
                "held".into(),
                "running".into(),
                "dead".into()
            )
        );
        db.drop().await;
    })
    .await
}

/// Run the CLI binary with PGHOST/PGPORT at `port`.
fn cli(schema: &str, port: u16, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args(["--schema", schema])
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("LEASEHOLD_TRANSACTION_POOLER")
        .stdin(Stdio::null())
        .env("PGDATABASE", test_db_name())
        .env("PGHOST", "127.0.0.1")
        .env("PGPORT", port.to_string())
        .env(
            "PGUSER",
            std::env::var("PGUSER").unwrap_or_else(|_| "root".into()),
        )
        .output()
        .expect("run the leasehold binary")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_through_an_untold_transaction_pooler_is_refused_with_the_pooler_error() {
    bounded(async {
        let db = TestDb::new("a2_pooler_cli").await;
        let id = db.store.enqueue(job("k")).await.unwrap();
        let bouncer = PgBouncer::start(1);
        let port = bouncer.port;
        let schema = db.schema.clone();
        let id_text = id.0.to_string();
        let outs = tokio::task::spawn_blocking(move || {
            let mut outs = Vec::new();
            for args in [
                vec!["status"],
                vec!["jobs"],
                vec!["job", id_text.as_str()],
                vec!["hold", id_text.as_str()],
                vec!["pause", "default"],
                vec!["migrate"],
                vec!["status"],
            ] {
                let o = cli(&schema, port, &args);
                outs.push((
                    args.join(" "),
                    o.status.code(),
                    String::from_utf8_lossy(&o.stderr).to_string(),
                    String::from_utf8_lossy(&o.stdout)
                        .chars()
                        .take(200)
                        .collect::<String>(),
                ));
            }
            outs
        })
        .await
        .unwrap();
        drop(bouncer);
        let wrong: Vec<_> = outs
            .iter()
            .filter(|(_, code, err, _)| {
                !(*code == Some(3) && err.contains("store.transaction_pooler"))
            })
            .collect();
        let state = db.state_of(id).await;
        let paused = db.count_where("paused_queues", "true").await;
        assert!(
            wrong.is_empty(),
            "CLI commands through the untold pooler not refused with the pooler error: {wrong:#?}"
        );
        assert_eq!((state.as_str(), paused), ("pending", 0), "nothing changed");
        db.drop().await;
    })
    .await
}
