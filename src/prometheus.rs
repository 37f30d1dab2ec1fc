//! The scheduler's figures as Prometheus (0.0.4) or OpenMetrics text.
//!
//! [`render`] takes this process' [`MetricsSnapshot`] and the database's per-queue
//! [`QueueGauges`] (one statement, see [`Store::queue_gauges`](crate::Store::queue_gauges))
//! and encodes them with `prometheus-client`, the Prometheus project's Rust client: names
//! carry their unit (`_seconds`) and counters their `_total`, every family has its HELP
//! and TYPE lines, and label values are escaped by it.
//!
//! # Names
//!
//! Every name starts with `leasehold_`. Per-job figures are labelled `queue` and `kind`,
//! mailbox figures `actor`, database gauges `queue` (and `state`). The README lists them.
//!
//! # Cost
//!
//! The process figures are atomic loads. The database gauges cost one statement that
//! reads the open and parked jobs' partial indexes, never the done history.

use std::fmt;
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use crate::error::Result;
use crate::metrics::{HistogramSnapshot, JobSnapshot, MailboxSnapshot, MetricsSnapshot};
use crate::store::QueueGauges;
use crate::{Scheduler, Store};

/// Which text exposition to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The classic Prometheus text format, version 0.0.4.
    Prometheus,
    /// OpenMetrics 1.0 text (`# UNIT` lines, ends with `# EOF`).
    OpenMetrics,
}

impl Format {
    /// OpenMetrics when the scraper's `Accept` header asks for it (Prometheus servers
    /// do), otherwise the classic text that every scraper reads.
    pub fn from_accept(accept: Option<&str>) -> Format {
        match accept {
            Some(a) if a.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::Prometheus,
        }
    }

    /// The `Content-Type` of a response in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// This scheduler's figures and the database's per-queue gauges, as text in `format`.
/// The gauges are read through the handle's store (the host's pool); from another
/// runtime than the pool's (an actix-web worker), use [`render_with`].
pub async fn render(scheduler: &Scheduler, format: Format) -> Result<String> {
    render_with(scheduler, scheduler.store(), format).await
}

/// [`render`], reading the per-queue gauges through `store` (over a pool of the
/// caller's runtime, on the scheduler's schema).
///
/// The gauges are read at most once per [`Config::metrics_cache`](crate::Config) for all
/// clones of the handle: scrapes in between (several Prometheus servers, every actix-web
/// worker) reuse the last reading, and concurrent scrapes wait for one read, so scraping
/// cannot load the database.
pub async fn render_with(scheduler: &Scheduler, store: &Store, format: Format) -> Result<String> {
    let max_age = scheduler.config().metrics_cache;
    let mut gauges = scheduler.gauge_cache().read(store, max_age).await?;
    with_every_queue(&mut gauges, &scheduler.config().queues);
    Ok(encode(scheduler.metrics(), gauges, format))
}

/// The per-queue gauges last read, and when. Held by the scheduler (see
/// [`render_with`]).
#[derive(Debug, Default)]
pub(crate) struct GaugeCache {
    last: tokio::sync::Mutex<Option<(Instant, Vec<QueueGauges>)>>,
}

impl GaugeCache {
    /// The gauges read less than `max_age` ago, or read now. The lock is held across
    /// the read so that concurrent callers wait for it instead of each reading.
    async fn read(&self, store: &Store, max_age: Duration) -> Result<Vec<QueueGauges>> {
        let mut last = self.last.lock().await;
        if let Some((at, gauges)) = last.as_ref() {
            if at.elapsed() < max_age {
                return Ok(gauges.clone());
            }
        }
        let gauges = store.queue_gauges().await?;
        *last = Some((Instant::now(), gauges.clone()));
        Ok(gauges)
    }
}

/// Zeros for the configured queues that have no open job, so a drained queue reads 0
/// rather than vanishing from the scrape (an alert on it would then never resolve).
fn with_every_queue(gauges: &mut Vec<QueueGauges>, queues: &[String]) {
    for queue in queues {
        if !gauges.iter().any(|g| &g.queue == queue) {
            gauges.push(QueueGauges {
                queue: queue.clone(),
                ..Default::default()
            });
        }
    }
    gauges.sort_by(|a, b| a.queue.cmp(&b.queue));
}

/// Encode figures already taken (no database access).
pub fn encode(snapshot: MetricsSnapshot, gauges: Vec<QueueGauges>, format: Format) -> String {
    let mut registry = Registry::with_prefix("leasehold");
    registry.register_collector(Box::new(Exposition { snapshot, gauges }));
    let mut text = String::new();
    let written = match format {
        Format::Prometheus => {
            prometheus_client::encoding::prometheus_text::encode(&mut text, &registry)
        }
        Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut text, &registry),
    };
    // Writing into a String fails only if an encoder refuses its input, which the
    // names and values built here never give it.
    written.expect("metrics exposition encodes into a String");
    text
}

