//! Throughput: the raw-SQL ceiling, leasehold end to end, enqueue, keyed work, and the
//! statement-cost diagnostic.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::{ClaimRequest, NewJob, OwnerId, Scheduler, Store};
use serde_json::json;
use sqlx::postgres::PgConnectOptions;
use sqlx::Connection;

use super::handlers::{config, debug_metrics, noop_job, wait_until, Cpu, Noop};
use super::report::percentile;
use super::setup::{self, QUEUE};

// ---------------------------------------------------------------------------------
// Raw-SQL ceiling

// One queue, `queue = $1`: the claim index leads with the queue (migration 3), and
// with `queue = ANY($1)` PostgreSQL 15 cannot take the index's order, so each claim
// sorted every pending row (25 ms at 40,000 pending instead of 0.1 ms).
const RAW_CLAIM: &str = "WITH cand AS (
    SELECT id FROM bench.jobs
    WHERE state = 'pending' AND available_at <= now() AND queue = $1
    ORDER BY priority, available_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE bench.jobs j
SET state = 'running', owner = $3, generation = j.generation + 1, attempts = j.attempts + 1,
    claimed_at = now(), lease_until = now() + interval '30 seconds'
FROM cand WHERE j.id = cand.id
RETURNING j.id, j.generation, j.payload";

const RAW_COMPLETE: &str = "UPDATE bench.jobs j
SET state = 'done', finished_at = now(), lease_until = NULL
FROM unnest($1::int8[], $2::int8[]) AS t(id, generation)
WHERE j.id = t.id AND j.generation = t.generation AND j.owner = $3 AND j.state = 'running'";

/// The same two statements as one: the previous loop's jobs completed and the next ones
/// claimed in a single round trip (and a single commit). Completed rows are `running`,
/// claimed ones `pending`, so the two UPDATEs never touch the same row. Rows with a
/// generation are the claimed jobs; the one row without counts the completed ones.
const RAW_COMPLETE_AND_CLAIM: &str = "WITH done AS (
    UPDATE bench.jobs j
    SET state = 'done', finished_at = now(), lease_until = NULL
    FROM unnest($4::int8[], $5::int8[]) AS t(id, generation)
    WHERE j.id = t.id AND j.generation = t.generation AND j.owner = $3 AND j.state = 'running'
    RETURNING j.id
), cand AS (
    SELECT id FROM bench.jobs
    WHERE state = 'pending' AND available_at <= now() AND queue = $1
    ORDER BY priority, available_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE bench.jobs j
    SET state = 'running', owner = $3, generation = j.generation + 1, attempts = j.attempts + 1,
        claimed_at = now(), lease_until = now() + interval '30 seconds'
    FROM cand WHERE j.id = cand.id
    RETURNING j.id, j.generation, j.payload
)
SELECT id, generation, payload FROM claimed
UNION ALL
SELECT count(*), NULL, NULL FROM done";

/// A row of [`RAW_COMPLETE_AND_CLAIM`]: a claimed job (id, generation, payload), or the
/// count of completed ones (count, NULL, NULL).
type OneTripRow = (i64, Option<i64>, Option<serde_json::Value>);

/// How the raw ceiling's loop talks to the database.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Trips {
    /// Claim, then complete: two statements (two round trips, two commits) per loop.
    Two,
    /// Complete the previous loop's jobs and claim the next in one statement.
    One,
}

/// `conns` connections, each looping: claim 100 with one SKIP LOCKED statement, complete
/// them with one fenced UPDATE. Jobs/s over `n` preloaded jobs.
pub async fn ceiling(store: &Store, opts: &PgConnectOptions, conns: usize, n: u64) -> f64 {
    raw_ceiling(store, opts, conns, n, Trips::Two).await.0
}

