//! Periodic schedules under the faults: every worker process also runs one small
//! scheduler per *episode*, each on a schema of its own whose sessions read a shifted
//! database clock (`leasehold::testkit::clock`: a schema of `now()`,
//! `clock_timestamp()`, ... functions before `pg_catalog` in the `search_path`). The
//! schedulers' pools go through the worker's fault proxy, so every fault of the run
//! (kills, stops, restarts, partitions, PostgreSQL restarts) hits them too.
//!
//! - `spring`: the database clock reaches 2027-03-28 01:00 UTC (Europe/Berlin jumps from
//!   02:00 to 03:00) about a third into the fault phase. Schedules: `gap`, a cron of
//!   every 5 s of local hour 2 in Berlin, which does not exist that night: it fires
//!   once, at 03:00 local (01:00 UTC); `tick`, every second, kept by every build but
//!   the first worker's (a build without the schedule beside ones that keep it);
//!   `deploy`, every 2 s in the even workers' build and every 3 s in the odd ones' (two
//!   builds side by side with different specs).
//! - `autumn`: the database clock reaches 2027-11-07 06:00 UTC (America/New_York falls
//!   back from 02:00 EDT to 01:00 EST) the same way. Schedule: `overlap`, every 5 s of
//!   local hour 1, which happens twice: it fires in the first hour 1 only.
//!
//! Every schedule backfills what an outage made it miss, so the fire times are the
//! stored spec's times with no gap and no double, whatever the faults; the checker
//! reads them from the enqueued jobs (`check/periodic.rs`). The jobs go to a queue no
//! scheduler claims: they are evidence, not work. Host clocks are not skewed here
//! (every decision is the database clock's; the test suite shifts it both ways).

use std::time::Duration;

use chrono::{DateTime, Utc};
use leasehold::{CatchUp, Config, Handler, JobContext, JobError, NewJob, Periodic, Scheduler};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::PgPool;

/// The queue the schedules' jobs go to; no scheduler claims from it.
pub const FIRES_QUEUE: &str = "fires";

/// One shifted clock and the schedules that run by it.
pub struct Episode {
    pub name: &'static str,
    /// The database clock's instant of interest (a daylight-saving change).
    pub at: &'static str,
}

pub const EPISODES: [Episode; 2] = [
    Episode {
        name: "spring",
        at: "2027-03-28T01:00:00Z",
    },
    Episode {
        name: "autumn",
        at: "2027-11-07T06:00:00Z",
    },
];

impl Episode {
    pub fn schema(&self) -> String {
        format!("chaos_periodic_{}", self.name)
    }

    fn clock(&self) -> String {
        format!("chaos_clock_{}", self.name)
    }

    #[allow(dead_code)]
    pub fn instant(&self) -> DateTime<Utc> {
        self.at.parse().expect("an RFC 3339 instant")
    }

    /// The schedules worker `worker` registers in this episode.
    fn schedules(&self, worker: usize) -> Vec<Periodic> {
        let job = |name: &str| {
            NewJob::from_json("tock", serde_json::json!({ "schedule": name }))
                .with_queue(FIRES_QUEUE)
        };
        let backfill = CatchUp::Backfill(10_000);
        match self.name {
            "spring" => {
                let mut out = vec![
                    Periodic::cron("gap", "*/5 * 2 * * *", job("gap"))
                        .expect("cron")
                        .in_time_zone(chrono_tz::Europe::Berlin)
                        .catch_up(backfill),
                    Periodic::every(
                        "deploy",
                        Duration::from_secs(if worker.is_multiple_of(2) { 2 } else { 3 }),
                        job("deploy"),
                    )
                    .expect("interval")
                    .catch_up(backfill),
                ];
                if worker != 0 {
                    out.push(
                        Periodic::every("tick", Duration::from_secs(1), job("tick"))
                            .expect("interval")
                            .catch_up(backfill),
                    );
                }
                out
            }
            _ => vec![Periodic::cron("overlap", "*/5 * 1 * * *", job("overlap"))
                .expect("cron")
                .in_time_zone(chrono_tz::America::New_York)
                .catch_up(backfill)],
        }
    }
}

