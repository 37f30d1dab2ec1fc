//! Attack on "one process prunes a schema at a time, and the others' passes are skipped
//! (`prune_skipped`)" and on the pass's figures: `PruneReport::skipped` is documented as
//! "Another process was pruning this schema: this pass did nothing".

mod common;

use std::time::Duration;

use common::*;
use leasehold::{Store, StoreOptions};

const WEEK: Duration = Duration::from_secs(7 * 24 * 3600);

async fn exec_on(pool: &sqlx::PgPool, schema: &str, sql: &str) {
    let sql = sql.replace("{s}", &format!("\"{schema}\""));
    sqlx::raw_sql(&sql).execute(pool).await.unwrap();
}

/// `n` done jobs finished 8 days ago (due under a week), keyed `due-<g>`, with their
/// history and key rows.
const DUE_KEYED: &str = "
    INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts,
                          job_key, key_seq, finished_at, created_at)
    SELECT 'default', 'noop', 'done', '{}', 2, 1, 'due-' || g, 1,
           now() - interval '8 days', now() - interval '8 days'
    FROM generate_series(1, 5) g;
    INSERT INTO {s}.job_events (job_id, generation, event, at)
    SELECT id, 1, 'completed', finished_at FROM {s}.jobs;
    INSERT INTO {s}.job_keys (queue, job_key, next_seq, open_jobs)
    SELECT 'default', 'due-' || g, 1, 0 FROM generate_series(1, 5) g;";

/// Another process's pass starts right after this one's jobs statement commits (in a
/// busy service, with reapers in several processes every second, it does): it takes
/// the retention lock in the gap between this pass's transactions. This pass has
/// already deleted 5 jobs; it must not come back as "skipped: this pass did nothing"
/// (the reaper then counts it in `prune_skipped`, not `prune_passes`, and `leasehold
/// prune` says "another process was pruning"), nor leave its key pass undone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_that_deleted_jobs_is_never_reported_as_skipped() {
    bounded(async {
        let db = TestDb::new("atk_ret_midpass_skip").await;
        exec_on(&db.owner, &db.schema, DUE_KEYED).await;
        // The jobs statement's history deletion waits at a gate the test holds, so the
        // other process is surely ready when it commits.
        let gate: i64 = rand::random();
        exec_on(
            &db.owner,
            &db.schema,
            &format!(
                "CREATE FUNCTION {{s}}.gate() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN PERFORM pg_advisory_xact_lock_shared({gate}); RETURN NULL; END $$;
                 CREATE TRIGGER gate BEFORE DELETE ON {{s}}.job_events
                 FOR EACH STATEMENT EXECUTE FUNCTION {{s}}.gate();"
            ),
        )
        .await;
        let mut gate_conn = db.raw_conn("gate").await;
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(gate)
            .execute(&mut gate_conn)
            .await
            .unwrap();
        let pruner = db.other_store("pruner").await;
        let prune = tokio::spawn(async move { pruner.prune(WEEK, 100).await });
        db.wait_until_lock_waiting("pruner").await;

        // The other process: it asks for the schema's retention lock until it has it,
        // holds it for the length of a pass, and lets go.
        let lock = leasehold::store::RETENTION_LOCK_KEY.replace("$1", &format!("'{}'", db.schema));
        let rival_pool = db.other_pool("rival", 1).await;
        let rival_sql: &'static str = Box::leak(
            format!(
                "SET statement_timeout = '20s';
                 DO $$ BEGIN
                   WHILE NOT pg_try_advisory_lock({lock})
                   LOOP END LOOP;
                   PERFORM pg_sleep(1.5);
                   PERFORM pg_advisory_unlock({lock});
                 END $$;"
            )
            .into_boxed_str(),
        );
        let rival = tokio::spawn(async move {
            sqlx::raw_sql(rival_sql).execute(&rival_pool).await.unwrap();
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(gate)
            .execute(&mut gate_conn)
            .await
            .unwrap();
        let report = within(20, "the pass", prune).await.unwrap().unwrap();
        within(20, "the other process", rival).await.unwrap();
        let jobs_left = db.count_where("jobs", "true").await;
        let keys_left = db.count_where("job_keys", "true").await;
        eprintln!("report {report:?}; jobs left {jobs_left}, key rows left {keys_left}");
        db.drop().await;
        assert_eq!(jobs_left, 0, "the jobs statement ran: {report:?}");
        assert!(
            !(report.skipped && report.deleted() > 0),
            "the pass deleted {} jobs and came back as skipped (\"this pass did nothing\"): \
             {report:?}; {keys_left} idle key rows left for a later key pass",
            report.jobs
        );
    })
    .await
}

/// Two schema names whose `hashtext` is equal, among tenant-like names (`tenant_<nonce>_<n>`).
async fn colliding_schema_names(owner: &sqlx::PgPool) -> (String, String) {
    let nonce = format!("{:08x}", rand::random::<u32>());
    sqlx::query_as(
        "SELECT min(name), max(name)
         FROM (SELECT format('tenant_%s_%s', $1::text, g) AS name
               FROM generate_series(1, 400000) g) n
         GROUP BY hashtext(name) HAVING count(*) > 1
         ORDER BY 1 LIMIT 1",
    )
    .bind(nonce)
    .fetch_one(owner)
    .await
    .expect("two tenant schema names with one hashtext among 400,000")
}

/// A database with one schema per tenant: two schemas' retention passes must not
/// exclude each other. Were the lock `(hashtext('leasehold.retention'), hashtext(schema))`,
/// two schema names with one hash (among 400,000 tenant names there are some
/// eighteen such pairs; with 10^5 schemas a database almost surely holds one) share it:
/// while one tenant prunes, the other's passes are skipped, though nobody prunes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_is_never_skipped_because_another_schema_is_being_pruned() {
    bounded(async {
        ensure_database().await;
        let owner = owner_pool_for("lh-atk-ret-collide", 3).await;
        let (a, b) = colliding_schema_names(&owner).await;
        let store_a = Store::new(owner.clone(), &a, StoreOptions::default()).unwrap();
        let store_b = Store::new(owner.clone(), &b, StoreOptions::default()).unwrap();
        store_a.migrate().await.unwrap();
        store_b.migrate().await.unwrap();
        exec_on(&owner, &b, DUE_KEYED).await;
        // Tenant a's pass is in progress (its transaction holds its retention lock).
        let mut a_pass = owner.acquire().await.unwrap();
        sqlx::query("BEGIN").execute(&mut *a_pass).await.unwrap();
        let locked: bool = sqlx::query_scalar(&format!(
            "SELECT pg_try_advisory_xact_lock({})",
            leasehold::store::RETENTION_LOCK_KEY
        ))
        .bind(&a)
        .fetch_one(&mut *a_pass)
        .await
        .unwrap();
        assert!(locked);
        let report = within(10, "tenant b's pass", store_b.prune(WEEK, 100)).await;
        sqlx::query("ROLLBACK").execute(&mut *a_pass).await.unwrap();
        drop(a_pass);
        for s in [&a, &b] {
            sqlx::query(&format!("DROP SCHEMA \"{s}\" CASCADE"))
                .execute(&owner)
                .await
                .unwrap();
        }
        let report = report.unwrap();
        assert!(
            !report.skipped && report.jobs == 5,
            "schema {b:?} skipped its pass while schema {a:?} was being pruned \
             (hashtext({a:?}) = hashtext({b:?})): {report:?}"
        );
    })
    .await
}
