//! The jobs listing (`Store::list_jobs`, what the dashboard's jobs page and
//! `leasehold jobs` show): pending jobs come in claim order, waiting jobs by key and
//! position, running jobs by id; paging after the last job of each page lists every
//! match exactly once, even when the cursor job changed state meanwhile; and a page of
//! an open state reads its own index, never the history of done jobs below it, on a
//! never-analyzed table and after ANALYZE.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use leasehold::store::JobFilter;
use leasehold::{JobId, JobState, StoreOptions};

/// Every page of `filter` with pages of `limit`, concatenated.
async fn all_pages(db: &TestDb, filter: JobFilter, limit: i64) -> Vec<JobId> {
    let mut out = Vec::new();
    let mut filter = JobFilter { limit, ..filter };
    for _ in 0..1_000 {
        let page = db.store.list_jobs(&filter).await.unwrap();
        out.extend(page.iter().map(|j| j.id));
        match page.last() {
            Some(last) if page.len() as i64 == limit => filter.after = Some(last.id),
            _ => return out,
        }
    }
    panic!("the listing never ended: {out:?}");
}

async fn exec(db: &TestDb, sql: &str) {
    sqlx::raw_sql(&sql.replace("{s}", db.store.schema().quoted()))
        .execute(&db.pool)
        .await
        .unwrap();
}

async fn ids(db: &TestDb, sql: &str) -> Vec<JobId> {
    sqlx::query_scalar::<_, i64>(&sql.replace("{s}", db.store.schema().quoted()))
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .map(JobId)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_jobs_are_listed_in_claim_order_and_pages_list_each_once() {
    bounded(async {
        let db = TestDb::with_options("listing_pending", StoreOptions::default(), 2).await;
        // Three queues, three priorities, due times out of id order, and done history.
        exec(
            &db,
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, priority, available_at)
             SELECT 'q' || (g % 3), 'k', 'pending', '{}', 2, 1, (g % 4)::smallint - 1,
                    now() - make_interval(secs => (g * 7919) % 101)
             FROM generate_series(1, 120) g;
             INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, finished_at)
             SELECT 'q1', 'k', 'done', '{}', 2, 1, now() FROM generate_series(1, 30);",
        )
        .await;
        let expected = ids(
            &db,
            "SELECT id FROM {s}.jobs WHERE state = 'pending' ORDER BY queue, priority, available_at, id",
        )
        .await;
        assert_eq!(expected.len(), 120);
        let pending = JobFilter {
            state: Some(JobState::Pending),
            ..JobFilter::default()
        };
        for limit in [1, 7, 50, 500] {
            assert_eq!(
                all_pages(&db, pending.clone(), limit).await,
                expected,
                "pages of {limit}"
            );
        }
        // A queue's pending jobs alone, in the same order.
        let q1 = ids(
            &db,
            "SELECT id FROM {s}.jobs WHERE state = 'pending' AND queue = 'q1'
             ORDER BY priority, available_at, id",
        )
        .await;
        let in_q1 = JobFilter {
            queue: Some("q1".into()),
            ..pending.clone()
        };
        assert_eq!(all_pages(&db, in_q1, 4).await, q1);

        // The cursor job is claimed between two pages: the next page goes on from its
        // position, skipping and repeating nothing.
        let first = db
            .store
            .list_jobs(&JobFilter {
                limit: 10,
                ..pending.clone()
            })
            .await
            .unwrap();
        let cursor = first.last().unwrap().id;
        exec(
            &db,
            &format!(
                "UPDATE {{s}}.jobs SET state = 'running', owner = 'w', lease_until = now() + interval '1 minute',
                        attempts = 1, generation = 1 WHERE id = {}",
                cursor.0
            ),
        )
        .await;
        let rest = all_pages(
            &db,
            JobFilter {
                after: Some(cursor),
                ..pending.clone()
            },
            10,
        )
        .await;
        assert_eq!(rest, expected[10..].to_vec());

        // A cursor job that no longer exists ends the listing instead of starting it over.
        exec(&db, &format!("DELETE FROM {{s}}.jobs WHERE id = {}", cursor.0)).await;
        let after_deleted = JobFilter {
            after: Some(cursor),
            ..pending
        };
        assert!(db.store.list_jobs(&after_deleted).await.unwrap().is_empty());
        db.drop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_jobs_are_listed_by_key_then_position_and_running_jobs_by_id() {
    bounded(async {
        let db = TestDb::with_options("listing_waiting", StoreOptions::default(), 2).await;
        exec(
            &db,
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, job_key, key_seq)
             SELECT 'q' || (g % 2), 'k', 'waiting', '{}', 2, 1, 'acct-' || (g % 5), 100 - g
             FROM generate_series(1, 40) g;
             INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, attempts,
                                   generation, owner, lease_until)
             SELECT 'q' || (g % 2), 'k', 'running', '{}', 2, 1, 1, 1, 'w', now() + make_interval(secs => 100 - g)
             FROM generate_series(1, 25) g;
             INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, finished_at)
             SELECT 'q1', 'k', 'done', '{}', 2, 1, now() FROM generate_series(1, 30);",
        )
        .await;
        let waiting = ids(
            &db,
            "SELECT id FROM {s}.jobs WHERE state = 'waiting' ORDER BY queue, job_key, key_seq",
        )
        .await;
        let running = ids(
            &db,
            "SELECT id FROM {s}.jobs WHERE state = 'running' ORDER BY id",
        )
        .await;
        for limit in [1, 6, 100] {
            let by_state = |state| JobFilter {
                state: Some(state),
                ..JobFilter::default()
            };
            assert_eq!(
                all_pages(&db, by_state(JobState::Waiting), limit).await,
                waiting
            );
            assert_eq!(
                all_pages(&db, by_state(JobState::Running), limit).await,
                running
            );
        }
        // A key's jobs are listed by id, whatever the state.
        let acct = ids(
            &db,
            "SELECT id FROM {s}.jobs WHERE job_key = 'acct-3' AND state = 'waiting' ORDER BY id",
        )
        .await;
        let of_key = JobFilter {
            state: Some(JobState::Waiting),
            key: Some("acct-3".into()),
            ..JobFilter::default()
        };
        assert_eq!(all_pages(&db, of_key, 3).await, acct);
        db.drop().await;
    })
    .await;
}

