//! "Payloads and progress nested 10,000 levels deep are refused instead of
//! overflowing the stack" and "a result ... nested more than 127 levels ... fails for
//! good", through the typed front doors a user calls: `NewJob::new(kind, &payload)`,
//! `JobContext::record_progress(&progress)`, and a handler's `Output`.
//!
//! Each case runs in a child process (this test binary re-executed) on a thread with an
//! 8 MiB stack, the size of a main thread: a stack overflow aborts the process, and
//! what is asserted is the child's exit status and what it printed / the job's row.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use leasehold::testkit::attempt_context;
use leasehold::{Handler, JobContext, JobError, JobState, NewJob, Scheduler};
use worker::{fast_config, run_in_system, wait_until, POOL};

const MODE_VAR: &str = "ATTACK_DEEP_MODE";
const SCHEMA_VAR: &str = "ATTACK_DEEP_SCHEMA";
const DEPTH_VAR: &str = "ATTACK_DEEP_DEPTH";

/// `levels` arrays around 1, built without recursion. Leaked by the callers (dropping it
/// recurses; that would be the test's own overflow, not the library's).
fn deep(levels: usize) -> serde_json::Value {
    let mut v = serde_json::json!(1);
    for _ in 0..levels {
        v = serde_json::Value::Array(vec![v]);
    }
    v
}

/// A typed payload/progress/output made of nested vectors (a user's own type).
#[derive(serde::Serialize, serde::Deserialize, Clone, Debug)]
struct Tree(Vec<Tree>);

fn deep_tree(levels: usize) -> Tree {
    let mut t = Tree(vec![]);
    for _ in 0..levels {
        t = Tree(vec![t]);
    }
    t
}

struct DeepOutput {
    depth: usize,
}

impl Handler for DeepOutput {
    type Payload = serde_json::Value;
    type Output = serde_json::Value;
    const KIND: &'static str = "deep_output";

    async fn run(
        &self,
        _ctx: JobContext,
        _p: serde_json::Value,
    ) -> Result<serde_json::Value, JobError> {
        Ok(deep(self.depth))
    }
}

