//! Throughput through PgBouncer in transaction mode (`StoreOptions::transaction_pooler`),
//! each run paired with the same drain straight to PostgreSQL.
//!
//! PgBouncer is Debian's (`apt-get install pgbouncer`), started here on a free loopback
//! port with the README's settings (`pool_mode = transaction`) and [`SERVER_CONNECTIONS`]
//! server connections, and stopped at the end (as the postgres user when run as root).

use leasehold::{Store, StoreOptions};

use super::setup;
use super::throughput;

#[path = "../../tests/common/pgbouncer.rs"]
mod pgbouncer;

pub use pgbouncer::PgBouncer;

/// PgBouncer's `default_pool_size`: the server connections every client shares.
pub const SERVER_CONNECTIONS: u32 = 8;

/// Jobs/s of a no-op scheduler at `concurrency` draining `n` preloaded jobs, its host
/// pool of `pool_size` client connections (and its own) through `bouncer`.
pub async fn through_pooler(
    store: &Store,
    bouncer: &PgBouncer,
    pool_size: u32,
    concurrency: usize,
    n: u64,
) -> f64 {
    let pool = setup::pool(&bouncer.options().database(&setup::db()), pool_size).await;
    let options = StoreOptions {
        transaction_pooler: true,
        ..store.options().clone()
    };
    let pooled = Store::new(pool.clone(), store.schema().name(), options).expect("store");
    let x = throughput::throughput(&pooled, concurrency, n, store.options().full_history).await;
    pool.close().await;
    x
}
