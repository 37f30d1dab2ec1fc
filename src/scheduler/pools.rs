//! The scheduler's own connections: small pools it opens from the host pool's connect
//! options, named after their role and the scheduler's owner id. They are made on the
//! scheduler's own threads, so no connection the host uses belongs to a runtime the
//! scheduler stops, and none of the scheduler's to a runtime the host stops.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use crate::config::Config;
use crate::job::OwnerId;

/// Session settings of the scheduler's maintenance connections (renewer, reaper): no
/// statement of theirs may wait long on a lock or run away. The renewal never waits on
/// a row lock by design (`SKIP LOCKED`); `lock_timeout` also bounds waits on table
/// locks (a host's `LOCK TABLE` or DDL). Set only on the scheduler's own sessions; the
/// host's pool is untouched.
pub(crate) const MAINTENANCE_SESSION: &str =
    "SET lock_timeout = '5s'; SET statement_timeout = '60s'; SET idle_in_transaction_session_timeout = '60s'";

/// Makes the scheduler's own small pools, named after their role and the owner.
#[derive(Clone)]
pub(crate) struct SidePools {
    pub connect: PgConnectOptions,
    pub owner: OwnerId,
    pub config: Config,
}

impl SidePools {
    /// A one-connection pool for `role`, named `leasehold-<role> <pid>:<nonce>` in
    /// `pg_stat_activity` (see [`OwnerId::short`]). The renewer and reaper sessions
    /// get [`MAINTENANCE_SESSION`], unless they go through a transaction pooler: a
    /// session `SET` there would stay on whichever server connection ran it, for the
    /// next client of that connection, and be missing from the next one we get.
    pub fn pool(&self, role: &str) -> PgPool {
        self.session_pool(role, self.connect.clone())
    }

    /// The listener's one-connection pool, connecting with `options` (the host pool's,
    /// or `Config::listen_url`'s).
    pub fn listener(&self, options: PgConnectOptions) -> PgPool {
        self.session_pool("listener", options)
    }

    fn session_pool(&self, role: &str, connect: PgConnectOptions) -> PgPool {
        let name = format!("leasehold-{role} {}", self.owner.short());
        let maintenance = role != "listener" && !self.config.store.transaction_pooler;
        // As the renewer's own bound (`LeaseRenewer::answer_within`).
        let statement_timeout = self.config.renew_interval.max(self.config.lease / 2);
        let renewer = maintenance && role == "renewer";
        PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(5))
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if maintenance {
                        sqlx::Executor::execute(&mut *conn, sqlx::raw_sql(MAINTENANCE_SESSION))
                            .await?;
                    }
                    if renewer {
                        // A renewal is abandoned after this anyway (client side).
                        let ms = statement_timeout.as_millis().max(100);
                        sqlx::Executor::execute(
                            &mut *conn,
                            sqlx::raw_sql(&format!("SET statement_timeout = {ms}")),
                        )
                        .await?;
                    }
                    Ok(())
                })
            })
            .connect_lazy_with(connect.application_name(&name))
    }

    pub fn maker(&self, role: &'static str) -> impl FnOnce() -> PgPool + Send + 'static {
        let me = self.clone();
        move || me.pool(role)
    }
}

/// The claimer's own connections (one per claim in flight), so a claim never waits for
/// the host's pool. They carry no session settings: the claim function sets what its
/// plans need for itself (see the store's claim module), which also holds behind a
/// transaction-mode pooler.
pub(crate) fn claim_session(connect: &PgConnectOptions, owner: &OwnerId) -> PgConnectOptions {
    connect
        .clone()
        .application_name(&format!("leasehold-claimer {}", owner.short()))
}

impl SidePools {
    /// The pool the scheduler writes job endings with (completions, failures,
    /// releases) and fetches a key's next job: `config.connections` connections, named
    /// `leasehold-writer <pid>:<nonce>`.
    /// The pool of the context handlers get when they do not run on the host's
    /// runtime (`Config::handler_threads` set): up to one connection per slot, at most
    /// 16, opened when a handler first writes (most handlers never do).
    pub fn handlers(&self) -> PgPool {
        PgPoolOptions::new()
            .max_connections(self.config.concurrency.clamp(1, 16) as u32)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(
                self.connect
                    .clone()
                    .application_name(&format!("leasehold-handlers {}", self.owner.short())),
            )
    }

    ///
    /// Its sessions wait at most `Config::writer_lock_wait` for a lock (`lock_timeout`): a
    /// key's head completing, failing or being released while a host's open transaction
    /// holds the key (its `enqueue_in`, say) must not sit on one of these few
    /// connections for as long as the host takes, or every other job's ending waits for
    /// a connection behind it (found by the fault harness: three keys held by hosts
    /// stalled all of a process's completions). The write is tried again after a pause,
    /// holding no connection meanwhile; the lease is renewed all along. Behind a
    /// transaction pooler, where a session `SET` would stay on the server connection for
    /// its next client, each of the writer's transactions sets it instead (`SET LOCAL`
    /// with its `BEGIN`: `Store::with_pooled_lock_wait`).
    pub fn writer(&self) -> PgPool {
        let bounded = !self.config.store.transaction_pooler;
        let ms = self.config.writer_lock_wait.as_millis();
        PgPoolOptions::new()
            .max_connections(self.config.connections)
            .acquire_timeout(Duration::from_secs(5))
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if bounded {
                        sqlx::Executor::execute(
                            &mut *conn,
                            sqlx::raw_sql(&format!("SET lock_timeout = {ms}")),
                        )
                        .await?;
                    }
                    Ok(())
                })
            })
            .connect_lazy_with(
                self.connect
                    .clone()
                    .application_name(&format!("leasehold-writer {}", self.owner.short())),
            )
    }
}
