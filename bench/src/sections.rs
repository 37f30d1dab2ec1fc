//! The sections of a run: each measures its figures `runs` times and adds its rows.

use leasehold::Store;
use sqlx::postgres::PgConnectOptions;
use sqlx::PgPool;

use super::peer::{self, Peer};
use super::report::{self, Goal, Row, Stat};
use super::throughput::{EnqueueWay, Trips};
use super::{footprint, handlers, latency, notify, pooler, setup, throughput};

/// Workload sizes: the for the default run, smaller for `--quick`.
pub struct Sizes {
    pub ceiling_jobs: u64,
    pub e2e: Vec<(usize, u64)>,
    pub enqueue_one: u64,
    pub enqueue_bulk: u64,
    pub latency_secs: f64,
    pub idle_rate: f64,
    pub keys: u64,
    pub per_key: u64,
    pub hot_backlog: u64,
    pub hot_window: f64,
    pub other_rate: f64,
    pub terminal: (i64, i64),
    pub pending: i64,
    pub claim_iterations: usize,
    pub memory_keys: u64,
    pub fresh_jobs: u64,
    pub cpu_jobs: u64,
    /// (done, pending) rows of the operator-figures section.
    pub stats_rows: (i64, i64),
    /// Jobs in the dashboard section's table.
    pub dashboard_rows: i64,
}

impl Sizes {
    pub fn new(quick: bool) -> Self {
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
                fresh_jobs: 5_000,
                cpu_jobs: 500,
                stats_rows: (100_000, 10_000),
                dashboard_rows: 100_000,
            }
        } else {
            Sizes {
                ceiling_jobs: 60_000,
                e2e: vec![(1, 20_000), (8, 20_000), (32, 100_000), (128, 100_000)],
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
                fresh_jobs: 20_000,
                cpu_jobs: 3_000,
                stats_rows: (1_000_000, 100_000),
                dashboard_rows: 1_000_000,
            }
        }
    }
}

/// Everything a section needs, and what the sections found.
pub struct Run {
    pub sizes: Sizes,
    pub runs: usize,
    pub history: bool,
    /// Connections of the schedulers' pool; the ceiling uses as many.
    pub pool_conns: usize,
    pub opts: PgConnectOptions,
    pub pool: PgPool,
    pub store: Store,
    pub rows: Vec<Row>,
    pub explains: Vec<(String, String)>,
    /// graphile_worker, measured after each of leasehold's matching runs (`--only peer`).
    pub peer: Option<Peer>,
}

/// Median of the per-run ratios `num[r] / den[r]`: each pair ran back to back, so a
/// slow spell on this shared machine slows both sides of a ratio.
pub fn paired_ratio(num: &[f64], den: &[f64]) -> f64 {
    Stat::of(num.iter().zip(den).map(|(a, b)| a / b).collect()).median()
}

impl Run {
    /// Statement costs, a diagnostic run only on request.
    pub async fn micro(&mut self) {
        for batch in [1i64, 32, 100] {
            let [lc, lw, rc, rw] = throughput::micro(&self.store, &self.opts, batch, 200).await;
            say!("batch {batch}: leasehold claim {lc:.3} ms, complete_many {lw:.3} ms; raw claim {rc:.3} ms, raw complete {rw:.3} ms");
        }
    }