/// [`ceiling`], with the loop's statements sent as `trips` says: jobs/s, and the
/// statements PostgreSQL ended as deadlocks (sent again).
pub async fn raw_ceiling(
    store: &Store,
    opts: &PgConnectOptions,
    conns: usize,
    n: u64,
    trips: Trips,
) -> (f64, u64) {
    setup::reset(store).await;
    setup::raw_copy(store, "noop", n).await;
    setup::analyze(store).await;
    let mut connections = Vec::new();
    for _ in 0..conns {
        connections.push(setup::connect(opts).await);
    }
    let deadlocks = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let workers: Vec<_> = connections
        .into_iter()
        .enumerate()
        .map(|(w, mut conn)| {
            let deadlocks = deadlocks.clone();
            tokio::spawn(async move {
                let owner = format!("raw:{w}");
                let done = match trips {
                    Trips::Two => two_trip_loop(&mut conn, &owner).await,
                    Trips::One => one_trip_loop(&mut conn, &owner, &deadlocks).await,
                };
                conn.close().await.ok();
                done
            })
        })
        .collect();
    let mut total = 0;
    for w in workers {
        total += w.await.expect("raw worker");
    }
    let took = t0.elapsed().as_secs_f64();
    assert_eq!(total, n, "the raw ceiling must process every job");
    (n as f64 / took, deadlocks.load(Relaxed))
}

/// The loop of [`Trips::Two`]: claim, complete, again. Jobs completed.
async fn two_trip_loop(conn: &mut sqlx::PgConnection, owner: &str) -> u64 {
    let mut done = 0u64;
    loop {
        let rows: Vec<(i64, i64, serde_json::Value)> = sqlx::query_as(RAW_CLAIM)
            .bind(QUEUE)
            .bind(100i64)
            .bind(owner)
            .fetch_all(&mut *conn)
            .await
            .expect("raw claim");
        if rows.is_empty() {
            return done;
        }
        let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
        let gens: Vec<i64> = rows.iter().map(|r| r.1).collect();
        let r = sqlx::query(RAW_COMPLETE)
            .bind(&ids)
            .bind(&gens)
            .bind(owner)
            .execute(&mut *conn)
            .await
            .expect("raw complete");
        assert_eq!(r.rows_affected(), rows.len() as u64, "raw fence refused");
        done += rows.len() as u64;
    }
}

/// The loop of [`Trips::One`]: each statement completes what the last one claimed.
/// Jobs completed. A statement PostgreSQL ended as a deadlock is counted in `deadlocks`
/// and sent again. A SKIP LOCKED scan keeps the lock on a row it took and then found
/// already claimed by another (its newer version failed the recheck) until it commits;
/// here that transaction then waits, holding it, to complete its own rows, which another
/// such scan may hold the same way: two statements can each wait for the other. (The
/// two-statement loop, which stops on any error, met no deadlock.)
async fn one_trip_loop(conn: &mut sqlx::PgConnection, owner: &str, deadlocks: &AtomicU64) -> u64 {
    let (mut ids, mut gens): (Vec<i64>, Vec<i64>) = (Vec::new(), Vec::new());
    let mut done = 0u64;
    loop {
        let sent: sqlx::Result<Vec<OneTripRow>> = sqlx::query_as(RAW_COMPLETE_AND_CLAIM)
            .bind(QUEUE)
            .bind(100i64)
            .bind(owner)
            .bind(&ids)
            .bind(&gens)
            .fetch_all(&mut *conn)
            .await;
        let rows = match sent {
            // The statement rolled back whole: send it again with the same jobs.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("40P01") => {
                deadlocks.fetch_add(1, Relaxed);
                continue;
            }
            r => r.expect("raw complete and claim"),
        };
        let completed = rows
            .iter()
            .find(|r| r.1.is_none())
            .map_or(0, |r| r.0 as u64);
        assert_eq!(completed, ids.len() as u64, "raw fence refused");
        done += completed;
        (ids, gens) = rows.iter().filter_map(|r| r.1.map(|g| (r.0, g))).unzip();
        if ids.is_empty() {
            return done;
        }
    }
}

// ---------------------------------------------------------------------------------
// Leasehold end to end

/// Jobs/s of a scheduler with no-op handlers draining `n` preloaded unkeyed jobs.
pub async fn throughput(store: &Store, concurrency: usize, n: u64, history: bool) -> f64 {
    setup::reset(store).await;
    setup::raw_copy(store, "noop", n).await;
    setup::analyze(store).await;
    drain_noop(
        store,
        concurrency,
        history,
        n,
        Duration::from_secs(30 + n / 200),
    )
    .await
}