/// 100,000 done jobs with the open ones above them in id order, as in a real table: a
/// page of pending, waiting or running jobs must not walk the done rows (that walk was
/// 200 to 250 ms at 10^6 rows), whether the table was analyzed or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_of_an_open_state_reads_its_own_index_not_the_history_below_it() {
    bounded(async {
        let db = TestDb::with_options("listing_plan", StoreOptions::default(), 2).await;
        exec(
            &db,
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, finished_at)
             SELECT 'q', 'k', 'done', '{}', 2, 1, now() FROM generate_series(1, 100000);
             INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts)
             SELECT 'q', 'k', 'pending', '{}', 2, 1 FROM generate_series(1, 200);
             INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, job_key, key_seq)
             SELECT 'q', 'k', 'waiting', '{}', 2, 1, 'a' || g, 2 FROM generate_series(1, 200) g;
             INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, attempts,
                                   generation, owner, lease_until)
             SELECT 'q', 'k', 'running', '{}', 2, 1, 1, 1, 'w', now() + interval '1 hour'
             FROM generate_series(1, 200);",
        )
        .await;
        let cases = [
            (JobState::Pending, "jobs_claimable_by_queue"),
            (JobState::Waiting, "jobs_waiting_by_key"),
            (JobState::Running, "jobs_leased"),
        ];
        for analyzed in [false, true] {
            if analyzed {
                exec(&db, "ANALYZE {s}.jobs").await;
            }
            for (state, index) in cases {
                let filter = JobFilter {
                    state: Some(state),
                    ..JobFilter::default()
                };
                let plan = db.store.explain_list_jobs(&filter).await.unwrap();
                assert!(
                    plan.contains(index),
                    "{state:?} (analyzed: {analyzed}) reads {index}: {plan}"
                );
                for walks_the_history in ["Seq Scan", "Rows Removed by Filter"] {
                    assert!(
                        !plan.contains(walks_the_history),
                        "{state:?} (analyzed: {analyzed}): {plan}"
                    );
                }
                let page = db.store.list_jobs(&filter).await.unwrap();
                assert_eq!(page.len(), 50);
                assert!(page.iter().all(|j| j.state == state));
                let distinct: HashSet<_> = page.iter().map(|j| j.id).collect();
                assert_eq!(distinct.len(), 50);
            }
        }
        // And the age filter on pending jobs stops at the claim order's page too.
        let old = JobFilter {
            state: Some(JobState::Pending),
            older_than: Some(Duration::from_secs(0)),
            ..JobFilter::default()
        };
        assert_eq!(db.store.list_jobs(&old).await.unwrap().len(), 50);
        db.drop().await;
    })
    .await;
}

