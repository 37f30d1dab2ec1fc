//! Least privilege: migrations run as the schema's owner; a scheduler and every admin
//! call run as a runtime role holding exactly the grants of
//! `leasehold::store::runtime_grants` (the SQL the README quotes), which cannot change
//! the schema. Starting as that role needs no CREATE on a current (or newer) schema,
//! and is refused with `Error::SchemaOutdated` on an older one.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use leasehold::store::{runtime_grants, JobFilter, RecordOutcome, Schema, SCHEMA_VERSION};
use leasehold::{
    CancelOutcome, CompleteOutcome, Error, Handler, JobContext, JobError, JobId, JobState, NewJob,
    Scheduler, Store, StoreOptions,
};
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgPool};
use worker::{fast_config, run_in_system, wait_until};

/// The role and schema names the README's copy of the grants is rendered with.
const README_SCHEMA: &str = "leasehold";
const README_ROLE: &str = "leasehold_app";

/// Runtime roles are named `lh_priv_<pid>_<nonce>`: a role whose process is gone was
/// left by a killed run, and is dropped by the next one.
const ROLE_PREFIX: &str = "lh_priv_";

/// A LOGIN role with exactly the documented grants on one test schema, and a pool and
/// store connected as it.
struct RuntimeRole {
    name: String,
    pool: PgPool,
    store: Store,
}

impl RuntimeRole {
    /// Create the role, have `owner` (a pool of the role that migrated: the superuser
    /// for most tests) grant it what `runtime_grants` says, and connect as it. PUBLIC's
    /// default EXECUTE on the schema's functions is revoked first, so the role runs on
    /// the documented grants alone.
    async fn new(db: &TestDb, owner: &PgPool) -> RuntimeRole {
        let name = create_role(&db.pool).await;
        sqlx::query(&format!(
            "REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA \"{}\" FROM PUBLIC",
            db.schema
        ))
        .execute(owner)
        .await
        .unwrap();
        let grants = runtime_grants(&Schema::new(&db.schema).unwrap(), &name);
        sqlx::raw_sql(&grants).execute(owner).await.unwrap();
        let pool = pool_as(db, &name, "runtime").await;
        let store = Store::new(pool.clone(), &db.schema, StoreOptions::default()).unwrap();
        RuntimeRole { name, pool, store }
    }

    /// Close the pool and drop the role (its grants first).
    async fn drop(self, db: &TestDb) {
        self.pool.close().await;
        drop_role(&db.pool, &self.name).await;
    }
}

/// A new LOGIN role with no grants, named for this process.
async fn create_role(admin: &PgPool) -> String {
    drop_stale_roles(admin).await;
    let name = format!(
        "{ROLE_PREFIX}{}_{:08x}",
        std::process::id(),
        rand::random::<u32>()
    );
    sqlx::query(&format!("CREATE ROLE {name} LOGIN"))
        .execute(admin)
        .await
        .unwrap();
    name
}

/// A pool on the test database connected as `role` (trust authentication).
async fn pool_as(db: &TestDb, role: &str, tag: &str) -> PgPool {
    let pool = PgPoolOptions::new()
        .max_connections(6)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(
            base_options()
                .database(&test_db_name())
                .username(role)
                .application_name(&format!("{}-{tag}", db.app_name)),
        )
        .await
        .unwrap_or_else(|e| panic!("connect as {role}: {e}"));
    let whoami: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(whoami, role);
    pool
}

async fn drop_role(admin: &PgPool, name: &str) {
    let _ = sqlx::query(&format!("DROP OWNED BY {name}"))
        .execute(admin)
        .await;
    if let Err(e) = sqlx::query(&format!("DROP ROLE IF EXISTS {name}"))
        .execute(admin)
        .await
    {
        eprintln!("cannot drop role {name}: {e}");
    }
}

/// Drop the runtime roles of test processes that no longer exist.
async fn drop_stale_roles(admin: &PgPool) {
    let roles: Vec<String> =
        sqlx::query_scalar("SELECT rolname::text FROM pg_roles WHERE rolname LIKE $1")
            .bind(format!("{}%", ROLE_PREFIX.replace('_', "\\_")))
            .fetch_all(admin)
            .await
            .unwrap();
    for role in roles {
        let pid = role[ROLE_PREFIX.len()..].split('_').next().unwrap_or("");
        if !pid.is_empty() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            drop_role(admin, &role).await;
        }
    }
}