/// Counters that [`MetricsSnapshot::jobs`] splits by queue, kind and outcome
/// (`leasehold_attempts_total`): not repeated as process-wide totals.
const PER_KIND_COUNTERS: [&str; 7] = [
    "completed",
    "failed",
    "dead",
    "snoozed",
    "cancelled",
    "released",
    "stale_completions",
];

#[derive(Debug)]
struct Exposition {
    snapshot: MetricsSnapshot,
    gauges: Vec<QueueGauges>,
}

type Labels<'a> = Vec<(&'static str, &'a str)>;

/// One sample's value.
enum Value<'a> {
    /// A counter's value.
    Count(u64),
    /// A counter of seconds.
    Seconds(f64),
    /// A gauge that counts things.
    Level(u64),
    /// A gauge of seconds.
    Age(f64),
    Histogram(&'a HistogramSnapshot),
}

/// One family: its name (without prefix, unit or `_total`), help, unit and samples.
struct Family<'a> {
    name: &'a str,
    help: &'a str,
    unit: Option<Unit>,
    kind: MetricType,
    samples: Vec<(Labels<'a>, Value<'a>)>,
}

impl<'a> Family<'a> {
    fn new(name: &'a str, help: &'a str, kind: MetricType) -> Self {
        Family {
            name,
            help,
            unit: None,
            kind,
            samples: Vec::new(),
        }
    }

    fn seconds(mut self) -> Self {
        self.unit = Some(Unit::Seconds);
        self
    }

    fn sample(mut self, labels: Labels<'a>, value: Value<'a>) -> Self {
        self.samples.push((labels, value));
        self
    }

    fn samples(mut self, samples: impl IntoIterator<Item = (Labels<'a>, Value<'a>)>) -> Self {
        self.samples.extend(samples);
        self
    }

    fn encode(&self, encoder: &mut DescriptorEncoder) -> fmt::Result {
        let mut metric =
            encoder.encode_descriptor(self.name, self.help, self.unit.as_ref(), self.kind)?;
        for (labels, value) in &self.samples {
            if labels.is_empty() {
                write_value(&mut metric, value)?;
            } else {
                write_value(&mut metric.encode_family(labels)?, value)?;
            }
        }
        Ok(())
    }
}

fn write_value(metric: &mut MetricEncoder, value: &Value) -> fmt::Result {
    match value {
        Value::Count(n) => metric.encode_counter::<NoLabelSet, _, u64>(n, None),
        Value::Seconds(s) => metric.encode_counter::<NoLabelSet, _, u64>(s, None),
        Value::Level(n) => metric.encode_gauge(n),
        Value::Age(secs) => metric.encode_gauge(secs),
        Value::Histogram(h) => {
            metric.encode_histogram::<NoLabelSet>(h.sum_secs, h.count, &per_bucket(h), None)
        }
    }
}

/// The encoder wants each bucket's own count (it accumulates) and the `+Inf` bucket.
fn per_bucket(h: &HistogramSnapshot) -> Vec<(f64, u64)> {
    let mut below = 0;
    let mut out: Vec<(f64, u64)> = h
        .buckets
        .iter()
        .map(|&(le, cumulative)| {
            let own = cumulative - below;
            below = cumulative;
            (le, own)
        })
        .collect();
    out.push((f64::INFINITY, h.count - below));
    out
}

