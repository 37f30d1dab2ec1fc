//! The harness: cluster, effect server, proxies, worker processes, workload, scenarios,
//! nemesis, retention operator, drain, artifacts, check. Everything it starts, it stops;
//! a watchdog enforces the hard deadline.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold::{Store, StoreOptions};
use rand::rngs::StdRng;
use rand::SeedableRng;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::cluster::Cluster;
use crate::effects::EffectServer;
use crate::model::{now_mono_ns, now_us, write_json, FaultRecord, Jsonl, ProcessRecord, RunInfo};
use crate::profile::Profile;
use crate::proxy::{Mode, Proxy};
use crate::worker::Options as WorkerOptions;
use crate::workload::{enqueue_batch, Enqueued, Generator};
use crate::{check, dbsetup, nemesis, operator, procs, scenarios};

pub struct Running {
    pub child: Child,
    pub inc: u32,
    pub started_us: i64,
}

pub struct WorkerSlot {
    pub id: usize,
    pub proxy: Proxy,
    pub inc: AtomicU32,
    pub proc: Mutex<Option<Running>>,
    /// A fault is active on this worker (no second one is started on it).
    pub busy: AtomicBool,
}

pub struct Harness {
    pub profile: Profile,
    pub out: PathBuf,
    pub cluster: Arc<Cluster>,
    pub admin: PgPool,
    /// The simulated host service's connections (its long transactions, row locks).
    pub host: PgPool,
    pub store: Store,
    pub effects: EffectServer,
    pub slots: Vec<Arc<WorkerSlot>>,
    pub faults: Mutex<Jsonl>,
    pub processes: Mutex<Jsonl>,
    pub enqueue_log: Mutex<Jsonl>,
    pub operator: Mutex<Jsonl>,
    pub seen: Arc<Mutex<Enqueued>>,
    /// Client ids for the scenarios and the host's enqueues (above the mix's range).
    pub next_cid: AtomicU64,
    /// kind → (attempted, hit)
    pub fault_counts: Mutex<BTreeMap<String, (u64, u64)>>,
    /// Only one database-wide fault at a time.
    pub pg_lock: tokio::sync::Mutex<()>,
    pub exe: PathBuf,
}

fn usage() -> ! {
    eprintln!(
        "usage: chaos short|long [--seed N] [--out DIR] [--keep]\n       chaos check DIR\n       chaos worker ... (internal)"
    );
    std::process::exit(2)
}

pub fn main(profile_name: &str, args: &[String]) -> ! {
    let Some(mut profile) = Profile::by_name(profile_name) else {
        usage()
    };
    let mut seed: Option<u64> = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| parse_seed(&s));
    let mut out: Option<PathBuf> = None;
    let mut keep = std::env::var("CHAOS_KEEP").is_ok();
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--seed" => seed = args.get(i + 1).and_then(|s| parse_seed(s)),
            "--out" => out = args.get(i + 1).map(PathBuf::from),
            "--fault-secs" => {
                if let Some(s) = args.get(i + 1).and_then(|s| s.parse::<u64>().ok()) {
                    profile.fault_phase = Duration::from_secs(s);
                }
            }
            "--keep" => {
                keep = true;
                i += 1;
                continue;
            }
            _ => usage(),
        }
        i += 2;
    }
    let seed = seed.unwrap_or_else(|| now_us() as u64 ^ (std::process::id() as u64) << 40);
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    let out = out.unwrap_or_else(|| Path::new(&target).join("chaos").join(seed.to_string()));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(out.join("workers")).expect("create the artifact directory");
    println!(
        "chaos: profile={} seed={seed} artifacts={} (replay: chaos {} --seed {seed})",
        profile.name,
        out.display(),
        profile.name
    );
    let started = Instant::now();
    let deadline = started + profile.hard_deadline;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let cluster_root: Arc<Mutex<Option<PathBuf>>> = Arc::new(Mutex::new(None));
    {
        let root = cluster_root.clone();
        procs::watchdog(deadline, move || {
            if let Some(r) = root.lock().unwrap().take() {
                if !keep {
                    Cluster::remove_dir(&r);
                }
            }
        });
    }
    let root = cluster_root.clone();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        runtime.block_on(run(profile, seed, out.clone(), keep, root))
    }));
    // Whatever happened, nothing we started outlives us.
    procs::kill_all();
    if let Some(r) = cluster_root.lock().unwrap().take() {
        if !keep {
            Cluster::remove_dir(&r);
        }
    }
    match result {
        Ok(Ok(pass)) => std::process::exit(if pass { 0 } else { 1 }),
        Err(_) => {
            eprintln!("chaos: the harness panicked; every child was killed");
            std::process::exit(2)
        }
        Ok(Err(e)) => {
            eprintln!("chaos: harness error: {e}");
            std::process::exit(2)
        }
    }
}