/// Jobs/s of a no-op scheduler draining `n` jobs bulk-loaded into a fresh schema beside
/// `beside` delayed jobs and `beside` jobs of another queue: as a new user's table is
/// after a bulk load with autovacuum not yet (or never) run. `analyzed`: the same, after
/// an ANALYZE, for the paired figure.
pub async fn throughput_fresh(
    pool: &sqlx::PgPool,
    history: bool,
    concurrency: usize,
    n: u64,
    beside: i64,
    analyzed: bool,
) -> f64 {
    let store = setup::fresh_schema(pool, "bench_fresh", history).await;
    setup::raw_copy(&store, "noop", n).await;
    setup::insert_beside(&store, beside).await;
    if analyzed {
        setup::analyze(&store).await;
    }
    let x = drain_noop(
        &store,
        concurrency,
        history,
        n,
        Duration::from_secs(60 + n / 50),
    )
    .await;
    setup::drop_schema(pool, "bench_fresh").await;
    x
}

/// Jobs/s of CPU-bound handlers ([`Cpu`], ~2 ms of one core each) at concurrency 8,
/// with handlers on the scheduler's starting runtime (`threads` None: one thread here)
/// or on `Config::handler_threads` threads.
pub async fn cpu_bound(store: &Store, threads: Option<usize>, n: u64, rounds: u64) -> f64 {
    setup::reset(store).await;
    setup::raw_copy(store, "noop", n).await;
    setup::analyze(store).await;
    let done = Arc::new(AtomicU64::new(0));
    let mut cfg = config(8, false);
    cfg.schema = store.schema().name().to_string();
    cfg.handler_threads = threads;
    let t0 = Instant::now();
    let s = Scheduler::builder(store.pool().clone(), cfg)
        .register(Cpu {
            done: done.clone(),
            rounds,
        })
        .start()
        .await
        .expect("start scheduler");
    wait_until(
        "the CPU-bound jobs to drain",
        Duration::from_secs(60 + n / 20),
        || done.load(Relaxed) >= n,
    )
    .await;
    let took = t0.elapsed().as_secs_f64();
    s.shutdown().await.expect("shutdown");
    n as f64 / took
}

/// Start a no-op scheduler on the loaded table and time it until `n` jobs completed;
/// jobs/s.
async fn drain_noop(
    store: &Store,
    concurrency: usize,
    history: bool,
    n: u64,
    limit: Duration,
) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let cpu0 = setup::cpu_secs();
    let t0 = Instant::now();
    let mut cfg = config(concurrency, history);
    cfg.schema = store.schema().name().to_string();
    cfg.store.transaction_pooler = store.options().transaction_pooler;
    let s = Scheduler::builder(store.pool().clone(), cfg)
        .register(Noop { done: done.clone() })
        .start()
        .await
        .expect("start scheduler");
    let (mut samples, mut empty, mut infl) = (0u64, 0u64, 0u64);
    wait_until("the scheduler to drain", limit, || {
        let m = s.metrics();
        samples += 1;
        empty += (m.ready == 0) as u64;
        infl += m.in_flight;
        m.counters.completed >= n
    })
    .await;
    let took = t0.elapsed().as_secs_f64();
    if std::env::var_os("BENCH_DEBUG").is_some() {
        eprintln!(
            "    samples {samples}: ready empty {:.0}%, mean in_flight {:.1}",
            empty as f64 * 100.0 / samples as f64,
            infl as f64 / samples as f64
        );
        eprintln!(
            "    process cpu {:.0}% of one core",
            (setup::cpu_secs() - cpu0) / took * 100.0
        );
    }
    debug_metrics(&s);
    s.shutdown().await.expect("shutdown");
    n as f64 / took
}

// ---------------------------------------------------------------------------------
// Enqueue

#[derive(Clone, Copy, Debug)]
pub enum EnqueueWay {
    One,
    Many,
    Copy,
    RawCopy,
}

