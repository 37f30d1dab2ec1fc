//! An invalid config is refused at start, naming the field, before anything is created.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::{within, TestDb};
use leasehold::{Config, Error, Handler, JobContext, JobError, Scheduler, StoreOptions};
use worker::{fast_config, run_in_system, POOL};

struct Noop;

impl Handler for Noop {
    type Payload = ();
    type Output = ();
    const KIND: &'static str = "noop";

    async fn run(&self, _: JobContext, _: ()) -> Result<(), JobError> {
        Ok(())
    }
}

/// A change that makes a valid config invalid.
type Change = Box<dyn Fn(&mut Config)>;

async fn schema_exists(db: &TestDb, schema: &str) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
        .bind(schema)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[test]
fn an_invalid_config_is_refused_at_start_naming_the_field() {
    run_in_system(within(60, "config test", async {
        let db = TestDb::with_options("rt_config", StoreOptions::default(), POOL).await;
        // A schema nobody created: a refused start must not create it. A start that
        // creates a schema is the owner's (a runtime role could not), so the schedulers
        // here connect as the owner in every mode.
        let fresh = format!("{}_never", db.schema);
        let base = fast_config(&fresh);
        let cases: Vec<(&str, Change)> = vec![
            (
                "renew_interval",
                Box::new(|c| c.renew_interval = c.lease / 3 + Duration::from_millis(1)),
            ),
            (
                "renew_interval",
                Box::new(|c| c.renew_interval = Duration::ZERO),
            ),
            ("lease", Box::new(|c| c.lease = Duration::from_millis(10))),
            ("concurrency", Box::new(|c| c.concurrency = 0)),
            (
                "poll_interval_min",
                Box::new(|c| c.poll_interval_min = c.poll_interval_max * 2),
            ),
            ("queues", Box::new(|c| c.queues.clear())),
            (
                "schema",
                Box::new(|c| c.schema = "no spaces; allowed".into()),
            ),
            ("mailbox_capacity", Box::new(|c| c.mailbox_capacity = 0)),
            (
                "writer_lock_wait",
                Box::new(|c| c.writer_lock_wait = Duration::ZERO),
            ),
            ("retry.max_attempts", Box::new(|c| c.retry.max_attempts = 0)),
            (
                "effect_keep",
                Box::new(|c| c.effect_keep = Duration::from_secs(1)),
            ),
        ];
        for (field, change) in &cases {
            let mut config = base.clone();
            change(&mut config);
            let err = match Scheduler::builder(db.owner.clone(), config)
                .register(Noop)
                .start()
                .await
            {
                Ok(s) => {
                    s.shutdown().await.unwrap();
                    panic!("a config with a bad {field} was accepted");
                }
                Err(e) => e,
            };
            match &err {
                Error::Config { field: f, .. } => assert_eq!(f, field, "{err}"),
                other => panic!("expected a config error naming {field}, got {other:?}"),
            }
            assert!(err.to_string().contains(field), "{err}");
        }
        // No handler at all is refused too.
        let err = Scheduler::builder(db.owner.clone(), base.clone())
            .start()
            .await
            .err()
            .expect("a scheduler without handlers was accepted");
        assert!(err.to_string().contains("handlers"), "{err}");
        assert!(
            !schema_exists(&db, &fresh).await,
            "a refused start created its schema"
        );

        // The same config, fixed, starts (the refusals were the fields, nothing else).
        let scheduler = Scheduler::builder(db.owner.clone(), base)
            .register(Noop)
            .start()
            .await
            .unwrap();
        assert!(schema_exists(&db, &fresh).await);
        scheduler.shutdown().await.unwrap();
        sqlx::query(&format!("DROP SCHEMA \"{fresh}\" CASCADE"))
            .execute(&db.owner)
            .await
            .unwrap();
        db.drop().await;
    }))
}