    /// The raw-SQL ceiling and leasehold end to end, interleaved run by run; with the
    /// peer, graphile_worker right after leasehold at its concurrencies (leasehold's runs
    /// at those are made for the pairs even without `e2e`). Returns the median no-op
    /// throughput at concurrency 32 (NaN when not measured).
    pub async fn ceiling_and_e2e(&mut self, ceiling: bool, e2e: bool) -> f64 {
        let with_peer = self.peer.is_some();
        if !ceiling && !e2e && !with_peer {
            return f64::NAN;
        }
        let (runs, pool_conns) = (self.runs, self.pool_conns);
        let mut conns = vec![1usize, 4, pool_conns];
        conns.sort();
        conns.dedup();
        let mut ceilings: Vec<Vec<f64>> = vec![Vec::new(); conns.len()];
        let mut tput: Vec<Vec<f64>> = vec![Vec::new(); self.sizes.e2e.len()];
        setup::checkpoint(&self.store).await;
        for r in 0..runs {
            if ceiling {
                for (i, &c) in conns.iter().enumerate() {
                    let x =
                        throughput::ceiling(&self.store, &self.opts, c, self.sizes.ceiling_jobs)
                            .await;
                    say!(
                        "run {}/{runs}: raw ceiling, {c} connections: {} jobs/s",
                        r + 1,
                        report::num(x)
                    );
                    ceilings[i].push(x);
                }
            }
            for (i, &(c, n)) in self.sizes.e2e.iter().enumerate() {
                let paired = with_peer && peer::CONCURRENCIES.contains(&c);
                if !e2e && !paired {
                    continue;
                }
                let x = throughput::throughput(&self.store, c, n, self.history).await;
                say!(
                    "run {}/{runs}: leasehold no-op, concurrency {c}: {} jobs/s",
                    r + 1,
                    report::num(x)
                );
                tput[i].push(x);
                if let Some(p) = self.peer.as_mut().filter(|_| paired) {
                    let g = p.drain(c, n, None).await;
                    say!(
                        "run {}/{runs}: graphile_worker no-op, concurrency {c}: {} jobs/s",
                        r + 1,
                        report::num(g)
                    );
                    p.record(
                        format!("unkeyed, concurrency {c} ({n} jobs)"),
                        "jobs/s",
                        true,
                        x,
                        g,
                    );
                }
            }
        }
        let at_pool = conns
            .iter()
            .position(|&c| c == pool_conns)
            .map(|i| ceilings[i].clone())
            .filter(|v| !v.is_empty());
        if let (Some(p), Some(den)) = (self.peer.as_mut(), &at_pool) {
            p.ceiling = Some((pool_conns, den.clone()));
        }
        if ceiling {
            for (i, &c) in conns.iter().enumerate() {
                self.rows.push(Row::new(
                    "raw-SQL ceiling: claim 100 (one SKIP LOCKED statement) + complete 100 (one fenced UPDATE)",
                    format!(
                        "{c} connection{}{}",
                        if c == 1 { "" } else { "s" },
                        if c == pool_conns { " (= the pool)" } else { "" }
                    ),
                    Stat::of(ceilings[i].clone()),
                    "jobs/s",
                ));
            }
        }
        let mut unkeyed_32 = f64::NAN;
        if let Some(i) = self.sizes.e2e.iter().position(|&(c, _)| c == 32) {
            unkeyed_32 = Stat::of(tput[i].clone()).median();
        }
        if e2e {
            for (i, &(c, n)) in self.sizes.e2e.iter().enumerate() {
                let st = Stat::of(tput[i].clone());
                let mut row = Row::new(
                    "leasehold end to end, no-op handlers",
                    format!("concurrency {c} ({n} jobs)"),
                    st,
                    "jobs/s",
                );
                if let Some(den) = &at_pool {
                    row = row.ratio(paired_ratio(&tput[i], den), format!("ceiling@{pool_conns}"));
                    if c == 32 {
                        row = row.goal(Goal::AtLeast(0.6));
                    }
                }
                self.rows.push(row);
            }
        }
        unkeyed_32
    }

    /// No-op throughput at concurrency 32 through PgBouncer in transaction mode, each run
    /// right after the same drain straight to PostgreSQL.
    pub async fn pooler(&mut self) {
        let Some(&(c, n)) = self.sizes.e2e.iter().find(|&&(c, _)| c == 32) else {
            return;
        };
        let bouncer = pooler::PgBouncer::start(pooler::SERVER_CONNECTIONS);
        let (mut direct, mut pooled) = (Vec::new(), Vec::new());
        setup::checkpoint(&self.store).await;
        for r in 0..self.runs {
            let d = throughput::throughput(&self.store, c, n, self.history).await;
            let p =
                pooler::through_pooler(&self.store, &bouncer, self.pool_conns as u32, c, n).await;
            say!(
                "run {}/{}: concurrency {c}: direct {} jobs/s, through PgBouncer {} jobs/s",
                r + 1,
                self.runs,
                report::num(d),
                report::num(p)
            );
            direct.push(d);
            pooled.push(p);
        }
        drop(bouncer);
        let ratio = paired_ratio(&pooled, &direct);
        self.rows.push(
            Row::new(
                "through PgBouncer 1.18, pool_mode = transaction (StoreOptions::transaction_pooler)",
                format!(
                    "no-op, concurrency {c} ({n} jobs), {} server connections, pool {} clients",
                    pooler::SERVER_CONNECTIONS,
                    self.pool_conns
                ),
                Stat::of(pooled),
                "jobs/s",
            )
            .ratio(ratio, "direct, same run"),
        );
    }