/// The child's entry: does nothing in a normal run.
#[test]
fn deep_child() {
    let Ok(mode) = std::env::var(MODE_VAR) else {
        return;
    };
    let schema = std::env::var(SCHEMA_VAR).unwrap();
    let depth: usize = std::env::var(DEPTH_VAR).unwrap().parse().unwrap();
    let t = std::thread::Builder::new()
        .stack_size(8 * 1024 * 1024)
        .spawn(move || {
            let system = actix::System::new();
            system.block_on(async move {
                let pool = pool_for(&format!("lh-{schema}-child"), POOL).await;
                let store =
                    leasehold::Store::new(pool.clone(), &schema, Default::default()).unwrap();
                match mode.as_str() {
                    "newjob" => {
                        let v = Box::leak(Box::new(deep(depth)));
                        println!("CHILD-BUILT");
                        let r = NewJob::new("k", &*v);
                        println!("CHILD-NEWJOB-RETURNED");
                        match r {
                            Err(e) => println!("CHILD-REFUSED {e}"),
                            Ok(job) => match store.enqueue(job).await {
                                Err(e) => println!("CHILD-REFUSED {e}"),
                                Ok(id) => println!("CHILD-ACCEPTED {id:?}"),
                            },
                        }
                    }
                    "newjob_typed" => {
                        let v = Box::leak(Box::new(deep_tree(depth)));
                        match NewJob::new("k", &*v) {
                            Err(e) => println!("CHILD-REFUSED {e}"),
                            Ok(job) => match store.enqueue(job).await {
                                Err(e) => println!("CHILD-REFUSED {e}"),
                                Ok(id) => println!("CHILD-ACCEPTED {id:?}"),
                            },
                        }
                    }
                    "progress" => {
                        let o = owner("deep");
                        let mut jobs = store.claim(&claim_req(&o, 1)).await.unwrap();
                        let j = jobs.pop().expect("a job to claim");
                        let ctx = attempt_context(j, store.clone());
                        let v = Box::leak(Box::new(deep(depth)));
                        match ctx.record_progress(&*v).await {
                            Err(e) => println!("CHILD-REFUSED {e:?}"),
                            Ok(o) => println!("CHILD-ACCEPTED {o:?}"),
                        }
                    }
                    "output" => {
                        let mut config = fast_config(&schema);
                        config.queues = vec!["default".into()];
                        let s = Scheduler::builder(pool.clone(), config)
                            .register(DeepOutput { depth })
                            .start()
                            .await
                            .unwrap();
                        // Let the handler run and its ending be written.
                        for _ in 0..150 {
                            let st: String = sqlx::query_scalar(&format!(
                                "SELECT state FROM \"{schema}\".jobs ORDER BY id LIMIT 1"
                            ))
                            .fetch_one(&pool)
                            .await
                            .unwrap();
                            if st != "pending" && st != "running" {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        let r = s.shutdown().await.unwrap();
                        println!("CHILD-SHUTDOWN {} {}", r.drained, r.cancelled);
                    }
                    other => panic!("unknown mode {other}"),
                }
                println!("CHILD-END");
            });
            std::mem::forget(system);
        })
        .unwrap();
    t.join().unwrap();
}

/// Run the child in `mode`; its exit status and output.
fn run_child(schema: &str, mode: &str, depth: usize) -> (std::process::ExitStatus, String) {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args([
            "deep_child",
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(MODE_VAR, mode)
        .env(SCHEMA_VAR, schema)
        .env(DEPTH_VAR, depth.to_string())
        .env("LEASEHOLD_TEST_DB", test_db_name())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status, text)
}

fn assert_refused_not_crashed(what: &str, status: std::process::ExitStatus, out: &str) {
    let tail: String = out
        .chars()
        .rev()
        .take(1500)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    assert!(
        status.success() && out.contains("CHILD-END"),
        "{what}: the process died ({status}) instead of refusing the value:\n{tail}"
    );
    assert!(
        out.contains("CHILD-REFUSED"),
        "{what}: not refused:\n{tail}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newjob_new_of_a_10000_deep_value_is_refused_not_a_stack_overflow() {
    bounded(async {
        let db = TestDb::new("atk_deep_newjob").await;
        let schema = db.schema.clone();
        let (status, out) =
            tokio::task::spawn_blocking(move || run_child(&schema, "newjob", 10_000))
                .await
                .unwrap();
        assert_refused_not_crashed("NewJob::new(serde_json::Value 10,000 deep)", status, &out);
        assert_eq!(db.count_where("jobs", "true").await, 0);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newjob_new_of_a_10000_deep_typed_payload_is_refused_not_a_stack_overflow() {
    bounded(async {
        let db = TestDb::new("atk_deep_newjob_typed").await;
        let schema = db.schema.clone();
        let (status, out) =
            tokio::task::spawn_blocking(move || run_child(&schema, "newjob_typed", 10_000))
                .await
                .unwrap();
        assert_refused_not_crashed("NewJob::new(typed 10,000 deep)", status, &out);
        assert_eq!(db.count_where("jobs", "true").await, 0);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_context_progress_10000_deep_is_refused_not_a_stack_overflow() {
    bounded(async {
        let db = TestDb::new("atk_deep_progress").await;
        db.store.enqueue(job("k")).await.unwrap();
        let schema = db.schema.clone();
        let (status, out) =
            tokio::task::spawn_blocking(move || run_child(&schema, "progress", 10_000))
                .await
                .unwrap();
        assert_refused_not_crashed("JobContext::record_progress(10,000 deep)", status, &out);
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_output_10000_deep_fails_its_attempt_not_the_process() {
    bounded(async {
        let db = TestDb::new("atk_deep_output").await;
        let id = db
            .store
            .enqueue(NewJob::from_json("deep_output", serde_json::json!({})).with_max_attempts(1))
            .await
            .unwrap();
        let schema = db.schema.clone();
        let (status, out) =
            tokio::task::spawn_blocking(move || run_child(&schema, "output", 10_000))
                .await
                .unwrap();
        let tail: String = out
            .chars()
            .rev()
            .take(1500)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        assert!(
            status.success() && out.contains("CHILD-END"),
            "a handler's 10,000-deep output killed the scheduler's process ({status}):\n{tail}"
        );
        let j = db.store.job(id).await.unwrap();
        assert_eq!(j.state, JobState::Dead, "{j:?}");
        db.drop().await;
    })
    .await
}

/// The 200-deep output, which serializes fine: the promise is that it fails for good
/// (a permanent error naming 127), its completion refused, in a scheduler.
#[test]
fn a_handler_output_200_deep_is_dead_at_once_with_the_reason() {
    run_in_system(within(60, "200-deep output", async {
        let db = TestDb::with_options("atk_deep_out200", Default::default(), POOL).await;
        let id = db
            .store
            .enqueue(NewJob::from_json("deep_output", serde_json::json!({})).with_max_attempts(5))
            .await
            .unwrap();
        let s = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
            .register(DeepOutput { depth: 200 })
            .start()
            .await
            .unwrap();
        wait_until(30, "the job to end", || async {
            let st = db.state_of(id).await;
            st == "dead" || st == "done"
        })
        .await;
        s.shutdown().await.unwrap();
        let j = db.store.job(id).await.unwrap();
        assert_eq!(j.state, JobState::Dead, "{j:?}");
        assert_eq!(j.attempts, 1, "a permanent failure, not retried: {j:?}");
        let err = format!("{:?}", j.last_error);
        assert!(err.contains("127"), "{err}");
        db.drop().await;
    }))
}
