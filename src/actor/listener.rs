//! Listener: LISTEN for enqueue wake-ups and pass them to the claimer as hints, for
//! cancel requests and pass them to the attempts they name, and for paused queues (the
//! claimer then gives back what it claimed ahead of them).
//!
//! A cancel request names a job; every process checks its own running attempts, and
//! the one running it cancels its handler with `CancelReason::Cancelled` at once. A
//! request lost in a reconnect is still delivered by the attempt's next renewal.
//!
//! # Lifecycle
//! Runs on the maintenance arbiter on its own connection: to the host pool's address,
//! or to `Config::listen_url`. Behind a transaction-mode pooler without a listen URL it
//! is not started (a pooled session cannot stay listening); polling alone finds work. When the connection drops
//! (a restarted database, `pg_terminate_backend`), it reconnects with backoff and
//! LISTENs again, and wakes the claimer once, since notifications sent during the gap
//! are lost. A NOTIFY is only a hint: the claimer's bounded polling is what guarantees
//! discovery.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use sqlx::postgres::{PgListener, PgPool};
use tokio_util::sync::CancellationToken;

use super::claimer::{Claimer, PausesChanged, Wake};
use super::lease_renewer::Running;
use super::Metered;
use crate::context::CancelReason;
use crate::metrics::Metrics;

/// The channels: enqueue wake-ups (and resumed queues), cancel requests, and paused
/// queues.
#[derive(Clone)]
pub(crate) struct Channels {
    pub wake: String,
    pub cancel: String,
    pub pause: String,
}

pub(crate) struct Listener {
    pool: PgPool,
    channels: Channels,
    claimer: Metered<Claimer>,
    running: Running,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
}

impl Listener {
    pub fn new(
        pool: PgPool,
        channels: Channels,
        claimer: Metered<Claimer>,
        running: Running,
        metrics: Arc<Metrics>,
    ) -> Self {
        Listener {
            pool,
            channels,
            claimer,
            running,
            metrics,
            stop: CancellationToken::new(),
        }
    }
}

/// An operator cancelled job `payload` (its id): cancel the attempts running it here.
fn cancel_requested(running: &Running, metrics: &Metrics, payload: &str) {
    let Ok(id) = payload.parse::<i64>() else {
        return;
    };
    for entry in running.iter().filter(|e| e.key().0 .0 == id) {
        let ctx = entry.value();
        if ctx.cancel_reason().is_none() {
            metrics.incr(|c| &c.cancels_requested);
            tracing::info!(
                job = id,
                "leasehold cancel requested by an operator; stopping the attempt"
            );
            ctx.cancel(CancelReason::Cancelled);
        }
    }
}

async fn listen_loop(
    pool: PgPool,
    channels: Channels,
    claimer: Metered<Claimer>,
    running: Running,
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
            l.listen_all([
                channels.wake.as_str(),
                channels.cancel.as_str(),
                channels.pause.as_str(),
            ])
            .await?;
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
        let _ = claimer.tell(PausesChanged);
        loop {
            tokio::select! {
                _ = stop.cancelled() => {
                    let _ = listener.unlisten_all().await;
                    return;
                }
                n = listener.try_recv() => match n {
                    Ok(Some(n)) if n.channel() == channels.cancel => {
                        cancel_requested(&running, &metrics, n.payload());
                    }
                    Ok(Some(n)) if n.channel() == channels.pause => {
                        let _ = claimer.tell(PausesChanged);
                    }
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
            self.channels.clone(),
            self.claimer.clone(),
            self.running.clone(),
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
