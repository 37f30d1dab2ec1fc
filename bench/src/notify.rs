//! What the enqueue wake-up (NOTIFY) costs when many producers commit at once.
//!
//! PostgreSQL serializes the commits of transactions that sent a NOTIFY (a cluster-wide
//! lock is held from queueing the notification until the commit is flushed), so a
//! one-job-per-transaction producer load could lose group commit. This section measures
//! the same single-row INSERT into the jobs table with and without a `pg_notify` in the
//! same statement, at 1 and 8 producers, beside leasehold's own `Store::enqueue` at 8.

use std::time::Instant;

use leasehold::Store;

use super::handlers::noop_job;
use super::setup::{self, QUEUE};

/// How each producer writes its jobs.
#[derive(Clone, Copy)]
pub enum Way {
    /// `Store::enqueue`, one job per transaction (NOTIFY included, as shipped).
    Leasehold,
    /// One INSERT per transaction with a `pg_notify` on the schema's channel.
    RawNotify,
    /// The same INSERT without it.
    RawQuiet,
}

/// Rows per second for `n` jobs written one per transaction by `producers` tasks.
pub async fn producers(store: &Store, way: Way, producers: u64, n: u64) -> f64 {
    setup::reset(store).await;
    let s = store.schema().quoted();
    let insert = format!(
        "INSERT INTO {s}.jobs (queue, kind, priority, state, payload, payload_bytes, max_attempts, dead_blocks_key) \
         VALUES ('{QUEUE}', 'noop', 0, 'pending', jsonb_build_object('n', $1::int8), 12, 25, true) RETURNING queue"
    );
    let sql = match way {
        Way::RawNotify => {
            format!("WITH ins AS ({insert}) SELECT count(pg_notify($2, queue)) FROM ins")
        }
        _ => format!("WITH ins AS ({insert}) SELECT count(*) FROM ins WHERE $2::text IS NOT NULL"),
    };
    let channel = store.schema().channel();
    let per = n / producers;
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..producers)
        .map(|p| {
            let (store, sql, channel) = (store.clone(), sql.clone(), channel.clone());
            tokio::spawn(async move {
                for i in p * per..(p + 1) * per {
                    match way {
                        Way::Leasehold => {
                            store.enqueue(noop_job(i)).await.expect("enqueue");
                        }
                        Way::RawNotify | Way::RawQuiet => {
                            let _: i64 = sqlx::query_scalar(&sql)
                                .bind(i as i64)
                                .bind(&channel)
                                .fetch_one(store.pool())
                                .await
                                .expect("raw insert");
                        }
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("producer");
    }
    let took = t0.elapsed().as_secs_f64();
    assert_eq!(
        setup::count_state(store, "pending").await,
        (per * producers) as i64
    );
    (per * producers) as f64 / took
}
