//! The history rows (`job_events`) are informational: no protocol write waits on them.
//!
//! Each protocol statement (claim, completion, failure, snooze, release, reap,
//! promotion) writes its history rows in the same statement as the state change, so an
//! ending costs one round trip. When the history table refuses a write (a trigger, a
//! full tablespace, a grant missing on `job_events` alone), that statement fails as a
//! whole. So a protocol call that fails with a refused statement is sent once more
//! without its history rows: if that succeeds, history was what failed. History is then
//! left out of every statement of the store (and of every store made from it) for
//! [`HISTORY_RETRY_AFTER`], so an outage costs one extra statement per that interval, not
//! one per call; the refusal is counted and logged once per distinct error, and shown as
//! the scheduler's `history_error`. If the second try fails as well, history was not the
//! cause: it stays on and the first error is returned. A lost connection, a deadlock, a
//! lock or statement timeout are never tried again so (the caller's own retry decides).
//!
//! Operator actions (hold, cancel, retry, ...) are not protocol work: their history row
//! is their audit record, so when it cannot be written the action is refused with the
//! database's error, which the operator sees, and nothing changes.

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::Store;
use crate::error::{Error, Result};

/// How long history is left out after a refusal, before a statement tries it again.
pub const HISTORY_RETRY_AFTER: Duration = Duration::from_secs(30);

/// Where a scheduler hears of history refusals (its metrics).
pub(crate) trait HistorySink: Send + Sync {
    /// History was refused with `error` (`None`: it is written again).
    fn history(&self, error: Option<&str>);
}

/// The history state of one store and every store derived from it.
#[derive(Default)]
pub(crate) struct History {
    /// History is left out until then.
    off_until: Mutex<Option<Instant>>,
    /// The latest refusal's text, until history is written again.
    last_error: Mutex<Option<String>>,
    /// Refusals so far: a call that wrote history clears a refusal only if none came
    /// while it ran (with some events refused and others not, a call writing the others
    /// must not hide a refusal that came meanwhile).
    refusals: AtomicU64,
    sink: OnceLock<Arc<dyn HistorySink>>,
}

impl History {
    /// Whether statements write their history rows now. Also notices the end of a
    /// pause (the next statement tries again).
    fn on(&self) -> bool {
        let mut off = self.off_until.lock().unwrap_or_else(|p| p.into_inner());
        match *off {
            Some(until) if Instant::now() < until => false,
            Some(_) => {
                *off = None;
                true
            }
            None => true,
        }
    }

    fn pause(&self) {
        *self.off_until.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(Instant::now() + HISTORY_RETRY_AFTER);
    }

    /// A refusal confirmed (the same call went through without history): counted, logged
    /// when its text differs from the one before, told to the sink.
    fn refused(&self, what: &'static str, error: &Error) {
        self.refusals.fetch_add(1, SeqCst);
        let text = error.to_string();
        let mut last = self.last_error.lock().unwrap_or_else(|p| p.into_inner());
        if last.as_deref() != Some(text.as_str()) {
            tracing::warn!(
                call = what,
                error = %text,
                "leasehold could not write job history (informational): the call went \
                 through without it; history is left out for {HISTORY_RETRY_AFTER:?}, then tried again"
            );
            *last = Some(text.clone());
        }
        if let Some(sink) = self.sink.get() {
            sink.history(Some(&text));
        }
    }

    /// A call that began when `refusals` were counted wrote its history: after
    /// refusals, and if none came since it began, logged once and told to the sink.
    fn written_again(&self, refusals: u64) {
        let mut last = self.last_error.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_some() && self.refusals.load(SeqCst) == refusals {
            *last = None;
            tracing::info!("leasehold writes job history again");
            if let Some(sink) = self.sink.get() {
                sink.history(None);
            }
        }
    }
}

/// A statement refused by the database for what it is (not for a lost connection or a
/// wait that may pass), which a history row may have caused.
fn refused_statement(e: &Error) -> bool {
    matches!(e, Error::Database(sqlx::Error::Database(_))) && !e.is_transient()
}

tokio::task_local! {
    /// Set while a call is tried again without history: only that call's statements
    /// leave their rows out, never another call's running meanwhile.
    static WITHOUT_HISTORY: ();
}

