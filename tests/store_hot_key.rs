//! A hot key with a 100,000-job backlog does not make the claim scan the backlog: the
//! backlog is `waiting`, outside the claim's partial index, so the claim reads a
//! handful of index entries whatever the backlog's size. Asserted on the plan and its
//! row and buffer counts (EXPLAIN ANALYZE, BUFFERS), never on wall-clock time.

mod common;

use common::*;
use leasehold::{CompleteOutcome, JobState};
use serde_json::Value;
use sqlx::Connection;

/// The claim statement exactly as the store renders it, read from the store's source
/// (the RETURNING list does not change the plan, so it is shortened).
fn claim_sql(schema: &str) -> String {
    let src = include_str!("../src/store/claim.rs");
    let start = src
        .find("pub(super) const CLAIM: &str = r#\"")
        .expect("CLAIM template in claim.rs");
    let body = &src[start..];
    let body = &body[body.find("r#\"").unwrap() + 3..];
    let body = &body[..body.find("\"#;").unwrap()];
    body.replace("{s}", &format!("\"{schema}\"")).replace(
        "__RETURNED__",
        "j.id, j.generation, j.claimed_at, j.priority",
    )
}

/// One plan node that touches `jobs`.
#[derive(Debug)]
struct JobsScan {
    node: String,
    index: Option<String>,
    rows_examined: i64,
}

fn walk(plan: &Value, out: &mut Vec<JobsScan>) {
    let relation = plan.get("Relation Name").and_then(Value::as_str);
    let node = plan["Node Type"].as_str().unwrap_or_default().to_string();
    let index = plan.get("Index Name").and_then(Value::as_str);
    if node == "Bitmap Index Scan" && index.is_some_and(|i| i.starts_with("jobs")) {
        // Its rows are counted by the Bitmap Heap Scan above it.
        out.push(JobsScan {
            node,
            index: index.map(str::to_string),
            rows_examined: 0,
        });
    } else if relation == Some("jobs") && node != "ModifyTable" {
        let n = |k: &str| plan.get(k).and_then(Value::as_f64).unwrap_or(0.0);
        let loops = n("Actual Loops").max(1.0);
        let examined =
            (n("Actual Rows") + n("Rows Removed by Filter") + n("Rows Removed by Index Recheck"))
                * loops;
        out.push(JobsScan {
            node,
            index: index.map(str::to_string),
            rows_examined: examined as i64,
        });
    }
    if let Some(children) = plan.get("Plans").and_then(Value::as_array) {
        for c in children {
            walk(c, out);
        }
    }
}

/// EXPLAIN (ANALYZE, BUFFERS) the store's claim of `limit` jobs, in a transaction that
/// is rolled back. Returns the scans of `jobs` and the shared buffers the claim touched.
/// `generic`: planned as the claimer's sessions plan it (`force_generic_plan`).
async fn explain_claim(db: &TestDb, limit: i64, generic: bool) -> (Vec<JobsScan>, i64, Value) {
    let mut conn = db.raw_conn("explain").await;
    sqlx::query(&format!(
        "PREPARE lh_claim(text[], text[], int8, int8, text, timestamptz, float8, bool, bool) AS {}",
        claim_sql(&db.schema)
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    let mut tx = conn.begin().await.unwrap();
    if generic {
        sqlx::query("SET LOCAL plan_cache_mode = force_generic_plan")
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    let plan: Value = sqlx::query_scalar(&format!(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE lh_claim(ARRAY['default'], NULL, {limit}, {}, 'explain', NULL, 30, true, true)",
        i64::MAX
    ))
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    conn.close().await.unwrap();
    let root = &plan[0]["Plan"];
    let mut scans = Vec::new();
    walk(root, &mut scans);
    let buffers =
        root["Shared Hit Blocks"].as_i64().unwrap() + root["Shared Read Blocks"].as_i64().unwrap();
    (scans, buffers, plan)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_key_backlog_of_100k_does_not_widen_the_claim_of_other_keys() {
    bounded(async {
        let db = TestDb::with_options("hot_key_backlog", Default::default(), 2).await;
        let mut others = Vec::new();
        for n in 0..10 {
            others.push(keyed("k", &format!("k{n}"), n));
            others.push(job("k"));
        }
        // The hot key's head comes first, so a claim takes it and then the others.
        let hot_head = db.store.enqueue(keyed("k", "hot", 0)).await.unwrap();
        let other_ids = db.store.enqueue_many(others).await.unwrap();
        let (scans_small, buffers_small, _) = explain_claim(&db, 10, false).await;

        for chunk in 0..10 {
            let ids = db
                .store
                .enqueue_many((0..10_000).map(|n| keyed("k", "hot", chunk * 10_000 + n + 1)).collect())
                .await
                .unwrap();
            assert_eq!(ids.len(), 10_000);
        }
        assert_eq!(db.count_where("jobs", "job_key = 'hot' AND state = 'waiting'").await, 100_000);
        // Right after the bulk enqueue (planner statistics still from the small table)
        // and after ANALYZE (as autovacuum would), planned with its parameters and as the
        // claimer's sessions plan it (generic), the claim reads only pending rows.
        for (analyzed, generic) in [(false, false), (false, true), (true, false), (true, true)] {
            if analyzed && !generic {
                sqlx::query(&format!("ANALYZE {}", db.table("jobs"))).execute(&db.pool).await.unwrap();
            }
            let (scans, buffers, plan) = explain_claim(&db, 10, generic).await;
            assert!(
                scans.iter().any(|s| s.index.as_deref() == Some("jobs_claimable")),
                "analyzed={analyzed} generic={generic}: the claim must use the jobs_claimable partial index: {scans:?}\n{plan:#}"
            );
            assert!(scans.iter().all(|s| s.node != "Seq Scan"), "analyzed={analyzed} generic={generic}: no sequential scan of jobs: {scans:?}");
            let examined: i64 = scans.iter().map(|s| s.rows_examined).sum();
            assert!(examined <= 40, "analyzed={analyzed} generic={generic}: the claim examined {examined} rows of jobs: {scans:?}\n{plan:#}");
            assert!(
                buffers <= 2 * buffers_small,
                "analyzed={analyzed} generic={generic}: the claim touched {buffers} buffers with the backlog, {buffers_small} without: {plan:#}"
            );
            eprintln!("analyzed={analyzed} generic={generic}: without backlog {scans_small:?} {buffers_small} buffers; with {scans:?} {buffers} buffers");
        }

        // And the claim itself: ten jobs, one of them the hot head, none of its backlog.
        let w = owner("w");
        let got = db.store.claim(&claim_req(&w, 10)).await.unwrap();
        assert_eq!(got.len(), 10);
        assert_eq!(got.iter().filter(|j| j.key.as_deref() == Some("hot")).count(), 1);
        assert!(got.iter().any(|j| j.id == hot_head));
        assert!(got.iter().filter(|j| j.id != hot_head).all(|j| other_ids.contains(&j.id)));
        for j in &got {
            assert_eq!(db.store.complete(&j.fence(), None).await.unwrap(), CompleteOutcome::Completed);
        }
        // The hot key moved on by exactly one.
        let next: (i64, String) = sqlx::query_as(&format!(
            "SELECT key_seq, state FROM {} WHERE job_key = 'hot' AND state IN ('pending', 'running')",
            db.table("jobs")
        ))
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(next, (2, JobState::Pending.as_str().to_string()));
        assert_eq!(db.count_where("jobs", "state = 'done'").await, 10);
        assert_eq!(db.count_where("jobs", "job_key = 'hot' AND state = 'waiting'").await, 99_999);
        db.drop().await;
    })
    .await
}
