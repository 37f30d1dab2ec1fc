//! `--only dashboard`: how long the dashboard's pages take at 10^6 jobs (issue 16's
//! target: under 200 ms each).
//!
//! A schema of its own is filled with `INSERT ... SELECT generate_series` and analyzed
//! once, as autovacuum would; the dashboard is mounted in an in-process actix-web
//! service and each page is requested `REPEATS` times after a first request (handler,
//! database and rendering; no network). The figure per page is the median over the
//! repeats, then the median over runs.
//!
//! The rows, in id order as a real table has them: 90% done (finished over the last two
//! hours, so the overview's 15-minute chart counts about 110,000 of them), then 9%
//! pending, then dead, held, waiting and running jobs of keyed accounts. The open jobs
//! are the newest ids, above the history: what makes a listing by id slow.

use std::time::{Duration, Instant};

use actix_web::{test as http, App};
use leasehold::{Config, Handler, JobContext, JobError, Scheduler, Store};

use super::report::{Goal, Row, Stat};
use super::sections::Run;
use super::setup;

const SECTION: &str = "dashboard pages (10^6 jobs in the full run; in-process, median of 10)";
const SCHEMA: &str = "bench_dashboard";
const REPEATS: usize = 10;

/// Never runs: the scheduler claims from a queue no bench row is in.
struct Idle;

impl Handler for Idle {
    type Payload = i64;
    type Output = ();
    const KIND: &'static str = "idle";

    async fn run(&self, _: JobContext, _: i64) -> Result<(), JobError> {
        Ok(())
    }
}

impl Run {
    pub async fn dashboard(&mut self) {
        let rows = self.sizes.dashboard_rows;
        let mut times: Vec<(String, Vec<f64>)> = Vec::new();
        for r in 0..self.runs {
            let store = setup::fresh_schema(&self.pool, SCHEMA, self.history).await;
            let t = Instant::now();
            fill(&store, rows).await;
            setup::checkpoint(&store).await;
            say!(
                "run {}/{}: filled {rows} jobs in {:.1} s",
                r + 1,
                self.runs,
                t.elapsed().as_secs_f64()
            );
            let measured = pages(&store, rows).await;
            for (i, (page, ms)) in measured.into_iter().enumerate() {
                if r == 0 {
                    times.push((page, vec![ms]));
                } else {
                    times[i].1.push(ms);
                }
            }
        }
        for (page, samples) in times {
            self.rows
                .push(Row::new(SECTION, page, Stat::of(samples), "ms").goal(Goal::AtMost(200.0)));
        }
        setup::drop_schema(&self.pool, SCHEMA).await;
    }
}

/// The pages an operator opens, with filters that take each listing path (by id, claim
/// order, key order, the leased jobs, a key's index, the parked index) and the two that
/// read the table (a rare kind alone, and age alone).
async fn pages(store: &Store, rows: i64) -> Vec<(String, f64)> {
    let config = Config {
        schema: SCHEMA.into(),
        queues: vec!["bench-idle".into()],
        ..Config::default()
    };
    let scheduler = Scheduler::builder(store.pool().clone(), config)
        .register(Idle)
        .start()
        .await
        .expect("start the scheduler");
    let s = store.schema().quoted();
    let dead: i64 = sqlx::query_scalar(&format!(
        "SELECT min(id) FROM {s}.jobs WHERE state = 'dead'"
    ))
    .fetch_one(store.pool())
    .await
    .expect("a dead job");
    let app = http::init_service(
        App::new().service(leasehold::web::dashboard(scheduler.clone()).at("/jobs")),
    )
    .await;
    let pages = [
        "/jobs/".to_string(),
        "/jobs/jobs".into(),
        format!("/jobs/jobs?after={}", rows / 2),
        "/jobs/jobs?state=pending".into(),
        format!("/jobs/jobs?state=pending&after={}", rows * 95 / 100),
        "/jobs/jobs?queue=emails&state=pending&older_than=60".into(),
        "/jobs/jobs?state=running".into(),
        "/jobs/jobs?state=waiting".into(),
        "/jobs/jobs?state=dead".into(),
        "/jobs/jobs?state=held&queue=payments".into(),
        "/jobs/jobs?state=done&queue=emails".into(),
        "/jobs/jobs?key=acct-7".into(),
        "/jobs/jobs?kind=refund&state=held".into(),
        "/jobs/jobs?kind=refund".into(),
        "/jobs/jobs?older_than=60".into(),
        format!("/jobs/job/{dead}"),
        "/jobs/keys".into(),
        "/jobs/schedulers".into(),
    ];
    let mut out = Vec::new();
    for page in pages {
        let mut times = Vec::new();
        for _ in 0..=REPEATS {
            let t = Instant::now();
            let res =
                http::call_service(&app, http::TestRequest::get().uri(&page).to_request()).await;
            let status = res.status();
            let _ = http::read_body(res).await;
            times.push(t.elapsed());
            assert!(status.is_success(), "{page}: {status}");
        }
        times.remove(0);
        times.sort();
        out.push((format!("GET {page}"), ms(times[times.len() / 2])));
    }
    scheduler.shutdown().await.expect("shut the scheduler down");
    out
}

