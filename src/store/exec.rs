//! Where the store's statements run: straight on the pool or connection, or, behind a
//! transaction-mode pooler ([`StoreOptions::transaction_pooler`]), each as an unnamed
//! statement inside a transaction.
//!
//! # Why both
//! sqlx prepares every statement under a name (`sqlx_s_1`, ...) and caches it per client
//! connection. A transaction-mode pooler (PgBouncer before 1.21, or with
//! `max_prepared_statements = 0`) hands each transaction whichever server connection is
//! free, so a cached name is missing there, or is another client's ("prepared statement
//! \"sqlx_s_1\" already exists"). An unnamed statement (`persistent(false)`) is not
//! enough on its own: sqlx parses it and binds it in two exchanges, each ended by a
//! Sync, and outside a transaction the pooler may give the second exchange another
//! server connection, where it silently runs whatever statement another client parsed
//! last (measured through PgBouncer 1.18: 394 wrong answers in 800 queries, no error).
//! Inside a transaction the pooler keeps one server connection from `BEGIN` to `COMMIT`,
//! so an unnamed statement there is safe. That is what this module does in pooled mode:
//! every statement is unnamed, and one that is not already inside a transaction gets a
//! transaction of its own. Direct connections keep sqlx's cached prepared statements.
//!
//! [`StoreOptions::transaction_pooler`]: super::StoreOptions::transaction_pooler

use futures_util::future::BoxFuture;
use futures_util::stream::{self, BoxStream, StreamExt};
use sqlx::postgres::PgTransactionManager;
use sqlx::postgres::{PgArguments, PgQueryResult, PgRow, PgStatement, PgTypeInfo};
use sqlx::TransactionManager;
use sqlx::{Acquire, Either, Execute, Executor, PgConnection, PgPool, Postgres};

use super::pooler::PoolerCheck;

type Item = std::result::Result<Either<PgQueryResult, PgRow>, sqlx::Error>;

/// A query as given, but never prepared under a name.
struct Unnamed<E>(E);

impl<'q, E: Execute<'q, Postgres>> Execute<'q, Postgres> for Unnamed<E> {
    fn sql(&self) -> &'q str {
        self.0.sql()
    }
    fn statement(&self) -> Option<&PgStatement<'q>> {
        self.0.statement()
    }
    fn take_arguments(
        &mut self,
    ) -> std::result::Result<Option<PgArguments>, sqlx::error::BoxDynError> {
        self.0.take_arguments()
    }
    fn persistent(&self) -> bool {
        false
    }
}

/// The store's pool as an executor: see the module docs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Db<'p> {
    pub pool: &'p PgPool,
    /// Asked before the first statement (see `pooler`).
    pub pooler: &'p PoolerCheck,
    pub pooled: bool,
    /// Behind a pooler: the `lock_timeout` of the transaction each statement gets.
    pub lock_wait: Option<std::time::Duration>,
}

/// A connection (maybe inside the caller's transaction) as an executor: see the
/// module docs.
#[derive(Debug)]
pub(crate) struct On<'c> {
    pub conn: &'c mut PgConnection,
    /// Asked before the first statement (see `pooler`).
    pub pooler: &'c PoolerCheck,
    pub pooled: bool,
    /// Behind a pooler: the `lock_timeout` of the transaction a statement gets when
    /// `conn` is not in one already.
    pub lock_wait: Option<std::time::Duration>,
}

/// Every result of `query` on `conn`, unnamed, inside a transaction: the caller's if
/// `conn` is in one, else one of its own, committed when the results are in.
async fn unnamed_in_transaction<'q, E>(
    conn: &mut PgConnection,
    query: E,
    lock_wait: Option<std::time::Duration>,
) -> Result<Vec<Item>, sqlx::Error>
where
    E: 'q + Execute<'q, Postgres>,
{
    if PgTransactionManager::get_transaction_depth(conn) > 0 {
        return Ok(conn.fetch_many(Unnamed(query)).collect().await);
    }
    let mut tx = begin(conn, lock_wait).await?;
    let items: Vec<Item> = tx.fetch_many(Unnamed(query)).collect().await;
    // A failed statement is an Err item: roll back at once, so the pooler gets its
    // server connection back now rather than at this connection's next use.
    if items.iter().all(|i| i.is_ok()) {
        tx.commit().await?;
    } else {
        tx.rollback().await?;
    }
    Ok(items)
}

/// `conn` is inside a transaction sqlx began (the caller's, or one of the store's).
pub(crate) fn in_transaction(conn: &mut PgConnection) -> bool {
    PgTransactionManager::get_transaction_depth(conn) > 0
}

