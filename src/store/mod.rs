//! The store: the only place leasehold speaks SQL.
//!
//! Each function is one statement or one short transaction. Every write about a
//! claimed job is conditional on its [`Fence`](crate::Fence) `(id, owner, generation,
//! effect identity, state='running')`, and says what happened with an outcome enum. Functions that a
//! caller may want inside its own transaction take `&mut PgConnection` (a
//! `Transaction` derefs to one) and end in `_in`.
//!
//! Deadlines use the database clock. Functions that tests need to move through time
//! take `at: Option<DateTime<Utc>>`, used in SQL as `coalesce($at, now())`.

mod admin;
mod claim;
mod complete;
mod copy;
mod effects;
mod enqueue;
mod exec;
pub use enqueue::MAX_DELAY;
mod fail;
mod history;
pub(crate) use history::HistorySink;
pub use history::HISTORY_RETRY_AFTER;
mod input;
pub(crate) use input::{
    check_effect_key, check_json, check_name, to_json, unstorable_json, JsonLimit,
};
pub use input::{INDEXED_TEXT_ALWAYS_FITS, INDEX_ENTRY_LIMIT, MAX_PAYLOAD_DEPTH};
mod inspect;
mod keys;
mod lease;
mod listing;
mod migrate;
mod operator;
mod pause;
mod periodic;
pub(crate) mod pooler;
mod progress;
mod reap;
mod retention;
mod schedulers;
mod schema;
mod stats;
mod unique;
mod views;
mod wakeups;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

pub use admin::CancelOutcome;
pub use claim::ClaimRequest;
pub(crate) use complete::{KeyedItem, KeyedWait, RowWait};
pub(crate) use effects::Lookup;
pub use effects::{EffectRecord, RecordOutcome};
pub use fail::Failure;
pub use inspect::{JobFilter, JobPage, LeaseExpiry, DEFAULT_PAGE, MAX_PAGE, SEARCH_STRETCH};
pub(crate) use keys::Chain;
pub use lease::RenewReport;
pub use migrate::{runtime_grants, SCHEMA_VERSION};
pub use operator::{Action, CANCEL_REQUESTED, OPERATOR};
pub use pause::PausedQueue;
pub use progress::MAX_PROGRESS_BYTES;
pub use reap::{ReapReport, UNSTARTED_EXPIRIES_MAX};
pub use retention::{
    PruneOptions, PruneReport, DEFAULT_PRUNE_BATCH, DEFAULT_PRUNE_FLOOR,
    DEFAULT_PRUNE_STATEMENT_TIMEOUT, RETENTION_LOCK_KEY,
};
pub(crate) use schedulers::Heartbeat;
pub use schedulers::LiveScheduler;
pub use schema::Schema;
pub use stats::{KeyBlock, QueueGauges, QueueStats, RECENT_EXPIRIES};
pub use views::{KeyPosition, MinuteCount};

use crate::error::Result;

/// Store limits and defaults that do not change per call.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreOptions {
    /// Largest accepted payload, in bytes of its JSON encoding. Default 256 KiB.
    pub max_payload_bytes: usize,
    /// Largest result a handler may return, in bytes of its JSON encoding. A larger one
    /// (or one with a NUL, which jsonb cannot store) fails that attempt for good, with
    /// the reason. Default 1 MiB.
    pub max_result_bytes: usize,
    /// Attempts a job gets when its `NewJob` does not say. Default 25. A scheduler sets
    /// this from `Config::retry.max_attempts`; see [`Store::for_config`].
    pub default_max_attempts: i32,
    /// Write `claimed` and `completed` history events too (failures, expiries, releases
    /// and operator actions are always recorded). Default true.
    pub full_history: bool,
    /// The pool goes through a transaction-mode pooler (PgBouncer `pool_mode =
    /// transaction`, or a managed pooler that behaves like it): every statement is sent
    /// unnamed (never a cached prepared statement, which another client's server
    /// connection would not have) and inside a transaction (its own when the caller is
    /// not in one), so the pooler keeps one server connection for it. Costs two round
    /// trips per statement outside a transaction, and the parse that a cached statement
    /// saves. See the README's "Running at scale". Default false.
    pub transaction_pooler: bool,
}

/// Default [`StoreOptions::max_payload_bytes`]: 256 KiB.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 256 * 1024;
/// Default [`StoreOptions::max_result_bytes`]: 1 MiB.
pub const DEFAULT_MAX_RESULT_BYTES: usize = 1024 * 1024;
/// Default attempts per job ([`StoreOptions::default_max_attempts`] and
/// `Config::retry.max_attempts`): 25.
pub const DEFAULT_MAX_ATTEMPTS: i32 = 25;

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            max_result_bytes: DEFAULT_MAX_RESULT_BYTES,
            default_max_attempts: DEFAULT_MAX_ATTEMPTS,
            full_history: true,
            transaction_pooler: false,
        }
    }
}

