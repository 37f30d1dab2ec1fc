//! Retention at size: a pass costs what is due, never the retained history, and never
//! stalls a keyed enqueue. Hundreds of thousands of rows inserted by SQL, never analyzed
//! (autovacuum is off in the test database); the work is read from `pg_stat_*`.

mod common;

use std::time::{Duration, Instant};

use common::*;
use leasehold::store::PruneOptions;
use leasehold::{JobState, Store, StoreOptions};
use sqlx::PgPool;

const WEEK: Duration = Duration::from_secs(7 * 24 * 3600);

/// Run `sql` as the owner, on `pool` (the measured store's, so what the setup reads is
/// flushed with its figures before the pass is measured) or the test's owner pool.
async fn exec_on(db: &TestDb, pool: Option<&PgPool>, sql: &str) {
    let sql = sql.replace("{s}", &format!("\"{}\"", db.schema));
    sqlx::raw_sql(&sql)
        .execute(pool.unwrap_or(&db.owner))
        .await
        .unwrap();
}

async fn exec(db: &TestDb, sql: &str) {
    exec_on(db, None, sql).await
}

/// `n` done jobs of default/noop finished `ago` (an interval), keyed `key_expr` (a SQL
/// expression of `g`, or NULL), with one history row each.
async fn finished_jobs(
    db: &TestDb,
    pool: &PgPool,
    n: i64,
    ago: &str,
    key_expr: &str,
    seq_expr: &str,
) {
    exec_on(
        db,
        Some(pool),
        &format!(
            "INSERT INTO {{s}}.jobs (queue, kind, state, payload, payload_bytes, max_attempts,
                                     job_key, key_seq, finished_at, created_at)
             SELECT 'default', 'noop', 'done', '{{}}', 2, 1, {key_expr}, {seq_expr},
                    now() - interval '{ago}', now() - interval '{ago}'
             FROM generate_series(1, {n}) g;
             INSERT INTO {{s}}.job_events (job_id, generation, event, at)
             SELECT id, 1, 'completed', finished_at FROM {{s}}.jobs
             WHERE finished_at < now() - interval '{ago}' + interval '1 second'"
        ),
    )
    .await;
}

/// A store on a pool of one connection as the schema's owner: the pass's statistics
/// are that backend's, flushed on demand (`pg_stat_force_next_flush` needs the owner).
async fn measured_store(db: &TestDb, suffix: &str) -> (Store, PgPool) {
    let pool = owner_pool_for(&db.app_name_of(suffix), 1).await;
    let store = Store::new(pool.clone(), &db.schema, StoreOptions::default()).unwrap();
    (store, pool)
}

/// Rows read from `table` so far, as the statistics views have them: its sequential
/// scans' rows and its indexes' entries. `pool` (one connection) flushes its backend's
/// figures first.
async fn rows_read(db: &TestDb, pool: &PgPool, table: &str) -> i64 {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query_scalar(
        "SELECT (coalesce(t.seq_tup_read, 0)
                 + coalesce((SELECT sum(i.idx_tup_read) FROM pg_stat_user_indexes i
                              WHERE i.relid = t.relid), 0))::int8
         FROM pg_stat_user_tables t WHERE t.schemaname = $1 AND t.relname = $2",
    )
    .bind(&db.schema)
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_with_nothing_due_reads_neither_the_history_nor_the_ledger() {
    bounded(async {
        let db = TestDb::new("ret_size_nothing_due").await;
        let (store, pool) = measured_store(&db, "pruner").await;
        // 300,000 jobs finished an hour ago, 2,000 dead letters finished a month ago (never
        // deleted), 100,000 ledger rows kept for 30 days more: nothing is due under a
        // week's retention.
        finished_jobs(&db, &pool, 300_000, "1 hour", "NULL", "NULL").await;
        exec_on(
            &db,
            Some(&pool),
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts,
                                   finished_at, last_error)
             SELECT 'default', 'noop', 'dead', '{}', 2, 1, now() - interval '30 days', 'gave up'
             FROM generate_series(1, 2000) g;
             INSERT INTO {s}.effects (effect_key, job_id, generation, fingerprint, outcome, keep_until)
             SELECT 'e/' || g, g, 1, 'fp', '\"ok\"', now() + interval '30 days'
             FROM generate_series(1, 100000) g",
        )
        .await;
        let (jobs_before, effects_before) = (
            rows_read(&db, &pool, "jobs").await,
            rows_read(&db, &pool, "effects").await,
        );
        let started = Instant::now();
        let report = store.prune(WEEK, 10_000).await.unwrap();
        let took = started.elapsed();
        let jobs = rows_read(&db, &pool, "jobs").await - jobs_before;
        let effects = rows_read(&db, &pool, "effects").await - effects_before;
        eprintln!("nothing due: {jobs} job rows, {effects} ledger rows read in {took:?}");
        assert_eq!((report.jobs, report.effects, report.keys), (0, 0, 0));
        // Before migration 20 the pass read every one of the 302,000 finished jobs'
        // index entries and every ledger row, in every process, every pass.
        assert!(
            jobs < 100 && effects < 100,
            "a pass with nothing due read {jobs} job rows and {effects} ledger rows ({took:?})"
        );
        assert_eq!(db.count_where("jobs", "true").await, 302_000);
        db.drop().await;
    })
    .await
}

