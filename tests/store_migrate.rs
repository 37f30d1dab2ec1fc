//! Migrations: into the library's own schema with its own version table, idempotent,
//! safe to run from several processes at once, never touching the host's
//! `_sqlx_migrations`, and every column documented.

mod common;

use common::*;
use leasehold::{CompleteOutcome, Store, StoreOptions};
use sqlx::{ConnectOptions, Connection};

/// Snapshot of what a migration could change: versions applied, and every relation
/// of the schema with its identity.
async fn catalog(
    db: &TestDb,
) -> (
    Vec<(i32, chrono::DateTime<chrono::Utc>)>,
    Vec<(String, i64)>,
) {
    let versions = sqlx::query_as(&format!(
        "SELECT version, applied_at FROM {} ORDER BY version",
        db.table("leasehold_migrations")
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let relations = sqlx::query_as(
        "SELECT c.relname::text, c.oid::int8 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = $1 ORDER BY c.relname",
    )
    .bind(&db.schema)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    (versions, relations)
}

/// Enqueue, claim and complete one job: the migrated schema works.
async fn smoke_run(db: &TestDb, store: &Store) {
    let id = store.enqueue(keyed("smoke", "acct", 1)).await.unwrap();
    let mut req = claim_req(&owner("w"), 1);
    req.kinds = Some(vec!["smoke".into()]);
    let j = store.claim(&req).await.unwrap().remove(0);
    assert_eq!(j.id, id);
    assert_eq!(
        store.complete(&j.fence(), None).await.unwrap(),
        CompleteOutcome::Completed
    );
    assert_eq!(db.state_of(id).await, "done");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrating_twice_is_a_no_op() {
    bounded(async {
        let db = TestDb::new("migrate_twice").await;
        let keep = db.store.enqueue(job("k")).await.unwrap();
        let before = catalog(&db).await;
        assert_eq!(before.0.len(), shipped_versions().len());
        db.store.migrate().await.unwrap();
        db.store.migrate().await.unwrap();
        assert_eq!(
            catalog(&db).await,
            before,
            "a second migration must change nothing"
        );
        assert_eq!(
            db.state_of(keep).await,
            "pending",
            "existing jobs are untouched"
        );
        smoke_run(&db, &db.store).await;
        assert_eq!(db.job_count().await, 2);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_concurrent_migrations_of_a_fresh_schema_all_succeed() {
    bounded(async {
        let db = TestDb::unmigrated("migrate_concurrent", StoreOptions::default(), 1).await;
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
                .bind(&db.schema)
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert!(!exists, "the schema must be fresh");
        let mut stores = vec![db.store.clone()];
        for p in 1..4 {
            stores.push(db.other_store_sized(&format!("m{p}"), 1).await);
        }
        let tasks: Vec<_> = stores
            .iter()
            .cloned()
            .map(|s| tokio::spawn(async move { s.migrate().await }))
            .collect();
        for t in tasks {
            within(60, "concurrent migrate", t)
                .await
                .unwrap()
                .expect("every concurrent migration succeeds");
        }
        let versions: Vec<i32> = sqlx::query_scalar(&format!(
            "SELECT version FROM {} ORDER BY version",
            db.table("leasehold_migrations")
        ))
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(versions, shipped_versions(), "each version applied once");
        for s in &stores[1..] {
            s.pool().close().await;
        }
        smoke_run(&db, &db.store).await;
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_never_creates_or_touches_the_hosts_sqlx_migrations() {
    bounded(async {
        // A database of its own, so nothing another test does can show up here.
        ensure_database().await;
        let name = format!("lh_mig_{:08x}", rand::random::<u32>());
        let mut admin = base_options().database("postgres").connect().await.unwrap();
        sqlx::query(&format!("CREATE DATABASE \"{name}\"")).execute(&mut admin).await.unwrap();
        let app = format!("lh-{name}");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(std::time::Duration::from_secs(10))
            .connect_with(base_options().database(&name).application_name(&app))
            .await
            .unwrap();
        let count_sqlx = |pool: sqlx::PgPool| async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pg_class WHERE relname = '_sqlx_migrations'")
                .fetch_one(&pool)
                .await
                .unwrap()
        };

        // A host without one: none is created.
        let store = Store::new(pool.clone(), "leasehold", StoreOptions::default()).unwrap();
        store.migrate().await.unwrap();
        assert_eq!(count_sqlx(pool.clone()).await, 0);

        // A host with its own: left exactly as it was, in another schema too.
        sqlx::raw_sql(
            "CREATE TABLE public._sqlx_migrations (version bigint PRIMARY KEY, description text NOT NULL);
             INSERT INTO public._sqlx_migrations VALUES (20240101000000, 'host app');",
        )
        .execute(&pool)
        .await
        .unwrap();
        let other = Store::new(pool.clone(), "leasehold_two", StoreOptions::default()).unwrap();
        other.migrate().await.unwrap();
        store.migrate().await.unwrap();
        let host: Vec<(i64, String)> = sqlx::query_as("SELECT version, description FROM public._sqlx_migrations")
            .fetch_all(&pool)
            .await
            .unwrap();
        assert_eq!(host, vec![(20240101000000, "host app".to_string())]);
        assert_eq!(count_sqlx(pool.clone()).await, 1);

        // The library's own version table is in its own schema.
        let own: Vec<String> = sqlx::query_scalar(
            "SELECT n.nspname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE c.relname = 'leasehold_migrations' ORDER BY 1",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(own, vec!["leasehold", "leasehold_two"]);

        // The store works there: one job done.
        let id = store.enqueue(job("k")).await.unwrap();
        let j = store.claim(&claim_req(&owner("w"), 1)).await.unwrap().remove(0);
        assert_eq!(store.complete(&j.fence(), None).await.unwrap(), CompleteOutcome::Completed);
        assert_eq!(store.job(id).await.unwrap().state, leasehold::JobState::Done);

        pool.close().await;
        sqlx::query(&format!("DROP DATABASE \"{name}\" WITH (FORCE)")).execute(&mut admin).await.unwrap();
        admin.close().await.unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_table_and_column_of_the_schema_has_a_comment() {
    bounded(async {
        let db = TestDb::new("migrate_comments").await;
        let tables: Vec<String> = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') ORDER BY 1",
        )
        .bind(&db.schema)
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert!(tables.len() >= 5, "{tables:?}");
        let undocumented_tables: Vec<String> = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relkind IN ('r', 'p')
               AND obj_description(c.oid, 'pg_class') IS NULL ORDER BY 1",
        )
        .bind(&db.schema)
        .fetch_all(&db.pool)
        .await
        .unwrap();
        let undocumented_columns: Vec<String> = sqlx::query_scalar(
            "SELECT c.relname || '.' || a.attname FROM pg_attribute a
               JOIN pg_class c ON c.oid = a.attrelid
               JOIN pg_namespace n ON n.oid = c.relnamespace
               LEFT JOIN pg_description d ON d.objoid = c.oid AND d.classoid = 'pg_class'::regclass AND d.objsubid = a.attnum
             WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') AND a.attnum > 0 AND NOT a.attisdropped
               AND coalesce(d.description, '') = ''
             ORDER BY 1",
        )
        .bind(&db.schema)
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert!(undocumented_tables.is_empty(), "tables without a comment: {undocumented_tables:?}");
        assert!(undocumented_columns.is_empty(), "columns without a comment: {undocumented_columns:?}");
        // No jobs were involved; the schema holds none and no effects.
        assert_eq!(db.job_count().await, 0);
        assert_eq!(db.count_where("effects", "true").await, 0);
        db.drop().await;
    })
    .await
}
