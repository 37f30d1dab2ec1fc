//! Listener: LISTEN for enqueue wake-ups and pass them to the claimer as hints, for
//! cancel requests and pass them to the attempts they name, and for paused queues (the
//! claimer then gives back what it claimed ahead of them).
//!
//! A cancel request names a job; every process checks its own running attempts, and
//! the one running it renews its leases at once: the renewal reads the row, and only a
//! cancel the row records stops a handler (with `CancelReason::Cancelled`). A
//! notification is a hint, never a fact: anyone may NOTIFY any channel, and a request
//! lost in a reconnect is still delivered by the attempt's next renewal.
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
use super::lease_renewer::{LeaseRenewer, RenewNow, Running};
use super::Metered;
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
    renewer: Metered<LeaseRenewer>,
    running: Running,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
}

impl Listener {
    pub fn new(
        pool: PgPool,
        channels: Channels,
        claimer: Metered<Claimer>,
        renewer: Metered<LeaseRenewer>,
        running: Running,
        metrics: Arc<Metrics>,
    ) -> Self {
        Listener {
            pool,
            channels,
            claimer,
            renewer,
            running,
            metrics,
            stop: CancellationToken::new(),
        }
    }
}

/// Someone says job `payload` (its id) was cancelled. When it runs here, renew at once:
/// the renewal reads the row and stops the attempt only if the row records a cancel
/// request for it (see the module docs). Costs one renewal statement per notification
/// that names a job running here; other payloads cost nothing.
fn cancel_hinted(running: &Running, renewer: &Metered<LeaseRenewer>, payload: &str) {
    let Ok(id) = payload.parse::<i64>() else {
        return;
    };
    if running.iter().any(|e| e.key().job.0 == id) {
        tracing::debug!(
            job = id,
            "leasehold cancel hinted; renewing now to read the row"
        );
        let _ = renewer.tell(RenewNow);
    }
}

struct Listening {
    channels: Channels,
    claimer: Metered<Claimer>,
    renewer: Metered<LeaseRenewer>,
    running: Running,
    metrics: Arc<Metrics>,
}

async fn listen_loop(pool: PgPool, on: Listening, stop: CancellationToken) {
    let Listening {
        channels,
        claimer,
        renewer,
        running,
        metrics,
    } = on;
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
                        cancel_hinted(&running, &renewer, n.payload());
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
        let on = Listening {
            channels: self.channels.clone(),
            claimer: self.claimer.clone(),
            renewer: self.renewer.clone(),
            running: self.running.clone(),
            metrics: self.metrics.clone(),
        };
        let fut = listen_loop(self.pool.clone(), on, self.stop.clone());
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
