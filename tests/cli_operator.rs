//! The `leasehold` binary against a real database: an operator finds the stuck job,
//! its reason and the key it blocks (as tables and as JSON), retries and cancels it,
//! is refused with exit 1 on an invalid transition, pages through jobs, applies the
//! printed migration by hand, and prunes.

mod common;

use std::process::{Command, Output, Stdio};

use common::*;
use leasehold::{ClaimRequest, Failure, JobId, NewJob};
use serde_json::Value;

/// Run the binary on the test's schema, connected through the PG* variables.
async fn cli(db: &TestDb, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_leasehold"));
    cmd.args(["--schema", &db.schema])
        .args(args)
        .env_remove("DATABASE_URL")
        // No terminal: a bulk action is never confirmed at a prompt.
        .stdin(Stdio::null())
        .env("PGDATABASE", test_db_name());
    for (var, default) in [
        ("PGHOST", "127.0.0.1"),
        ("PGPORT", "5432"),
        ("PGUSER", "root"),
    ] {
        cmd.env(var, std::env::var(var).unwrap_or_else(|_| default.into()));
    }
    tokio::task::spawn_blocking(move || cmd.output().expect("run the leasehold binary"))
        .await
        .unwrap()
}

/// Stdout of a command that must succeed.
async fn ok(db: &TestDb, args: &[&str]) -> String {
    let out = cli(db, args).await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "leasehold {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The JSON a command prints with `--json`.
async fn json(db: &TestDb, args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let text = ok(db, &all).await;
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{args:?} printed no JSON ({e}): {text}"))
}

/// Two jobs of key `acct` (the head dead with "card declined", the other waiting
/// behind it) and one unkeyed pending email job.
async fn stuck_key(db: &TestDb) -> (JobId, JobId, JobId) {
    let keyed = db
        .store
        .enqueue_many(vec![keyed("charge", "acct", 1), keyed("charge", "acct", 2)])
        .await
        .unwrap();
    let email = db.store.enqueue(job("email")).await.unwrap();
    let mut req = ClaimRequest::new(owner("w"), vec!["default".into()], 1, LEASE);
    req.kinds = Some(vec!["charge".into()]);
    let claimed = db.store.claim(&req).await.unwrap();
    assert_eq!(claimed[0].id, keyed[0]);
    let declined = Failure {
        reason: "card declined".into(),
        permanent: true,
        retry_after: None,
    };
    db.store
        .fail(&claimed[0].fence(), &declined, &fixed_backoff(1))
        .await
        .unwrap();
    (keyed[0], keyed[1], email)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_sees_which_key_is_stuck_behind_which_dead_job_and_why() {
    bounded(async {
        let db = TestDb::new("cli_stuck").await;
        let (dead, waiting, _email) = stuck_key(&db).await;

        let status = ok(&db, &["status"]).await;
        let header = status.lines().next().unwrap();
        assert!(
            header.starts_with("QUEUE") && header.contains("BLOCKED KEYS"),
            "{status}"
        );
        let row: Vec<&str> = status.lines().nth(1).unwrap().split_whitespace().collect();
        // QUEUE pending waiting running held dead, ages, blocked keys, lease expiries, paused
        assert_eq!(&row[..6], ["default", "1", "1", "0", "0", "1"], "{status}");
        assert_eq!(
            row[row.len() - 3..],
            ["1", "0", "-"],
            "one blocked key, no lease expired, not paused: {status}"
        );
        let status = json(&db, &["status"]).await;
        let queue = &status["queues"][0];
        assert_eq!(queue["queue"], "default");
        assert_eq!(queue["by_state"]["dead"], 1);
        assert_eq!(queue["by_state"]["waiting"], 1);
        assert_eq!(queue["blocked_keys"], 1);

        let listed = json(&db, &["jobs", "--state", "dead"]).await;
        let ids: Vec<i64> = listed["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| j["id"].as_i64().unwrap())
            .collect();
        assert_eq!(ids, [dead.0]);
        assert_eq!(listed["jobs"][0]["last_error"], "card declined");
        let table = ok(&db, &["jobs", "--state", "dead"]).await;
        assert!(
            table.contains("card declined") && table.contains("acct"),
            "{table}"
        );

        let shown = ok(&db, &["job", &dead.to_string()]).await;
        assert!(shown.starts_with(&format!("job {dead}\n")), "{shown}");
        for line in [
            "state         dead",
            "attempts      1 of 25",
            "last error    card declined",
        ] {
            assert!(shown.contains(line), "missing {line:?} in\n{shown}");
        }
        assert!(
            shown.contains("history") && shown.contains("claimed"),
            "{shown}"
        );
        let behind = ok(&db, &["show", &waiting.to_string()]).await;
        assert!(
            behind.contains(&format!("waits behind  job {dead} (dead): card declined")),
            "{behind}"
        );
        let detail = json(&db, &["job", &dead.to_string()]).await;
        assert_eq!(detail["job"]["state"], "dead");
        let events: Vec<&str> = detail["history"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["event"].as_str().unwrap())
            .collect();
        assert!(events.contains(&"claimed"), "{events:?}");

        let keys = json(&db, &["keys", "--blocked"]).await;
        let key = &keys["blocked_keys"][0];
        assert_eq!(
            (
                &key["key"],
                &key["head"],
                &key["head_state"],
                &key["reason"],
                &key["waiting"]
            ),
            (
                &Value::from("acct"),
                &Value::from(dead.0),
                &Value::from("dead"),
                &Value::from("card declined"),
                &Value::from(1)
            )
        );
        let keys = ok(&db, &["keys", "--blocked"]).await;
        assert!(
            keys.contains("acct") && keys.contains("card declined"),
            "{keys}"
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_change_the_state_and_invalid_ones_exit_1_with_the_reason() {
    bounded(async {
        let db = TestDb::new("cli_actions").await;
        let (dead, waiting, email) = stuck_key(&db).await;

        let retried = ok(&db, &["retry", &dead.to_string()]).await;
        assert_eq!(
            retried,
            format!("job {dead}: retry done, dead -> pending\n")
        );
        assert_eq!(db.state_of(dead).await, "pending");
        assert_eq!(
            db.state_of(waiting).await,
            "waiting",
            "the key keeps its order"
        );

        let again = cli(&db, &["retry", &dead.to_string()]).await;
        assert_eq!(again.status.code(), Some(1));
        let stderr = String::from_utf8_lossy(&again.stderr);
        assert!(
            stderr.contains(&format!("job {dead} is pending; cannot retry")),
            "{stderr}"
        );
        assert!(again.stdout.is_empty());

        let held = json(&db, &["hold", &email.to_string()]).await;
        assert_eq!(
            (&held["before"], &held["after"]),
            (&Value::from("pending"), &Value::from("held"))
        );
        ok(&db, &["release", &email.to_string()]).await;
        assert_eq!(db.state_of(email).await, "pending");

        let cancelled = json(
            &db,
            &["cancel", &email.to_string(), "--reason", "duplicate"],
        )
        .await;
        assert_eq!(cancelled["after"], "cancelled");
        assert_eq!(db.state_of(email).await, "cancelled");
        assert!(db
            .store
            .job(email)
            .await
            .unwrap()
            .last_error
            .unwrap()
            .contains("duplicate"));
        let twice = cli(&db, &["cancel", &email.to_string()]).await;
        assert_eq!(
            twice.status.code(),
            Some(1),
            "a cancelled job cannot be cancelled"
        );
        assert_eq!(
            cli(&db, &["release", &email.to_string()])
                .await
                .status
                .code(),
            Some(1)
        );

        let unknown = cli(&db, &["job", "987654321"]).await;
        assert_eq!(unknown.status.code(), Some(1));
        assert!(String::from_utf8_lossy(&unknown.stderr).contains("job 987654321 does not exist"));
        assert_eq!(
            cli(&db, &["retry", "not-a-number"]).await.status.code(),
            Some(2)
        );
        assert_eq!(
            cli(&db, &["jobs", "--older-than", "soon"])
                .await
                .status
                .code(),
            Some(2)
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_pages_by_id_without_gaps_or_repeats_and_filters() {
    bounded(async {
        let db = TestDb::new("cli_pages").await;
        let mut all = Vec::new();
        for n in 0..5 {
            let kind = if n % 2 == 0 { "even" } else { "odd" };
            all.push(db.store.enqueue(job(kind)).await.unwrap().0);
        }
        let mut seen = Vec::new();
        let mut after: Option<i64> = None;
        for _ in 0..5 {
            let mut args = vec!["jobs".to_string(), "--limit".into(), "2".into()];
            if let Some(a) = after {
                args.extend(["--after".into(), a.to_string()]);
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let page = json(&db, &args).await;
            seen.extend(
                page["jobs"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|j| j["id"].as_i64().unwrap()),
            );
            after = page["next_after"].as_i64();
            if after.is_none() {
                break;
            }
        }
        assert_eq!(seen, all);
        let text = ok(&db, &["jobs", "--limit", "2"]).await;
        assert!(
            text.ends_with(&format!("next page: --after {}\n", all[1])),
            "{text}"
        );

        let odd = json(&db, &["jobs", "--kind", "odd"]).await;
        assert_eq!(odd["jobs"].as_array().unwrap().len(), 2);
        let old = ok(&db, &["jobs", "--older-than", "1h"]).await;
        assert_eq!(old, "no jobs match\n", "every job is seconds old");
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_printed_migration_applied_by_hand_leaves_migrate_nothing_to_do() {
    bounded(async {
        let db = TestDb::unmigrated("cli_migrate", Default::default(), 2).await;
        let script = ok(&db, &["migrate", "--print-sql"]).await;
        let shipped = shipped_versions();
        let newest = *shipped.last().unwrap();
        assert_eq!(
            script.matches("\n-- migration ").count(),
            shipped.len(),
            "{script}"
        );
        sqlx::raw_sql(&script).execute(&db.pool).await.unwrap();

        let again = ok(&db, &["migrate", "--print"]).await;
        assert!(
            !again.contains("-- migration"),
            "nothing left to apply:\n{again}"
        );
        let versions: Vec<i32> = sqlx::query_scalar(&format!(
            "SELECT version FROM {} ORDER BY version",
            db.table("leasehold_migrations")
        ))
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(versions, shipped);
        assert_eq!(
            ok(&db, &["migrate"]).await,
            format!("schema {} is at version {newest}\n", db.schema)
        );
        db.store
            .enqueue(NewJob::from_json("k", serde_json::json!({})))
            .await
            .unwrap();
        assert_eq!(
            json(&db, &["status"]).await["queues"][0]["by_state"]["pending"],
            1
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_deletes_finished_jobs_past_the_floor_and_keeps_dead_letters() {
    bounded(async {
        let db = TestDb::new("cli_prune").await;
        let (dead, _waiting, email) = stuck_key(&db).await;
        ok(&db, &["cancel", &email.to_string()]).await;

        let url = format!(
            "postgres://{}@{}:{}/{}",
            std::env::var("PGUSER").unwrap_or_else(|_| "root".into()),
            std::env::var("PGHOST").unwrap_or_else(|_| "127.0.0.1".into()),
            std::env::var("PGPORT").unwrap_or_else(|_| "5432".into()),
            test_db_name()
        );
        // Cancelled a moment ago: within the floor, kept whatever --older-than says.
        let kept = json(
            &db,
            &["--database-url", &url, "prune", "--older-than", "0s"],
        )
        .await;
        assert_eq!(kept["jobs"], 0, "{kept}");
        sqlx::query(&format!(
            "UPDATE {} SET finished_at = now() - interval '10 minutes' WHERE id = $1",
            db.table("jobs")
        ))
        .bind(email.0)
        .execute(&db.owner)
        .await
        .unwrap();
        let pruned = json(
            &db,
            &["--database-url", &url, "prune", "--older-than", "0s"],
        )
        .await;
        assert_eq!(pruned["jobs"], 1, "{pruned}");
        assert_eq!(
            cli(&db, &["job", &email.to_string()]).await.status.code(),
            Some(1)
        );
        assert_eq!(
            db.state_of(dead).await,
            "dead",
            "dead letters are never pruned"
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_retry_changes_nothing_until_confirmed_then_retries_every_selected_job() {
    bounded(async {
        let db = TestDb::new("cli_bulk").await;
        let mut charges = Vec::new();
        let mut refund = None;
        for kind in ["charge", "charge", "charge", "refund"] {
            let id = db.store.enqueue(job(kind)).await.unwrap();
            let mut req = ClaimRequest::new(owner("w"), vec!["default".into()], 1, LEASE);
            req.kinds = Some(vec![kind.into()]);
            let claimed = db.store.claim(&req).await.unwrap().remove(0);
            let fatal = Failure {
                reason: "declined".into(),
                permanent: true,
                retry_after: None,
            };
            db.store
                .fail(&claimed.fence(), &fatal, &fixed_backoff(1))
                .await
                .unwrap();
            match kind {
                "charge" => charges.push(id),
                _ => refund = Some(id),
            }
        }
        let refund = refund.unwrap();

        let unconfirmed = cli(&db, &["retry", "--kind", "charge"]).await;
        assert_eq!(unconfirmed.status.code(), Some(1));
        let stderr = String::from_utf8_lossy(&unconfirmed.stderr);
        assert!(
            stderr.contains("3 jobs match; nothing was changed"),
            "{stderr}"
        );
        for id in &charges {
            assert_eq!(
                db.state_of(*id).await,
                "dead",
                "nothing changes without a yes"
            );
        }

        let report = json(&db, &["retry", "--kind", "charge", "--yes"]).await;
        assert_eq!(report["matched"], 3);
        let done: Vec<i64> = report["done"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        assert_eq!(done, charges.iter().map(|id| id.0).collect::<Vec<_>>());
        for id in &charges {
            assert_eq!(db.state_of(*id).await, "pending");
        }
        assert_eq!(
            db.state_of(refund).await,
            "dead",
            "another kind is not selected"
        );

        let one = ok(&db, &["retry", "--kind", "refund"]).await;
        assert_eq!(
            one, "retry: 1 of 1 selected jobs done\n",
            "one job needs no yes"
        );
        assert_eq!(
            cli(&db, &["retry"]).await.status.code(),
            Some(2),
            "an id or a filter"
        );
        db.drop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_resume_a_queue_show_in_status_and_are_idempotent() {
    bounded(async {
        let db = TestDb::new("cli_pause").await;
        stuck_key(&db).await;
        let text = ok(&db, &["pause", "payments", "--by", "ops\u{1b}[31m"]).await;
        assert!(text.contains("paused queue payments"), "{text}");
        let again = ok(&db, &["pause", "payments"]).await;
        assert!(again.contains("already paused"), "{again}");
        assert!(
            again.contains("by ops\\u{1b}[31m"),
            "the recorded author is shown escaped: {again}"
        );
        let status = json(&db, &["status"]).await;
        let queues = status["queues"].as_array().unwrap();
        let payments = queues.iter().find(|q| q["queue"] == "payments").unwrap();
        assert_eq!(payments["paused"], true, "{status}");
        let table = ok(&db, &["status"]).await;
        let row = table.lines().find(|l| l.starts_with("payments")).unwrap();
        assert!(row.ends_with("paused"), "{table}");

        let resumed = json(&db, &["resume", "payments"]).await;
        assert_eq!(resumed["changed"], true, "{resumed}");
        let not_paused = ok(&db, &["resume", "payments"]).await;
        assert!(not_paused.contains("was not paused"), "{not_paused}");
        let status = json(&db, &["status"]).await;
        assert!(status["queues"]
            .as_array()
            .unwrap()
            .iter()
            .all(|q| q["paused"] == false));
        db.drop().await;
    })
    .await
}

struct Noop;

impl leasehold::Handler for Noop {
    type Payload = i64;
    type Output = ();
    const KIND: &'static str = "noop";

    async fn run(&self, _: leasehold::JobContext, _: i64) -> Result<(), leasehold::JobError> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_lists_the_live_schedulers_with_their_owner_ids_until_they_stop() {
    bounded(async {
        let db = TestDb::new("cli_live_schedulers").await;
        let none = ok(&db, &["status"]).await;
        assert!(none.contains("no live scheduler"), "{none}");
        let config = leasehold::Config {
            schema: db.schema.clone(),
            concurrency: 3,
            queues: vec!["mail".into()],
            ..Default::default()
        };
        let scheduler = leasehold::Scheduler::builder(db.pool.clone(), config)
            .register(Noop)
            .start()
            .await
            .unwrap();
        let owner = scheduler.owner().to_string();
        let mut seen = String::new();
        for _ in 0..100 {
            seen = ok(&db, &["status"]).await;
            if seen.contains(&owner) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let line = seen
            .lines()
            .find(|l| l.contains(&owner))
            .unwrap_or_else(|| panic!("{seen}"));
        let cells: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(&cells[..3], [owner.as_str(), "mail", "3"], "{seen}");
        let json = json(&db, &["status"]).await;
        assert_eq!(json["schedulers"][0]["owner"], owner.as_str());
        scheduler.shutdown().await.unwrap();
        let after = ok(&db, &["status"]).await;
        assert!(after.contains("no live scheduler"), "{after}");
        db.drop().await;
    })
    .await;
}