/// Rows/s of enqueueing `n` unkeyed jobs one way, from building the jobs to commit.
pub async fn enqueue(store: &Store, way: EnqueueWay, n: u64) -> f64 {
    setup::reset(store).await;
    let t0 = Instant::now();
    match way {
        EnqueueWay::One => {
            for i in 0..n {
                store.enqueue(noop_job(i)).await.expect("enqueue");
            }
        }
        EnqueueWay::Many => {
            let mut i = 0;
            while i < n {
                let batch: Vec<NewJob> = (i..(i + 1000).min(n)).map(noop_job).collect();
                i += batch.len() as u64;
                store.enqueue_many(batch).await.expect("enqueue_many");
            }
        }
        EnqueueWay::Copy => {
            let jobs: Vec<NewJob> = (0..n).map(noop_job).collect();
            if std::env::var_os("BENCH_DEBUG").is_some() {
                eprintln!(
                    "    built {n} jobs in {:.1} ms",
                    t0.elapsed().as_secs_f64() * 1e3
                );
            }
            let written = store.enqueue_copy(jobs).await.expect("enqueue_copy");
            assert_eq!(written, n);
        }
        EnqueueWay::RawCopy => {
            assert_eq!(setup::raw_copy(store, "noop", n).await, n);
        }
    }
    let took = t0.elapsed().as_secs_f64();
    assert_eq!(setup::count_state(store, "pending").await, n as i64);
    n as f64 / took
}

// ---------------------------------------------------------------------------------
// Keyed work

/// Enqueue `keys` x `per_key` keyed no-op jobs, round robin over the keys.
pub async fn load_keyed(store: &Store, keys: u64, per_key: u64, kind: &str, prefix: &str) {
    let mut batch = Vec::with_capacity(5000);
    for j in 0..per_key {
        for k in 0..keys {
            batch.push(
                NewJob::from_json(kind, json!({ "n": j * keys + k }))
                    .with_key(format!("{prefix}{k}")),
            );
            if batch.len() == 5000 {
                store
                    .enqueue_many(std::mem::take(&mut batch))
                    .await
                    .expect("enqueue keyed");
            }
        }
    }
    if !batch.is_empty() {
        store.enqueue_many(batch).await.expect("enqueue keyed");
    }
}

/// Jobs/s draining `keys` x `per_key` keyed jobs.
pub async fn keyed(
    store: &Store,
    keys: u64,
    per_key: u64,
    concurrency: usize,
    history: bool,
) -> f64 {
    setup::reset(store).await;
    load_keyed(store, keys, per_key, "noop", "k").await;
    setup::analyze(store).await;
    let n = keys * per_key;
    drain_noop(
        store,
        concurrency,
        history,
        n,
        Duration::from_secs(30 + n / 100),
    )
    .await
}

// ---------------------------------------------------------------------------------
// Statement costs (diagnostic, `--only micro`)

/// Median ms of (leasehold claim, leasehold complete_many, raw claim, raw complete) for
/// batches of `batch`, one at a time on an otherwise idle database.
pub async fn micro(store: &Store, opts: &PgConnectOptions, batch: i64, rounds: usize) -> [f64; 4] {
    setup::reset(store).await;
    setup::raw_copy(store, "noop", 2 * rounds as u64 * batch as u64).await;
    setup::vacuum_analyze(store).await;
    let owner = OwnerId::named("bench:micro");
    let mut req = ClaimRequest::new(
        owner.clone(),
        vec![QUEUE.into()],
        batch,
        Duration::from_secs(30),
    );
    req.kinds = Some(vec!["noop".into()]);
    let (mut lc, mut lw, mut rc, mut rw) = (vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        let t = Instant::now();
        let jobs = store.claim(&req).await.expect("claim");
        lc.push(t.elapsed().as_secs_f64() * 1e3);
        let items: Vec<_> = jobs.iter().map(|j| (j.attempt(), None)).collect();
        let t = Instant::now();
        store.complete_many(&owner, &items).await.expect("complete");
        lw.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let mut conn = setup::connect(opts).await;
    for _ in 0..rounds {
        let t = Instant::now();
        let rows: Vec<(i64, i64, serde_json::Value)> = sqlx::query_as(RAW_CLAIM)
            .bind(QUEUE)
            .bind(batch)
            .bind("raw")
            .fetch_all(&mut conn)
            .await
            .expect("raw claim");
        rc.push(t.elapsed().as_secs_f64() * 1e3);
        let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
        let gens: Vec<i64> = rows.iter().map(|r| r.1).collect();
        let t = Instant::now();
        sqlx::query(RAW_COMPLETE)
            .bind(&ids)
            .bind(&gens)
            .bind("raw")
            .execute(&mut conn)
            .await
            .expect("raw complete");
        rw.push(t.elapsed().as_secs_f64() * 1e3);
    }
    conn.close().await.ok();
    [
        percentile(&lc, 0.5),
        percentile(&lw, 0.5),
        percentile(&rc, 0.5),
        percentile(&rw, 0.5),
    ]
}
