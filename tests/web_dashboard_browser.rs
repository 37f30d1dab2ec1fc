//! The dashboard in a real browser: headless Chromium driven through chromedriver
//! (Debian's `chromium` and `chromium-driver`, which `.ci/run` installs). A scheduler
//! runs jobs; the dashboard is mounted in an actix-web server on a loopback port; the
//! browser loads the overview, filters the dead jobs, opens one, retries it and sees
//! it done; pauses a queue and sees the scheduler claim nothing of it until resumed;
//! and shows a hostile payload, key, kind and error as text. A screenshot of each page
//! goes to `target/dashboard-screenshots/`.
//!
//! Without chromedriver the tests fail, naming the packages: a browser test that
//! skips would pass on a machine that never ran it.

mod common;
#[path = "common/worker.rs"]
mod worker;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use actix_web::{App, HttpServer};
use common::{base_options, within, TestDb};
use fantoccini::{Client, ClientBuilder, Locator};
use leasehold::{Handler, JobContext, JobError, JobState, NewJob, Scheduler, Store, StoreOptions};
use sqlx::postgres::PgPoolOptions;
use worker::{fast_config, run_in_system, wait_until, POOL};

/// Set by the retry test once the "bug" is fixed: until then every charge of a negative
/// amount fails for good.
static FIXED: AtomicBool = AtomicBool::new(false);

/// A negative amount fails for good (dead at once) until [`FIXED`]; the rest complete.
struct Charge;

impl Handler for Charge {
    type Payload = serde_json::Value;
    type Output = ();
    const KIND: &'static str = "charge";

    async fn run(&self, _: JobContext, charge: serde_json::Value) -> Result<(), JobError> {
        if charge["amount"].as_i64().unwrap_or(0) >= 0 || FIXED.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(JobError::permanent(
                "card declined <script>document.title='pwned-error'</script>",
            ))
        }
    }
}

/// Who the browser tests act as (the hook accepts every request).
const OPERATOR: &str = "browser-test-operator";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// chromedriver on a free loopback port, killed on drop.
struct Driver {
    child: Child,
    port: u16,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn chromedriver() -> Driver {
    let port = free_port();
    let child = Command::new("chromedriver")
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start chromedriver ({e}): install Debian's `chromium` and `chromium-driver` \
                 packages (apt-get install -y chromium chromium-driver; .ci/run does)"
            )
        });
    let driver = Driver { child, port };
    wait_until(15, "chromedriver to listen", || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    driver
}

async fn browser(driver: &Driver) -> Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1400,1000"],
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    within(
        60,
        "a Chromium session",
        ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{}", driver.port)),
    )
    .await
    .expect("chromedriver could not start Chromium (is the `chromium` package installed?)")
}

/// The dashboard at `/jobs` on a loopback port, with actions for [`OPERATOR`]; each
/// worker reads through a lazy pool of its own (a connection belongs to the runtime
/// that opened it).
fn serve(scheduler: &Scheduler, schema: &str) -> (actix_web::dev::ServerHandle, String) {
    let (scheduler, schema) = (scheduler.clone(), schema.to_string());
    let server = HttpServer::new(move || {
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect_lazy_with(base_options().database(&common::test_db_name()));
        let store = Store::new(pool, &schema, StoreOptions::default()).unwrap();
        App::new().service(
            leasehold::web::dashboard(scheduler.clone())
                .at("/jobs")
                .store(store)
                .actions(|_| Some(OPERATOR.to_string())),
        )
    })
    .workers(1)
    .disable_signals()
    .bind(("127.0.0.1", 0))
    .unwrap();
    let url = format!("http://{}/jobs", server.addrs()[0]);
    let server = server.run();
    let handle = server.handle();
    actix::spawn(server);
    (handle, url)
}

/// Save the page as `target/dashboard-screenshots/<name>.png`.
async fn screenshot(client: &Client, name: &str) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .join("dashboard-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    let png = client.screenshot().await.unwrap();
    std::fs::write(dir.join(format!("{name}.png")), png).unwrap();
}

