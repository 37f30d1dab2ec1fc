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
    /// get [`MAINTENANCE_SESSION`].
    pub fn pool(&self, role: &str) -> PgPool {
        let name = format!("leasehold-{role} {}", self.owner.short());
        let maintenance = role != "listener";
        // As the renewer's own bound (`LeaseRenewer::answer_within`).
        let statement_timeout = self.config.renew_interval.max(self.config.lease / 2);
        let renewer = role == "renewer";
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
            .connect_lazy_with(self.connect.clone().application_name(&name))
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
    pub fn writer(&self) -> PgPool {
        PgPoolOptions::new()
            .max_connections(self.config.connections)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(
                self.connect
                    .clone()
                    .application_name(&format!("leasehold-writer {}", self.owner.short())),
            )
    }
}
