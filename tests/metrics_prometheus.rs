//! `/metrics`: a scheduler runs jobs of three kinds on two queues (one retried, one
//! dead that blocks its key), the route is mounted in an actix-web test service, and
//! the scrape is parsed with a Prometheus text parser: names, types, labels and values
//! are what the jobs did and what the database holds.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::collections::HashMap;
use std::time::Duration;

use actix_web::{test as http, App};
use common::{within, TestDb};
use leasehold::web::metrics_route;
use leasehold::{Handler, JobContext, JobError, NewJob, Scheduler, StoreOptions};
use prometheus_parse::{Scrape, Value};
use worker::{fast_config, run_in_system, wait_until, POOL};

/// Lets the running `parked` job finish.
static UNPARK: tokio::sync::Notify = tokio::sync::Notify::const_new();

const QUICK: usize = 0;
const FLAKY: usize = 1;
const DOOMED: usize = 2;
const PARKED: usize = 3;
const KINDS: [&str; 4] = ["quick", "flaky", "doomed", "parked"];

/// Does what its kind says: `quick` succeeds, `flaky` fails its first attempt (retried)
/// and completes the second, `doomed` fails for good (dead; keyed, it blocks its key),
/// `parked` runs until the test lets it go (seen running at the scrape).
struct Act<const K: usize>;

impl<const K: usize> Handler for Act<K> {
    type Payload = i64;
    type Output = ();
    const KIND: &'static str = KINDS[K];