async fn text_of(client: &Client, css: &str) -> String {
    client
        .find(Locator::Css(css))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Wait for the page an action redirected to: its flash message contains `needle`. Read
/// right after the click, the old page (or none, mid-navigation) may still be there.
async fn wait_for_flash(client: &Client, needle: &str) {
    wait_until(10, &format!("a flash message with {needle:?}"), || async {
        match client.find(Locator::Css("#flash")).await {
            Ok(element) => element.text().await.is_ok_and(|t| t.contains(needle)),
            Err(_) => false,
        }
    })
    .await;
}

async fn click(client: &Client, css: &str) {
    let element = client.find(Locator::Css(css)).await.unwrap();
    element.click().await.unwrap();
}

/// Wait for the navigation a click started: the page's URL contains `part`.
async fn wait_for_url(client: &Client, part: &str) {
    wait_until(
        10,
        &format!("the browser to reach a URL with {part}"),
        || async { client.current_url().await.unwrap().as_str().contains(part) },
    )
    .await;
}

async fn start(db: &TestDb, queues: &[&str]) -> Scheduler {
    let mut config = fast_config(&db.schema);
    config.queues = queues.iter().map(|q| q.to_string()).collect();
    Scheduler::builder(db.pool.clone(), config)
        .register(Charge)
        .start()
        .await
        .unwrap()
}

fn charge(queue: &str, n: i64) -> NewJob {
    NewJob::new("charge", &serde_json::json!({ "amount": n }))
        .unwrap()
        .with_queue(queue)
}

#[test]
fn an_operator_filters_the_dead_jobs_opens_one_and_retries_it_until_it_is_done() {
    run_in_system(within(150, "the retry walk-through", async {
        let db = TestDb::with_options("web_browser_retry", StoreOptions::default(), POOL).await;
        let scheduler = start(&db, &["payments", "emails"]).await;
        let mut ids = Vec::new();
        for n in 0..3 {
            ids.push(
                scheduler
                    .enqueue_job(charge("payments", -1 - n))
                    .await
                    .unwrap(),
            );
        }
        // And some that complete, in two queues, for the overview's chart.
        for n in 0..6 {
            let queue = if n % 2 == 0 { "payments" } else { "emails" };
            scheduler.enqueue_job(charge(queue, n)).await.unwrap();
        }
        wait_until(
            20,
            "the charges to die and the rest to complete",
            || async {
                db.count_where("jobs", "state = 'dead'").await == 3
                    && db.count_where("jobs", "state = 'done'").await == 6
            },
        )
        .await;
        let driver = chromedriver().await;
        let client = browser(&driver).await;
        let (server, url) = serve(&scheduler, &db.schema);

        client.goto(&format!("{url}/")).await.unwrap();
        let row = text_of(&client, "#queues tr[data-queue='payments']").await;
        assert!(row.contains("payments"), "{row}");
        screenshot(&client, "overview").await;

        // Filter the dead jobs with the form.
        client.goto(&format!("{url}/jobs")).await.unwrap();
        let state = client.find(Locator::Css("#state")).await.unwrap();
        state.select_by_value("dead").await.unwrap();
        click(&client, "#apply").await;
        wait_for_url(&client, "state=dead").await;
        let states = client
            .find_all(Locator::Css("#jobs td.state"))
            .await
            .unwrap();
        assert_eq!(states.len(), 3, "the three dead jobs are listed");
        for s in &states {
            assert_eq!(s.text().await.unwrap(), "dead");
        }
        screenshot(&client, "jobs-dead").await;

        // Open the first, see why it died, retry it.
        click(&client, "#jobs a.job-link").await;
        wait_for_url(&client, "/jobs/job/").await;
        assert_eq!(text_of(&client, "#state").await, "dead");
        assert!(text_of(&client, "#last-error")
            .await
            .contains("card declined <script>"));
        screenshot(&client, "job-dead").await;
        FIXED.store(true, Ordering::SeqCst);
        click(&client, "#action-retry").await;
        wait_for_flash(&client, "retry done by").await;
        let page = client.current_url().await.unwrap();
        let mut seen = String::new();
        for _ in 0..100 {
            client.goto(page.as_str()).await.unwrap();
            seen = text_of(&client, "#state").await;
            if seen == "done" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(seen, "done", "the retried job ran again and completed");
        let history = text_of(&client, "#history").await;
        assert!(
            history.contains("retried_by_operator") && history.contains(OPERATOR),
            "{history}"
        );
        screenshot(&client, "job-done").await;

        let _ = client.close().await;
        server.stop(true).await;
        scheduler.shutdown().await.unwrap();
        db.drop().await;
    }));
}

#[test]
fn pausing_a_queue_from_the_overview_stops_the_scheduler_claiming_it() {
    run_in_system(within(150, "the pause walk-through", async {
        let db = TestDb::with_options("web_browser_pause", StoreOptions::default(), POOL).await;
        let scheduler = start(&db, &["payouts"]).await;
        // A job, so the queue is on the overview.
        let first = scheduler.enqueue_job(charge("payouts", 0)).await.unwrap();
        wait_until(20, "the first payout", || async {
            db.store.job(first).await.unwrap().state == JobState::Done
        })
        .await;
        let driver = chromedriver().await;
        let client = browser(&driver).await;
        let (server, url) = serve(&scheduler, &db.schema);

        client.goto(&format!("{url}/")).await.unwrap();
        let pause = "#queues tr[data-queue='payouts'] button.pause";
        assert_eq!(text_of(&client, pause).await, "pause");
        click(&client, pause).await;
        wait_for_flash(&client, "paused by").await;
        assert_eq!(
            text_of(&client, "#queues tr[data-queue='payouts'] td.paused").await,
            "paused"
        );
        screenshot(&client, "overview-paused").await;

        let held_back: Vec<_> = {
            let mut ids = Vec::new();
            for n in 1..4 {
                ids.push(scheduler.enqueue_job(charge("payouts", n)).await.unwrap());
            }
            ids
        };
        // The scheduler is woken by the enqueues and polls every 200 ms at most.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        for id in &held_back {
            let job = db.store.job(*id).await.unwrap();
            assert_eq!((job.state, job.attempts), (JobState::Pending, 0), "{job:?}");
        }

        click(&client, pause).await;
        wait_for_flash(&client, "resumed by").await;
        wait_until(20, "the payouts after the resume", || async {
            db.count_where("jobs", "queue = 'payouts' AND state = 'done'")
                .await
                == 4
        })
        .await;

        let _ = client.close().await;
        server.stop(true).await;
        scheduler.shutdown().await.unwrap();
        db.drop().await;
    }));
}

/// Markup that would run script or add elements if it reached the page unescaped.
const HOSTILE: &str = "<script>document.title='pwned'</script><img id=injected src=x onerror=\"document.title='pwned'\">";

#[test]
fn a_hostile_payload_key_and_kind_render_as_text() {
    run_in_system(within(150, "the escaping check", async {
        let db = TestDb::with_options("web_browser_xss", StoreOptions::default(), POOL).await;
        let scheduler = start(&db, &["default"]).await;
        // Not claimed: its kind has no handler here, and it is held at once.
        let job = NewJob::new(
            format!("kind{HOSTILE}"),
            &serde_json::json!({ "note": HOSTILE }),
        )
        .unwrap()
        .with_queue("hostile")
        .with_key(format!("key{HOSTILE}"));
        let id = db.store.enqueue(job).await.unwrap();
        db.store.hold(id).await.unwrap();
        let driver = chromedriver().await;
        let client = browser(&driver).await;
        let (server, url) = serve(&scheduler, &db.schema);

        for (page, name) in [
            (format!("{url}/job/{}", id.0), "job-hostile"),
            (format!("{url}/jobs?queue=hostile"), "jobs-hostile"),
            (format!("{url}/keys"), "keys-hostile"),
        ] {
            client.goto(&page).await.unwrap();
            let title = client.title().await.unwrap();
            assert!(!title.contains("pwned"), "{page}: a script ran ({title})");
            let injected = client
                .find_all(Locator::Css("#injected, main script"))
                .await
                .unwrap();
            assert!(
                injected.is_empty(),
                "{page}: hostile markup became elements"
            );
            let body = text_of(&client, "main").await;
            assert!(
                body.contains("<script>document.title='pwned'</script>"),
                "{page}: {body}"
            );
            screenshot(&client, name).await;
        }
        client.goto(&format!("{url}/job/{}", id.0)).await.unwrap();
        let payload = text_of(&client, "#payload").await;
        assert!(payload.contains("<img id=injected"), "{payload}");

        let _ = client.close().await;
        server.stop(true).await;
        scheduler.shutdown().await.unwrap();
        db.drop().await;
    }));
}