fn parse_seed(s: &str) -> Option<u64> {
    s.strip_prefix("0x")
        .map(|h| u64::from_str_radix(h, 16).ok())
        .unwrap_or_else(|| s.parse().ok())
}

async fn run(
    profile: Profile,
    seed: u64,
    out: PathBuf,
    keep: bool,
    cluster_root: Arc<Mutex<Option<PathBuf>>>,
) -> Result<bool, String> {
    let t0 = Instant::now();
    let mut info = RunInfo {
        seed,
        profile: profile.name.into(),
        workers: profile.workers,
        concurrency: profile.concurrency,
        lease_ms: profile.lease_ms,
        renew_ms: profile.renew_ms,
        reaper_ms: profile.reaper_ms,
        backoff_base_ms: profile.backoff_base_ms,
        backoff_cap_ms: profile.backoff_cap_ms,
        backoff_jitter: profile.jitter,
        max_run_ms: profile.max_run_ms,
        min_faults: profile.min_faults,
        started_us: now_us(),
        pg_version: Cluster::version(),
        ..Default::default()
    };
    let tag = seed.to_string();
    let cluster = tokio::task::spawn_blocking(move || Cluster::create(&tag, keep))
        .await
        .map_err(|e| e.to_string())??;
    *cluster_root.lock().unwrap() = Some(cluster.root.clone());
    let cluster = Arc::new(cluster);
    println!(
        "chaos: cluster up on 127.0.0.1:{} ({}) in {:.1}s",
        cluster.port,
        cluster.root.display(),
        t0.elapsed().as_secs_f64()
    );
    let admin = dbsetup::setup(cluster.port).await?;
    let host = dbsetup::host_pool(cluster.port).await?;
    let store = Store::new(
        admin.clone(),
        "leasehold",
        StoreOptions {
            default_max_attempts: 12,
            ..StoreOptions::default()
        },
    )
    .map_err(|e| e.to_string())?;
    store.migrate().await.map_err(|e| e.to_string())?;
    dbsetup::install_audit(&admin).await?;
    // The periodic episodes' daylight-saving instants a third into the fault phase.
    crate::periodic::setup(&admin, Duration::from_secs(3) + profile.fault_phase / 3).await?;
    info.cluster_ready_us = now_us();
    info.max_result_bytes = crate::worker::MAX_RESULT_BYTES;
    let clock = Arc::new(Mutex::new(crate::model::ClockInfo::default()));
    let clock_stop = CancellationToken::new();
    let clock_task = tokio::spawn(dbsetup::watch_clock(
        admin.clone(),
        clock.clone(),
        clock_stop.clone(),
    ));
    let effects = EffectServer::start(&out.join("effects.jsonl"))
        .await
        .map_err(|e| e.to_string())?;
    let mut slots = Vec::new();
    for id in 0..profile.workers {
        slots.push(Arc::new(WorkerSlot {
            id,
            proxy: Proxy::start(cluster.port)
                .await
                .map_err(|e| e.to_string())?,
            inc: AtomicU32::new(0),
            proc: Mutex::new(None),
            busy: AtomicBool::new(false),
        }));
    }
    let h = Arc::new(Harness {
        profile: profile.clone(),
        out: out.clone(),
        cluster: cluster.clone(),
        admin: admin.clone(),
        host: host.clone(),
        store: store.clone(),
        effects,
        slots,
        faults: Mutex::new(Jsonl::create(&out.join("faults.jsonl")).map_err(|e| e.to_string())?),
        processes: Mutex::new(
            Jsonl::create(&out.join("processes.jsonl")).map_err(|e| e.to_string())?,
        ),
        enqueue_log: Mutex::new(
            Jsonl::create(&out.join("enqueue.jsonl")).map_err(|e| e.to_string())?,
        ),
        operator: Mutex::new(
            Jsonl::create(&out.join("operator.jsonl")).map_err(|e| e.to_string())?,
        ),
        seen: Arc::new(Mutex::new(Enqueued::default())),
        next_cid: AtomicU64::new(10_000_000),
        fault_counts: Mutex::new(BTreeMap::new()),
        pg_lock: tokio::sync::Mutex::new(()),
        exe: std::env::current_exe().map_err(|e| e.to_string())?,
    });
    for slot in &h.slots {
        h.start_worker(slot)?;
    }

    // Fault phase: workload and nemesis side by side, both from the seed.
    let phase_end = tokio::time::Instant::now() + profile.fault_phase;
    let gen = Generator::new(profile.clone());
    let workload = tokio::spawn(crate::workload::run(
        h.clone(),
        gen,
        StdRng::seed_from_u64(seed ^ 0x5eed_0001),
        phase_end,
    ));
    let scenarios = tokio::spawn(scenarios::run(
        h.clone(),
        StdRng::seed_from_u64(seed ^ 0x5eed_0003),
        phase_end,
    ));
    let retention = tokio::spawn(operator::run(
        h.clone(),
        StdRng::seed_from_u64(seed ^ 0x0be7_0004),
        phase_end,
    ));
    let nemesis = nemesis::run(
        h.clone(),
        StdRng::seed_from_u64(seed ^ 0xfa17_0002),
        phase_end,
    );
    let background = nemesis.await;
    let mut gen = workload.await.map_err(|e| e.to_string())?;
    scenarios.await.map_err(|e| e.to_string())?;
    retention.await.map_err(|e| e.to_string())?;

    // Heal: every fault undone, every worker running.
    for task in background {
        let _ = tokio::time::timeout(Duration::from_secs(30), task).await;
    }
    for slot in &h.slots {
        slot.proxy.set(Mode::Pass);
        slot.proxy.partition_app(None);
        if let Some(r) = slot.proc.lock().unwrap().as_ref() {
            procs::signal(r.child.id(), libc::SIGCONT);
        }
        let alive = slot
            .proc
            .lock()
            .unwrap()
            .as_mut()
            .map(|r| matches!(r.child.try_wait(), Ok(None)))
            .unwrap_or(false);
        if !alive {
            h.stop_worker(slot, libc::SIGKILL, "dead_at_heal", Duration::from_secs(2))
                .await;
            h.start_worker(slot)?;
        }
    }
    info.healed_us = now_us();
    println!(
        "chaos: faults over at {:.0}s: {} jobs enqueued, {} faults hit; draining",
        t0.elapsed().as_secs_f64(),
        h.seen.lock().unwrap().ok,
        h.fault_counts
            .lock()
            .unwrap()
            .values()
            .map(|v| v.1)
            .sum::<u64>()
    );
    // Probe: fresh work after the last fault must flow at once.
    let probes: Vec<_> = (0..40).map(|i| gen.probe(i)).collect();
    enqueue_batch(&h.store, probes, &h.enqueue_log, &h.seen).await;

    info.drain_complete = crate::drain::drain(&h, &mut info).await;
    info.drained_us = now_us();
    println!(
        "chaos: drain {} at {:.0}s",
        if info.drain_complete {
            "complete"
        } else {
            "INCOMPLETE"
        },
        t0.elapsed().as_secs_f64()
    );
    for slot in &h.slots {
        h.stop_worker(
            slot,
            libc::SIGTERM,
            "stopped_at_end",
            Duration::from_secs(15),
        )
        .await;
    }
    clock_stop.cancel();
    let _ = clock_task.await;
    info.clock = clock.lock().unwrap().clone();
    crate::drain::dump(&h.admin, &out).await?;
    crate::periodic::dump(&h.admin, &out).await?;
    h.host.close().await;
    info.effect_server = h.effects.stats();
    info.refused = h.seen.lock().unwrap().refused.clone();
    h.admin.close().await;
    drop(h);
    let c = cluster.clone();
    drop(cluster);
    tokio::task::spawn_blocking(move || {
        let _ = c.stop("immediate");
        drop(c);
    })
    .await
    .map_err(|e| e.to_string())?;
    cluster_root.lock().unwrap().take();
    info.finished_us = now_us();
    info.wall_secs = t0.elapsed().as_secs_f64();
    write_json(&out.join("run.json"), &info).map_err(|e| e.to_string())?;
    let report = check::check(&out).map_err(|e| format!("checker: {e}"))?;
    print!("{}", report.text);
    std::fs::write(out.join("report.txt"), &report.text).map_err(|e| e.to_string())?;
    Ok(report.pass)
}