impl Collector for Exposition {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        for family in self.job_families() {
            family.encode(&mut encoder)?;
        }
        for family in self.process_families() {
            family.encode(&mut encoder)?;
        }
        for family in self.mailbox_families() {
            family.encode(&mut encoder)?;
        }
        for family in self.queue_families() {
            family.encode(&mut encoder)?;
        }
        Ok(())
    }
}

fn job_labels(j: &JobSnapshot) -> Labels<'_> {
    vec![("queue", &j.queue), ("kind", &j.kind)]
}

impl Exposition {
    /// Per (queue, kind): attempts by outcome, wait to start, handler run time.
    fn job_families(&self) -> Vec<Family<'_>> {
        let jobs = &self.snapshot.jobs;
        let attempts = jobs.iter().flat_map(|j| {
            j.outcomes.iter().map(move |(outcome, n)| {
                let mut l = job_labels(j);
                l.push(("outcome", outcome.as_str()));
                (l, Value::Count(*n))
            })
        });
        vec![
            Family::new(
                "attempts",
                "Attempts ended by this process, by queue, kind and outcome (completed, retried, dead, cancelled, released, stale: refused for a lost fence, unknown: ending not written).",
                MetricType::Counter,
            )
            .samples(attempts),
            Family::new(
                "enqueue_to_start",
                "Database time from a job's enqueue (or run-at) to its first claim.",
                MetricType::Histogram,
            )
            .seconds()
            .samples(jobs.iter().map(|j| (job_labels(j), Value::Histogram(&j.enqueue_to_start)))),
            Family::new(
                "handler_run",
                "Handler run time of an attempt, from its start to its return or its stop.",
                MetricType::Histogram,
            )
            .seconds()
            .samples(jobs.iter().map(|j| (job_labels(j), Value::Histogram(&j.run_time)))),
        ]
    }

    /// Process-wide counters, the claim latency and the in-process gauges.
    fn process_families(&self) -> Vec<Family<'_>> {
        let s = &self.snapshot;
        let mut out: Vec<Family> = s
            .counters
            .described()
            .into_iter()
            .filter(|(name, _, _)| !PER_KIND_COUNTERS.contains(name))
            .map(|(name, help, n)| {
                Family::new(name, help, MetricType::Counter).sample(vec![], Value::Count(n))
            })
            .collect();
        out.push(
            Family::new("claim", "Time of claim statements.", MetricType::Histogram)
                .seconds()
                .sample(vec![], Value::Histogram(&s.claim_histogram)),
        );
        let gauges = [
            (
                "jobs_in_flight",
                "Jobs this process holds now: running, or claimed and queued for their key.",
                s.in_flight,
            ),
            (
                "jobs_ready",
                "Claimed jobs waiting in this process for a free slot now.",
                s.ready,
            ),
            (
                "sequencers",
                "Key sequencer actors alive now.",
                s.sequencers,
            ),
        ];
        out.extend(gauges.into_iter().map(|(name, help, v)| {
            Family::new(name, help, MetricType::Gauge).sample(vec![], Value::Level(v))
        }));
        out
    }

    /// Per actor kind (actix has no mailbox length: leasehold counts sends and handles).
    fn mailbox_families(&self) -> Vec<Family<'_>> {
        let boxes = &self.snapshot.mailboxes;
        let each = |value: fn(&MailboxSnapshot) -> Value<'static>| {
            boxes
                .iter()
                .map(move |m| (vec![("actor", m.actor.as_str())], value(m)))
        };
        vec![
            Family::new(
                "mailbox_depth",
                "Messages sent to the actor kind and not yet handled.",
                MetricType::Gauge,
            )
            .samples(each(|m| Value::Level(m.depth))),
            Family::new(
                "mailbox_high_water",
                "Largest mailbox depth seen since start.",
                MetricType::Gauge,
            )
            .samples(each(|m| Value::Level(m.high_water))),
            Family::new("mailbox_handled", "Messages handled.", MetricType::Counter)
                .samples(each(|m| Value::Count(m.handled))),
            Family::new(
                "mailbox_handling",
                "Time spent in handlers (not counting futures they spawned).",
                MetricType::Counter,
            )
            .seconds()
            .samples(each(|m| Value::Seconds(m.handling.as_secs_f64()))),
            Family::new(
                "mailbox_overflows",
                "Sends that found the mailbox at capacity (delivered anyway).",
                MetricType::Counter,
            )
            .samples(each(|m| Value::Count(m.overflows))),
        ]
    }

    /// Per queue, from the database: what every process sees.
    fn queue_families(&self) -> Vec<Family<'_>> {
        let by_state = self.gauges.iter().flat_map(|g| {
            g.by_state.iter().map(move |(state, n)| {
                (
                    vec![("queue", g.queue.as_str()), ("state", state.as_str())],
                    Value::Level((*n).max(0) as u64),
                )
            })
        });
        let each = |value: fn(&QueueGauges) -> Value<'static>| {
            self.gauges
                .iter()
                .map(move |g| (vec![("queue", g.queue.as_str())], value(g)))
        };
        vec![
            Family::new(
                "jobs",
                "Jobs in the database by queue and open or parked state (pending, waiting, running, held, dead).",
                MetricType::Gauge,
            )
            .samples(by_state),
            Family::new(
                "oldest_eligible_age",
                "How long the oldest due pending job has waited to be claimed (0: none due).",
                MetricType::Gauge,
            )
            .seconds()
            .samples(each(|g| Value::Age(g.oldest_eligible_secs))),
            Family::new(
                "oldest_running_age",
                "Time since the oldest running job was claimed (0: none running).",
                MetricType::Gauge,
            )
            .seconds()
            .samples(each(|g| Value::Age(g.oldest_running_secs))),
            Family::new(
                "blocked_keys",
                "Keys whose head is held, or dead with the default key policy: their later jobs wait for an operator.",
                MetricType::Gauge,
            )
            .samples(each(|g| Value::Level(g.blocked_keys.max(0) as u64))),
            Family::new(
                "blocked_oldest_waiting_age",
                "Age of the oldest job waiting behind a blocked key (0: none waits).",
                MetricType::Gauge,
            )
            .seconds()
            .samples(each(|g| Value::Age(g.blocked_oldest_waiting_secs))),
            Family::new(
                "queue_paused",
                "1 while the queue is paused (nothing of it is claimed), else 0.",
                MetricType::Gauge,
            )
            .samples(each(|g| Value::Level(u64::from(g.paused)))),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_bucket_counts_undo_the_cumulative_sums_and_end_with_inf() {
        let h = HistogramSnapshot {
            count: 5,
            sum_secs: 1.0,
            buckets: vec![(0.001, 1), (0.01, 3), (0.1, 3)],
        };
        assert_eq!(
            per_bucket(&h),
            vec![(0.001, 1), (0.01, 2), (0.1, 0), (f64::INFINITY, 2)]
        );
    }

    #[test]
    fn openmetrics_ends_with_eof_and_declares_units() {
        let text = encode(MetricsSnapshot::default(), vec![], Format::OpenMetrics);
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(
            text.contains("# UNIT leasehold_claim_seconds seconds"),
            "{text}"
        );
        let classic = encode(MetricsSnapshot::default(), vec![], Format::Prometheus);
        assert!(
            classic.contains("# TYPE leasehold_claims_total counter"),
            "{classic}"
        );
        assert!(!classic.contains("# EOF"));
    }

    #[test]
    fn accept_header_picks_openmetrics_only_when_asked() {
        let prom = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5";
        assert_eq!(Format::from_accept(Some(prom)), Format::OpenMetrics);
        assert_eq!(Format::from_accept(Some("*/*")), Format::Prometheus);
        assert_eq!(Format::from_accept(None), Format::Prometheus);
    }
}
