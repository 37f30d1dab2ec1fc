//! Schedulers behind a real PgBouncer in transaction mode (`store.transaction_pooler`):
//! two of them keep each key's order and make each effect once, a shutdown gives back
//! what it held, and wake-ups come through a direct `listen_url`, or from polling
//! alone without one (no listener connection then); the idle enqueue-to-start latency
//! of each, and of the same straight to PostgreSQL, is printed (`--nocapture`). Each test has a database of its
//! own (`OwnDb`), so it can count the scheduler's backends by name.

mod common;
#[path = "common/host_keys.rs"]
mod host_keys;
#[path = "common/pgbouncer.rs"]
mod pgbouncer;
#[path = "common/scripted.rs"]
mod scripted;
#[path = "common/worker.rs"]
mod worker;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::within;
use leasehold::{Config, Handler, JobContext, JobError, JobState, NewJob, Scheduler};
use pgbouncer::PgBouncer;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use worker::{fast_config, run_in_system, wait_until, OwnDb};

/// The scheduler's pool through `bouncer`, to the test's own database.
async fn pooled_pool(bouncer: &PgBouncer, own: &OwnDb, size: u32) -> PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(bouncer.options().database(&own.database))
        .await
        .expect("connect through pgbouncer")
}

/// [`fast_config`] behind a transaction pooler, listening on a direct URL if `listen`.
fn pooled_config(own: &OwnDb, listen: bool) -> Config {
    let mut c = fast_config(&own.db.schema);
    c.store.transaction_pooler = true;
    if listen {
        let (user, host, port) = (
            std::env::var("PGUSER").unwrap_or_else(|_| "root".into()),
            std::env::var("PGHOST").unwrap_or_else(|_| "127.0.0.1".into()),
            std::env::var("PGPORT").unwrap_or_else(|_| "5432".into()),
        );
        c.listen_url = Some(format!("postgres://{user}@{host}:{port}/{}", own.database));
    }
    c
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Step {
    key: String,
    n: i64,
}

/// One run: which key and position, and when it started and ended.
#[derive(Clone, Debug)]
struct Run {
    key: String,
    n: i64,
    attempt: i32,
    start: Instant,
    end: Instant,
}

/// Pays once per job through the effect ledger; every third job's first attempt fails
/// after paying, so its retry must find the payment recorded.
#[derive(Clone, Default)]
struct Paying {
    runs: Arc<Mutex<Vec<Run>>>,
    payments: Arc<Mutex<HashMap<String, u32>>>,
}

impl Handler for Paying {
    type Payload = Step;
    type Output = ();
    const KIND: &'static str = "paying";

    async fn run(&self, ctx: JobContext, step: Step) -> Result<(), JobError> {
        let start = Instant::now();
        let payments = self.payments.clone();
        ctx.once("pay", &step.n, |key| async move {
            *payments
                .lock()
                .unwrap()
                .entry(key.as_str().to_string())
                .or_default() += 1;
            Ok(())
        })
        .await?;
        tokio::time::sleep(Duration::from_millis(3)).await;
        self.runs.lock().unwrap().push(Run {
            key: step.key.clone(),
            n: step.n,
            attempt: ctx.attempt(),
            start,
            end: Instant::now(),
        });
        if step.n % 3 == 0 && ctx.attempt() == 1 {
            return Err(JobError::retry("fails after paying, once"));
        }
        Ok(())
    }
}

#[test]
fn two_schedulers_through_the_pooler_keep_key_order_and_pay_once() {
    run_in_system(within(90, "two pooled schedulers", async {
        let own = OwnDb::new("pooler_two").await;
        // Two server connections for two schedulers' dozen client connections.
        let bouncer = PgBouncer::start(2);
        let handler = Paying::default();
        let mut schedulers = Vec::new();
        for _ in 0..2 {
            let pool = pooled_pool(&bouncer, &own, 4).await;
            let s = Scheduler::builder(pool, pooled_config(&own, true))
                .register(handler.clone())
                .start()
                .await
                .unwrap();
            schedulers.push(s);
        }
        let (keys, per_key): (i64, i64) = (4, 12);
        let jobs: Vec<NewJob> = (0..per_key)
            .flat_map(|n| (0..keys).map(move |k| (k, n)))
            .map(|(k, n)| {
                let key = format!("acct-{k}");
                NewJob::new(
                    Paying::KIND,
                    &Step {
                        key: key.clone(),
                        n,
                    },
                )
                .unwrap()
                .with_key(key)
            })
            .collect();
        schedulers[0].enqueue_many(jobs).await.unwrap();
        let total: i64 = keys * per_key;
        wait_until(60, "every job done", || async {
            own.db.count_where("jobs", "state = 'done'").await == total
        })
        .await;
        for s in &schedulers {
            s.shutdown().await.unwrap();
        }

        // Per key: runs in enqueue order, one at a time (a retry runs before the next).
        let runs = handler.runs.lock().unwrap().clone();
        let mut by_key: BTreeMap<String, Vec<Run>> = BTreeMap::new();
        for r in runs {
            by_key.entry(r.key.clone()).or_default().push(r);
        }
        assert_eq!(by_key.len(), keys as usize);
        for (key, mut runs) in by_key {
            runs.sort_by_key(|r| r.start);
            let order: Vec<(i64, i32)> = runs.iter().map(|r| (r.n, r.attempt)).collect();
            let expected: Vec<(i64, i32)> = (0..per_key)
                .flat_map(|n| {
                    if n % 3 == 0 {
                        vec![(n, 1), (n, 2)]
                    } else {
                        vec![(n, 1)]
                    }
                })
                .collect();
            assert_eq!(order, expected, "key {key}");
            for w in runs.windows(2) {
                assert!(w[0].end <= w[1].start, "key {key}: runs overlap: {w:?}");
            }
        }
        // Each job paid exactly once, the retried ones included.
        let payments = handler.payments.lock().unwrap().clone();
        assert_eq!(payments.len(), total as usize);
        assert!(payments.values().all(|&n| n == 1), "{payments:?}");
        assert_eq!(own.db.count_where("effects", "true").await, total);
        drop(bouncer);
        own.drop().await;
    }))
}

/// Never returns by itself: holds its slot until the shutdown drops it.
#[derive(Clone)]
struct Holding;

impl Handler for Holding {
    type Payload = ();
    type Output = ();
    const KIND: &'static str = "holding";

    async fn run(&self, _: JobContext, _: ()) -> Result<(), JobError> {
        tokio::time::sleep(Duration::from_secs(3600)).await;
        Ok(())
    }
}

#[test]
fn a_shutdown_through_the_pooler_gives_back_the_running_and_the_claimed_ahead() {
    run_in_system(within(60, "pooled shutdown", async {
        let own = OwnDb::new("pooler_shutdown").await;
        let bouncer = PgBouncer::start(2);
        let mut config = pooled_config(&own, false);
        config.concurrency = 1;
        // Held ahead whatever the pace (the held job makes the pace nil).
        config.claim_ahead_window = None;
        config.lease = Duration::from_secs(60);
        config.renew_interval = Duration::from_secs(5);
        config.shutdown_grace = Duration::from_millis(300);
        let pool = pooled_pool(&bouncer, &own, 4).await;
        let s = Scheduler::builder(pool, config)
            .register(Holding)
            .start()
            .await
            .unwrap();
        let ids = s
            .enqueue_many(
                (0..3)
                    .map(|_| NewJob::new(Holding::KIND, &()).unwrap())
                    .collect(),
            )
            .await
            .unwrap();
        // One runs, two wait in this process (claimed ahead).
        wait_until(10, "all three claimed", || async {
            own.db.count_where("jobs", "state = 'running'").await == 3
        })
        .await;
        let report = s.shutdown().await.unwrap();
        assert_eq!(report.cancelled, 1, "{report:?}");
        for id in ids {
            let job = own.db.store.job(id).await.unwrap();
            assert_eq!(job.state, JobState::Pending, "{job:?}");
            assert_eq!((job.attempts, job.lease_until), (0, None), "{job:?}");
        }
        assert_eq!(own.db.count_where("lease_expiries", "true").await, 0);
        drop(bouncer);
        own.drop().await;
    }))
}

/// Starts and reports when: the enqueue-to-start latency probe.
#[derive(Clone)]
struct Started(tokio::sync::mpsc::UnboundedSender<Instant>);

impl Handler for Started {
    type Payload = ();
    type Output = ();
    const KIND: &'static str = "started";

    async fn run(&self, _: JobContext, _: ()) -> Result<(), JobError> {
        let _ = self.0.send(Instant::now());
        Ok(())
    }
}

/// A scheduler running [`Started`] on `pool`, and where its starts arrive.
async fn probe(
    pool: PgPool,
    config: Config,
) -> (Scheduler, tokio::sync::mpsc::UnboundedReceiver<Instant>) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let s = Scheduler::builder(pool, config)
        .register(Started(tx))
        .start()
        .await
        .unwrap();
    (s, rx)
}