impl Harness {
    pub fn worker_options(&self, slot: &WorkerSlot, inc: u32) -> WorkerOptions {
        let p = &self.profile;
        WorkerOptions {
            id: slot.id,
            inc,
            db_port: slot.proxy.port,
            effects: self.effects.addr.to_string(),
            out: self.out.clone(),
            concurrency: p.concurrency,
            lease_ms: p.lease_ms,
            renew_ms: p.renew_ms,
            reaper_ms: p.reaper_ms,
            backoff_base_ms: p.backoff_base_ms,
            backoff_cap_ms: p.backoff_cap_ms,
            jitter: p.jitter,
            max_run_ms: p.max_run_ms,
        }
    }

    pub fn start_worker(&self, slot: &WorkerSlot) -> Result<(), String> {
        let inc = slot.inc.fetch_add(1, SeqCst) + 1;
        let log = std::fs::File::create(
            self.out
                .join("workers")
                .join(format!("w{}.{inc}.log", slot.id)),
        )
        .map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&self.exe);
        cmd.args(self.worker_options(slot, inc).to_args())
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        let child = procs::spawn(cmd, libc::SIGKILL).map_err(|e| format!("spawn worker: {e}"))?;
        *slot.proc.lock().unwrap() = Some(Running {
            child,
            inc,
            started_us: now_us(),
        });
        Ok(())
    }

    /// Signal the worker and wait for it to exit (SIGKILL after `limit`). Returns
    /// whether a running process was signalled.
    pub async fn stop_worker(
        &self,
        slot: &WorkerSlot,
        sig: libc::c_int,
        how: &str,
        limit: Duration,
    ) -> bool {
        let Some(mut running) = slot.proc.lock().unwrap().take() else {
            return false;
        };
        let pid = running.child.id();
        let hit = matches!(running.child.try_wait(), Ok(None)) && procs::signal(pid, sig);
        if sig != libc::SIGKILL {
            procs::signal(pid, libc::SIGCONT);
        }
        let (running, status) = tokio::task::spawn_blocking(move || {
            let mut status = procs::wait_timeout(&mut running.child, limit);
            if status.is_none() {
                unsafe {
                    libc::kill(-(pid as i32), libc::SIGKILL);
                }
                status = running.child.wait().ok();
            }
            (running, status)
        })
        .await
        .expect("wait for worker");
        procs::forget(pid);
        let how = match status {
            Some(s) if sig == libc::SIGTERM && s.success() => how.to_string(),
            Some(s) => format!("{how}({s})"),
            None => format!("{how}(unknown)"),
        };
        self.processes.lock().unwrap().write(&ProcessRecord {
            w: slot.id,
            inc: running.inc,
            pid,
            started_us: running.started_us,
            ended_us: now_us(),
            ended_mono_ns: now_mono_ns(),
            how,
        });
        hit
    }

    /// The owner id of the worker's current incarnation (from its history's `up` line).
    pub fn owner_of(&self, slot: &WorkerSlot) -> Option<String> {
        let inc = slot.proc.lock().unwrap().as_ref()?.inc;
        let path = self
            .out
            .join("workers")
            .join(format!("w{}.{inc}.jsonl", slot.id));
        let text = std::fs::read_to_string(path).ok()?;
        let first = text.lines().next()?;
        let line: crate::model::HistoryLine = serde_json::from_str(first).ok()?;
        line.owner
    }

    pub fn record_fault(&self, rec: FaultRecord) {
        {
            let mut counts = self.fault_counts.lock().unwrap();
            let e = counts.entry(rec.kind.clone()).or_default();
            e.0 += 1;
            e.1 += rec.hit as u64;
        }
        self.faults.lock().unwrap().write(&rec);
    }
}