/// Run `call` with its history rows left out (see [`WITHOUT_HISTORY`]).
pub(crate) async fn without_history<T>(call: impl std::future::Future<Output = T>) -> T {
    WITHOUT_HISTORY.scope((), call).await
}

impl Store {
    /// Whether this store's statements write the history rows that are always recorded
    /// (failures, expiries, releases, snoozes) now: not inside a retry without history,
    /// nor while history is paused after a refusal.
    pub(crate) fn history_on(&self) -> bool {
        WITHOUT_HISTORY.try_with(|_| ()).is_err() && self.inner.history.on()
    }

    /// Whether this store's statements write `claimed`, `completed` and `promoted` rows
    /// now ([`StoreOptions::full_history`](super::StoreOptions::full_history)).
    pub(crate) fn full_history(&self) -> bool {
        self.options().full_history && self.history_on()
    }

    /// Refuse to start a scheduler whose role may not insert history rows. PostgreSQL
    /// checks a statement's privileges before it runs, so a protocol statement that
    /// holds a history insert is refused for a missing grant even when it would insert
    /// no row, and sending it again without history rows cannot help: without the grant,
    /// every claim and ending would fail. [`Error::Config`] for `grants`, naming the
    /// table and the grants to give.
    pub(crate) async fn check_history_grant(&self) -> Result<()> {
        let table = self.schema().render("{s}.job_events");
        let granted: bool =
            sqlx::query_scalar("SELECT has_table_privilege(current_user, $1::regclass, 'INSERT')")
                .bind(&table)
                .fetch_one(self.db())
                .await?;
        if granted {
            return Ok(());
        }
        Err(Error::Config {
            field: "grants",
            reason: format!(
                "the role this scheduler connects as may not insert into {table}: every claim \
                 and ending writes its history there, and PostgreSQL refuses a statement for a \
                 missing grant before it runs. Give the role \
                 `leasehold::store::runtime_grants` (the README's \"Running with least \
                 privilege\")"
            ),
        })
    }

    /// [`Store::history_on`], with the refusals counted so far when it is on (for
    /// [`Store::history_refused`]).
    pub(crate) fn history_from(&self) -> Option<u64> {
        let refusals = self.inner.history.refusals.load(SeqCst);
        self.history_on().then_some(refusals)
    }

    /// Tell `sink` of this store's history refusals (a scheduler's metrics).
    pub(crate) fn report_history_to(&self, sink: Arc<dyn HistorySink>) {
        let _ = self.inner.history.sink.set(sink);
    }

    /// Run `call` (one protocol call, whole: it binds [`Store::history_on`] and
    /// [`Store::full_history`] when it runs) and, if the database refused it, once more
    /// with its history left out (see the module docs). `call` must leave nothing
    /// written when it fails: one statement, or one transaction (or savepoint) of its own.
    pub(crate) async fn unless_history_refused<T, F, Fut>(
        &self,
        what: &'static str,
        call: F,
    ) -> Result<T>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let on = self.history_from();
        let first = call().await;
        match self.history_refused(on, first) {
            Ok(done) => done,
            Err(refused) => self.after_history_retry(what, refused, without_history(call()).await),
        }
    }

    /// The first try of a protocol call, made with history `on` (as
    /// [`Store::history_from`] said just before it): `Ok(its result)` to return, or
    /// `Err(its error)` when it should be tried once more inside [`without_history`].
    /// (The two halves of [`Store::unless_history_refused`], for a call on a borrowed
    /// connection that a closure cannot hand out twice.)
    pub(crate) fn history_refused<T>(
        &self,
        on: Option<u64>,
        first: Result<T>,
    ) -> std::result::Result<Result<T>, Error> {
        match first {
            Err(e) if on.is_some() && refused_statement(&e) => Err(e),
            Ok(v) => {
                if let Some(refusals) = on {
                    self.inner.history.written_again(refusals);
                }
                Ok(Ok(v))
            }
            other => Ok(other),
        }
    }

    /// The second try, without history, of a call whose first try was `refused`: if it
    /// went through, history was what the database refused, and it is paused.
    pub(crate) fn after_history_retry<T>(
        &self,
        what: &'static str,
        refused: Error,
        second: Result<T>,
    ) -> Result<T> {
        match second {
            Ok(v) => {
                self.inner.history.pause();
                self.inner.history.refused(what, &refused);
                Ok(v)
            }
            Err(_) => Err(refused),
        }
    }
}