/// Idle enqueue-to-start latencies of `samples` jobs, each enqueued by another client
/// (`store`: an enqueue through the scheduler's own handle wakes its claimer in-process)
/// after the claimer has backed off to `poll_interval_max` (`idle`, plus up to
/// `jitter` at random, so the enqueue does not fall at the same point of the poll cycle
/// each time).
async fn idle_latencies(
    store: &leasehold::Store,
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Instant>,
    samples: usize,
    idle: Duration,
    jitter: Duration,
) -> Vec<Duration> {
    let mut out = Vec::new();
    for _ in 0..samples {
        tokio::time::sleep(idle + jitter.mul_f64(rand::random::<f64>())).await;
        let sent = Instant::now();
        store
            .enqueue(NewJob::new(Started::KIND, &()).unwrap())
            .await
            .unwrap();
        let started = tokio::time::timeout(Duration::from_secs(20), rx.recv())
            .await
            .expect("the job started")
            .unwrap();
        out.push(started - sent);
    }
    out
}

/// Through the pooler, hosts' open transactions (straight to PostgreSQL) hold three keys
/// while their heads finish: the heads' completions wait for their keys, unkeyed jobs'
/// endings do not (there the writer's transactions bound their lock waits themselves,
/// `SET LOCAL lock_timeout`, since a session setting cannot be used). Fails without it:
/// the waiting completions hold the writer's connections, and the pooler's.
#[test]
fn completions_waiting_on_keys_a_host_holds_do_not_delay_other_endings_through_the_pooler() {
    run_in_system(within(120, "pooled keys held by hosts", async {
        let own = OwnDb::new("pooler_keywait").await;
        let bouncer = PgBouncer::start(6);
        let pool = pooled_pool(&bouncer, &own, 6).await;
        let h = scripted::Scripted::new(&pool);
        let config = pooled_config(&own, true);
        let lease = config.lease;
        let s = Scheduler::builder(pool, config)
            .register(h.clone())
            .start()
            .await
            .unwrap();
        host_keys::endings_while_hosts_hold_keys(s, &h, &own.db, &own.db.pool, lease).await;
        drop(bouncer);
        own.drop().await;
    }))
}

