//! The retention operator: through the fault phase, every second, prune with zero
//! retention and retry a dead job or two, the two racing each other and the workers.
//!
//! The pass keeps the floor (a finished job stays at least that long, so a worker whose
//! ending's reply was lost can read it back), scaled to the harness's leases: the
//! default floor is ten default leases (5 minutes of 30 s), the harness's is fifteen of
//! its own (30 s of 2 s), so pruning races the workers within the short run too.
//!
//! Why: retention is the only thing that deletes rows, and it runs beside everything
//! else. Pruning a dead job deletes the dead-letter queue, and pruning a dead head
//! strands its key's waiting jobs for good; `retry_dead` on a job being pruned is the
//! race in between. Each action goes to `operator.jsonl`; what was deleted is kept by the
//! audit triggers (see [`crate::dbsetup`]) for the checker.

use std::sync::Arc;
use std::time::Duration;

use leasehold::store::PruneOptions;
use leasehold::JobId;
use rand::rngs::StdRng;
use rand::Rng;
use tokio::time::Instant;

use crate::harness::Harness;
use crate::model::{now_us, OperatorRecord};

pub async fn run(h: Arc<Harness>, mut rng: StdRng, phase_end: Instant) {
    // The same start as the nemesis: the workers come up first.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut options = PruneOptions::new(Duration::ZERO);
    options.floor = Duration::from_millis(15 * h.profile.lease_ms);
    options.batch = 1000;
    while Instant::now() < phase_end {
        let pruned =
            tokio::time::timeout(Duration::from_secs(5), h.store.prune_with(&options)).await;
        let (ok, n, detail) = match pruned {
            Ok(Ok(r)) => (true, r.jobs, format!("{r:?}")),
            Ok(Err(e)) => (false, 0, e.to_string()),
            Err(_) => (false, 0, "timed out".into()),
        };
        write(&h, "prune", ok, Vec::new(), n, detail);
        let dead: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM leasehold.jobs WHERE state = 'dead' ORDER BY random() LIMIT $1",
        )
        .bind(rng.gen_range(1..=2i64))
        .fetch_all(&h.admin)
        .await
        .unwrap_or_default();
        for id in dead {
            let r =
                tokio::time::timeout(Duration::from_secs(5), h.store.retry_dead(JobId(id))).await;
            let (ok, detail) = match r {
                Ok(Ok(())) => (true, String::new()),
                Ok(Err(e)) => (false, e.to_string()),
                Err(_) => (false, "timed out".into()),
            };
            write(&h, "retry_dead", ok, vec![id], ok as u64, detail);
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(900..1100))).await;
    }
}

fn write(h: &Harness, action: &str, ok: bool, jobs: Vec<i64>, n: u64, detail: String) {
    h.operator.lock().unwrap().write(&OperatorRecord {
        t_us: now_us(),
        action: action.into(),
        ok,
        jobs,
        n,
        detail,
    });
}