/// The SQLSTATE of a refused statement.
fn sqlstate(e: &sqlx::Error) -> String {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.to_string())
        .unwrap_or_else(|| format!("not a database error: {e}"))
}

// ---------------------------------------------------------------------------
// A handler that says what it did.
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
enum Act {
    /// Complete at once.
    Done,
    /// Fail for good: dead on the first attempt.
    Fail,
    /// One external effect under `JobContext::once`, then complete.
    Effect,
    /// Work until cancelled, then stop with an error.
    UntilCancelled,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Probe {
    n: i64,
    act: Act,
}

/// One execution: job, key, n, generation, and whether it saw a cancellation.
#[derive(Clone, Debug, PartialEq)]
struct Ran {
    job: JobId,
    key: Option<String>,
    n: i64,
    generation: i64,
    cancelled: bool,
}

#[derive(Clone, Default)]
struct Log {
    runs: Arc<Mutex<Vec<Ran>>>,
    /// Times the external effect's action really ran.
    effects: Arc<Mutex<u32>>,
}

impl Log {
    fn runs_of(&self, id: JobId) -> Vec<Ran> {
        let runs = self.runs.lock().unwrap();
        runs.iter().filter(|r| r.job == id).cloned().collect()
    }
}

struct ProbeHandler(Log);

impl Handler for ProbeHandler {
    type Payload = Probe;
    type Output = i64;
    const KIND: &'static str = "probe";

