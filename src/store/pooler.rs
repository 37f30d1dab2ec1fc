//! Telling a transaction-mode pooler from a direct connection, once per store, before
//! its first statement.
//!
//! Without [`StoreOptions::transaction_pooler`], the store's statements are prepared
//! under sqlx's names and cached per client connection. Behind a transaction-mode
//! pooler (PgBouncer `pool_mode = transaction`, or a managed pooler that behaves like
//! it) those names meet other clients' on shared server connections: `prepared
//! statement "sqlx_s_1" already exists`, or, worse, a name bound to another client's
//! statement. So every store asks once, on connections of its own, whether its pool
//! goes through such a pooler, and refuses every call with one error naming
//! `store.transaction_pooler` if it does. [`Store::migrate`](super::Store::migrate)
//! asks first; a store that never migrates (a web service that only enqueues) asks at
//! its first statement. Each store derived from it shares the verdict.
//!
//! [`StoreOptions::transaction_pooler`]: super::StoreOptions::transaction_pooler

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::PgPool;
use tokio::sync::OnceCell;

/// What the probe found, kept for the store's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    /// Straight to PostgreSQL or through a session-mode pool, or undecided within
    /// [`POOLER_PROBE_WAIT`] (going on as configured).
    Direct,
    /// Through a transaction-mode pooler while the store was not told.
    Pooler,
}

/// The pooler check of one store and every store derived from it.
pub(crate) struct PoolerCheck {
    /// The pool's own connect options: the probe's two connections are made with them,
    /// outside the pool. None for [`CHECKED`].
    options: Option<Arc<PgConnectOptions>>,
    /// Told (`transaction_pooler`): nothing to check.
    told: bool,
    verdict: OnceCell<Verdict>,
}

impl std::fmt::Debug for PoolerCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolerCheck")
            .field("told", &self.told)
            .field("verdict", &self.verdict.get())
            .finish()
    }
}

