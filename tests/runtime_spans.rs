//! Each attempt runs inside a `leasehold.attempt` span carrying the job's identity, and
//! what the handler logs is inside it: a tracing-opentelemetry user gets one trace per
//! attempt with no code of their own. Asserted on what a subscriber actually received,
//! also for jobs that start in the previous job's handler task (claimed ahead, at
//! concurrency 1): each is its own root span, not nested in the one before.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use common::{within, TestDb};
use leasehold::{Handler, JobContext, JobError, JobState, Scheduler, StoreOptions};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;
use tracing_subscriber::registry::LookupSpan;
use worker::{fast_config, run_in_system, wait_until, POOL};

/// Fields of a span or event, as text.
#[derive(Default)]
struct Fields(HashMap<String, String>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(
            field.name().to_string(),
            format!("{value:?}").trim_matches('"').to_string(),
        );
    }
}

/// The field under which the recorder notes a span's parent (by name), if it has one.
const PARENT: &str = "(parent)";
/// The field under which the recorder notes a span's id, to find it again on a record.
const SPAN_ID: &str = "(id)";

/// A span's name and its recorded fields.
type SpanRecord = (String, HashMap<String, String>);

/// What the subscriber saw: spans by name with their fields, and for each handler
/// message, the names of the spans it was inside.
#[derive(Default, Clone)]
struct Seen {
    spans: Arc<Mutex<Vec<SpanRecord>>>,
    handler_scopes: Arc<Mutex<Vec<Vec<String>>>>,
}

struct Recorder(Seen);

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Recorder {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut f = Fields::default();
        attrs.record(&mut f);
        if let Some(span) = ctx.span(id) {
            if let Some(parent) = span.parent() {
                f.0.insert(PARENT.into(), parent.name().to_string());
            }
            f.0.insert(SPAN_ID.into(), id.into_u64().to_string());
            span.extensions_mut().insert(f.0.clone());
        }
        self.0
            .spans
            .lock()
            .unwrap()
            .push((attrs.metadata().name().to_string(), f.0));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        let mut f = Fields::default();
        values.record(&mut f);
        let id = id.into_u64().to_string();
        let mut spans = self.0.spans.lock().unwrap();
        if let Some(entry) = spans
            .iter_mut()
            .rev()
            .find(|(_, fields)| fields.get(SPAN_ID) == Some(&id))
        {
            entry.1.extend(f.0);
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut f = Fields::default();
        event.record(&mut f);
        if f.0.get("message").map(String::as_str) == Some("handler at work") {
            let scope = ctx
                .event_scope(event)
                .map(|s| s.map(|span| span.name().to_string()).collect())
                .unwrap_or_default();
            self.0.handler_scopes.lock().unwrap().push(scope);
        }
    }
}

/// Unkeyed jobs enqueued beside the keyed one.
const UNKEYED: usize = 5;

struct Talks;

impl Handler for Talks {
    type Payload = ();
    type Output = ();
    const KIND: &'static str = "talks";

    async fn run(&self, _: JobContext, _: ()) -> Result<(), JobError> {
        tracing::info!("handler at work");
        Ok(())
    }
}

#[test]
fn each_attempt_runs_in_a_span_with_the_jobs_identity_and_the_handler_inside_it() {
    let seen = Seen::default();
    tracing_subscriber::registry()
        .with(Recorder(seen.clone()))
        .try_init()
        .expect("this test binary's only subscriber");
    run_in_system(within(60, "span test", async move {
        let db = TestDb::with_options("rt_spans", StoreOptions::default(), POOL).await;
        // Enqueued before the start, at concurrency 1: the first claim takes them all
        // (claim-ahead, whatever the pace), so each unkeyed job after the first starts in the task of the
        // handler before it, as that handler returns.
        let talk = || leasehold::NewJob::new("talks", &()).unwrap();
        let mut jobs = vec![talk().with_key("acct-9")];
        jobs.extend((0..UNKEYED).map(|_| talk()));
        let ids = db.store.enqueue_many(jobs).await.unwrap();
        let id = ids[0];
        let mut config = fast_config(&db.schema);
        config.concurrency = 1;
        config.claim_ahead_window = None;
        let scheduler = Scheduler::builder(db.pool.clone(), config)
            .register(Talks)
            .start()
            .await
            .unwrap();
        wait_until(10, "the jobs to finish", || async {
            for id in &ids {
                if db.store.job(*id).await.unwrap().state != JobState::Done {
                    return false;
                }
            }
            true
        })
        .await;
        scheduler.shutdown().await.unwrap();

        let spans = seen.spans.lock().unwrap().clone();
        let attempt = spans
            .iter()
            .find(|(n, f)| n == "leasehold.attempt" && f.get("job.id") == Some(&id.0.to_string()))
            .unwrap_or_else(|| {
                panic!(
                    "no attempt span for job {id}: {:?}",
                    spans.iter().map(|s| &s.0).collect::<Vec<_>>()
                )
            });
        let f = &attempt.1;
        assert_eq!(f.get("job.kind").map(String::as_str), Some("talks"));
        assert_eq!(f.get("job.queue").map(String::as_str), Some("default"));
        assert_eq!(f.get("job.key").map(String::as_str), Some("acct-9"));
        assert_eq!(f.get("job.attempt").map(String::as_str), Some("1"));
        assert_eq!(f.get("job.generation").map(String::as_str), Some("1"));
        assert_eq!(
            f.get("owner").map(String::as_str),
            Some(scheduler.owner().as_str())
        );
        assert_eq!(f.get("outcome").map(String::as_str), Some("Completed"));
        assert!(
            spans.iter().any(|(n, _)| n == "leasehold.claim"),
            "the claim statement has its span"
        );
        assert!(
            spans
                .iter()
                .any(|(n, _)| n.starts_with("leasehold.complete")),
            "the completion has its span"
        );
        let attempts: Vec<_> = spans
            .iter()
            .filter(|(n, _)| n == "leasehold.attempt")
            .collect();
        assert_eq!(
            attempts.len(),
            ids.len(),
            "one span per attempt: {attempts:?}"
        );
        for (_, f) in &attempts {
            assert_eq!(f.get(PARENT), None, "an attempt's span is a root: {f:?}");
            assert_eq!(
                f.get("outcome").map(String::as_str),
                Some("Completed"),
                "{f:?}"
            );
        }
        let scopes = seen.handler_scopes.lock().unwrap().clone();
        assert_eq!(scopes.len(), ids.len(), "{scopes:?}");
        for scope in &scopes {
            assert_eq!(
                scope.iter().filter(|s| *s == "leasehold.attempt").count(),
                1,
                "each handler's log is inside its own attempt's span, and only that: {scope:?}"
            );
        }
        db.drop().await;
    }))
}
