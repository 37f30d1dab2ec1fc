//! Listener: LISTEN for enqueue wake-ups and pass them to the claimer as hints.
//!
//! # Lifecycle
//! Runs on the maintenance arbiter on its own connection. When the connection drops
//! (a restarted database, `pg_terminate_backend`), it reconnects with backoff and
//! LISTENs again, and wakes the claimer once, since notifications sent during the gap
//! are lost. A NOTIFY is only a hint: the claimer's bounded polling is what guarantees
//! discovery.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use sqlx::postgres::{PgListener, PgPool};
use tokio_util::sync::CancellationToken;

use super::claimer::{Claimer, Wake};
use super::Metered;
use crate::metrics::Metrics;

pub(crate) struct Listener {
    pool: PgPool,
    channel: String,
    claimer: Metered<Claimer>,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
}

impl Listener {
    pub fn new(
        pool: PgPool,
        channel: String,
        claimer: Metered<Claimer>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Listener {
            pool,
            channel,
            claimer,
            metrics,
            stop: CancellationToken::new(),
        }
    }
}

async fn listen_loop(
    pool: PgPool,
    channel: String,
    claimer: Metered<Claimer>,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    let mut pause = Duration::from_millis(50);
    let mut first = true;
    while !stop.is_cancelled() {
        let connected = async {
            let mut l = PgListener::connect_with(&pool).await?;
            // We count and announce reconnects ourselves, so no silent auto-reconnect.
            l.ignore_pool_close_event(true);
            l.listen(&channel).await?;
            Ok::<_, sqlx::Error>(l)
        };
        let mut listener = tokio::select! {
            _ = stop.cancelled() => return,
            r = connected => match r {
                Ok(l) => l,
                Err(e) => {
                    metrics.incr(|c| &c.db_errors);
                    tracing::warn!(error = %e, "leasehold listener cannot connect; retrying");
                    tokio::select! { _ = stop.cancelled() => return, _ = tokio::time::sleep(pause) => {} }
                    pause = (pause * 2).min(Duration::from_secs(2));
                    continue;
                }
            }
        };
        if !first {
            metrics.incr(|c| &c.listener_reconnects);
            tracing::info!("leasehold listener reconnected");
        }
        first = false;
        pause = Duration::from_millis(50);
        // Anything sent while we were away is lost: look once.
        let _ = claimer.tell(Wake);
        loop {
            tokio::select! {
                _ = stop.cancelled() => {
                    let _ = listener.unlisten_all().await;
                    return;
                }
                n = listener.try_recv() => match n {
                    Ok(Some(_)) => {
                        metrics.incr(|c| &c.notifications);
                        let _ = claimer.tell(Wake);
                    }
                    Ok(None) | Err(_) => {
                        tracing::warn!("leasehold listener connection lost; reconnecting");
                        break;
                    }
                }
            }
        }
    }
}

impl Actor for Listener {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let fut = listen_loop(
            self.pool.clone(),
            self.channel.clone(),
            self.claimer.clone(),
            self.metrics.clone(),
            self.stop.clone(),
        );
        ctx.spawn(fut.into_actor(self));
    }
}

impl Handler<super::Stop> for Listener {
    type Result = ResponseActFuture<Self, ()>;
    fn handle(&mut self, _: super::Stop, _: &mut Self::Context) -> Self::Result {
        self.stop.cancel();
        let pool = self.pool.clone();
        Box::pin(
            async move {
                // Let the loop drop its connection first.
                tokio::time::sleep(Duration::from_millis(10)).await;
                pool.close().await
            }
            .into_actor(self)
            .map(|_, _, ctx| ctx.stop()),
        )
    }
}