    /// Enqueue one at a time, batched and by COPY, each round right after a raw COPY.
    pub async fn enqueue(&mut self) {
        let (runs, s) = (self.runs, &self.sizes);
        let ways = [
            (
                EnqueueWay::One,
                "enqueue, one per transaction",
                s.enqueue_one,
            ),
            (
                EnqueueWay::Many,
                "enqueue_many, 1000 per statement",
                s.enqueue_bulk,
            ),
            (EnqueueWay::Copy, "enqueue_copy, one COPY", s.enqueue_bulk),
        ];
        let bulk = s.enqueue_bulk;
        let mut raw = Vec::new();
        let mut got: Vec<Vec<f64>> = vec![Vec::new(); ways.len()];
        setup::checkpoint(&self.store).await;
        for r in 0..runs {
            let x = throughput::enqueue(&self.store, EnqueueWay::RawCopy, bulk).await;
            raw.push(x);
            let mut line = format!("run {}/{runs}: raw COPY {} rows/s", r + 1, report::num(x));
            for (i, (way, name, n)) in ways.iter().enumerate() {
                let x = throughput::enqueue(&self.store, *way, *n).await;
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
            self.rows.push(row);
        }
        self.rows.push(Row::new(
            section,
            format!("raw COPY, same columns ({bulk} rows)"),
            Stat::of(raw),
            "rows/s",
        ));
    }

    /// The round-trip lever, measured on raw SQL: the ceiling's loop as two statements
    /// (claim, then complete) and as one (complete the last loop's jobs and claim the
    /// next), interleaved run by run at 1, 4 and the pool's connections. What one round
    /// trip could buy leasehold is at most what it buys here. A diagnostic
    /// (`--only trips`), not in the default run.
    pub async fn trips(&mut self) {
        let (runs, n) = (self.runs, self.sizes.ceiling_jobs);
        let mut conns = vec![1usize, 4, self.pool_conns];
        conns.sort();
        conns.dedup();
        let section = "the round-trip lever on raw SQL: claim 100 + complete 100 as two statements, or as one";
        for c in conns {
            let (mut two, mut one, mut deadlocks) = (Vec::new(), Vec::new(), Vec::new());
            for r in 0..runs {
                let (t, _) =
                    throughput::raw_ceiling(&self.store, &self.opts, c, n, Trips::Two).await;
                let (o, d) =
                    throughput::raw_ceiling(&self.store, &self.opts, c, n, Trips::One).await;
                say!(
                    "run {}/{runs}: raw, {c} connections: two statements {} jobs/s, one {} ({d} deadlocks, sent again)",
                    r + 1,
                    report::num(t),
                    report::num(o)
                );
                two.push(t);
                one.push(o);
                deadlocks.push(d as f64);
            }
            self.rows.push(
                Row::new(
                    section,
                    format!("{c} connections, one statement per loop"),
                    Stat::of(one.clone()),
                    "jobs/s",
                )
                .ratio(paired_ratio(&one, &two), "two statements"),
            );
            self.rows.push(Row::new(
                section,
                format!("{c} connections, one statement per loop: deadlocks"),
                Stat::of(deadlocks),
                "statements",
            ));
            self.rows.push(Row::new(
                section,
                format!("{c} connections, two statements per loop"),
                Stat::of(two),
                "jobs/s",
            ));
        }
    }

    /// Throughput on a never-analyzed table (fresh schema, bulk load, 10^5 delayed and
    /// 10^5 other-queue rows beside the backlog), each run paired with the same load
    /// after ANALYZE: the claim must not depend on planner statistics.
    pub async fn fresh(&mut self) {
        let (runs, beside) = (self.runs, self.sizes.pending);
        let cases = [(1usize, self.sizes.e2e[0].1), (32, self.sizes.fresh_jobs)];
        let section = "never-analyzed table: a bulk load beside delayed and other-queue rows (as many as the growth section's pending rows), no ANALYZE";
        for (c, n) in cases {
            let (mut fresh, mut analyzed) = (Vec::new(), Vec::new());
            for r in 0..runs {
                let f = throughput::throughput_fresh(&self.pool, self.history, c, n, beside, false)
                    .await;
                let a = throughput::throughput_fresh(&self.pool, self.history, c, n, beside, true)
                    .await;
                say!(
                    "run {}/{runs}: concurrency {c}: never analyzed {} jobs/s, analyzed {}",
                    r + 1,
                    report::num(f),
                    report::num(a)
                );
                fresh.push(f);
                analyzed.push(a);
            }
            self.rows.push(
                Row::new(
                    section,
                    format!("concurrency {c} ({n} jobs), never analyzed"),
                    Stat::of(fresh.clone()),
                    "jobs/s",
                )
                .ratio(paired_ratio(&fresh, &analyzed), "analyzed")
                .goal(Goal::AtLeast(1.0 / 1.3)),
            );
            self.rows.push(Row::new(
                section,
                format!("concurrency {c} ({n} jobs), after ANALYZE"),
                Stat::of(analyzed),
                "jobs/s",
            ));
        }
    }

    /// CPU-bound handlers on one thread (the scheduler's starting runtime, as in an
    /// actix app by default) and on `handler_threads` = every core.
    pub async fn cpu(&mut self) {
        let runs = self.runs;
        let n = self.sizes.cpu_jobs;
        let cores = std::thread::available_parallelism().map_or(2, |c| c.get());
        let rounds = handlers::Cpu::calibrate();
        let (mut one, mut all) = (Vec::new(), Vec::new());
        for r in 0..runs {
            let a = throughput::cpu_bound(&self.store, None, n, rounds).await;
            let b = throughput::cpu_bound(&self.store, Some(cores), n, rounds).await;
            say!(
                "run {}/{runs}: CPU-bound handlers: host thread {} jobs/s, {cores} handler threads {}",
                r + 1,
                report::num(a),
                report::num(b)
            );
            one.push(a);
            all.push(b);
        }
        let section = "CPU-bound handlers (~2 ms of one core each), concurrency 8";
        self.rows.push(Row::new(
            section,
            format!("on the host's one thread ({n} jobs)"),
            Stat::of(one.clone()),
            "jobs/s",
        ));
        self.rows.push(
            Row::new(
                section,
                format!("handler_threads = {cores} ({n} jobs)"),
                Stat::of(all.clone()),
                "jobs/s",
            )
            .ratio(paired_ratio(&all, &one), "one thread"),
        );
    }

    /// One job per transaction from 1 and 8 producers, with and without the NOTIFY the
    /// enqueue statement sends, and leasehold's own enqueue at 8 (see bench/notify.rs).
    pub async fn notify(&mut self) {
        let (runs, n) = (self.runs, self.sizes.enqueue_one);
        let cases = [
            (
                notify::Way::RawQuiet,
                1,
                "raw INSERT, no NOTIFY, 1 producer",
            ),
            (notify::Way::RawNotify, 1, "raw INSERT + NOTIFY, 1 producer"),
            (
                notify::Way::RawQuiet,
                8,
                "raw INSERT, no NOTIFY, 8 producers",
            ),
            (
                notify::Way::RawNotify,
                8,
                "raw INSERT + NOTIFY, 8 producers",
            ),
            (notify::Way::Leasehold, 8, "leasehold enqueue, 8 producers"),
        ];
        let mut got: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
        setup::checkpoint(&self.store).await;
        for r in 0..runs {
            let mut line = format!("run {}/{runs}:", r + 1);
            for (i, (way, producers, name)) in cases.iter().enumerate() {
                let x = notify::producers(&self.store, *way, *producers, n).await;
                line.push_str(&format!(" {name} {};", report::num(x)));
                got[i].push(x);
            }
            say!("{line}");
        }
        let section = "enqueue one per transaction: the cost of NOTIFY";
        for (i, (_, _, name)) in cases.iter().enumerate() {
            let mut row = Row::new(
                section,
                format!("{name} ({n} rows)"),
                Stat::of(got[i].clone()),
                "rows/s",
            );
            row = match i {
                1 => row.ratio(paired_ratio(&got[1], &got[0]), "no NOTIFY, 1"),
                3 => row.ratio(paired_ratio(&got[3], &got[2]), "no NOTIFY, 8"),
                4 => row.ratio(paired_ratio(&got[4], &got[2]), "raw, no NOTIFY, 8"),
                _ => row,
            };
            self.rows.push(row);
        }
    }

    /// Enqueue-to-start latency at a fixed offered rate: an idle queue, and half the
    /// measured maximum (`unkeyed_32`, or 2,000/s when e2e did not run). With the peer,
    /// graphile_worker's idle latency after each idle run; without `rows`, only the idle
    /// runs the peer is paired with, and no latency rows of their own.
    pub async fn latency(&mut self, unkeyed_32: f64, rows: bool) {
        let runs = self.runs;
        let half = if unkeyed_32.is_finite() {
            (unkeyed_32 / 2.0).round()
        } else {
            2000.0
        };
        let section = "enqueue-to-start latency (enqueue call → handler start; concurrency 32)";
        let secs = self.sizes.latency_secs;
        for (label, rate, goal) in [
            ("idle queue", self.sizes.idle_rate, Some(Goal::AtMost(5.0))),
            ("half the measured maximum", half, None),
        ] {
            let idle = goal.is_some();
            if !rows && !idle {
                continue;
            }
            let (mut p50, mut p99, mut db) = (Vec::new(), Vec::new(), Vec::new());
            setup::checkpoint(&self.store).await;
            for r in 0..runs {
                let l = latency::latency(&self.store, 32, rate, secs, self.history).await;
                say!("run {}/{runs}: latency, {label} ({rate}/s offered, {:.0}/s sent, {} jobs): p50 {:.2} ms p99 {:.2} ms (db clock p50 {:.2} ms)",
                    r + 1, l.offered, l.samples, l.p50, l.p99, l.db_p50);
                p50.push(l.p50);
                p99.push(l.p99);
                db.push(l.db_p50);
                if let Some(p) = self.peer.as_mut().filter(|_| idle) {
                    let g = p.latency(32, rate, secs).await;
                    say!("run {}/{runs}: graphile_worker latency, {label} ({rate}/s offered, {:.0}/s sent, {} jobs): p50 {:.2} ms p99 {:.2} ms",
                        r + 1, g.offered, g.samples, g.p50, g.p99);
                    let name = format!("enqueue → start, idle queue at {rate}/s, concurrency 32");
                    p.record(format!("{name}: p50"), "ms", false, l.p50, g.p50);
                    p.record(format!("{name}: p99"), "ms", false, l.p99, g.p99);
                }
            }
            if !rows {
                continue;
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
            self.rows.push(row);
            self.rows.push(Row::new(
                section,
                format!("{label}, {rate}/s: p99"),
                Stat::of(p99),
                "ms",
            ));
            self.rows.push(Row::new(
                section,
                format!("{label}, {rate}/s: p50 created_at → claimed_at (db clock)"),
                Stat::of(db),
                "ms",
            ));
        }
    }

    /// Many keys, each run right after an unkeyed run of the same size; with the peer,
    /// graphile_worker's named queues (one per key) after each keyed run. Without `rows`,
    /// only the keyed runs the peer is paired with, and no keyed rows of their own.
    pub async fn keyed(&mut self, rows: bool) {
        let (runs, keys, per_key) = (self.runs, self.sizes.keys, self.sizes.per_key);
        let n = keys * per_key;
        let (mut plain, mut keyed) = (Vec::new(), Vec::new());
        setup::checkpoint(&self.store).await;
        for r in 0..runs {
            if rows {
                plain.push(throughput::throughput(&self.store, 32, n, self.history).await);
            }
            let k = throughput::keyed(&self.store, keys, per_key, 32, self.history).await;
            say!(
                "run {}/{runs}: unkeyed {} jobs/s, {keys} keys x {per_key} {} jobs/s",
                r + 1,
                plain.last().map_or("-".into(), |u| report::num(*u)),
                report::num(k)
            );
            keyed.push(k);
            if let Some(p) = self.peer.as_mut() {
                let g = p.drain(32, n, Some((keys, per_key))).await;
                say!(
                    "run {}/{runs}: graphile_worker, {keys} named queues x {per_key}: {} jobs/s",
                    r + 1,
                    report::num(g)
                );
                p.record(
                    format!("keyed, concurrency 32: {keys} keys (named queues) x {per_key} jobs"),
                    "jobs/s",
                    false,
                    k,
                    g,
                );
            }
        }
        if !rows {
            return;
        }
        let section = "keyed work (concurrency 32)";
        self.rows.push(
            Row::new(
                section,
                format!("{keys} keys x {per_key} jobs"),
                Stat::of(keyed.clone()),
                "jobs/s",
            )
            .ratio(paired_ratio(&keyed, &plain), "unkeyed")
            .goal(Goal::AtLeast(0.7)),
        );
        self.rows.push(Row::new(
            section,
            format!("the same {n} jobs unkeyed"),
            Stat::of(plain),
            "jobs/s",
        ));
    }

    /// One hot key with a long backlog, and other keys' latency while it drains.
    pub async fn hot_key(&mut self) {
        let (runs, s) = (self.runs, &self.sizes);
        let section = "keyed work (concurrency 32)";
        say!("hot key: loading {} jobs behind one key", s.hot_backlog);
        let windows = latency::hot_key(
            &self.store,
            s.hot_backlog,
            runs,
            s.hot_window,
            s.other_rate,
            32,
            self.history,
        )
        .await;
        for (i, (rate, l)) in windows.iter().enumerate() {
            say!("hot key window {}/{runs}: {:.0} jobs/s; other keys p50 {:.2} ms p99 {:.2} ms ({} jobs)",
                i + 1, rate, l.p50, l.p99, l.samples);
        }
        let (backlog, other) = (s.hot_backlog, s.other_rate);
        self.rows.push(
            Row::new(
                section,
                format!("one hot key, {backlog} jobs behind it"),
                Stat::of(windows.iter().map(|w| w.0).collect()),
                "jobs/s",
            )
            .goal(Goal::AtLeast(500.0)),
        );
        self.rows.push(Row::new(
            section,
            format!("other keys meanwhile ({other}/s): enqueue → start p50"),
            Stat::of(windows.iter().map(|w| w.1.p50).collect()),
            "ms",
        ));
        self.rows.push(Row::new(
            section,
            format!("other keys meanwhile ({other}/s): enqueue → start p99"),
            Stat::of(windows.iter().map(|w| w.1.p99).collect()),
            "ms",
        ));
    }

    /// Claim latency with terminal and pending rows: each run on the big table right
    /// after one on an empty table (its own schema), so each ratio compares
    /// back-to-back runs. Captures the EXPLAIN of the claim at 10^6 rows.
    pub async fn growth(&mut self) {
        let empty = setup::fresh_schema(&self.pool, "bench_empty", self.history).await;
        let (terminal, pending) = (self.sizes.terminal, self.sizes.pending);
        let mut base_all = Vec::new();

        setup::reset(&self.store).await;
        self.claim_phase(
            "empty table (the jobs schema itself)".into(),
            None,
            &empty,
            &mut base_all,
        )
        .await;

        setup::insert_rows(&self.store, "done", terminal.0).await;
        setup::checkpoint(&self.store).await;
        self.claim_phase(
            format!("{} terminal rows", terminal.0),
            None,
            &empty,
            &mut base_all,
        )
        .await;

        say!("inserting terminal rows up to {}", terminal.1);
        setup::insert_rows(&self.store, "done", terminal.1 - terminal.0).await;
        setup::checkpoint(&self.store).await;
        self.claim_phase(
            format!("{} terminal rows", terminal.1),
            Some(Goal::AtMost(1.3)),
            &empty,
            &mut base_all,
        )
        .await;
        setup::raw_copy(&self.store, "noop", 1000).await;
        setup::vacuum_analyze(&self.store).await;
        self.explains.push((
            format!(
                "claim of 100 with {} terminal rows and 1,000 pending",
                terminal.1
            ),
            footprint::explain_claim(&self.store, 100).await,
        ));

        say!("inserting {pending} pending rows");
        setup::reset(&self.store).await;
        setup::insert_rows(&self.store, "pending", pending).await;
        setup::checkpoint(&self.store).await;
        self.claim_phase(
            format!("{pending} pending rows"),
            None,
            &empty,
            &mut base_all,
        )
        .await;
        setup::vacuum_analyze(&self.store).await;
        self.explains.push((
            format!("claim of 100 with {pending} pending rows"),
            footprint::explain_claim(&self.store, 100).await,
        ));
        self.rows.push(Row::new(
            GROWTH,
            "empty table, every paired run",
            Stat::of(base_all),
            "ms",
        ));
        setup::reset(&self.store).await;
        sqlx::query("DROP SCHEMA bench_empty CASCADE")
            .execute(&self.pool)
            .await
            .ok();
    }

    async fn claim_phase(
        &mut self,
        label: String,
        goal: Option<Goal>,
        empty: &Store,
        base_all: &mut Vec<f64>,
    ) {
        let (runs, it) = (self.runs, self.sizes.claim_iterations);
        let (mut big, mut base) = (Vec::new(), Vec::new());
        for r in 0..runs {
            let b = footprint::claim_latency(&self.store, it, 100).await;
            setup::reset(empty).await;
            let e = footprint::claim_latency(empty, it, 100).await;
            say!(
                "run {}/{runs}: claim latency, {label}: {b:.2} ms (empty table {e:.2} ms)",
                r + 1
            );
            big.push(b);
            base.push(e);
        }
        let mut row = Row::new(GROWTH, label, Stat::of(big.clone()), "ms")
            .ratio(paired_ratio(&big, &base), "empty");
        if let Some(g) = goal {
            row = row.goal(g);
        }
        self.rows.push(row);
        base_all.extend(base);
    }

    /// RSS of a child process holding only a scheduler with `memory_keys` active keys.
    pub async fn memory(&mut self) {
        let (runs, keys) = (self.runs, self.sizes.memory_keys);
        let (mut rss, mut base, mut seqs) = (Vec::new(), Vec::new(), Vec::new());
        setup::checkpoint(&self.store).await;
        for r in 0..runs {
            let v = footprint::memory(&self.store, keys).await;
            say!("run {}/{runs}: memory {v}", r + 1);
            rss.push(v["rss_mb"].as_f64().unwrap_or(f64::NAN));
            base.push(v["rss_before_mb"].as_f64().unwrap_or(f64::NAN));
            seqs.push(v["sequencers"].as_f64().unwrap_or(f64::NAN));
        }
        let section = "memory (a child process holding only the scheduler; VmRSS)";
        self.rows.push(
            Row::new(
                section,
                format!("RSS with {keys} active keys"),
                Stat::of(rss),
                "MB",
            )
            .goal(Goal::AtMost(100.0)),
        );
        self.rows.push(Row::new(
            section,
            "RSS before the scheduler started",
            Stat::of(base),
            "MB",
        ));
        self.rows.push(Row::new(
            section,
            "sequencers alive when measured",
            Stat::of(seqs),
            "actors",
        ));
        setup::reset(&self.store).await;
    }
}

const GROWTH: &str = "claim latency as the table grows (Store::claim of 100, median of each run)";
