//! The store behind a real PgBouncer in transaction mode (`StoreOptions::
//! transaction_pooler`): migrations, enqueue (one, many, COPY), concurrent claims,
//! fencing of a stale worker, the effect ledger and the key order all go through a
//! pooler whose few server connections every client shares. Without the switch, sqlx's
//! cached prepared statements collide on the first shared server connection.

mod common;
#[path = "common/pgbouncer.rs"]
mod pgbouncer;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use leasehold::store::RecordOutcome;
use leasehold::{CompleteOutcome, JobId, Store, StoreOptions};
use pgbouncer::PgBouncer;

/// A pool of `size` client connections to the test database through `bouncer`.
async fn through(bouncer: &PgBouncer, app_name: &str, size: u32) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(
            bouncer
                .options()
                .database(&test_db_name())
                .application_name(app_name),
        )
        .await
        .expect("connect through pgbouncer")
}

fn pooled() -> StoreOptions {
    StoreOptions {
        transaction_pooler: true,
        ..StoreOptions::default()
    }
}

/// A schema created and migrated through `bouncer`; the returned `TestDb` reads and
/// cleans up directly.
async fn pooled_db(test: &str, bouncer: &PgBouncer, clients: u32) -> (TestDb, Store) {
    let db = TestDb::unmigrated(test, pooled(), 2).await;
    let pool = through(bouncer, &db.app_name_of("pooled"), clients).await;
    let store = Store::new(pool, &db.schema, pooled()).unwrap();
    store.migrate().await.unwrap();
    // Twice: the second finds nothing to do (the read-only path).
    store.migrate().await.unwrap();
    (db, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_switch_a_store_that_never_migrates_refuses_every_call_and_writes_nothing() {
    bounded(async {
        // One server connection: without the check, the second client's cached
        // `sqlx_s_1` would meet the first one's on it ("already exists", or a name
        // bound to the other client's statement).
        let bouncer = PgBouncer::start(1);
        let db = TestDb::new("pooler_collide").await;
        let direct = StoreOptions::default();
        let a = Store::new(
            through(&bouncer, "lh-collide-a", 1).await,
            &db.schema,
            direct.clone(),
        )
        .unwrap();
        let b = Store::new(
            through(&bouncer, "lh-collide-b", 1).await,
            &db.schema,
            direct,
        )
        .unwrap();
        for store in [&a, &b, &a] {
            match store.enqueue(job("k")).await {
                Err(leasehold::Error::Config { field, reason }) => {
                    assert_eq!(field, "store.transaction_pooler");
                    assert!(reason.contains("Nothing was written"), "{reason}");
                }
                other => panic!("expected the pooler refusal, got {other:?}"),
            }
        }
        assert!(matches!(
            a.job(leasehold::JobId(1)).await,
            Err(leasehold::Error::Config {
                field: "store.transaction_pooler",
                ..
            })
        ));
        assert_eq!(db.job_count().await, 0);

        // The same two clients with the switch on.
        let a = Store::new(a.pool().clone(), &db.schema, pooled()).unwrap();
        let b = Store::new(b.pool().clone(), &db.schema, pooled()).unwrap();
        for _ in 0..20 {
            a.enqueue(job("k")).await.unwrap();
            b.enqueue(job("k")).await.unwrap();
        }
        assert_eq!(db.job_count().await, 40);
        drop(bouncer);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_through_the_pooler_take_each_job_once() {
    bounded(async {
        let bouncer = PgBouncer::start(2);
        let (db, store) = pooled_db("pooler_claims", &bouncer, 8).await;
        // One at a time, in a batch, and through COPY.
        for _ in 0..50 {
            store.enqueue(job("k")).await.unwrap();
        }
        store
            .enqueue_many((0..100).map(|_| job("k")).collect())
            .await
            .unwrap();
        store
            .enqueue_copy((0..150).map(|_| job("k")).collect())
            .await
            .unwrap();
        assert_eq!(db.job_count().await, 300);

        let mut tasks = Vec::new();
        for w in 0..6 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                let me = owner(&format!("w{w}"));
                let mut mine = Vec::new();
                loop {
                    let got = store.claim(&claim_req(&me, 7)).await.unwrap();
                    if got.is_empty() {
                        return mine;
                    }
                    for j in got {
                        let done = store.complete(&j.fence(), None).await.unwrap();
                        assert_eq!(done, CompleteOutcome::Completed);
                        mine.push(j.id);
                    }
                }
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        let distinct: BTreeSet<JobId> = all.iter().copied().collect();
        assert_eq!((all.len(), distinct.len()), (300, 300));
        assert_eq!(db.count_where("jobs", "state = 'done'").await, 300);
        drop(bouncer);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_worker_is_fenced_and_the_ledger_keeps_one_effect_through_the_pooler() {
    bounded(async {
        let bouncer = PgBouncer::start(2);
        let (db, store) = pooled_db("pooler_fencing", &bouncer, 4).await;
        let id = store.enqueue(job("k")).await.unwrap();
        let (a, b) = (owner("a"), owner("b"));
        let a_job = store.claim(&claim_req(&a, 1)).await.unwrap().remove(0);
        let keep = Duration::from_secs(3600);
        let outcome = serde_json::json!({ "paid": 1 });
        assert_eq!(
            store
                .record_effect(&a_job.fence(), "pay/1", "f", &outcome, keep)
                .await
                .unwrap(),
            RecordOutcome::Recorded
        );

        // A's lease passes (test clock); the reaper puts the job back and B claims it.
        let at = secs_after(a_job.lease_until, 1);
        let reaped = store
            .reap(&owner("reaper"), &fixed_backoff(1), 10, Some(at))
            .await
            .unwrap();
        assert_eq!(reaped.retried, vec![id]);
        let b_job = store
            .claim(&claim_at(&b, 1, secs_after(at, 2)))
            .await
            .unwrap()
            .remove(0);
        assert_eq!(b_job.generation.0, a_job.generation.0 + 1);

        // A is refused everywhere; B finds A's recorded effect instead of paying again.
        assert_eq!(
            store.complete(&a_job.fence(), None).await.unwrap(),
            CompleteOutcome::Stale
        );
        assert_eq!(
            store
                .record_effect(&a_job.fence(), "pay/2", "f", &outcome, keep)
                .await
                .unwrap(),
            RecordOutcome::Stale
        );
        match store
            .record_effect(&b_job.fence(), "pay/1", "f", &outcome, keep)
            .await
            .unwrap()
        {
            RecordOutcome::AlreadyRecorded(r) => assert_eq!(r.outcome, outcome),
            other => panic!("expected the recorded effect, got {other:?}"),
        }
        assert_eq!(
            store.complete(&b_job.fence(), None).await.unwrap(),
            CompleteOutcome::Completed
        );
        assert_eq!(db.state_of(id).await, "done");
        assert_eq!(db.count_where("effects", "true").await, 1);
        drop(bouncer);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_runs_in_enqueue_order_through_the_pooler() {
    bounded(async {
        let bouncer = PgBouncer::start(2);
        let (db, store) = pooled_db("pooler_key_order", &bouncer, 4).await;
        let mut ids = Vec::new();
        for n in 0..10 {
            ids.push(store.enqueue(keyed("k", "acct-1", n)).await.unwrap());
        }
        let me = owner("w");
        let mut order = Vec::new();
        while order.len() < ids.len() {
            // Only the head is claimable, however many are asked for.
            let got = store.claim(&claim_req(&me, 10)).await.unwrap();
            assert_eq!(got.len(), 1, "{got:?}");
            store.complete(&got[0].fence(), None).await.unwrap();
            order.push(got[0].id);
        }
        assert_eq!(order, ids);
        drop(bouncer);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_calls_work_through_the_pooler() {
    bounded(async {
        let bouncer = PgBouncer::start(2);
        let (db, store) = pooled_db("pooler_operator", &bouncer, 4).await;
        let a = store.enqueue(job("k")).await.unwrap();
        let b = store.enqueue(job("k")).await.unwrap();

        // Pause: nothing is claimed; resume: it is.
        assert!(store.pause_queue("default", Some("ops")).await.unwrap());
        assert_eq!(store.paused_queues().await.unwrap().len(), 1);
        assert!(store
            .claim(&claim_req(&owner("w"), 5))
            .await
            .unwrap()
            .is_empty());
        assert!(store.resume_queue("default").await.unwrap());

        // Hold, release, cancel; the stats and the listing see them.
        store.hold(a).await.unwrap();
        assert_eq!(db.state_of(a).await, "held");
        store.release_hold(a).await.unwrap();
        assert_eq!(
            store.cancel(b, "not needed").await.unwrap(),
            leasehold::store::CancelOutcome::Cancelled
        );
        let stats = store.queue_stats().await.unwrap();
        assert_eq!(stats.len(), 1, "{stats:?}");
        let listed = store
            .list_jobs(&leasehold::store::JobFilter::default())
            .await
            .unwrap();
        assert_eq!(listed.len(), 2);
        assert!(!store.history(b).await.unwrap().is_empty());
        assert!(store
            .explain_claim(&claim_req(&owner("w"), 5))
            .await
            .unwrap()
            .contains("Index"));
        // Twice: its prepared statements did not outlive it on a shared server connection.
        store
            .explain_claim(&claim_req(&owner("w"), 5))
            .await
            .unwrap();
        drop(bouncer);
        db.drop().await;
    })
    .await
}

#[test]
fn a_listen_url_that_is_not_a_postgresql_url_is_refused_by_name() {
    let config = leasehold::Config {
        listen_url: Some("mysql://db/app".into()),
        ..leasehold::Config::default()
    };
    let err = config.validate().unwrap_err().to_string();
    assert!(err.contains("listen_url"), "{err}");
    let config = leasehold::Config {
        listen_url: Some("postgres://leasehold_app@db-primary:5432/app".into()),
        ..leasehold::Config::default()
    };
    config.validate().unwrap();
}

/// The operator CLI through the pooler: each command is a new client on the same
/// server connection, so without `--transaction-pooler` the second command's cached
/// statement collides with the first's; with it every command works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_works_through_the_pooler_with_its_switch() {
    bounded(async {
        let bouncer = PgBouncer::start(1);
        let (db, store) = pooled_db("pooler_cli", &bouncer, 1).await;
        let id = store.enqueue(job("k")).await.unwrap();
        store.pool().close().await;
        let cli = |args: Vec<String>| {
            let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_leasehold"));
            cmd.args(&args)
                .arg("--schema")
                .arg(&db.schema)
                .env_remove("DATABASE_URL")
                .env_remove("LEASEHOLD_TRANSACTION_POOLER")
                .env("PGHOST", "127.0.0.1")
                .env("PGPORT", bouncer.port.to_string())
                .env(
                    "PGUSER",
                    std::env::var("PGUSER").unwrap_or_else(|_| "root".into()),
                )
                .env("PGDATABASE", test_db_name())
                .stdin(std::process::Stdio::null());
            async move {
                tokio::task::spawn_blocking(move || cmd.output().expect("run the leasehold binary"))
                    .await
                    .unwrap()
            }
        };
        let commands = |switch: bool| {
            let mut out = Vec::new();
            for args in [vec!["status"], vec!["jobs"], vec!["job", &id.0.to_string()]] {
                let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
                if switch {
                    args.push("--transaction-pooler".into());
                }
                out.push(args);
            }
            out
        };
        for args in commands(true).into_iter().chain(commands(true)) {
            let out = cli(args.clone()).await;
            assert!(
                out.status.success(),
                "{args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let mut collided = false;
        for args in commands(false).into_iter().chain(commands(false)) {
            let out = cli(args).await;
            let err = String::from_utf8_lossy(&out.stderr);
            collided |= !out.status.success() && err.contains("already exists");
        }
        assert!(collided, "without the switch a cached statement collides");
        drop(bouncer);
        db.drop().await;
    })
    .await
}