/// A filter no index serves (a rare kind among 250,000 done jobs) is searched a stretch
/// of ids at a time by the page a person waits for: with no time to spare each page
/// searches one stretch, says how far it searched, and the next goes on from there, so
/// the pages together find every match once, in id order; with time, one page finds
/// them all and is the last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_page_searches_a_stretch_at_a_time_and_the_next_searches_on() {
    bounded(async {
        let db = TestDb::with_options("listing_bounded", StoreOptions::default(), 2).await;
        exec(
            &db,
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, finished_at)
             SELECT 'q', CASE WHEN g IN (5, 150000, 249990) THEN 'rare' ELSE 'common' END,
                    'done', '{}', 2, 1, now()
             FROM generate_series(1, 250000) g",
        )
        .await;
        let rare = ids(&db, "SELECT id FROM {s}.jobs WHERE kind = 'rare' ORDER BY id").await;
        let last = ids(&db, "SELECT max(id) FROM {s}.jobs").await[0];
        let filter = JobFilter {
            kind: Some("rare".into()),
            limit: 2,
            ..JobFilter::default()
        };
        let mut found = Vec::new();
        let mut searched = Vec::new();
        let mut next = None;
        for _ in 0..10 {
            let page = db
                .store
                .list_jobs_page(&JobFilter { after: next, ..filter.clone() }, Duration::ZERO)
                .await
                .unwrap();
            found.extend(page.jobs.iter().map(|j| j.id));
            searched.extend(page.searched_to);
            next = page.next;
            if next.is_none() {
                break;
            }
        }
        assert_eq!(found, rare, "every match once, in id order");
        assert!(next.is_none(), "the search reached the end");
        // One stretch per page: each page that came back short says how far it read.
        let start = rare[0].0 - 5;
        let stretch = leasehold::store::SEARCH_STRETCH;
        let expected: Vec<JobId> = (1..)
            .map(|n| JobId(start + n * stretch))
            .take_while(|id| id.0 < last.0)
            .collect();
        assert_eq!(searched, expected);

        let whole = db
            .store
            .list_jobs_page(&JobFilter { limit: 50, ..filter.clone() }, Duration::from_secs(60))
            .await
            .unwrap();
        let whole_ids: Vec<JobId> = whole.jobs.iter().map(|j| j.id).collect();
        assert_eq!(whole_ids, rare);
        assert!(whole.next.is_none() && whole.searched_to.is_none());

        // A common match fills its page in the first stretch and pages on by id.
        let common = JobFilter {
            kind: Some("common".into()),
            limit: 10,
            ..JobFilter::default()
        };
        let page = db.store.list_jobs_page(&common, Duration::ZERO).await.unwrap();
        assert_eq!(page.jobs.len(), 10);
        assert_eq!(page.next, Some(page.jobs[9].id));
        assert!(page.searched_to.is_none());
        db.drop().await;
    })
    .await;
}

/// A key's jobs, in every state, by id: its history (done, cancelled) among 50,000 done
/// jobs of other keys, its open jobs and its waiting ones, paged in id order with each
/// job once; the page reads the key's indexes (history from `jobs_ended_by_key`), never
/// the table, whether analyzed or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_jobs_are_listed_by_id_from_its_own_indexes_in_every_state() {
    bounded(async {
        let db = TestDb::with_options("listing_key", StoreOptions::default(), 2).await;
        exec(
            &db,
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, job_key, key_seq, finished_at)
             SELECT 'q', 'k', 'done', '{}', 2, 1, 'other-' || (g % 500), g, now() FROM generate_series(1, 50000) g;
             INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, job_key, key_seq, finished_at)
             SELECT 'q', 'k', CASE WHEN g % 5 = 0 THEN 'cancelled' ELSE 'done' END, '{}', 2, 1, 'acct', g, now()
             FROM generate_series(1, 40) g;
             INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, job_key, key_seq, attempts,
                                   generation, owner, lease_until)
             VALUES ('q', 'k', 'running', '{}', 2, 1, 'acct', 41, 1, 1, 'w', now() + interval '1 hour');
             INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, job_key, key_seq)
             SELECT 'q', 'k', 'waiting', '{}', 2, 1, 'acct', 41 + g FROM generate_series(1, 30) g;
             INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, job_key, key_seq, finished_at)
             SELECT 'q', 'k', 'done', '{}', 2, 1, 'other-' || (g % 500), g, now() FROM generate_series(1, 5000) g;",
        )
        .await;
        let expected = ids(&db, "SELECT id FROM {s}.jobs WHERE job_key = 'acct' ORDER BY id").await;
        assert_eq!(expected.len(), 71);
        let of_key = JobFilter {
            key: Some("acct".into()),
            ..JobFilter::default()
        };
        for analyzed in [false, true] {
            if analyzed {
                exec(&db, "ANALYZE {s}.jobs").await;
            }
            for limit in [1, 8, 50, 500] {
                assert_eq!(
                    all_pages(&db, of_key.clone(), limit).await,
                    expected,
                    "pages of {limit} (analyzed: {analyzed})"
                );
            }
            let plan = db.store.explain_list_jobs(&of_key).await.unwrap();
            assert!(plan.contains("jobs_ended_by_key"), "{plan}");
            assert!(!plan.contains("Seq Scan"), "{plan}");
            assert!(!plan.contains("jobs_pkey"), "{plan}");
        }
        db.drop().await;
    })
    .await;
}