/// The backend of `suffix` runs a statement containing `marker` now.
async fn running(db: &TestDb, suffix: &str, marker: &str) -> bool {
    sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM pg_stat_activity
         WHERE application_name = $1 AND state = 'active' AND position($2 in query) > 0",
    )
    .bind(db.app_name_of(suffix))
    .bind(marker)
    .fetch_one(&db.owner)
    .await
    .unwrap()
        > 0
}

/// How long a keyed enqueue of `key` takes, at most `secs` (else the test fails).
async fn enqueue_time(store: &Store, key: &str, secs: u64) -> (Duration, leasehold::JobId) {
    let started = Instant::now();
    let id = within(
        secs,
        &format!("a keyed enqueue of {key} during a prune"),
        async { store.enqueue(keyed("k", key, 1)).await.unwrap() },
    )
    .await;
    (started.elapsed(), id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_key_rows_go_by_their_own_keys_and_keyed_enqueues_answer_during_the_pass() {
    bounded(async {
        let db = TestDb::new("ret_size_keys").await;
        let (pruner, pool) = measured_store(&db, "pruner").await;
        // 200,000 jobs over 50,000 keys finished an hour ago (kept), and 1,000 keys whose
        // one job finished 8 days ago (due): their rows go once the job has.
        let kept = ("'kept-' || (g % 50000)", "1 + g / 50000");
        finished_jobs(&db, &pool, 200_000, "1 hour", kept.0, kept.1).await;
        finished_jobs(&db, &pool, 1_000, "8 days", "'idle-' || g", "1").await;
        exec(
            &db,
            "INSERT INTO {s}.job_keys (queue, job_key, next_seq, open_jobs)
             SELECT 'default', 'kept-' || k, 5, 0 FROM generate_series(0, 49999) k;
             INSERT INTO {s}.job_keys (queue, job_key, next_seq, open_jobs)
             SELECT 'default', 'idle-' || g, 1, 0 FROM generate_series(1, 1000) g;
             -- Each key row's deletion takes a moment, so the pass lasts long enough to be
             -- met by the enqueues below.
             CREATE FUNCTION {s}.slow_key_delete() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_sleep(0.002); RETURN OLD; END $$;
             CREATE TRIGGER slow_key_delete BEFORE DELETE ON {s}.job_keys
             FOR EACH ROW EXECUTE FUNCTION {s}.slow_key_delete();",
        )
        .await;
        let before = rows_read(&db, &pool, "jobs").await;
        let started = Instant::now();
        let prune = tokio::spawn(async move { pruner.prune(WEEK, 10_000).await });
        within(30, "the key pass to start", async {
            while !running(&db, "pruner", "leasehold:prune_keys */").await {
                assert!(
                    !prune.is_finished(),
                    "the prune ended before its key pass was seen"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        // A key never seen, a key with jobs kept, and a key whose row is going right now.
        let producer = db.other_store("producer").await;
        let (fresh, _) = enqueue_time(&producer, "brand-new", 5).await;
        let (kept, _) = enqueue_time(&producer, "kept-7", 5).await;
        assert!(
            fresh < Duration::from_millis(500) && kept < Duration::from_millis(500),
            "keyed enqueues waited for retention: {fresh:?} for a new key, {kept:?} for a kept one"
        );
        let (_, again) = enqueue_time(&producer, "idle-500", 30).await;
        let report = within(60, "the prune", prune).await.unwrap().unwrap();
        let took = started.elapsed();
        let read = rows_read(&db, &pool, "jobs").await - before;
        eprintln!(
            "key pass: {read} job rows read in {took:?} (the row deletions slowed to 2 ms \
             each); enqueues {fresh:?} (new key), {kept:?} (kept key)"
        );
        assert_eq!(report.jobs, 1_000, "{report:?}");
        assert_eq!(
            db.count_where(
                "job_keys",
                "job_key LIKE 'idle-%' AND job_key <> 'idle-500'"
            )
            .await,
            0,
            "every idle key row but the one enqueued again went ({report:?}, {took:?})"
        );
        assert_eq!(
            db.count_where("job_keys", "job_key LIKE 'kept-%'").await,
            50_000
        );
        // The 1,000 due jobs and, per idle key, a probe or three: never the 200,000 kept.
        assert!(read < 20_000, "the pass read {read} job rows ({took:?})");
        // The key enqueued again continues above where it was.
        let rec = db.store.job(again).await.unwrap();
        assert!(
            rec.key_seq > Some(1),
            "key_seq went back: {:?}",
            rec.key_seq
        );
        assert_eq!(rec.state, JobState::Pending);
        db.drop().await;
    })
    .await
}

/// Make every key-row deletion wait, inside the pruning transaction and holding the row,
/// until the test releases the advisory lock `gate`.
async fn pause_key_deletes_at(db: &TestDb, gate: i64) {
    exec(
        db,
        &format!(
            "CREATE FUNCTION {{s}}.pause_key_delete() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_advisory_xact_lock({gate}); RETURN OLD; END $$;
             CREATE TRIGGER pause_key_delete BEFORE DELETE ON {{s}}.job_keys
             FOR EACH ROW EXECUTE FUNCTION {{s}}.pause_key_delete();"
        ),
    )
    .await;
}

/// A key other than `key` whose row shares its `key_floors` slot.
async fn same_slot_key(db: &TestDb, key: &str) -> String {
    sqlx::query_scalar(
        "SELECT 'slot-mate-' || g FROM generate_series(1, 10000) g
         WHERE hashtext('default/slot-mate-' || g) & 63 = hashtext('default/' || $1) & 63
         ORDER BY g LIMIT 1",
    )
    .bind(key)
    .fetch_one(&db.owner)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_enqueued_again_while_its_row_is_deleted_keeps_its_order_and_others_never_wait() {
    bounded(async {
        let db = TestDb::new("ret_key_race").await;
        let w = owner("w");
        for n in 1..=3 {
            db.store.enqueue(keyed("k", "acct", n)).await.unwrap();
        }
        let old = run_all(&db, &w).await;
        assert_eq!(old.len(), 3);
        let gate: i64 = rand::random();
        pause_key_deletes_at(&db, gate).await;
        let mut gate_conn = db.raw_conn("gate").await;
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(gate)
            .execute(&mut gate_conn)
            .await
            .unwrap();
        // The pass deletes the jobs, then stops inside the key row's deletion, holding it.
        let pruner = db.other_store("pruner").await;
        let prune = tokio::spawn(async move { common::prune_now(&pruner, 100).await });
        db.wait_until_lock_waiting("pruner").await;

        // Another key of the same floor slot: its enqueue waits for nothing.
        let mate = same_slot_key(&db, "acct").await;
        let producer = db.other_store("producer").await;
        let (took, _) = enqueue_time(&producer, &mate, 5).await;
        assert!(
            took < Duration::from_millis(500),
            "an enqueue of another key of the slot waited {took:?} for retention"
        );
        // The key itself: its row is being deleted, so this enqueue waits for that
        // statement, then makes the row again above the floor retention raised.
        let again = db.other_store("again").await;
        let enqueue = tokio::spawn(async move { again.enqueue(keyed("k", "acct", 4)).await });
        db.wait_until_lock_waiting("again").await;
        sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(gate)
            .execute(&mut gate_conn)
            .await
            .unwrap();
        let report = within(10, "prune", prune).await.unwrap().unwrap();
        let id = within(10, "the enqueue", enqueue).await.unwrap().unwrap();
        assert_eq!((report.jobs, report.keys), (3, 1), "{report:?}");
        let rec = db.store.job(id).await.unwrap();
        assert_eq!(rec.state, JobState::Pending, "the new job heads its key");
        let ran = run_all(&db, &w).await;
        let acct: Vec<_> = ran
            .iter()
            .filter(|j| j.key.as_deref() == Some("acct"))
            .collect();
        assert_eq!(acct.len(), 1);
        assert!(
            acct[0].key_seq > old.iter().map(|j| j.key_seq).max().unwrap(),
            "key_seq went back after the key row was deleted: {:?}",
            acct[0].key_seq
        );
        drop(gate_conn);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_pass_skips_a_slot_a_host_transaction_enqueued_into_and_never_waits_for_it() {
    bounded(async {
        let db = TestDb::new("ret_key_host_tx").await;
        let w = owner("w");
        db.store.enqueue(keyed("k", "acct", 1)).await.unwrap();
        run_all(&db, &w).await;
        // A host transaction enqueues into another key of the slot, and stays open.
        let mate = same_slot_key(&db, "acct").await;
        let mut host = db.pool.begin().await.unwrap();
        db.store
            .enqueue_in(&mut host, keyed("k", &mate, 1))
            .await
            .unwrap();
        let report = within(10, "a prune beside an open host transaction", async {
            common::prune_now(&db.store, 100).await.unwrap()
        })
        .await;
        assert_eq!((report.jobs, report.keys), (1, 0), "{report:?}");
        assert_eq!(db.count_where("job_keys", "job_key = 'acct'").await, 1);
        host.commit().await.unwrap();
        // Once it committed, the key's row goes, and the key comes back above it.
        let report = common::prune_now(&db.store, 100).await.unwrap();
        assert_eq!(report.keys, 1, "{report:?}");
        let id = db.store.enqueue(keyed("k", "acct", 2)).await.unwrap();
        assert!(db.store.job(id).await.unwrap().key_seq > Some(1));
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_that_hits_its_statement_timeout_shrinks_its_batch_in_every_mode() {
    bounded(async {
        for pooled in [false, true] {
            let options = StoreOptions {
                transaction_pooler: pooled,
                ..StoreOptions::default()
            };
            let db = TestDb::with_options("ret_timeout", options, 4).await;
            // 2,000 due jobs, each history row's deletion slowed: a statement of 2,000
            // takes 2 s, far over the pass's 300 ms.
            finished_jobs(&db, &db.owner, 2_000, "8 days", "NULL", "NULL").await;
            exec(
                &db,
                "CREATE FUNCTION {s}.slow_event_delete() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN PERFORM pg_sleep(0.001); RETURN OLD; END $$;
                 CREATE TRIGGER slow_event_delete BEFORE DELETE ON {s}.job_events
                 FOR EACH ROW EXECUTE FUNCTION {s}.slow_event_delete();",
            )
            .await;
            let mut prune = PruneOptions::new(WEEK);
            prune.batch = 2_000;
            prune.statement_timeout = Duration::from_millis(300);
            let report = within(30, "a pass that times out", db.store.prune_with(&prune))
                .await
                .unwrap_or_else(|e| panic!("pooled {pooled}: the pass failed: {e}"));
            assert!(
                report.timeouts >= 1 && report.batch < 2_000 && report.jobs > 0,
                "pooled {pooled}: {report:?}"
            );
            assert_eq!(
                report.jobs as i64,
                2_000 - db.count_where("jobs", "true").await
            );
            // Passes at the smaller batch finish the work.
            prune.batch = report.batch;
            let mut left = db.count_where("jobs", "true").await;
            while left > 0 {
                let pass = within(30, "a pass", db.store.prune_with(&prune))
                    .await
                    .unwrap();
                assert!(pass.jobs > 0, "pooled {pooled}: no progress: {pass:?}");
                prune.batch = pass.batch;
                left = db.count_where("jobs", "true").await;
            }
            db.drop().await;
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_prunes_a_schema_at_a_time_and_the_others_skip_without_waiting() {
    bounded(async {
        let db = TestDb::new("ret_one_pruner").await;
        finished_jobs(&db, &db.owner, 10, "8 days", "NULL", "NULL").await;
        // Another process's pass holds the schema's retention lock.
        let mut other = db.raw_conn("other").await;
        sqlx::query("BEGIN").execute(&mut other).await.unwrap();
        let locked: bool = sqlx::query_scalar(&format!(
            "SELECT pg_try_advisory_xact_lock({})",
            leasehold::store::RETENTION_LOCK_KEY
        ))
        .bind(&db.schema)
        .fetch_one(&mut other)
        .await
        .unwrap();
        assert!(locked);
        let report = within(5, "a pass while another prunes", db.store.prune(WEEK, 100))
            .await
            .unwrap();
        assert!(report.skipped && report.deleted() == 0, "{report:?}");
        sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
        let report = db.store.prune(WEEK, 100).await.unwrap();
        assert_eq!((report.skipped, report.jobs), (false, 10), "{report:?}");
        db.drop().await;
    })
    .await
}
