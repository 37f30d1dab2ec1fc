//! leasehold against the raw-SQL ceiling: throughput, enqueue, latency, keyed work,
//! table growth and memory, in one run.
//!
//!     cargo run --release --example bench              # the full run (under 10 minutes)
//!     cargo run --release --example bench -- --json    # the same, as JSON on stdout
//!     cargo run --release --example bench -- --quick   # smaller sizes, a smoke run
//!
//! Other flags: `--runs N` (default 3; every figure is the median of N runs, printed
//! with the spread), `--only ceiling,e2e,enqueue,latency,keyed,hot,growth,memory` (`keyed` includes `hot`),
//! `--pool N` (connections of the scheduler's pool, default 24), `--history` (write the
//! `claimed`/`completed` history events, `StoreOptions::full_history`).
//!
//! Needs a PostgreSQL on 127.0.0.1:5432 that lets the current user in (or
//! DATABASE_URL). It connects to the `postgres` database, creates `leasehold_bench`,
//! and works in the schema `bench` there, which it drops and recreates.

use std::time::Instant;

use serde_json::json;

#[path = "bench/report.rs"]
mod report;
#[path = "bench/setup.rs"]
mod setup;
#[path = "bench/work.rs"]
mod work;

use report::{Goal, Row, Stat};
use work::EnqueueWay;

struct Args {
    json: bool,
    quick: bool,
    runs: usize,
    only: Option<Vec<String>>,
    pool: u32,
    history: bool,
    memory_child: Option<usize>,
}

fn args() -> Args {
    let mut a = Args {
        json: false,
        quick: false,
        runs: 3,
        only: None,
        pool: 24,
        history: false,
        memory_child: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().unwrap_or_else(|| panic!("{name} needs a value"));
        match arg.as_str() {
            "--json" => a.json = true,
            "--quick" => a.quick = true,
            "--history" => a.history = true,
            "--runs" => a.runs = value("--runs").parse().expect("--runs N"),
            "--pool" => a.pool = value("--pool").parse().expect("--pool N"),
            "--only" => {
                a.only = Some(
                    value("--only")
                        .split(',')
                        .map(|s| s.trim().to_string())
                        .collect(),
                )
            }
            "--memory-child" => {
                a.memory_child = Some(value("--memory-child").parse().expect("--memory-child N"))
            }
            "-h" | "--help" => {
                eprintln!("{}", HELP);
                std::process::exit(0);
            }
            other => panic!("unknown flag {other:?}\n{HELP}"),
        }
    }
    a
}

const HELP: &str = "usage: bench [--json] [--quick] [--runs N] [--pool N] [--history] \
[--only ceiling,e2e,enqueue,latency,keyed,hot,growth,memory]";

/// Workload sizes: the for the default run, smaller for `--quick`.
struct Sizes {
    ceiling_jobs: u64,
    e2e: Vec<(usize, u64)>,
    enqueue_one: u64,
    enqueue_bulk: u64,
    latency_secs: f64,
    idle_rate: f64,
    keys: u64,
    per_key: u64,
    hot_backlog: u64,
    hot_window: f64,
    other_rate: f64,
    terminal: (i64, i64),
    pending: i64,
    claim_iterations: usize,
    memory_keys: u64,
}

impl Sizes {
    fn new(quick: bool) -> Self {
        if quick {
            Sizes {
                ceiling_jobs: 10_000,
                e2e: vec![(1, 500), (8, 3_000), (32, 10_000), (128, 10_000)],
                enqueue_one: 300,
                enqueue_bulk: 10_000,
                latency_secs: 1.0,
                idle_rate: 50.0,
                keys: 1_000,
                per_key: 10,
                hot_backlog: 10_000,
                hot_window: 1.5,
                other_rate: 50.0,
                terminal: (10_000, 100_000),
                pending: 100_000,
                claim_iterations: 30,
                memory_keys: 2_000,
            }
        } else {
            Sizes {
                ceiling_jobs: 60_000,
                e2e: vec![(1, 3_000), (8, 20_000), (32, 100_000), (128, 100_000)],
                enqueue_one: 2_000,
                enqueue_bulk: 100_000,
                latency_secs: 3.0,
                idle_rate: 50.0,
                keys: 10_000,
                per_key: 10,
                hot_backlog: 100_000,
                hot_window: 4.0,
                other_rate: 50.0,
                terminal: (100_000, 1_000_000),
                pending: 1_000_000,
                claim_iterations: 50,
                memory_keys: 10_000,
            }
        }
    }
}