/// Refuse a connection inside a transaction sqlx did not begin (the caller sent `BEGIN`
/// as a plain query). sqlx counts only the transactions it began, so on such a
/// connection leasehold's own `BEGIN` would be ignored by the server and its `COMMIT`
/// would commit the caller's transaction early (a `ROLLBACK`, discard it), and its
/// savepoints would be skipped. Asked only where a call would open a transaction or a
/// savepoint of its own and sqlx reports none: one round trip (`SAVEPOINT`, refused by
/// the server outside a transaction), never on the store's own connections. Found so,
/// the caller's transaction is left as it was (the probe's savepoint released) and the
/// call refused with [`Error::InvalidInput`](crate::Error::InvalidInput) for
/// `connection`.
pub(crate) async fn refuse_hidden_transaction(conn: &mut PgConnection) -> crate::Result<()> {
    if in_transaction(conn) {
        return Ok(());
    }
    match conn
        .execute("SAVEPOINT leasehold_hidden_transaction_probe")
        .await
    {
        Ok(_) => {
            conn.execute("RELEASE SAVEPOINT leasehold_hidden_transaction_probe")
                .await?;
            Err(crate::Error::InvalidInput {
                field: "connection",
                reason: "it is inside a transaction begun by a plain `BEGIN` query, which \
                         sqlx (and so leasehold) cannot see: leasehold's own COMMIT would end \
                         it. Begin the transaction through sqlx (`pool.begin()`, \
                         `conn.begin()`) and pass `&mut *tx`; nothing was written"
                    .into(),
            })
        }
        // 25P01 no_active_sql_transaction: autocommit, as sqlx says.
        Err(e) if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("25P01") => {
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// Begin a transaction on `conn`; with `lock_wait`, one whose lock waits are bounded
/// (`SET LOCAL lock_timeout`, sent with `BEGIN` as one simple query: no extra round
/// trip). A nested call makes a savepoint, which keeps the outer setting.
pub(crate) async fn begin(
    conn: &mut PgConnection,
    lock_wait: Option<std::time::Duration>,
) -> Result<sqlx::Transaction<'_, Postgres>, sqlx::Error> {
    match lock_wait {
        Some(wait) if PgTransactionManager::get_transaction_depth(conn) == 0 => {
            let ms = wait.as_millis();
            sqlx::Connection::begin_with(conn, format!("BEGIN; SET LOCAL lock_timeout = {ms}"))
                .await
        }
        _ => conn.begin().await,
    }
}

/// The pooler check before a statement on `conn` (see `pooler`): on a caller's open
/// transaction, one that does not keep an undecided verdict.
async fn ensure_on(pooler: &PoolerCheck, conn: &PgConnection) -> Result<(), sqlx::Error> {
    if PgTransactionManager::get_transaction_depth(conn) > 0 {
        pooler.ensure_in_transaction().await
    } else {
        pooler.ensure().await
    }
}

fn collected<'e>(fut: BoxFuture<'e, Result<Vec<Item>, sqlx::Error>>) -> BoxStream<'e, Item> {
    stream::once(fut)
        .map(|r| match r {
            Ok(items) => stream::iter(items).left_stream(),
            Err(e) => stream::iter(vec![Err(e)]).right_stream(),
        })
        .flatten()
        .boxed()
}

fn first_row(items: Vec<Item>) -> Result<Option<PgRow>, sqlx::Error> {
    for item in items {
        if let Either::Right(row) = item? {
            return Ok(Some(row));
        }
    }
    Ok(None)
}

impl<'p> Executor<'p> for Db<'p> {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, Item>
    where
        'p: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        if !self.pooled {
            if self.pooler.passed() {
                return self.pool.fetch_many(query);
            }
            return collected(Box::pin(async move {
                self.pooler.ensure().await?;
                Ok(self.pool.fetch_many(query).collect().await)
            }));
        }
        let pool = self.pool.clone();
        collected(Box::pin(async move {
            let mut conn = pool.acquire().await?;
            unnamed_in_transaction(&mut conn, query, self.lock_wait).await
        }))
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'p: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        if !self.pooled {
            if self.pooler.passed() {
                return self.pool.fetch_optional(query);
            }
            return Box::pin(async move {
                self.pooler.ensure().await?;
                self.pool.fetch_optional(query).await
            });
        }
        let pool = self.pool.clone();
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            first_row(unnamed_in_transaction(&mut conn, query, self.lock_wait).await?)
        })
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, sqlx::Error>>
    where
        'p: 'e,
    {
        self.pool.prepare_with(sql, parameters)
    }

    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<sqlx::Describe<Postgres>, sqlx::Error>>
    where
        'p: 'e,
    {
        self.pool.describe(sql)
    }
}

impl<'c> Executor<'c> for On<'c> {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, Item>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        if !self.pooled {
            if self.pooler.passed() {
                return self.conn.fetch_many(query);
            }
            return collected(Box::pin(async move {
                ensure_on(self.pooler, self.conn).await?;
                Ok(self.conn.fetch_many(query).collect().await)
            }));
        }
        collected(Box::pin(unnamed_in_transaction(
            self.conn,
            query,
            self.lock_wait,
        )))
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        if !self.pooled {
            if self.pooler.passed() {
                return self.conn.fetch_optional(query);
            }
            return Box::pin(async move {
                ensure_on(self.pooler, self.conn).await?;
                self.conn.fetch_optional(query).await
            });
        }
        Box::pin(async move {
            first_row(unnamed_in_transaction(self.conn, query, self.lock_wait).await?)
        })
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, sqlx::Error>>
    where
        'c: 'e,
    {
        self.conn.prepare_with(sql, parameters)
    }

    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<sqlx::Describe<Postgres>, sqlx::Error>>
    where
        'c: 'e,
    {
        self.conn.describe(sql)
    }
}