    async fn run(&self, ctx: JobContext, p: Probe) -> Result<i64, JobError> {
        let mut ran = Ran {
            job: ctx.job_id(),
            key: ctx.key().map(str::to_string),
            n: p.n,
            generation: ctx.generation().0,
            cancelled: false,
        };
        let out = match p.act {
            Act::Done => Ok(p.n),
            Act::Fail => Err(JobError::permanent("refused by the probe")),
            Act::Effect => {
                let effects = self.0.effects.clone();
                ctx.once("charge", &p.n, |_key| async move {
                    *effects.lock().unwrap() += 1;
                    Ok(p.n * 100)
                })
                .await
            }
            Act::UntilCancelled => {
                self.0.runs.lock().unwrap().push(ran.clone());
                ctx.cancelled().await;
                ran.cancelled = true;
                Err(JobError::retry("stopped: cancelled"))
            }
        };
        let mut runs = self.0.runs.lock().unwrap();
        // A long job logs its start too; its end replaces that entry.
        runs.retain(|r| !(r.job == ran.job && r.generation == ran.generation));
        runs.push(ran);
        out
    }
}

fn probe(n: i64, act: Act) -> NewJob {
    NewJob::new(ProbeHandler::KIND, &Probe { n, act }).unwrap()
}

async fn wait_for_state(store: &Store, id: JobId, state: JobState) {
    wait_until(30, &format!("job {id} to be {state}"), || async move {
        store.job(id).await.unwrap().state == state
    })
    .await
}

// ---------------------------------------------------------------------------
// The tests.
// ---------------------------------------------------------------------------

#[test]
fn the_runtime_role_runs_a_scheduler_and_every_admin_call() {
    run_in_system(bounded(async {
        let db = TestDb::new("least_priv_runtime").await;
        let rt = RuntimeRole::new(&db, &db.pool).await;
        let log = Log::default();
        let mut config = fast_config(&db.schema);
        config.shutdown_grace = Duration::from_millis(300);
        let scheduler = Scheduler::builder(rt.pool.clone(), config)
            .register(ProbeHandler(log.clone()))
            .start()
            .await
            .expect("a runtime role starts a scheduler on a current schema");
        let store = &rt.store;

        // Claim, complete, a key's succession, a permanent failure, an effect.
        let mut unkeyed = Vec::new();
        for n in 1..=3 {
            unkeyed.push(scheduler.enqueue_job(probe(n, Act::Done)).await.unwrap());
        }
        let keyed = scheduler
            .enqueue_many(
                (1..=3)
                    .map(|n| probe(n, Act::Done).with_key("acct"))
                    .collect(),
            )
            .await
            .unwrap();
        let failing = scheduler.enqueue_job(probe(9, Act::Fail)).await.unwrap();
        let effect = scheduler.enqueue_job(probe(7, Act::Effect)).await.unwrap();
        for &id in unkeyed.iter().chain(&keyed).chain([&effect]) {
            wait_for_state(store, id, JobState::Done).await;
        }
        wait_for_state(store, failing, JobState::Dead).await;
        for (n, &id) in (1..=3).zip(&unkeyed) {
            let runs = log.runs_of(id);
            assert_eq!(runs.len(), 1, "{runs:?}");
            assert_eq!(runs[0].n, n);
            assert_eq!(store.job(id).await.unwrap().result, Some(n.into()));
        }
        let key_order: Vec<i64> = log
            .runs
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.key.as_deref() == Some("acct"))
            .map(|r| r.n)
            .collect();
        assert_eq!(key_order, vec![1, 2, 3], "a key's jobs run in order, once");
        assert_eq!(
            store.job(effect).await.unwrap().result,
            Some(700.into()),
            "the effect's recorded outcome is the job's result"
        );
        assert_eq!(*log.effects.lock().unwrap(), 1);
        let ledger = store.job_effects(effect).await.unwrap();
        assert_eq!(ledger.len(), 1);
        assert_eq!(ledger[0].outcome, serde_json::json!(700));
        assert!(store.effect(&ledger[0].effect_key).await.unwrap().is_some());
        let dead = store.job(failing).await.unwrap();
        assert_eq!(dead.last_error.as_deref(), Some("refused by the probe"));

        // An operator's retry of the dead job: it runs again (and fails again).
        store.retry_dead(failing).await.unwrap();
        wait_until(30, "the retried job to run again", || async {
            log.runs_of(failing).len() == 2
        })
        .await;
        wait_for_state(store, failing, JobState::Dead).await;

        // Renewal of a running lease, then an operator's cancel of the running job.
        let long = scheduler
            .enqueue_job(probe(5, Act::UntilCancelled))
            .await
            .unwrap();
        wait_until(30, "the long job to start", || async {
            !log.runs_of(long).is_empty()
        })
        .await;
        let (renewed, lost) = scheduler.renew_now().await.unwrap();
        assert!(renewed >= 1 && lost == 0, "renewed {renewed}, lost {lost}");
        assert_eq!(
            store.cancel(long, "by the test").await.unwrap(),
            CancelOutcome::Requested
        );
        wait_for_state(store, long, JobState::Cancelled).await;
        assert!(log.runs_of(long)[0].cancelled, "the handler was told");

        // Hold, release and cancel a pending job (on a queue no scheduler serves).
        let parked = store
            .enqueue(probe(6, Act::Done).with_queue("elsewhere"))
            .await
            .unwrap();
        store.hold(parked).await.unwrap();
        assert_eq!(db.state_of(parked).await, "held");
        store.release_hold(parked).await.unwrap();
        assert_eq!(db.state_of(parked).await, "pending");
        assert_eq!(
            store.cancel(parked, "not wanted").await.unwrap(),
            CancelOutcome::Cancelled
        );
        assert_eq!(db.state_of(parked).await, "cancelled");

        // Pause and resume: a job enqueued while paused waits, then runs.
        assert!(store
            .pause_queue("default", Some("the test"))
            .await
            .unwrap());
        assert_eq!(store.paused_queues().await.unwrap().len(), 1);
        let later = scheduler.enqueue_job(probe(8, Act::Done)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(db.state_of(later).await, "pending", "a paused queue waits");
        let stats = scheduler.queue_stats().await.unwrap();
        let default = stats.iter().find(|s| s.queue == "default").unwrap();
        assert!(default.paused);
        assert_eq!(default.by_state.get("pending"), Some(&1));
        assert!(store.resume_queue("default").await.unwrap());
        wait_for_state(store, later, JobState::Done).await;
        assert!(!store.explain_queue_stats().await.unwrap().is_empty());

        // Shutdown with one attempt still running past the grace: cancelled and its
        // job released (pending again, claimable by anyone).
        let straggler = scheduler
            .enqueue_job(probe(4, Act::UntilCancelled))
            .await
            .unwrap();
        wait_until(30, "the straggler to start", || async {
            !log.runs_of(straggler).is_empty()
        })
        .await;
        let report = scheduler.shutdown().await.unwrap();
        assert_eq!(report.cancelled, 1, "{report:?}");
        assert_eq!(report.metrics.in_flight, 0);
        assert_eq!(db.state_of(straggler).await, "pending", "released");
        let j = db.store.job(straggler).await.unwrap();
        assert_eq!(j.attempts, 0, "released, the attempt not counted: {j:?}");

        store_calls(&db, store, straggler).await;

        rt.drop(&db).await;
        db.drop().await;
    }))
}

/// The store's own calls, as the runtime role: claim, explain, renew, reap, record an
/// effect, complete, a key's head claimed by key, the bulk enqueues, the read calls,
/// and retention.
async fn store_calls(db: &TestDb, store: &Store, pending: JobId) {
    let w = owner("w");
    assert!(!store
        .explain_claim(&claim_req(&w, 1))
        .await
        .unwrap()
        .is_empty());
    let job = store.claim(&claim_req(&w, 10)).await.unwrap().remove(0);
    assert_eq!(job.id, pending);
    let renewed = store.renew(&w, &[job.attempt()], LEASE).await.unwrap();
    assert!(renewed.lost.is_empty(), "{renewed:?}");
    let reaped = store
        .reap(&owner("reaper"), &fixed_backoff(0), 10, Some(far_future()))
        .await
        .unwrap();
    assert_eq!(reaped.retried, vec![pending], "the expired lease is reaped");
    assert_eq!(store.lease_expiries(pending).await.unwrap().len(), 1);

    let job = store
        .claim(&claim_at(&w, 10, far_future()))
        .await
        .unwrap()
        .remove(0);
    assert_eq!(
        store
            .record_effect(
                &job.fence(),
                "by-hand",
                "fp",
                &serde_json::json!(1),
                Duration::ZERO
            )
            .await
            .unwrap(),
        RecordOutcome::Recorded
    );
    assert_eq!(
        store.complete(&job.fence(), None).await.unwrap(),
        CompleteOutcome::Completed
    );

    let ids = store
        .enqueue_many(vec![
            probe(1, Act::Done).with_key("b"),
            probe(2, Act::Done).with_key("b"),
        ])
        .await
        .unwrap();
    assert_eq!(
        store.enqueue_copy(vec![probe(3, Act::Done)]).await.unwrap(),
        1
    );
    let head = store
        .claim_key(&w, "default", "b", None, LEASE, None)
        .await
        .unwrap()
        .expect("the key's head");
    assert_eq!(head.id, ids[0]);
    assert_eq!(
        store.complete(&head.fence(), None).await.unwrap(),
        CompleteOutcome::Completed
    );
    assert_eq!(
        db.state_of(ids[1]).await,
        "pending",
        "its successor promoted"
    );

    let filter = JobFilter {
        state: Some(JobState::Dead),
        ..JobFilter::default()
    };
    assert_eq!(store.list_jobs(&filter).await.unwrap().len(), 1);
    assert!(!store.history(pending).await.unwrap().is_empty());
    assert!(!store.job_counts().await.unwrap().is_empty());
    store.queue_gauges().await.unwrap();
    store.blocked_keys(10).await.unwrap();

    // Retention: finished jobs, their history and expiries, and the effect recorded
    // with no keep time (the handler's is kept for its retry window).
    let finished = "state IN ('done', 'cancelled')";
    let before = db.count_where("jobs", finished).await;
    let pruned = common::prune_now(store, 1000).await.unwrap();
    assert!(pruned.jobs > 0 && pruned.effects >= 1, "{pruned:?}");
    assert_eq!(
        db.count_where("jobs", finished).await,
        before - pruned.jobs as i64
    );
    assert_eq!(db.count_where("jobs", "state = 'dead'").await, 1, "kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runtime_role_cannot_change_the_schema() {
    bounded(async {
        let db = TestDb::new("least_priv_ddl").await;
        let rt = RuntimeRole::new(&db, &db.pool).await;
        let s = format!("\"{}\"", db.schema);
        let other_schema = format!("{}_x", db.schema);
        for sql in [
            format!("DROP TABLE {s}.jobs"),
            format!("ALTER TABLE {s}.jobs ADD COLUMN x int"),
            format!("CREATE TABLE {s}.x (i int)"),
            format!("CREATE SCHEMA \"{other_schema}\""),
            format!("CREATE SCHEMA IF NOT EXISTS {s}"),
            format!("TRUNCATE {s}.jobs"),
            format!("DROP FUNCTION {s}.claim"),
            format!("CREATE INDEX ON {s}.jobs (kind)"),
            format!(
                "INSERT INTO {s}.leasehold_migrations (version, description) VALUES (999, 'x')"
            ),
            format!("DELETE FROM {s}.leasehold_migrations"),
        ] {
            let e = sqlx::raw_sql(&sql).execute(&rt.pool).await.unwrap_err();
            assert_eq!(sqlstate(&e), "42501", "{sql}: {e}");
        }
        // What the role holds, from the catalog: nothing beyond the documented grants.
        let (create_db, create_schema, truncate, references, trigger): (
            bool,
            bool,
            bool,
            bool,
            bool,
        ) = sqlx::query_as(
            "SELECT has_database_privilege($1, current_database(), 'CREATE'),
                        has_schema_privilege($1, $2, 'CREATE'),
                        has_table_privilege($1, $3, 'TRUNCATE'),
                        has_table_privilege($1, $3, 'REFERENCES'),
                        has_table_privilege($1, $3, 'TRIGGER')",
        )
        .bind(&rt.name)
        .bind(&db.schema)
        .bind(db.table("jobs"))
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert!(!(create_db || create_schema || truncate || references || trigger));
        assert_eq!(db.job_count().await, 0);
        rt.drop(&db).await;
        db.drop().await;
    })
    .await
}

#[test]
fn starting_as_the_runtime_role_needs_a_current_schema_and_tolerates_a_newer_one() {
    run_in_system(bounded(async {
        let db = TestDb::new("least_priv_versions").await;
        let rt = RuntimeRole::new(&db, &db.pool).await;
        let start = || {
            Scheduler::builder(rt.pool.clone(), fast_config(&db.schema))
                .register(ProbeHandler(Log::default()))
                .start()
        };

        // Current: no lock and no DDL. Held by a migration elsewhere, the advisory lock
        // (the same key as src/store/migrate.rs) does not delay a start.
        let mut migrating = db.raw_conn("migrating").await;
        let mut tx = migrating.begin().await.unwrap();
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('leasehold.migrate'), hashtext($1))")
            .bind(&db.schema)
            .execute(&mut *tx)
            .await
            .unwrap();
        within(5, "migrate of a current schema", rt.store.migrate())
            .await
            .unwrap();
        let scheduler = within(10, "start on a current schema", start())
            .await
            .unwrap();
        scheduler.shutdown().await.unwrap();
        tx.rollback().await.unwrap();

        // Newer (a rolling deploy: another build migrated first): starts and runs jobs.
        let versions = db.table("leasehold_migrations");
        sqlx::query(&format!(
            "INSERT INTO {versions} (version, description) VALUES ($1, 'from a newer build')"
        ))
        .bind(SCHEMA_VERSION + 1)
        .execute(&db.pool)
        .await
        .unwrap();
        let scheduler = start().await.expect("a newer schema keeps starting");
        let id = scheduler.enqueue_job(probe(1, Act::Done)).await.unwrap();
        wait_for_state(&rt.store, id, JobState::Done).await;
        scheduler.shutdown().await.unwrap();
        sqlx::query(&format!("DELETE FROM {versions} WHERE version = $1"))
            .bind(SCHEMA_VERSION + 1)
            .execute(&db.pool)
            .await
            .unwrap();

        // Older (this build's newest migration not recorded): refused, clearly, and
        // nothing changed.
        let (description, applied_at): (String, chrono::DateTime<chrono::Utc>) = sqlx::query_as(
            &format!("DELETE FROM {versions} WHERE version = $1 RETURNING description, applied_at"),
        )
        .bind(SCHEMA_VERSION)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        // The newest version applied now (versions need not be contiguous: each branch
        // of the schema's history takes its own number).
        let previous: i32 = sqlx::query_scalar(&format!("SELECT max(version) FROM {versions}"))
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let applied: i64 = db.count_where("leasehold_migrations", "true").await;
        let refused = start().await.err().expect("an older schema is refused");
        match &refused {
            Error::SchemaOutdated {
                schema,
                found,
                needed,
                source,
            } => {
                assert_eq!(schema, &db.schema);
                assert_eq!((*found, *needed), (previous, SCHEMA_VERSION));
                assert_eq!(sqlstate(source), "42501");
            }
            other => panic!("expected SchemaOutdated, got {other:?}"),
        }
        let text = refused.to_string();
        for part in [
            format!("is at version {previous}"),
            format!("needs version {SCHEMA_VERSION}"),
            "run `leasehold migrate` (or `Store::migrate`) as the schema's owner".to_string(),
        ] {
            assert!(text.contains(&part), "{text}");
        }
        assert!(matches!(
            rt.store.migrate().await,
            Err(Error::SchemaOutdated { .. })
        ));
        let script = rt.store.migration_script().await.unwrap();
        assert!(
            script.contains(&format!("-- migration {SCHEMA_VERSION}:")),
            "{script}"
        );
        let recorded: i64 = db.count_where("leasehold_migrations", "true").await;
        assert_eq!(recorded, applied, "nothing was recorded");
        sqlx::query(&format!(
            "INSERT INTO {versions} (version, description, applied_at) VALUES ($1, $2, $3)"
        ))
        .bind(SCHEMA_VERSION)
        .bind(description)
        .bind(applied_at)
        .execute(&db.pool)
        .await
        .unwrap();
        let script = rt.store.migration_script().await.unwrap();
        assert!(!script.contains("-- migration"), "{script}");
        start().await.unwrap().shutdown().await.unwrap();

        // Missing altogether, and not creatable by this role: version 0.
        let absent = format!("{}_absent", db.schema);
        let store = Store::new(rt.pool.clone(), &absent, StoreOptions::default()).unwrap();
        match store.migrate().await {
            Err(Error::SchemaOutdated { found: 0, .. }) => {}
            other => panic!("expected SchemaOutdated at version 0, got {other:?}"),
        }

        rt.drop(&db).await;
        db.drop().await;
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_setup_an_owner_given_its_schema_migrates_and_grants() {
    bounded(async {
        // As the README: a superuser makes both roles and gives the owner the schema;
        // the owner has no CREATE on the database.
        let db = TestDb::unmigrated("least_priv_owner", StoreOptions::default(), 2).await;
        let owner_role = create_role(&db.pool).await;
        sqlx::query(&format!(
            "CREATE SCHEMA \"{}\" AUTHORIZATION {owner_role}",
            db.schema
        ))
        .execute(&db.pool)
        .await
        .unwrap();
        let owner_pool = pool_as(&db, &owner_role, "owner").await;
        let owner_store =
            Store::new(owner_pool.clone(), &db.schema, StoreOptions::default()).unwrap();
        owner_store.migrate().await.expect("the owner migrates");
        let rt = RuntimeRole::new(&db, &owner_pool).await;

        let id = rt.store.enqueue(probe(1, Act::Done)).await.unwrap();
        let job = rt
            .store
            .claim(&claim_req(&owner("w"), 1))
            .await
            .unwrap()
            .remove(0);
        assert_eq!(job.id, id);
        assert_eq!(
            rt.store.complete(&job.fence(), None).await.unwrap(),
            CompleteOutcome::Completed
        );

        // A later migration's table, made by the owner: the default privileges cover it.
        let later = db.table("later");
        sqlx::query(&format!("CREATE TABLE {later} (i int)"))
            .execute(&owner_pool)
            .await
            .unwrap();
        sqlx::query(&format!("INSERT INTO {later} VALUES (1)"))
            .execute(&rt.pool)
            .await
            .expect("default privileges grant a new table");
        let e = sqlx::query(&format!("DROP TABLE {later}"))
            .execute(&rt.pool)
            .await
            .unwrap_err();
        assert_eq!(sqlstate(&e), "42501");

        owner_pool.close().await;
        rt.drop(&db).await;
        drop_role(&db.pool, &owner_role).await; // its schema with it
        db.drop().await;
    })
    .await
}

#[test]
fn the_readme_quotes_the_runtime_grants() {
    let readme = include_str!("../README.md");
    let grants = runtime_grants(&Schema::new(README_SCHEMA).unwrap(), README_ROLE);
    assert!(
        readme.contains(&grants),
        "README.md must quote runtime_grants({README_SCHEMA:?}, {README_ROLE:?}) verbatim:\n{grants}"
    );
}