/// Retry timing for failed attempts and expired leases, computed by the database:
/// `min(cap, base * 2^(attempt-1))`, reduced by up to `jitter` (a fraction) at random.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Backoff {
    /// Wait after the first failed attempt; doubles with each attempt. Default 1 s.
    #[serde(with = "crate::config::humantime_serde")]
    pub base: Duration,
    /// The longest wait, whatever the attempt. Default 10 min.
    #[serde(with = "crate::config::humantime_serde")]
    pub cap: Duration,
    /// The largest fraction taken off a wait at random, 0.0 ..= 1.0, so jobs that
    /// failed together do not retry together. Default 0.25.
    pub jitter: f64,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(600),
            jitter: 0.25,
        }
    }
}

/// Handle to the job tables of one schema. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    schema: Schema,
    options: StoreOptions,
    sql: Statements,
    wakeups: wakeups::Wakeups,
    /// Behind a transaction pooler: the `lock_timeout` each transaction of this store
    /// sets for itself (`SET LOCAL`), where a session setting cannot be used. The
    /// scheduler's writer store has one (see `scheduler::pools::SidePools::writer`).
    lock_wait: Option<std::time::Duration>,
    /// `lock_wait` holds without a pooler too (see [`Store::with_lock_wait_everywhere`]).
    lock_wait_everywhere: bool,
    /// The attempts and priority of each kind a scheduler registered
    /// ([`crate::KindPolicy`]), applied at every enqueue through this store and every
    /// store made from it: the scheduler's own enqueues, its periodic fires, its
    /// handlers' follow-ups ([`crate::JobContext::enqueue`]) and its handle's store.
    kinds: Arc<HashMap<String, crate::KindPolicy>>,
    /// What this process's retention passes learned (where the jobs scan resumes, jobs
    /// too big to delete at once): shared by every store derived from this one.
    retention: Arc<retention::Memory>,
    /// Whether the pool goes through a transaction-mode pooler it was not told of
    /// (see `pooler`): shared by every store derived from this one.
    pooler: Arc<pooler::PoolerCheck>,
    /// Whether history rows are written now (see `history`): shared by every store
    /// derived from this one.
    history: Arc<history::History>,
}

impl Store {
    /// A store over `schema` (validated here). Call [`Store::migrate`] before use.
    pub fn new(pool: PgPool, schema: &str, options: StoreOptions) -> Result<Self> {
        let schema = Schema::new(schema)?;
        let sql = Statements::render(&schema);
        let pooler = Arc::new(pooler::PoolerCheck::new(&pool, options.transaction_pooler));
        Ok(Store {
            inner: Arc::new(Inner {
                pool,
                schema,
                options,
                sql,
                wakeups: wakeups::Wakeups::default(),
                lock_wait: None,
                lock_wait_everywhere: false,
                kinds: Arc::default(),
                retention: Arc::default(),
                pooler,
                history: Arc::default(),
            }),
        })
    }

    /// A store with the schema and limits of `config`, so jobs enqueued through it get
    /// the same defaults (attempts included) as through a scheduler with that config.
    pub fn for_config(pool: PgPool, config: &crate::Config) -> Result<Self> {
        Store::new(pool, &config.schema, config.store_options())
    }

    /// Create or upgrade the schema. Safe to call from many processes at once.
    ///
    /// This is the store's start-up (a scheduler's `start` calls it first), so it
    /// checks first that the pool does not go through a transaction-mode pooler
    /// unless [`StoreOptions::transaction_pooler`] says so: without the switch, every
    /// later statement would fail with protocol errors (`prepared statement "sqlx_s_1"
    /// already exists`, an unexpected `NotificationResponse`). It refuses then with
    /// [`Error::Config`](crate::Error::Config) for `store.transaction_pooler`, before it
    /// has changed anything. A store that is never migrated makes the same check before
    /// its first statement, and refuses every call so.
    pub async fn migrate(&self) -> Result<()> {
        self.inner.pooler.ensure().await?;
        migrate::migrate(
            &self.inner.pool,
            &self.inner.schema,
            self.options().transaction_pooler,
        )
        .await
    }

    /// The SQL [`Store::migrate`] would run now, as one script to apply by hand (it
    /// records the versions it applies, so a later `migrate` finds nothing to do).
    /// Reads which versions are applied; changes nothing.
    pub async fn migration_script(&self) -> Result<String> {
        self.inner.pooler.ensure().await?;
        migrate::script(
            &self.inner.pool,
            &self.inner.schema,
            self.options().transaction_pooler,
        )
        .await
    }