#[test]
fn wake_ups_come_through_the_listen_url_or_from_polling_alone() {
    run_in_system(within(90, "pooled wake-ups", async {
        let own = OwnDb::new("pooler_wakeups").await;
        let bouncer = PgBouncer::start(2);
        let samples = 4;

        // The yardstick: the same, straight to PostgreSQL (no pooler, LISTEN on the
        // host pool's address).
        let mut config = fast_config(&own.db.schema);
        config.poll_interval_max = Duration::from_secs(10);
        let (s, mut rx) = probe(own.db.pool.clone(), config).await;
        let direct = idle_latencies(
            &own.db.store,
            &mut rx,
            samples,
            Duration::from_secs(3),
            Duration::ZERO,
        )
        .await;
        s.shutdown().await.unwrap();

        // With a direct listen URL: one listener backend, and a NOTIFY starts the job
        // long before a poll would (polling backs off to 10 s here).
        let mut config = pooled_config(&own, true);
        config.poll_interval_max = Duration::from_secs(10);
        let (s, mut rx) = probe(pooled_pool(&bouncer, &own, 4).await, config).await;
        wait_until(10, "the listener to listen", || async {
            own.listening_backends_named("leasehold-listener").await == 1
        })
        .await;
        let listened = idle_latencies(
            &own.db.store,
            &mut rx,
            samples,
            Duration::from_secs(3),
            Duration::ZERO,
        )
        .await;
        s.shutdown().await.unwrap();
        assert!(
            listened.iter().all(|d| *d < Duration::from_secs(2)),
            "woken by NOTIFY: {listened:?}"
        );

        // Without one: no listener at all; polling alone (backing off to the default
        // 2 s) finds each job within poll_interval_max and the time of a claim.
        let mut config = pooled_config(&own, false);
        config.poll_interval_max = Config::default().poll_interval_max;
        let (s, mut rx) = probe(pooled_pool(&bouncer, &own, 4).await, config).await;
        let polled = idle_latencies(
            &own.db.store,
            &mut rx,
            samples,
            Duration::from_secs(4),
            Duration::from_secs(2),
        )
        .await;
        assert_eq!(own.backends_named("leasehold-listener").await, 0);
        s.shutdown().await.unwrap();
        assert!(
            polled.iter().all(|d| *d < Duration::from_secs(3)),
            "polling alone: {polled:?}"
        );
        let mean = |v: &[Duration]| v.iter().sum::<Duration>() / v.len() as u32;
        eprintln!(
            "idle enqueue-to-start: direct mean {:?} max {:?}; through pgbouncer with listen_url mean {:?} max {:?}; polling alone mean {:?} max {:?}",
            mean(&direct),
            direct.iter().max().unwrap(),
            mean(&listened),
            listened.iter().max().unwrap(),
            mean(&polled),
            polled.iter().max().unwrap()
        );
        drop(bouncer);
        own.drop().await;
    }))
}

