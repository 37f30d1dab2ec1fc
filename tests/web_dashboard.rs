//! The dashboard's guards, without a browser: actions need the page's CSRF token and
//! the host's authorization hook (a refusal changes nothing), a dashboard without a
//! hook has no action routes and no buttons, a bulk action acts only on the count it
//! confirmed, the actor is written into the job's history, and live schedulers are
//! listed until they shut down. Requests go through an actix-web test service.

mod common;
#[path = "common/worker.rs"]
mod worker;

use actix_web::body::MessageBody;
use actix_web::dev::{Service, ServiceResponse};
use actix_web::http::{header, StatusCode};
use actix_web::{test as http, App, HttpRequest};
use common::{within, TestDb};
use leasehold::{JobId, JobState, NewJob, Scheduler, StoreOptions};
use worker::{fast_config, run_in_system, wait_until, POOL};

/// A scheduler that claims only from `elsewhere`, so the test's jobs stay put.
async fn idle_scheduler(db: &TestDb) -> Scheduler {
    let mut config = fast_config(&db.schema);
    config.queues = vec!["elsewhere".into()];
    Scheduler::builder(db.pool.clone(), config)
        .register(Noop)
        .start()
        .await
        .unwrap()
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

async fn pending(db: &TestDb, queue: &str) -> JobId {
    let job = NewJob::new("noop", &0).unwrap().with_queue(queue);
    db.store.enqueue(job).await.unwrap()
}

/// The hook of these tests: who the `x-user` header names; refused without one.
fn by_header(req: &HttpRequest) -> Option<String> {
    req.headers()
        .get("x-user")?
        .to_str()
        .ok()
        .map(|s| format!("web:{s}"))
}

async fn body(res: ServiceResponse<impl MessageBody>) -> String {
    let bytes = http::read_body(res).await;
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// The CSRF cookie a page set, and the token its forms carry.
async fn token<S, B>(app: &S, path: &str) -> String
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: MessageBody,
{
    let res = http::call_service(
        app,
        http::TestRequest::get()
            .uri(path)
            .insert_header(("x-user", "ann"))
            .to_request(),
    )
    .await;
    assert_eq!(res.status(), StatusCode::OK);
    let cookie = res
        .response()
        .cookies()
        .find(|c| c.name() == "leasehold_csrf")
        .expect("the page sets the CSRF cookie")
        .value()
        .to_string();
    let html = body(res).await;
    assert!(
        html.contains(&format!("name=\"csrf\" value=\"{cookie}\"")),
        "the forms carry the cookie's token"
    );
    cookie
}

fn post(path: &str, cookie: Option<&str>, form: &str) -> actix_http::Request {
    let mut req = http::TestRequest::post()
        .uri(path)
        .insert_header(("x-user", "ann"))
        .insert_header((header::CONTENT_TYPE, "application/x-www-form-urlencoded"))
        .set_payload(form.to_string());
    if let Some(c) = cookie {
        req = req.insert_header((header::COOKIE, format!("leasehold_csrf={c}")));
    }
    req.to_request()
}

#[test]
fn an_action_without_the_pages_csrf_token_is_refused_and_changes_nothing() {
    run_in_system(within(60, "csrf", async {
        let db = TestDb::with_options("web_csrf", StoreOptions::default(), POOL).await;
        let scheduler = idle_scheduler(&db).await;
        let id = pending(&db, "q").await;
        let app = http::init_service(
            App::new().service(
                leasehold::web::dashboard(scheduler.clone())
                    .at("/ops")
                    .actions(by_header),
            ),
        )
        .await;
        let path = format!("/ops/job/{}/hold", id.0);
        let token = token(&app, &format!("/ops/job/{}", id.0)).await;
        let forged = format!("{}.{}", "ab".repeat(16), "0".repeat(64));
        for (what, cookie, form) in [
            ("no token at all", None, String::new()),
            (
                "the cookie without the field",
                Some(token.as_str()),
                String::new(),
            ),
            (
                "the field without the cookie",
                None,
                format!("csrf={token}"),
            ),
            (
                "a field that is not the cookie",
                Some(token.as_str()),
                format!("csrf={forged}"),
            ),
            (
                "a forged pair",
                Some(forged.as_str()),
                format!("csrf={forged}"),
            ),
        ] {
            let res = http::call_service(&app, post(&path, cookie, &form)).await;
            assert_eq!(res.status(), StatusCode::FORBIDDEN, "{what}");
            assert_eq!(
                db.store.job(id).await.unwrap().state,
                JobState::Pending,
                "{what}"
            );
        }
        let res =
            http::call_service(&app, post(&path, Some(&token), &format!("csrf={token}"))).await;
        assert_eq!(res.status(), StatusCode::SEE_OTHER);
        assert_eq!(db.store.job(id).await.unwrap().state, JobState::Held);
        let last = db.store.history(id).await.unwrap().pop().unwrap();
        assert_eq!(
            (last.event.as_str(), last.owner.as_deref()),
            ("held", Some("web:ann"))
        );
        scheduler.shutdown().await.unwrap();
        db.drop().await;
    }));
}

#[test]
fn without_a_hook_there_are_no_buttons_and_no_action_routes_and_a_refusing_hook_gets_403() {
    run_in_system(within(60, "read-only", async {
        let db = TestDb::with_options("web_readonly", StoreOptions::default(), POOL).await;
        let scheduler = idle_scheduler(&db).await;
        let id = pending(&db, "q").await;
        let guarded = http::init_service(
            App::new().service(
                leasehold::web::dashboard(scheduler.clone())
                    .at("/ops")
                    .actions(by_header),
            ),
        )
        .await;
        // A valid token (the secret is the process's): only the missing routes refuse.
        let token = token(&guarded, &format!("/ops/job/{}", id.0)).await;
        let read_only = http::init_service(
            App::new().service(leasehold::web::dashboard(scheduler.clone()).at("/ops")),
        )
        .await;
        for page in [
            format!("/ops/job/{}", id.0),
            "/ops/".into(),
            "/ops/jobs".into(),
        ] {
            let res =
                http::call_service(&read_only, http::TestRequest::get().uri(&page).to_request())
                    .await;
            let html = body(res).await;
            assert!(!html.contains("method=\"post\""), "{page} shows no action");
        }
        let form = format!("csrf={token}");
        for path in [
            format!("/ops/job/{}/hold", id.0),
            "/ops/queue/q/pause".into(),
            "/ops/bulk".into(),
        ] {
            let res = http::call_service(&read_only, post(&path, Some(&token), &form)).await;
            assert_eq!(res.status(), StatusCode::NOT_FOUND, "{path}");
        }

        let anonymous = http::TestRequest::get()
            .uri(&format!("/ops/job/{}", id.0))
            .to_request();
        let html = body(http::call_service(&guarded, anonymous).await).await;
        assert!(
            !html.contains("method=\"post\""),
            "no buttons for whom the hook refuses"
        );
        let mut refused = post(&format!("/ops/job/{}/hold", id.0), Some(&token), &form);
        refused.headers_mut().remove("x-user");
        let res = http::call_service(&guarded, refused).await;
        assert_eq!(res.status(), StatusCode::FORBIDDEN);
        let res =
            http::call_service(&guarded, post("/ops/queue/q/pause", Some(&token), &form)).await;
        assert_eq!(res.status(), StatusCode::SEE_OTHER, "the hook accepts ann");
        assert_eq!(db.store.job(id).await.unwrap().state, JobState::Pending);
        let paused = db.store.paused_queues().await.unwrap();
        assert_eq!(paused[0].paused_by.as_deref(), Some("web:ann"));
        scheduler.shutdown().await.unwrap();
        db.drop().await;
    }));
}

#[test]
fn a_bulk_cancel_asks_to_confirm_its_count_and_acts_only_on_that_count() {
    run_in_system(within(60, "bulk", async {
        let db = TestDb::with_options("web_bulk", StoreOptions::default(), POOL).await;
        let scheduler = idle_scheduler(&db).await;
        let mut ids = Vec::new();
        for _ in 0..3 {
            ids.push(pending(&db, "q").await);
        }
        let other = pending(&db, "r").await;
        let app = http::init_service(
            App::new().service(
                leasehold::web::dashboard(scheduler.clone())
                    .at("/ops")
                    .actions(by_header),
            ),
        )
        .await;
        let token = token(&app, "/ops/jobs").await;
        let ask = format!("csrf={token}&action=cancel&queue=q&state=pending");
        let html =
            body(http::call_service(&app, post("/ops/bulk", Some(&token), &ask)).await).await;
        assert!(html.contains("cancel 3 jobs"), "{html}");
        let stale = format!("{ask}&confirm=2");
        let html =
            body(http::call_service(&app, post("/ops/bulk", Some(&token), &stale)).await).await;
        assert!(
            html.contains("cancel 3 jobs"),
            "a count that changed is asked again: {html}"
        );
        assert_eq!(
            db.count_where("jobs", "state = 'cancelled'").await,
            0,
            "nothing yet"
        );

        let yes = format!("{ask}&confirm=3");
        let html =
            body(http::call_service(&app, post("/ops/bulk", Some(&token), &yes)).await).await;
        assert!(
            html.contains("3 of 3 selected jobs done by web:ann"),
            "{html}"
        );
        for id in ids {
            let job = db.store.job(id).await.unwrap();
            assert_eq!(job.state, JobState::Cancelled);
            let last = db.store.history(id).await.unwrap().pop().unwrap();
            assert_eq!(last.owner.as_deref(), Some("web:ann"));
        }
        assert_eq!(db.store.job(other).await.unwrap().state, JobState::Pending);
        scheduler.shutdown().await.unwrap();
        db.drop().await;
    }));
}

#[test]
fn a_scheduler_is_listed_live_with_its_owner_and_concurrency_until_it_shuts_down() {
    run_in_system(within(60, "live schedulers", async {
        let db = TestDb::with_options("web_live", StoreOptions::default(), POOL).await;
        let scheduler = idle_scheduler(&db).await;
        let owner = scheduler.owner().to_string();
        wait_until(10, "the first heartbeat", || async {
            !db.store.live_schedulers().await.unwrap().is_empty()
        })
        .await;
        let live = db.store.live_schedulers().await.unwrap();
        assert_eq!(live.len(), 1);
        assert_eq!(
            (live[0].owner.as_str(), live[0].concurrency),
            (owner.as_str(), 8)
        );
        assert_eq!(live[0].queues, vec!["elsewhere".to_string()]);
        assert_eq!(live[0].pid, std::process::id() as i32);
        let app =
            http::init_service(App::new().service(leasehold::web::dashboard(scheduler.clone())))
                .await;
        let html = body(
            http::call_service(
                &app,
                http::TestRequest::get().uri("/schedulers").to_request(),
            )
            .await,
        )
        .await;
        assert!(html.contains(&owner), "{html}");
        scheduler.shutdown().await.unwrap();
        assert!(
            db.store.live_schedulers().await.unwrap().is_empty(),
            "its row went with it"
        );
        db.drop().await;
    }));
}

/// The jobs page's query reads an index and stops at its page: the primary key from
/// `after` on (no sort, no scan of the rows before), and for the dead letters the index
/// of parked jobs by id (migration 13), on a table of 100,000 done jobs with the 50 dead ones at its end.
#[test]
fn a_page_of_jobs_reads_an_index_and_stops_at_its_limit() {
    run_in_system(within(120, "explain", async {
        let db = TestDb::with_options("web_explain", StoreOptions::default(), POOL).await;
        for sql in [
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, finished_at)
             SELECT 'q', 'noop', 'done', '{}', 2, 1, now() FROM generate_series(1, 100000)",
            "INSERT INTO {s}.jobs (queue, kind, state, payload, payload_bytes, max_attempts, finished_at, last_error)
             SELECT 'q', 'noop', 'dead', '{}', 2, 1, now(), 'x' FROM generate_series(1, 50)",
            "ANALYZE {s}.jobs",
        ] {
            // The owner's: only a table's owner may ANALYZE it.
            sqlx::query(&sql.replace("{s}", db.store.schema().quoted()))
                .execute(&db.owner)
                .await
                .unwrap();
        }
        let page = |filter: leasehold::store::JobFilter| {
            let store = db.store.clone();
            async move { store.explain_list_jobs(&filter).await.unwrap() }
        };
        let later = page(leasehold::store::JobFilter {
            after: Some(JobId(60_000)),
            ..Default::default()
        })
        .await;
        assert!(later.contains("Index Scan using jobs_pkey"), "{later}");
        assert!(
            !later.contains("Sort") && !later.contains("Seq Scan"),
            "{later}"
        );
        assert!(
            later.contains("rows=50 loops=1"),
            "one page, no more: {later}"
        );
        let dead = page(leasehold::store::JobFilter {
            state: Some(JobState::Dead),
            ..Default::default()
        })
        .await;
        // In id order from an index of their own: no scan of the done rows, no sort.
        for shows_a_scan in ["Seq Scan", "Sort", "Rows Removed by Filter: 1000"] {
            assert!(!dead.contains(shows_a_scan), "the dead letters: {dead}");
        }
        db.drop().await;
    }));
}