/// The refusal, carried through sqlx's error type out of the store's executors (see
/// `exec`) and turned into [`Error::Config`](crate::Error::Config) for
/// `store.transaction_pooler` by `From<sqlx::Error>`.
/// Holds the reason: [`POOLER_REFUSED`], or [`POOLER_UNDECIDED_IN_TRANSACTION`].
#[derive(Debug)]
pub(crate) struct PoolerRefused(pub &'static str);

impl std::fmt::Display for PoolerRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for PoolerRefused {}

/// The field of the [`Error::Config`](crate::Error::Config) a refused pool gets.
pub(crate) const POOLER_FIELD: &str = "store.transaction_pooler";

/// Why, in words: what was seen, and what to set.
pub(crate) const POOLER_REFUSED: &str = "the database connection goes through a \
    transaction-mode pooler (PgBouncer `pool_mode = transaction` or alike: one client \
    connection's statements ran on different server sessions, or two client connections \
    on one), where leasehold's statements fail (`prepared statement \"sqlx_s_1\" already \
    exists`, notifications arriving on another client's connection). Set \
    `store.transaction_pooler = true` (LEASEHOLD_STORE__TRANSACTION_POOLER=true through \
    `Config::set_from_env(\"LEASEHOLD\")`; `StoreOptions::transaction_pooler` for a \
    `Store` of its own; `--transaction-pooler` for the operator CLI) and `listen_url` to \
    a URL straight to PostgreSQL (LEASEHOLD_LISTEN_URL; without it new jobs are found by \
    polling), or connect straight to PostgreSQL or to a session-mode pool. See the \
    README's \"Behind PgBouncer in transaction mode\". Nothing was written";

/// The check of statements whose caller has asked already (the migration's, after
/// [`Store::migrate`](super::Store::migrate) did).
pub(crate) static CHECKED: PoolerCheck = PoolerCheck {
    options: None,
    told: true,
    verdict: OnceCell::const_new(),
};

/// Why a call on a caller's open transaction is refused when the check could not tell.
pub(crate) const POOLER_UNDECIDED_IN_TRANSACTION: &str = "leasehold could not tell within \
    10 s whether the database connection goes through a transaction-mode pooler, while the \
    caller's transaction was open: behind such a pooler with one server connection free, \
    that transaction holds it and the check waits for it. Nothing was written. Make one call \
    outside a transaction first (`Store::migrate` does; the verdict is kept for the store), \
    or set `store.transaction_pooler = true` if the pool goes through a transaction-mode \
    pooler. See the README's \"Behind PgBouncer in transaction mode\"";

impl PoolerCheck {
    pub(crate) fn new(pool: &PgPool, told: bool) -> PoolerCheck {
        PoolerCheck {
            options: Some(pool.connect_options()),
            told,
            verdict: OnceCell::new(),
        }
    }

    /// Known to be fine: told, or probed and found direct. The executors' fast path
    /// (one atomic load).
    pub(crate) fn passed(&self) -> bool {
        self.told || self.verdict.get() == Some(&Verdict::Direct)
    }

    /// Probe once (concurrent first callers wait for the one probe), then answer from
    /// the verdict: `Err(Configuration(PoolerRefused))` behind an untold pooler. A probe
    /// that could not connect decides nothing and is tried again by the next call, and
    /// its error is the call's; one refused for the role's or the server's connection
    /// limit (the pool may use every connection the role has) is undecided.
    pub(crate) async fn ensure(&self) -> Result<(), sqlx::Error> {
        self.ensure_with(false).await
    }

    /// [`PoolerCheck::ensure`] for a statement on a caller's open transaction. A probe
    /// that cannot tell within [`POOLER_PROBE_WAIT`] is not kept then: behind a pooler
    /// with one server connection, the caller's own transaction holds it, and the
    /// probe's transactions wait for it until the caller ends. The call is refused
    /// ([`POOLER_UNDECIDED_IN_TRANSACTION`]), having written nothing; the next one asks
    /// again.
    pub(crate) async fn ensure_in_transaction(&self) -> Result<(), sqlx::Error> {
        self.ensure_with(true).await
    }

    async fn ensure_with(&self, in_transaction: bool) -> Result<(), sqlx::Error> {
        let Some(options) = self.options.as_deref().filter(|_| !self.told) else {
            return Ok(());
        };
        let init = || async {
            match probe(options).await? {
                Some(true) => Ok::<_, sqlx::Error>(Some(Verdict::Pooler)),
                Some(false) => Ok(Some(Verdict::Direct)),
                None if in_transaction => Ok(None),
                None => {
                    tracing::warn!(
                        "leasehold could not tell within {POOLER_PROBE_WAIT:?} whether the \
                         pool goes through a transaction-mode pooler; going on as \
                         configured (direct)"
                    );
                    Ok(Some(Verdict::Direct))
                }
            }
        };
        let verdict = if in_transaction && !self.verdict.initialized() {
            match init().await? {
                Some(v) => *self.verdict.get_or_init(|| async { v }).await,
                None => {
                    return Err(sqlx::Error::Configuration(Box::new(PoolerRefused(
                        POOLER_UNDECIDED_IN_TRANSACTION,
                    ))))
                }
            }
        } else {
            *self
                .verdict
                .get_or_try_init(|| async { init().await.map(|v| v.unwrap_or(Verdict::Direct)) })
                .await?
        };
        match verdict {
            Verdict::Direct => Ok(()),
            Verdict::Pooler => Err(sqlx::Error::Configuration(Box::new(PoolerRefused(
                POOLER_REFUSED,
            )))),
        }
    }
}

/// Rounds of [`sessions_are_shared`]: a pooler that hands out the server connection
/// freed last or first is caught by the second round; one that picks at random, with
/// probability 1 - 2^-(rounds - 1) or better.
const POOLER_PROBES: usize = 6;

/// How long the probe may take (two connects and a few rounds of short queries). A
/// pooler with no server connection free makes it wait; it is then left undecided,
/// rather than failing a start that may well work.
const POOLER_PROBE_WAIT: Duration = Duration::from_secs(10);

/// Whether a pool made with `options` goes through a transaction-mode pooler: `None`
/// when that could not be told within [`POOLER_PROBE_WAIT`].
///
/// How it tells: two client connections made with the pool's options each ask
/// `pg_backend_pid()` inside a transaction (see [`sessions_are_shared`]). Straight to
/// PostgreSQL, or through a session-mode pooler, a client connection keeps one server
/// session for its whole life: each always gets the same pid, and the two pids differ.
/// Behind a transaction pooler the server connection goes back to the pool after every
/// transaction, so the next one may run on another. So the verdict "pooler" is never
/// wrong, and no timing is involved. Other ways were weighed and are weaker: `SHOW`
/// differs between poolers (PgBouncer answers its own only on its admin console); a
/// session `SET` read back stays on the server connection that ran it, for whichever
/// client gets that next; a prepared-statement probe fails only when two clients'
/// statements happen to meet on one server connection. The probe sends simple-protocol
/// queries only (no named statement, which could itself collide) on connections of its
/// own, closed before this returns.
async fn probe(options: &PgConnectOptions) -> Result<Option<bool>, sqlx::Error> {
    use sqlx::Connection;
    let probe = async {
        let mut a = sqlx::PgConnection::connect_with(options).await?;
        let mut b = sqlx::PgConnection::connect_with(options).await?;
        let verdict = sessions_are_shared(&mut a, &mut b).await;
        let _ = a.close().await;
        let _ = b.close().await;
        verdict
    };
    match tokio::time::timeout(POOLER_PROBE_WAIT, probe).await {
        Ok(Err(e)) if at_connection_limit(&e) => {
            tracing::warn!(
                error = %e,
                "leasehold could not open the two connections that tell whether the pool \
                 goes through a transaction-mode pooler (a connection limit); going on as \
                 configured (direct)"
            );
            Ok(None)
        }
        Ok(verdict) => verdict.map(Some),
        Err(_) => Ok(None),
    }
}

/// The server refused a connection for a limit (53300 `too_many_connections`: the
/// role's or the server's), which says nothing about a pooler.
fn at_connection_limit(e: &sqlx::Error) -> bool {
    e.as_database_error().and_then(|d| d.code()).as_deref() == Some("53300")
}

/// Whether `a` and `b` do not each keep a server session of their own (see [`probe`]).
///
/// First one transaction on each in turn: a pooler with a single server connection free
/// (or one that hands out the connection freed last, PgBouncer's default) gives both
/// the same backend. Then rounds that open a transaction on both at once (so both hold
/// a server session: two sessions either way), read each one's backend, and end them in
/// turn, first `a`'s, then, the next round, first `b`'s. A pooler gives the next
/// transaction the server connection freed last, or the one freed first (PgBouncer's
/// `server_round_robin`), or one at random: in one order or the other, a client gets a
/// server the other client (or someone else) used, and its backend changes. Two clients
/// merely taking turns is not enough on its own: with round-robin each lands on "its"
/// server every time and looks direct.
async fn sessions_are_shared(
    a: &mut sqlx::PgConnection,
    b: &mut sqlx::PgConnection,
) -> Result<bool, sqlx::Error> {
    // A bare `&str` without arguments goes as a simple Query message: no named
    // statement. (`raw_sql(..).fetch_one` does the same, but makes `migrate`'s future
    // fail to be `Send` for every lifetime, so `tokio::spawn(store.migrate())` would not
    // compile.)
    async fn backend_in_tx(conn: &mut sqlx::PgConnection) -> Result<i32, sqlx::Error> {
        use sqlx::Row;
        sqlx::Executor::execute(&mut *conn, "BEGIN").await?;
        sqlx::Executor::fetch_one(conn, "SELECT pg_backend_pid()")
            .await?
            .try_get(0)
    }
    async fn end(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
        sqlx::Executor::execute(conn, "COMMIT").await.map(|_| ())
    }
    let pa = backend_in_tx(a).await?;
    end(a).await?;
    let pb = backend_in_tx(b).await?;
    end(b).await?;
    if pa == pb {
        return Ok(true);
    }
    let (mut a_pid, mut b_pid) = (Some(pa), Some(pb));
    for round in 0..POOLER_PROBES {
        let pa = backend_in_tx(a).await?;
        let pb = backend_in_tx(b).await?;
        if round % 2 == 0 {
            end(a).await?;
            end(b).await?;
        } else {
            end(b).await?;
            end(a).await?;
        }
        if pa == pb || *a_pid.get_or_insert(pa) != pa || *b_pid.get_or_insert(pb) != pb {
            return Ok(true);
        }
    }
    Ok(false)
}