async fn fill(store: &Store, rows: i64) {
    let s = store.schema().quoted();
    let parked = (rows / 1000).max(10);
    let done = rows * 9 / 10;
    let pending = rows - done - 4 * parked;
    let statements = [
        format!(
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, attempts,
                                   generation, owner, created_at, finished_at, result)
             SELECT CASE WHEN g % 3 = 0 THEN 'emails' ELSE 'payments' END, 'charge', 'done',
                    jsonb_build_object('amount', g, 'customer', 'c' || (g % 5000)), 40, 5, 1, 1,
                    'bench:worker', now() - make_interval(secs => 7200.0 * g / {done}) - interval '1 second',
                    now() - make_interval(secs => 7200.0 * g / {done}), '{{\"ok\": true}}'
             FROM generate_series(1, {done}) g"
        ),
        format!(
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts)
             SELECT CASE WHEN g % 3 = 0 THEN 'emails' ELSE 'payments' END, 'charge', 'pending',
                    jsonb_build_object('amount', g), 20, 5
             FROM generate_series(1, {pending}) g"
        ),
        format!(
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, attempts,
                                   generation, owner, job_key, key_seq, finished_at, last_error)
             SELECT 'payments', 'charge', 'dead', jsonb_build_object('amount', g), 20, 5, 5, 5,
                    'bench:worker', 'acct-' || g, 1, now() - interval '1 hour', 'gateway timeout after 30s'
             FROM generate_series(1, {parked}) g"
        ),
        format!(
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, job_key, key_seq)
             SELECT 'payments', 'charge', 'waiting', jsonb_build_object('amount', g), 20, 5, 'acct-' || g, 2
             FROM generate_series(1, {parked}) g"
        ),
        format!(
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, job_key, key_seq)
             SELECT 'payments', 'refund', 'held', jsonb_build_object('amount', g), 20, 5, 'hold-' || g, 1
             FROM generate_series(1, {parked}) g"
        ),
        format!(
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, attempts,
                                   generation, owner, claimed_at, lease_until)
             SELECT 'emails', 'send', 'running', jsonb_build_object('to', g), 20, 5, 1, 1,
                    'bench:worker', now(), now() + interval '1 hour'
             FROM generate_series(1, {parked}) g"
        ),
        format!(
            "INSERT INTO {s}.job_keys (queue, job_key, next_seq, open_jobs)
             SELECT 'payments', 'acct-' || g, 2, 2 FROM generate_series(1, {parked}) g
             UNION ALL
             SELECT 'payments', 'hold-' || g, 1, 1 FROM generate_series(1, {parked}) g"
        ),
        format!("ANALYZE {s}.jobs"),
    ];
    for sql in statements {
        sqlx::raw_sql(&sql)
            .execute(store.pool())
            .await
            .expect("fill the dashboard's table");
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