/// Finishes at once.
#[derive(Clone)]
struct Quick;

impl Handler for Quick {
    type Payload = ();
    type Output = ();
    const KIND: &'static str = "quick";

    async fn run(&self, _: JobContext, _: ()) -> Result<(), JobError> {
        Ok(())
    }
}

/// Issue 30, item 7: with the default config (no `store.transaction_pooler`), a
/// scheduler behind a transaction-mode pooler is refused at start with one error that
/// names the switch and `listen_url`, before it has taken a job or opened a connection
/// of its own; a `Store` of its own is refused the same way by `migrate`. The same
/// config through a session-mode pooler, and straight to PostgreSQL, runs jobs.
#[test]
fn without_the_switch_a_transaction_pooler_is_refused_at_start_with_one_error_naming_it() {
    run_in_system(within(90, "pooler refused at start", async {
        let own = OwnDb::new("pooler_refused").await;
        let waiting = own
            .db
            .store
            .enqueue(NewJob::new(Quick::KIND, &()).unwrap())
            .await
            .unwrap();

        let bouncer = PgBouncer::start(2);
        let pool = pooled_pool(&bouncer, &own, 4).await;
        let start = Scheduler::builder(pool.clone(), fast_config(&own.db.schema))
            .register(Quick)
            .start()
            .await;
        let Err(err) = start else {
            panic!("a scheduler started behind a transaction pooler without the switch");
        };
        let text = err.to_string();
        assert!(
            matches!(
                err,
                leasehold::Error::Config {
                    field: "store.transaction_pooler",
                    ..
                }
            ),
            "{text}"
        );
        assert!(
            text.contains("`store.transaction_pooler = true`") && text.contains("`listen_url`"),
            "{text}"
        );
        let store = leasehold::Store::new(
            pool.clone(),
            &own.db.schema,
            leasehold::StoreOptions::default(),
        )
        .unwrap();
        let err = store
            .migrate()
            .await
            .expect_err("a store's migrate through the pooler");
        assert!(
            err.to_string().contains("store.transaction_pooler"),
            "{err}"
        );
        // Nothing was taken, and nothing of a scheduler's own was opened.
        let job = own.db.store.job(waiting).await.unwrap();
        assert_eq!(job.state, JobState::Pending, "{job:?}");
        assert_eq!((job.attempts, job.generation.0), (0, 0), "{job:?}");
        assert_eq!(own.scheduler_backends().await, 0);
        pool.close().await;
        drop(bouncer);

        // Session mode: every client connection keeps its server connection (sixteen
        // for the host pool's four, the scheduler's eight and the start-up check's two).
        let session = PgBouncer::start_session(16);
        let s = Scheduler::builder(
            pooled_pool(&session, &own, 4).await,
            fast_config(&own.db.schema),
        )
        .register(Quick)
        .start()
        .await
        .unwrap();
        wait_until(
            20,
            "the job to run through the session-mode pooler",
            || async { own.db.state_of(waiting).await == "done" },
        )
        .await;
        s.shutdown().await.unwrap();
        drop(session);

        // Straight to PostgreSQL.
        let s = Scheduler::builder(own.db.pool.clone(), fast_config(&own.db.schema))
            .register(Quick)
            .start()
            .await
            .unwrap();
        let direct = s.enqueue::<Quick>(&()).await.unwrap();
        wait_until(20, "the job to run straight to PostgreSQL", || async {
            own.db.state_of(direct).await == "done"
        })
        .await;
        s.shutdown().await.unwrap();
        own.drop().await;
    }))
}