/// Progress goes to stderr; the table (or JSON) to stdout.
macro_rules! say {
    ($($t:tt)*) => { eprintln!("[bench {:>6.1}s] {}", START.with(|s| s.elapsed().as_secs_f64()), format!($($t)*)) };
}

thread_local! {
    static START: Instant = Instant::now();
}

/// Median of the per-run ratios `num[r] / den[r]`: each pair ran back to back, so a
/// slow spell on this shared machine slows both sides of a ratio.
fn paired_ratio(num: &[f64], den: &[f64]) -> f64 {
    Stat::of(num.iter().zip(den).map(|(a, b)| a / b).collect()).median()
}

#[actix::main]
async fn main() {
    let a = args();
    tracing_subscriber::fmt()
        .with_env_filter("leasehold=warn,sqlx=error")
        .with_writer(std::io::stderr)
        .init();
    if let Some(keys) = a.memory_child {
        work::memory_child(keys).await;
        return;
    }
    START.with(|_| ());
    let sizes = Sizes::new(a.quick);
    let want = |s: &str| a.only.as_ref().map_or(true, |o| o.iter().any(|x| x == s));
    let runs = a.runs.max(1);

    let opts = setup::bench_database().await;
    let pool = setup::pool(&opts, a.pool).await;
    let store = setup::fresh_schema(&pool, setup::SCHEMA, a.history).await;
    let machine = setup::machine();
    let settings = setup::settings(&pool).await;
    say!(
        "database {} schema {}, pool {} connections, {runs} runs per figure",
        setup::DB,
        setup::SCHEMA,
        a.pool
    );

    let mut rows: Vec<Row> = Vec::new();
    let mut explains: Vec<(String, String)> = Vec::new();

    // 0. Statement costs, a diagnostic run only on request.
    if a.only
        .as_ref()
        .is_some_and(|o| o.iter().any(|x| x == "micro"))
    {
        for batch in [1i64, 32, 100] {
            let [lc, lw, rc, rw] = work::micro(&store, &opts, batch, 200).await;
            say!("batch {batch}: leasehold claim {lc:.3} ms, complete_many {lw:.3} ms; raw claim {rc:.3} ms, raw complete {rw:.3} ms");
        }
    }

    // 1-2. The raw-SQL ceiling and leasehold end to end, interleaved run by run.
    let pool_conns = a.pool as usize;
    let mut conns = vec![1usize, 4, pool_conns];
    conns.sort();
    conns.dedup();
    let mut ceilings: Vec<Vec<f64>> = vec![Vec::new(); conns.len()];
    let mut e2e: Vec<Vec<f64>> = vec![Vec::new(); sizes.e2e.len()];
    if want("ceiling") || want("e2e") {
        setup::checkpoint(&store).await;
        for r in 0..runs {
            if want("ceiling") {
                for (i, &c) in conns.iter().enumerate() {
                    let x = work::ceiling(&store, &opts, c, sizes.ceiling_jobs).await;
                    say!(
                        "run {}/{runs}: raw ceiling, {c} connections: {} jobs/s",
                        r + 1,
                        report::num(x)
                    );
                    ceilings[i].push(x);
                }
            }
            if want("e2e") {
                for (i, &(c, n)) in sizes.e2e.iter().enumerate() {
                    let x = work::throughput(&store, c, n, a.history).await;
                    say!(
                        "run {}/{runs}: leasehold no-op, concurrency {c}: {} jobs/s",
                        r + 1,
                        report::num(x)
                    );
                    e2e[i].push(x);
                }
            }
        }
    }
    let ceiling_at_pool = conns
        .iter()
        .position(|&c| c == pool_conns)
        .map(|i| ceilings[i].clone());
    let ceiling_at_pool = ceiling_at_pool.filter(|v| !v.is_empty());
    let best_ceiling = ceilings
        .iter()
        .map(|v| Stat::of(v.clone()).median())
        .filter(|m| m.is_finite())
        .fold(f64::NAN, f64::max);
    if want("ceiling") {
        for (i, &c) in conns.iter().enumerate() {
            rows.push(Row::new(
                "raw-SQL ceiling: claim 100 (one SKIP LOCKED statement) + complete 100 (one fenced UPDATE)",
                format!("{c} connection{}{}", if c == 1 { "" } else { "s" }, if c == pool_conns { " (= the pool)" } else { "" }),
                Stat::of(ceilings[i].clone()),
                "jobs/s",
            ));
        }
    }
    let mut unkeyed_32 = f64::NAN;
    if want("e2e") {
        for (i, &(c, n)) in sizes.e2e.iter().enumerate() {
            let st = Stat::of(e2e[i].clone());
            if c == 32 {
                unkeyed_32 = st.median();
            }
            let mut row = Row::new(
                "leasehold end to end, no-op handlers",
                format!("concurrency {c} ({n} jobs)"),
                st,
                "jobs/s",
            );
            if let Some(den) = &ceiling_at_pool {
                row = row.ratio(paired_ratio(&e2e[i], den), format!("ceiling@{pool_conns}"));
                if c == 32 {
                    row = row.goal(Goal::AtLeast(0.6));
                }
            }
            rows.push(row);
        }
    }

    // 3. Enqueue, each way right after a raw COPY.
    if want("enqueue") {
        let ways = [
            (
                EnqueueWay::One,
                "enqueue, one per transaction",
                sizes.enqueue_one,
            ),
            (
                EnqueueWay::Many,
                "enqueue_many, 1000 per statement",
                sizes.enqueue_bulk,
            ),
            (
                EnqueueWay::Copy,
                "enqueue_copy, one COPY",
                sizes.enqueue_bulk,
            ),
        ];
        let mut raw = Vec::new();
        let mut got: Vec<Vec<f64>> = vec![Vec::new(); ways.len()];
        setup::checkpoint(&store).await;
        for r in 0..runs {
            let x = work::enqueue(&store, EnqueueWay::RawCopy, sizes.enqueue_bulk).await;
            raw.push(x);
            let mut line = format!("run {}/{runs}: raw COPY {} rows/s", r + 1, report::num(x));
            for (i, (way, name, n)) in ways.iter().enumerate() {
                let x = work::enqueue(&store, *way, *n).await;
                line.push_str(&format!("; {name} {}", report::num(x)));
                got[i].push(x);
            }
            say!("{line}");
        }
        let section = "enqueue, unkeyed (from building the jobs to commit)";
        for (i, (way, name, n)) in ways.iter().enumerate() {
            let mut row = Row::new(
                section,
                format!("{name} ({n} rows)"),
                Stat::of(got[i].clone()),
                "rows/s",
            )
            .ratio(paired_ratio(&got[i], &raw), "raw COPY");
            if matches!(way, EnqueueWay::Copy) {
                row = row.goal(Goal::AtLeast(0.8));
            }
            rows.push(row);
        }
        rows.push(Row::new(
            section,
            format!("raw COPY, same columns ({} rows)", sizes.enqueue_bulk),
            Stat::of(raw),
            "rows/s",
        ));
    }

    // 4. Enqueue-to-start latency at a fixed offered rate.
    if want("latency") {
        let half = if unkeyed_32.is_finite() {
            (unkeyed_32 / 2.0).round()
        } else {
            2000.0
        };
        let section = "enqueue-to-start latency (enqueue call → handler start; concurrency 32)";
        for (label, rate, goal) in [
            ("idle queue", sizes.idle_rate, Some(Goal::AtMost(5.0))),
            ("half the measured maximum", half, None),
        ] {
            let (mut p50, mut p99, mut db) = (Vec::new(), Vec::new(), Vec::new());
            setup::checkpoint(&store).await;
            for r in 0..runs {
                let l = work::latency(&store, 32, rate, sizes.latency_secs, a.history).await;
                say!("run {}/{runs}: latency, {label} ({rate}/s offered, {:.0}/s sent, {} jobs): p50 {:.2} ms p99 {:.2} ms (db clock p50 {:.2} ms)",
                    r + 1, l.offered, l.samples, l.p50, l.p99, l.db_p50);
                p50.push(l.p50);
                p99.push(l.p99);
                db.push(l.db_p50);
            }
            let mut row = Row::new(
                section,
                format!("{label}, {rate}/s: p50"),
                Stat::of(p50),
                "ms",
            );
            if let Some(g) = goal {
                row = row.goal(g);
            }
            rows.push(row);
            rows.push(Row::new(
                section,
                format!("{label}, {rate}/s: p99"),
                Stat::of(p99),
                "ms",
            ));
            rows.push(Row::new(
                section,
                format!("{label}, {rate}/s: p50 created_at → claimed_at (db clock)"),
                Stat::of(db),
                "ms",
            ));
        }
    }

    // 5. Keyed work, each run right after an unkeyed run of the same size.
    if want("keyed") {
        let n = sizes.keys * sizes.per_key;
        let (mut plain, mut keyed) = (Vec::new(), Vec::new());
        setup::checkpoint(&store).await;
        for r in 0..runs {
            let u = work::throughput(&store, 32, n, a.history).await;
            let k = work::keyed(&store, sizes.keys, sizes.per_key, 32, a.history).await;
            say!(
                "run {}/{runs}: unkeyed {} jobs/s, {} keys x {} {} jobs/s",
                r + 1,
                report::num(u),
                sizes.keys,
                sizes.per_key,
                report::num(k)
            );
            plain.push(u);
            keyed.push(k);
        }
        let section = "keyed work (concurrency 32)";
        rows.push(
            Row::new(
                section,
                format!("{} keys x {} jobs", sizes.keys, sizes.per_key),
                Stat::of(keyed.clone()),
                "jobs/s",
            )
            .ratio(paired_ratio(&keyed, &plain), "unkeyed")
            .goal(Goal::AtLeast(0.7)),
        );
        rows.push(Row::new(
            section,
            format!("the same {n} jobs unkeyed"),
            Stat::of(plain),
            "jobs/s",
        ));
    }
    if want("keyed") || want("hot") {
        let section = "keyed work (concurrency 32)";
        say!("hot key: loading {} jobs behind one key", sizes.hot_backlog);
        setup::checkpoint(&store).await;
        let windows = work::hot_key(
            &store,
            sizes.hot_backlog,
            runs,
            sizes.hot_window,
            sizes.other_rate,
            32,
            a.history,
        )
        .await;
        for (i, (rate, l)) in windows.iter().enumerate() {
            say!("hot key window {}/{runs}: {:.0} jobs/s; other keys p50 {:.2} ms p99 {:.2} ms ({} jobs)",
                i + 1, rate, l.p50, l.p99, l.samples);
        }
        rows.push(
            Row::new(
                section,
                format!("one hot key, {} jobs behind it", sizes.hot_backlog),
                Stat::of(windows.iter().map(|w| w.0).collect()),
                "jobs/s",
            )
            .goal(Goal::AtLeast(500.0)),
        );
        rows.push(Row::new(
            section,
            format!(
                "other keys meanwhile ({}/s): enqueue → start p50",
                sizes.other_rate
            ),
            Stat::of(windows.iter().map(|w| w.1.p50).collect()),
            "ms",
        ));
        rows.push(Row::new(
            section,
            format!(
                "other keys meanwhile ({}/s): enqueue → start p99",
                sizes.other_rate
            ),
            Stat::of(windows.iter().map(|w| w.1.p99).collect()),
            "ms",
        ));
    }

    // 6. Claim cost as the table grows: each run on the big table right after one on an
    //    empty table (its own schema), so each ratio compares back-to-back runs.
    if want("growth") {
        let empty = setup::fresh_schema(&pool, "bench_empty", a.history).await;
        let section = "claim latency as the table grows (Store::claim of 100, median of each run)";
        let it = sizes.claim_iterations;
        let mut base_all = Vec::new();
        let measure = |label: String, goal: Option<Goal>| {
            let store = &store;
            let empty = &empty;
            async move {
                let (mut big, mut base) = (Vec::new(), Vec::new());
                for r in 0..runs {
                    let b = work::claim_latency(store, it, 100).await;
                    setup::reset(empty).await;
                    let e = work::claim_latency(empty, it, 100).await;
                    say!(
                        "run {}/{runs}: claim latency, {label}: {b:.2} ms (empty table {e:.2} ms)",
                        r + 1
                    );
                    big.push(b);
                    base.push(e);
                }
                let mut row = Row::new(section, label, Stat::of(big.clone()), "ms")
                    .ratio(paired_ratio(&big, &base), "empty");
                if let Some(g) = goal {
                    row = row.goal(g);
                }
                (row, base)
            }
        };
        setup::reset(&store).await;
        let (row, base) = measure("empty table (the jobs schema itself)".into(), None).await;
        rows.push(row);
        base_all.extend(base);

        setup::insert_rows(&store, "done", sizes.terminal.0).await;
        setup::checkpoint(&store).await;
        let (row, base) = measure(format!("{} terminal rows", sizes.terminal.0), None).await;
        rows.push(row);
        base_all.extend(base);

        say!("inserting terminal rows up to {}", sizes.terminal.1);
        setup::insert_rows(&store, "done", sizes.terminal.1 - sizes.terminal.0).await;
        setup::checkpoint(&store).await;
        let (row, base) = measure(
            format!("{} terminal rows", sizes.terminal.1),
            Some(Goal::AtMost(1.3)),
        )
        .await;
        rows.push(row);
        base_all.extend(base);
        setup::raw_copy(&store, "noop", 1000).await;
        setup::vacuum_analyze(&store).await;
        explains.push((
            format!(
                "claim of 100 with {} terminal rows and 1,000 pending",
                sizes.terminal.1
            ),
            work::explain_claim(&store, 100).await,
        ));

        say!("inserting {} pending rows", sizes.pending);
        setup::reset(&store).await;
        setup::insert_rows(&store, "pending", sizes.pending).await;
        setup::checkpoint(&store).await;
        let (row, base) = measure(format!("{} pending rows", sizes.pending), None).await;
        rows.push(row);
        base_all.extend(base);
        setup::vacuum_analyze(&store).await;
        explains.push((
            format!("claim of 100 with {} pending rows", sizes.pending),
            work::explain_claim(&store, 100).await,
        ));
        rows.push(Row::new(
            section,
            "empty table, every paired run",
            Stat::of(base_all),
            "ms",
        ));
        setup::reset(&store).await;
        sqlx::query("DROP SCHEMA bench_empty CASCADE")
            .execute(&pool)
            .await
            .ok();
    }

    // 7. Memory, in a child process that holds only the scheduler.
    if want("memory") {
        let (mut rss, mut base, mut seqs) = (Vec::new(), Vec::new(), Vec::new());
        setup::checkpoint(&store).await;
        for r in 0..runs {
            let v = work::memory(&store, sizes.memory_keys).await;
            say!("run {}/{runs}: memory {v}", r + 1);
            rss.push(v["rss_mb"].as_f64().unwrap_or(f64::NAN));
            base.push(v["rss_before_mb"].as_f64().unwrap_or(f64::NAN));
            seqs.push(v["sequencers"].as_f64().unwrap_or(f64::NAN));
        }
        let section = "memory (a child process holding only the scheduler; VmRSS)";
        rows.push(
            Row::new(
                section,
                format!("RSS with {} active keys", sizes.memory_keys),
                Stat::of(rss),
                "MB",
            )
            .goal(Goal::AtMost(100.0)),
        );
        rows.push(Row::new(
            section,
            "RSS before the scheduler started",
            Stat::of(base),
            "MB",
        ));
        rows.push(Row::new(
            section,
            "sequencers alive when measured",
            Stat::of(seqs),
            "actors",
        ));
        setup::reset(&store).await;
    }

    let total = START.with(|s| s.elapsed().as_secs_f64());
    say!("done in {total:.0} s");
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    if a.json {
        let kv = |v: &[(String, String)]| {
            v.iter()
                .map(|(k, v)| (k.clone(), json!(v)))
                .collect::<serde_json::Map<_, _>>()
        };
        let out = json!({
            "command": command,
            "machine": kv(&machine),
            "postgres": kv(&settings),
            "runs": runs,
            "pool": a.pool,
            "full_history": a.history,
            "best_ceiling_jobs_per_sec": best_ceiling,
            "total_secs": total,
            "rows": report::rows_json(&rows),
            "explain": explains.iter().map(|(k, v)| json!({"what": k, "plan": v})).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&out).unwrap());
        return;
    }
    println!("leasehold bench: {runs} runs per figure (median, spread min-max), {total:.0} s");
    println!("command: {command}");
    let line = |v: &[(String, String)], sep: &str| {
        v.iter()
            .map(|(k, v)| format!("{k}{sep}{v}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!("machine: {}", line(&machine, " "));
    println!("postgres: {}", line(&settings, "="));
    println!(
        "scheduler: Config::default() except concurrency; pool {} connections; full_history {}; \
         ratios are medians of per-run ratios (each pair ran back to back); a CHECKPOINT \
         opens each section",
        a.pool, a.history
    );
    println!();
    report::print_table(&rows);
    for (what, plan) in &explains {
        println!("\nEXPLAIN (ANALYZE, BUFFERS), {what}\n{plan}");
    }
}