    async fn run(&self, ctx: JobContext, _: i64) -> Result<(), JobError> {
        match K {
            FLAKY if ctx.job().attempt == 1 => Err(JobError::retry("first attempt fails")),
            DOOMED => Err(JobError::permanent("never works")),
            PARKED => {
                UNPARK.notified().await;
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

fn job(kind: &str, queue: &str) -> NewJob {
    NewJob::new(kind, &0).unwrap().with_queue(queue)
}

/// default: 3 quick, 1 flaky, 1 quick an hour away; mail: 2 quick, 1 parked (running until let go), a dead head of key `acct`
/// and a quick job waiting behind it.
fn workload() -> Vec<NewJob> {
    let mut jobs: Vec<NewJob> = (0..3).map(|_| job("quick", "default")).collect();
    jobs.push(job("flaky", "default"));
    jobs.push(job("quick", "default").with_delay(Duration::from_secs(3600)));
    jobs.push(job("parked", "mail"));
    jobs.extend((0..2).map(|_| job("quick", "mail")));
    jobs.push(job("doomed", "mail").with_key("acct"));
    jobs.push(job("quick", "mail").with_key("acct"));
    jobs
}

/// A parsed scrape, looked up by metric name and exact label set.
struct Parsed {
    scrape: Scrape,
}

impl Parsed {
    fn new(text: &str) -> Parsed {
        let lines = text.lines().map(|l| Ok(l.to_string()));
        Parsed {
            scrape: Scrape::parse(lines).expect("the exposition parses"),
        }
    }

    fn value(&self, name: &str, labels: &[(&str, &str)]) -> &Value {
        let wanted: HashMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let found: Vec<&Value> = self
            .scrape
            .samples
            .iter()
            .filter(|s| s.metric == name && *s.labels == wanted)
            .map(|s| &s.value)
            .collect();
        match found.as_slice() {
            [one] => one,
            other => panic!("{name}{labels:?}: {} samples, wanted 1", other.len()),
        }
    }

    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        match self.value(name, labels) {
            Value::Counter(v) => *v,
            other => panic!("{name}{labels:?} is not a counter: {other:?}"),
        }
    }

    fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        match self.value(name, labels) {
            Value::Gauge(v) => *v,
            other => panic!("{name}{labels:?} is not a gauge: {other:?}"),
        }
    }

    /// The `+Inf` bucket of a histogram: its count of observations.
    fn histogram_count(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        match self.value(name, labels) {
            Value::Histogram(buckets) => {
                let inf = buckets.iter().find(|b| b.less_than.is_infinite());
                inf.unwrap_or_else(|| panic!("{name}: no +Inf bucket"))
                    .count
            }
            other => panic!("{name}{labels:?} is not a histogram: {other:?}"),
        }
    }

    fn has_help(&self, name: &str) -> bool {
        self.scrape.docs.get(name).is_some_and(|h| !h.is_empty())
    }
}

async fn scrape(scheduler: &Scheduler, accept: Option<&str>) -> (String, String) {
    let app = http::init_service(App::new().service(metrics_route(scheduler.clone()))).await;
    let mut req = http::TestRequest::get().uri("/metrics");
    if let Some(accept) = accept {
        req = req.insert_header(("accept", accept));
    }
    let resp = http::call_service(&app, req.to_request()).await;
    assert!(resp.status().is_success(), "{:?}", resp.status());
    let content_type = resp
        .headers()
        .get("content-type")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let body = http::read_body(resp).await;
    (content_type, String::from_utf8(body.to_vec()).unwrap())
}

#[test]
fn metrics_route_serves_per_kind_counters_histograms_and_queue_gauges() {
    run_in_system(within(90, "prometheus scrape test", async {
        let db = TestDb::with_options("prom_scrape", StoreOptions::default(), POOL).await;
        let mut config = fast_config(&db.schema);
        config.queues = vec!["default".into(), "mail".into()];
        let scheduler = Scheduler::builder(db.pool.clone(), config)
            .register(Act::<QUICK>)
            .register(Act::<FLAKY>)
            .register(Act::<DOOMED>)
            .register(Act::<PARKED>)
            .start()
            .await
            .unwrap();
        scheduler.enqueue_many(workload()).await.unwrap();
        // A kind this scheduler does not run (the store enqueues it; the scheduler would
        // refuse): due, and never claimed.
        db.store
            .enqueue(job("unregistered", "default"))
            .await
            .unwrap();
        wait_until(60, "the due jobs to end", || async {
            db.count_where("jobs", "state = 'done'").await == 6
                && db.count_where("jobs", "state = 'dead'").await == 1
                && db.count_where("jobs", "state = 'running'").await == 1
        })
        .await;

        let (content_type, text) = scrape(&scheduler, None).await;
        assert!(
            content_type.starts_with("text/plain; version=0.0.4"),
            "{content_type}"
        );
        let m = Parsed::new(&text);

        let attempts = |queue, kind, outcome| {
            m.counter(
                "leasehold_attempts_total",
                &[("queue", queue), ("kind", kind), ("outcome", outcome)],
            )
        };
        assert_eq!(attempts("default", "quick", "completed"), 3.0);
        assert_eq!(attempts("default", "flaky", "retried"), 1.0);
        assert_eq!(attempts("default", "flaky", "completed"), 1.0);
        assert_eq!(attempts("mail", "quick", "completed"), 2.0);
        assert_eq!(attempts("mail", "doomed", "dead"), 1.0);
        assert_eq!(attempts("mail", "doomed", "completed"), 0.0);

        let run = |queue, kind| {
            m.histogram_count(
                "leasehold_handler_run_seconds",
                &[("queue", queue), ("kind", kind)],
            )
        };
        assert_eq!(run("default", "flaky"), 2.0, "both attempts ran");
        assert_eq!(run("default", "quick"), 3.0);
        assert_eq!(run("mail", "doomed"), 1.0);
        let started = m.histogram_count(
            "leasehold_enqueue_to_start_seconds",
            &[("queue", "default"), ("kind", "flaky")],
        );
        assert_eq!(started, 1.0, "first attempts only");
        assert!(m.histogram_count("leasehold_claim_seconds", &[]) >= 1.0);

        // The database's view: the delayed job is pending but not due, the unregistered
        // one due and waiting; the parked job runs; the dead head blocks its key with
        // one job waiting behind it.
        let jobs = |queue, state| m.gauge("leasehold_jobs", &[("queue", queue), ("state", state)]);
        assert_eq!(jobs("default", "pending"), 2.0);
        assert_eq!(jobs("mail", "running"), 1.0);
        assert_eq!(jobs("mail", "dead"), 1.0);
        assert_eq!(jobs("mail", "waiting"), 1.0);
        let per_queue = |name, queue| m.gauge(name, &[("queue", queue)]);
        assert!(per_queue("leasehold_oldest_eligible_age_seconds", "default") > 0.0);
        assert_eq!(
            per_queue("leasehold_oldest_eligible_age_seconds", "mail"),
            0.0
        );
        assert!(per_queue("leasehold_oldest_running_age_seconds", "mail") > 0.0);
        assert_eq!(
            per_queue("leasehold_oldest_running_age_seconds", "default"),
            0.0
        );
        assert_eq!(m.gauge("leasehold_jobs_in_flight", &[]), 1.0);
        assert_eq!(per_queue("leasehold_blocked_keys", "mail"), 1.0);
        assert_eq!(per_queue("leasehold_blocked_keys", "default"), 0.0);
        assert!(per_queue("leasehold_blocked_oldest_waiting_age_seconds", "mail") > 0.0);

        assert!(m.counter("leasehold_mailbox_handled_total", &[("actor", "claimer")]) > 0.0);
        assert!(m.gauge("leasehold_mailbox_high_water", &[("actor", "completer")]) >= 1.0);
        assert!(m.counter("leasehold_claims_total", &[]) >= 1.0);
        for name in [
            "leasehold_attempts_total",
            "leasehold_handler_run_seconds",
            "leasehold_jobs",
            "leasehold_mailbox_handling_seconds_total",
            "leasehold_reaped_total",
        ] {
            assert!(m.has_help(name), "no HELP for {name}");
        }
        // Counted per kind, so not repeated process-wide.
        assert!(!text.contains("leasehold_completed_total"), "{text}");

        UNPARK.notify_one();
        let report = scheduler.shutdown().await.unwrap();
        assert_eq!(report.cancelled, 0, "the parked job finished in the grace");
        db.drop().await;
    }))
}

#[test]
fn metrics_route_answers_openmetrics_to_a_prometheus_server() {
    run_in_system(within(60, "openmetrics negotiation test", async {
        let db = TestDb::with_options("prom_openmetrics", StoreOptions::default(), POOL).await;
        let scheduler = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
            .register(Act::<QUICK>)
            .start()
            .await
            .unwrap();
        // What Prometheus 2.x sends.
        let accept = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        let (content_type, text) = scrape(&scheduler, Some(accept)).await;
        assert!(
            content_type.starts_with("application/openmetrics-text"),
            "{content_type}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(text.contains("# TYPE leasehold_attempts counter"), "{text}");
        assert!(
            text.contains("# UNIT leasehold_handler_run_seconds seconds"),
            "{text}"
        );
        assert!(text.contains("leasehold_jobs_in_flight 0"), "{text}");
        scheduler.shutdown().await.unwrap();
        db.drop().await;
    }))
}

/// Pending jobs of `default` in a scrape through a fresh route over `scheduler`'s handle
/// (as each actix-web worker mounts its own).
async fn pending_scraped(scheduler: &Scheduler) -> f64 {
    let (_, text) = scrape(scheduler, None).await;
    Parsed::new(&text).gauge(
        "leasehold_jobs",
        &[("queue", "default"), ("state", "pending")],
    )
}

#[test]
fn scrapes_within_metrics_cache_reuse_one_database_reading_across_routes() {
    run_in_system(within(60, "metrics cache test", async {
        let db = TestDb::with_options("prom_cache", StoreOptions::default(), POOL).await;
        let later = || job("quick", "default").with_delay(Duration::from_secs(3600));
        let mut config = fast_config(&db.schema);
        config.metrics_cache = Duration::from_secs(3600);
        let cached = Scheduler::builder(db.pool.clone(), config)
            .register(Act::<QUICK>)
            .start()
            .await
            .unwrap();
        cached.enqueue_job(later()).await.unwrap();
        assert_eq!(pending_scraped(&cached).await, 1.0);
        cached.enqueue_job(later()).await.unwrap();
        assert_eq!(
            pending_scraped(&cached.clone()).await,
            1.0,
            "a second route over a clone of the handle is served the cached reading"
        );
        cached.shutdown().await.unwrap();

        let mut config = fast_config(&db.schema);
        config.metrics_cache = Duration::ZERO;
        let uncached = Scheduler::builder(db.pool.clone(), config)
            .register(Act::<QUICK>)
            .start()
            .await
            .unwrap();
        assert_eq!(pending_scraped(&uncached).await, 2.0);
        uncached.enqueue_job(later()).await.unwrap();
        assert_eq!(
            pending_scraped(&uncached).await,
            3.0,
            "zero reads every scrape"
        );
        uncached.shutdown().await.unwrap();
        db.drop().await;
    }))
}