    /// The same store over another pool (the scheduler's maintenance connections).
    pub fn with_pool(&self, pool: PgPool) -> Store {
        self.derived(pool, None, false, self.inner.kinds.clone())
    }

    /// A store sharing this one's schema, options and kinds' policies, with its own statements
    /// and wake-ups.
    fn derived(
        &self,
        pool: PgPool,
        lock_wait: Option<Duration>,
        lock_wait_everywhere: bool,
        kinds: Arc<HashMap<String, crate::KindPolicy>>,
    ) -> Store {
        let i = &self.inner;
        Store {
            inner: Arc::new(Inner {
                pool,
                schema: i.schema.clone(),
                options: i.options.clone(),
                sql: Statements::render(&i.schema),
                wakeups: wakeups::Wakeups::default(),
                lock_wait,
                lock_wait_everywhere,
                kinds,
                retention: i.retention.clone(),
                pooler: i.pooler.clone(),
                history: i.history.clone(),
            }),
        }
    }

    /// This store with every transaction it runs behind a transaction pooler waiting
    /// at most `wait` for a lock (`SET LOCAL lock_timeout`, sent with its `BEGIN`).
    /// Without a pooler it changes nothing: give the pool's sessions the setting.
    pub(crate) fn with_pooled_lock_wait(&self, wait: std::time::Duration) -> Store {
        let i = &self.inner;
        self.derived(i.pool.clone(), Some(wait), false, i.kinds.clone())
    }

    /// This store with every transaction and statement it runs waiting at most `wait`
    /// for a lock, with or without a pooler: `SET LOCAL lock_timeout` sent with each
    /// `BEGIN`, and a statement sent on its own gets a transaction of its own for it (two
    /// more round trips). For the endings the executor writes itself (failures, snoozes,
    /// releases): one whose row another session holds must give its connection back
    /// after a short turn, not hold one of the writer's few connections for the session's
    /// whole `lock_timeout` while every other job's ending waits for a connection.
    pub(crate) fn with_lock_wait_everywhere(&self, wait: std::time::Duration) -> Store {
        let i = &self.inner;
        self.derived(i.pool.clone(), Some(wait), true, i.kinds.clone())
    }

    /// This store applying each kind's attempts and priority of `policies` to every job
    /// it enqueues that sets none of its own (a scheduler's stores: see
    /// [`crate::KindPolicy`]). One place decides a job's policy, so no enqueue path of a
    /// scheduler can leave it out.
    pub(crate) fn with_kind_policies(&self, policies: Vec<(String, crate::KindPolicy)>) -> Store {
        let i = &self.inner;
        self.derived(
            i.pool.clone(),
            i.lock_wait,
            i.lock_wait_everywhere,
            Arc::new(policies.into_iter().collect()),
        )
    }

    /// The policy of `kind` this store applies at enqueue, if it knows one.
    pub(crate) fn kind_policy(&self, kind: &str) -> Option<&crate::KindPolicy> {
        self.inner.kinds.get(kind)
    }

    /// Begin a transaction on `conn`: behind a transaction pooler, with this store's
    /// lock wait (if any) set in the same round trip.
    pub(crate) async fn begin<'c>(
        &self,
        conn: &'c mut sqlx::PgConnection,
    ) -> Result<sqlx::Transaction<'c, sqlx::Postgres>> {
        Ok(exec::begin(conn, self.pooled_lock_wait()).await?)
    }

    fn pooled_lock_wait(&self) -> Option<std::time::Duration> {
        self.inner
            .lock_wait
            .filter(|_| self.inner.options.transaction_pooler || self.inner.lock_wait_everywhere)
    }

    /// A connection of this store's pool for a transaction (or statements) of its own,
    /// once the pool is known not to go through an untold transaction pooler (see
    /// `pooler`): asked before the store begins anything on it, since behind such a
    /// pooler the store's own open transaction would hold the server connection the
    /// check needs. (Taken first: a client connection holds no server connection until
    /// it sends a statement, and a database that is down fails the call here, before a
    /// probe could mistake the wait for an undecided pooler.)
    pub(crate) async fn acquire(&self) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>> {
        let conn = self.inner.pool.acquire().await?;
        self.inner.pooler.ensure().await?;
        Ok(conn)
    }

    /// The pool this store's statements run on.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The schema holding this store's tables.
    pub fn schema(&self) -> &Schema {
        &self.inner.schema
    }

    /// The limits and defaults this store enqueues and completes with.
    pub fn options(&self) -> &StoreOptions {
        &self.inner.options
    }

    /// The pool as the executor every statement of the store runs on (see `exec`).
    pub(crate) fn db(&self) -> exec::Db<'_> {
        exec::Db {
            pool: &self.inner.pool,
            pooler: &self.inner.pooler,
            pooled: self.inner.options.transaction_pooler || self.inner.lock_wait_everywhere,
            lock_wait: self.pooled_lock_wait(),
        }
    }

    /// `conn` (a pooled connection, or the caller's transaction) as the executor a
    /// statement of the store runs on (see `exec`).
    pub(crate) fn on<'c>(&'c self, conn: &'c mut sqlx::PgConnection) -> exec::On<'c> {
        exec::On {
            conn,
            pooler: &self.inner.pooler,
            pooled: self.inner.options.transaction_pooler || self.inner.lock_wait_everywhere,
            lock_wait: self.pooled_lock_wait(),
        }
    }

    pub(crate) fn sql(&self) -> &Statements {
        &self.inner.sql
    }

    pub(crate) fn wakeups(&self) -> &wakeups::Wakeups {
        &self.inner.wakeups
    }
}