/// Create each episode's schema and clock, the clock set to reach the episode's
/// instant `lead` from now.
pub async fn setup(admin: &PgPool, lead: Duration) -> Result<(), String> {
    for e in &EPISODES {
        let store = leasehold::Store::new(
            admin.clone(),
            &e.schema(),
            leasehold::StoreOptions::default(),
        )
        .map_err(|x| x.to_string())?;
        store.migrate().await.map_err(|x| x.to_string())?;
        let initial = format!(
            "extract(epoch FROM '{}'::timestamptz - pg_catalog.clock_timestamp()) - {}",
            e.at,
            lead.as_secs_f64()
        );
        let sql = leasehold::testkit::clock::install_sql(&e.clock(), &e.schema(), &initial);
        sqlx::raw_sql(&sql)
            .execute(admin)
            .await
            .map_err(|x| format!("episode {}: {x}", e.name))?;
    }
    Ok(())
}

/// Never run: the schedules' jobs wait in [`FIRES_QUEUE`], which no scheduler claims. A
/// scheduler needs a handler.
struct Tock;

#[derive(Deserialize, Serialize)]
struct TockPayload {
    schedule: String,
}

impl Handler for Tock {
    type Payload = TockPayload;
    type Output = ();
    const KIND: &'static str = "tock";
    async fn run(&self, _ctx: JobContext, _p: TockPayload) -> Result<(), JobError> {
        Ok(())
    }
}

/// Start worker `worker`'s scheduler of each episode, through its proxy at `port`.
/// Retries a start that fails (the database may be down) until `deadline`.
pub async fn start(
    worker: usize,
    port: u16,
    deadline: tokio::time::Instant,
) -> Result<Vec<(Scheduler, PgPool)>, String> {
    let mut out = Vec::new();
    for e in &EPISODES {
        let connect = PgConnectOptions::new()
            .host("127.0.0.1")
            .port(port)
            .username("chaos_worker")
            .database("chaos")
            .ssl_mode(PgSslMode::Disable)
            .application_name(&format!("chaos-w{worker}-{}", e.name))
            .options([("search_path", format!("{},pg_catalog", e.clock()))]);
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(3))
            .connect_lazy_with(connect);
        let config = Config {
            schema: e.schema(),
            concurrency: 1,
            queues: vec!["unclaimed".into()],
            ..Config::default()
        };
        let s = loop {
            let mut b = Scheduler::builder(pool.clone(), config.clone()).register(Tock);
            for p in e.schedules(worker) {
                b = b.periodic(p);
            }
            match b.start().await {
                Ok(s) => break s,
                Err(x) if tokio::time::Instant::now() < deadline => {
                    eprintln!(
                        "w{worker}: periodic {} start failed ({x}); retrying",
                        e.name
                    );
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Err(x) => return Err(format!("periodic {}: {x}", e.name)),
            }
        };
        out.push((s, pool));
    }
    Ok(out)
}

/// (episode, schedule, job, run-at µs, fire time µs, late), as [`dump`] reads them.
type FireRow = (String, Option<String>, i64, i64, Option<i64>, bool);

/// Save each episode's fires, from the enqueued jobs (schedule, run-at time) beside the
/// fire records, and where its clock ended, as `db/periodic.jsonl`.
pub async fn dump(admin: &PgPool, out: &std::path::Path) -> Result<(), String> {
    let mut lines = Vec::new();
    for e in &EPISODES {
        let sql = format!(
            "SELECT '{n}' AS episode, j.payload ->> 'schedule' AS schedule, j.id AS job_id,
                    (extract(epoch FROM j.available_at) * 1000000)::bigint AS run_at_us,
                    (extract(epoch FROM f.fire_at) * 1000000)::bigint AS fire_at_us,
                    coalesce(f.late, false) AS late
             FROM {t}.jobs j LEFT JOIN {t}.periodic_fires f ON f.job_id = j.id
             WHERE j.kind = 'tock' ORDER BY j.id",
            n = e.name,
            t = e.schema()
        );
        let rows: Vec<FireRow> = sqlx::query_as(&sql)
            .fetch_all(admin)
            .await
            .map_err(|x| format!("periodic dump {}: {x}", e.name))?;
        for r in rows {
            lines.push(serde_json::json!({
                "episode": r.0, "schedule": r.1, "job_id": r.2, "run_at_us": r.3,
                "fire_at_us": r.4, "late": r.5,
            }));
        }
        let clock_end: i64 = sqlx::query_scalar(&format!(
            "SELECT (extract(epoch FROM {}.clock_timestamp()) * 1000000)::bigint",
            e.clock()
        ))
        .fetch_one(admin)
        .await
        .map_err(|x| format!("periodic clock {}: {x}", e.name))?;
        lines.push(serde_json::json!({ "episode": e.name, "clock_end_us": clock_end }));
    }
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(out.join("db").join("periodic.jsonl"), text).map_err(|x| x.to_string())
}
