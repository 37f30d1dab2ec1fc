//! Attack on "a pass with nothing due reads an index entry or two per statement" (README,
//! "What retention costs") as a busy service runs: retention deletes thousands of rows
//! an hour while a long snapshot is open somewhere (a nightly `pg_dump`, which holds one
//! REPEATABLE READ snapshot for its whole run, or a report). The work is read from
//! `pg_stat_*`, as `store_retention_at_size` does.

mod common;

use std::time::Duration;

use common::*;
use leasehold::{Store, StoreOptions};
use sqlx::PgPool;

const WEEK: Duration = Duration::from_secs(7 * 24 * 3600);

async fn exec_on(db: &TestDb, pool: &PgPool, sql: &str) {
    let sql = sql.replace("{s}", &format!("\"{}\"", db.schema));
    sqlx::raw_sql(&sql).execute(pool).await.unwrap();
}

/// A store on a pool of one connection as the schema's owner, so its backend's
/// statistics can be flushed on demand.
async fn measured_store(db: &TestDb, suffix: &str) -> (Store, PgPool) {
    let pool = owner_pool_for(&db.app_name_of(suffix), 1).await;
    let store = Store::new(pool.clone(), &db.schema, StoreOptions::default()).unwrap();
    (store, pool)
}

/// Entries read from `jobs` (sequential scans' rows and all its indexes' entries).
async fn jobs_rows_read(db: &TestDb, pool: &PgPool) -> i64 {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query_scalar(
        "SELECT (coalesce(t.seq_tup_read, 0)
                 + coalesce((SELECT sum(i.idx_tup_read) FROM pg_stat_user_indexes i
                              WHERE i.relid = t.relid), 0))::int8
         FROM pg_stat_user_tables t WHERE t.schemaname = $1 AND t.relname = 'jobs'",
    )
    .bind(&db.schema)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// 30,000 jobs come due and retention deletes them (three passes of 10,000) while a
/// backup's snapshot, taken before, is still open. Then nothing is due: the next passes
/// must read an index entry or two, not the 30,000 entries of rows already deleted,
/// again in every pass of every process until the backup ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passes_with_nothing_due_do_not_reread_deleted_rows_while_a_backup_snapshot_is_open() {
    bounded(async {
        let db = TestDb::new("atk_ret_snapshot").await;
        let (store, pool) = measured_store(&db, "pruner").await;
        exec_on(
            &db,
            &db.owner,
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts,
                                   finished_at, created_at)
             SELECT 'default', 'noop', 'done', '{}', 2, 1,
                    now() - interval '8 days', now() - interval '8 days'
             FROM generate_series(1, 30000) g;
             INSERT INTO {s}.job_events (job_id, generation, event, at)
             SELECT id, 1, 'completed', finished_at FROM {s}.jobs;",
        )
        .await;
        // The backup starts: one snapshot for its whole run.
        let mut backup = db.raw_conn("backup").await;
        sqlx::raw_sql(&format!(
            "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM \"{}\".jobs",
            db.schema
        ))
        .execute(&mut backup)
        .await
        .unwrap();
        let mut deleted = 0;
        while deleted < 30_000 {
            let r = within(60, "a pass with work", store.prune(WEEK, 10_000))
                .await
                .unwrap();
            assert!(r.jobs > 0, "no progress: {r:?}");
            deleted += r.jobs;
        }
        // Nothing is due now. The first pass after the deletions may tidy up after them;
        // the ones after it must cost nothing.
        store.prune(WEEK, 10_000).await.unwrap();
        let mut reads = Vec::new();
        for _ in 0..3 {
            let before = jobs_rows_read(&db, &pool).await;
            let r = store.prune(WEEK, 10_000).await.unwrap();
            let read = jobs_rows_read(&db, &pool).await - before;
            assert_eq!(r.deleted(), 0, "{r:?}");
            reads.push((read, r.read, r.elapsed));
        }
        sqlx::raw_sql("ROLLBACK")
            .execute(&mut backup)
            .await
            .unwrap();
        // The service goes on writing (a write's commit is what lets PostgreSQL see the
        // snapshot is gone).
        db.store.enqueue(job("k")).await.unwrap();
        // After the backup: a pass or two tidies up, then nothing.
        store.prune(WEEK, 10_000).await.unwrap();
        store.prune(WEEK, 10_000).await.unwrap();
        let before = jobs_rows_read(&db, &pool).await;
        store.prune(WEEK, 10_000).await.unwrap();
        let after_backup = jobs_rows_read(&db, &pool).await - before;
        eprintln!(
            "nothing due, backup open: (job index entries read, PruneReport::read, elapsed) \
             per pass {reads:?}; after the backup ended: {after_backup}"
        );
        drop(backup);
        db.drop().await;
        assert!(
            reads.iter().all(|(read, _, _)| *read < 100),
            "passes with nothing due read {:?} job index entries each (PruneReport::read said \
             {:?}) while a backup snapshot was open; {after_backup} once it ended",
            reads.iter().map(|r| r.0).collect::<Vec<_>>(),
            reads.iter().map(|r| r.1).collect::<Vec<_>>()
        );
    })
    .await
}