/// Every statement, rendered once for the schema. sqlx prepares each on first use per
/// connection and reuses it, so the hot path never re-parses.
pub(crate) struct Statements {
    pub enqueue: String,
    pub enqueue_copy: String,
    pub enqueue_copy_notify: String,
    pub claim: String,
    pub claim_key: String,
    pub renew: String,
    pub complete: String,
    pub complete_keyed: String,
    pub job_row_exists: String,
    pub complete_unkeyed: String,
    pub complete_unkeyed_skipping: String,
    pub completion_readback: String,
    pub keys_of: String,
    pub fail: String,
    pub snooze: String,
    pub release: String,
    pub prune_jobs: String,
    pub prune_effects: String,
    pub prune_keys: String,
    pub prune_fires: String,
    pub prune_key_tops: String,
    pub raise_floors: String,
    pub leave_keys: String,
    pub promote: String,
    pub reap: String,
    pub effect_record: String,
    pub effect_lookup: String,
    pub effect_lookup_under: String,
}

impl Statements {
    fn render(s: &Schema) -> Self {
        Statements {
            enqueue: s.render(&slots(enqueue::ENQUEUE)),
            enqueue_copy: s.render(&copy::copy_statement()),
            enqueue_copy_notify: s.render(copy::COPY_NOTIFY),
            claim: s.render(claim::CLAIM),
            claim_key: s.render(&claim::with_returned(claim::CLAIM_KEY)),
            renew: s.render(lease::RENEW),
            complete: s.render(complete::COMPLETE),
            complete_keyed: s.render(complete::COMPLETE_KEYED),
            job_row_exists: s.render(complete::JOB_ROW_EXISTS),
            complete_unkeyed: s.render(complete::COMPLETE_UNKEYED),
            complete_unkeyed_skipping: s.render(complete::COMPLETE_UNKEYED_SKIPPING),
            completion_readback: s.render(complete::COMPLETION_READBACK),
            keys_of: s.render(complete::KEYS_OF),
            fail: s.render(fail::FAIL),
            snooze: s.render(fail::SNOOZE),
            release: s.render(fail::RELEASE),
            prune_jobs: s.render(&retention::prune_jobs()),
            prune_effects: s.render(retention::PRUNE_EFFECTS),
            prune_keys: s.render(&slots(&retention::prune_keys())),
            prune_fires: s.render(retention::PRUNE_FIRES),
            prune_key_tops: s.render(&slots(&retention::prune_key_tops())),
            raise_floors: s.render(retention::RAISE_FLOORS),
            leave_keys: s.render(keys::LEAVE_KEYS),
            promote: s.render(&claim::with_returned(keys::PROMOTE)),
            reap: s.render(reap::REAP),
            effect_record: s.render(effects::RECORD),
            effect_lookup: s.render(effects::LOOKUP),
            effect_lookup_under: s.render(effects::LOOKUP_UNDER),
        }
    }
}

/// A template with its key-slot expressions filled in (see `key_floors`).
fn slots(template: &str) -> String {
    template
        .replace("__SLOT_JK__", keys::KEY_SLOT_JK)
        .replace("__SLOT_M__", keys::KEY_SLOT_M)
        .replace("__SLOT__", keys::KEY_SLOT)
}

/// Seconds as the `float8` that `make_interval(secs => ...)` takes.
pub(crate) fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// PostgreSQL text cannot hold NUL; error text is ours to sanitize (it is a record, not
/// an identity), and long texts are cut so a 10 MB panic message cannot bloat the row.
pub(crate) fn sanitize_error_text(text: &str) -> String {
    const MAX: usize = 4096;
    let mut out: String = text.replace('\0', "\\0");
    if out.len() > MAX {
        let mut cut = MAX;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push_str(" …[truncated]");
    }
    out
}
