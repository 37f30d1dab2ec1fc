//! The checker's own test: every second-edition rule, on small synthetic runs, fires
//! when its invariant is broken and stays quiet when it is not. A rule that cannot fail
//! proves nothing, so this runs in CI (`chaos selftest`, from tests/chaos_short.rs) and
//! under `cargo test --example chaos`.
//!
//! The synthetic runs are built with [`super::synth`].

use super::input::{Expiry, Input, KeyRow, LeaseWrite};
use super::synth::{expect, us, Synth};
use super::{endings, execution, leases, poison, retention, starts, Findings, Stats};
use crate::model::EnqueueRecord;

/// Two handlers of one key on two workers: overlapping, then one after the other.
fn key_overlap() -> Result<(), String> {
    let build = |second_start: i64| {
        let mut s = Synth::new();
        s.job(1, Some("k"), Some(1), "done");
        s.job(2, Some("k"), Some(2), "done");
        s.attempt(0, 1, 1, Some("k"), 100, Some(900));
        s.attempt(1, 2, 1, Some("k"), second_start, Some(second_start + 50));
        s.run(execution::check)
    };
    expect("key_overlap", build(500), build(950))
}

/// A head that completed in its own transaction (at 600) and returned later (at 900):
/// its attempt ended at the commit, so a successor after 600 does not overlap it; one
/// before the commit does.
fn completed_in_transaction_ends_at_commit() -> Result<(), String> {
    let build = |second_start: i64| {
        let mut s = Synth::new();
        s.job(1, Some("k"), Some(1), "done");
        s.job(2, Some("k"), Some(2), "done");
        s.attempt(0, 1, 1, Some("k"), 100, Some(900));
        s.event(1, 1, "completed", 600, "owner-w0");
        s.attempt(1, 2, 1, Some("k"), second_start, Some(second_start + 50));
        s.run(execution::check)
    };
    expect("key_overlap", build(550), build(650))
}

/// A cancelled head still running while its successor starts: no exemption.
fn cancelled_head_overlaps() -> Result<(), String> {
    let build = |end: i64| {
        let mut s = Synth::new();
        s.job(1, Some("k"), Some(1), "cancelled");
        s.job(2, Some("k"), Some(2), "done");
        s.attempt(0, 1, 1, Some("k"), 100, Some(end));
        s.event(1, 1, "cancelled", 300, "operator");
        s.attempt(1, 2, 1, Some("k"), 320, Some(400));
        s.run(execution::check)
    };
    expect("key_overlap", build(700), build(310))
}

/// Two generations of one unkeyed job at once (a lease lost, not noticed).
fn job_generations_overlap() -> Result<(), String> {
    let build = |old_end: i64| {
        let mut s = Synth::new();
        s.job(1, None, None, "done");
        s.attempt(0, 1, 1, None, 100, Some(old_end));
        s.0.expiries.push(Expiry {
            job_id: 1,
            generation: 1,
            owner: "owner-w0".into(),
            lease_until_us: us(2100),
            reaped_at_us: us(2200),
            reaped_by: "r".into(),
        });
        s.attempt(1, 1, 2, None, 2400, Some(2500));
        s.run(execution::check)
    };
    expect("key_overlap", build(3000), build(2050))
}

/// The nemesis's racing reaper (clock ahead) took a live lease: the overlap that
/// follows is the fault's, and excused; the same overlap after a genuine expiry is not.
fn race_reaped_excused() -> Result<(), String> {
    let build = |reaper: &str| {
        let mut s = Synth::new();
        s.job(1, None, None, "done");
        s.attempt(0, 1, 1, None, 100, Some(1500));
        s.0.expiries.push(Expiry {
            job_id: 1,
            generation: 1,
            owner: "owner-w0".into(),
            lease_until_us: us(2100),
            reaped_at_us: us(1000),
            reaped_by: reaper.into(),
        });
        s.attempt(1, 1, 2, None, 1200, Some(1300));
        s.run(execution::check)
    };
    expect(
        "key_overlap",
        build("vm:1:reaper"),
        build(execution::RACE_REAPER),
    )
}

/// A SIGKILLed worker's open attempt ends when its process was reaped.
fn killed_attempt_ends_at_reap() -> Result<(), String> {
    let build = |reaped: i64| {
        let mut s = Synth::new();
        s.job(1, Some("k"), Some(1), "done");
        s.job(2, Some("k"), Some(2), "done");
        s.attempt(0, 1, 1, Some("k"), 100, None);
        s.process_end(0, reaped, "killed(signal: 9)");
        s.attempt(1, 2, 1, Some("k"), 2500, Some(2600));
        s.run(execution::check)
    };
    expect("key_overlap", build(3000), build(400))
}

/// A frozen (SIGSTOP) process's handler is excused while frozen and for the grace after
/// it resumes, not longer.
fn frozen_process_grace() -> Result<(), String> {
    let build = |old_end: i64| {
        let mut s = Synth::new();
        s.job(1, Some("k"), Some(1), "done");
        s.job(2, Some("k"), Some(2), "done");
        s.attempt(0, 1, 1, Some("k"), 100, Some(old_end));
        s.fault("sigstop", "w0", 200, 4200, vec![]);
        s.attempt(1, 2, 1, Some("k"), 2600, Some(2700));
        s.run(execution::check)
    };
    // Grace is renew (500 ms) + 1 s after SIGCONT at 4200.
    expect("key_overlap", build(6000), build(4300))
}

/// A handler whose process froze between its lease check and its first line starts
/// when the process resumes, after its successor generation began: excused if it stops
/// within the grace after resuming, not if it runs on.
fn frozen_before_first_line_grace() -> Result<(), String> {
    let build = |zombie_end: i64| {
        let mut s = Synth::new();
        s.job(1, None, None, "done");
        s.fault("sigstop", "w0", 100, 3000, vec![]);
        s.attempt(1, 1, 2, None, 2500, Some(6000));
        s.attempt(0, 1, 1, None, 3050, Some(zombie_end));
        s.run(execution::check)
    };
    // Grace is renew (500 ms) + 1 s after SIGCONT at 3000.
    expect("key_overlap", build(5000), build(3100))
}

fn key_start_order() -> Result<(), String> {
    let build = |second: i64| {
        let mut s = Synth::new();
        s.job(1, Some("k"), Some(1), "done");
        s.job(2, Some("k"), Some(2), "done");
        s.attempt(0, 1, 1, Some("k"), 500, Some(600));
        s.attempt(1, 2, 1, Some("k"), second, Some(second + 50));
        s.run(execution::check)
    };
    expect("key_start_order", build(100), build(700))
}

/// Retention deleted the key row once its jobs ended; the key's next job starts again
/// at key_seq 1 and is not out of order.
fn key_epochs() -> Result<(), String> {
    let build = |deleted: bool| {
        let mut s = Synth::new();
        s.job(1, Some("k"), Some(1), "done");
        s.job(5, Some("k"), Some(1), "done");
        s.attempt(0, 1, 1, Some("k"), 100, Some(200));
        s.attempt(0, 5, 1, Some("k"), 50, Some(80));
        if deleted {
            s.0.keys.push(KeyRow {
                queue: "default".into(),
                job_key: "k".into(),
                next_seq: 1,
                deleted_at_us: Some(us(300)),
            });
        }
        let input = Input::assemble(s.0);
        (input.epoch.len(), input.ambiguous_keys.len())
    };
    match (build(true), build(false)) {
        ((2, 0), (0, 1)) => Ok(()),
        other => Err(format!(
            "key epochs: with the deleted key row (2 jobs placed, 0 ambiguous) and without (0, 1) expected, got {other:?}"
        )),
    }
}

/// Retention deleted the key row twice; key floors kept key_seq growing (2, then 3, 4),
/// so every job of the key is in one epoch and order-checked.
fn key_floors_one_epoch() -> Result<(), String> {
    let mut s = Synth::new();
    for (id, seq) in [(1, 1), (2, 2), (7, 3), (9, 4)] {
        s.job(id, Some("k"), Some(seq), "done");
    }
    for (next_seq, at) in [(2, 300), (3, 600)] {
        s.0.keys.push(KeyRow {
            queue: "default".into(),
            job_key: "k".into(),
            next_seq,
            deleted_at_us: Some(us(at)),
        });
    }
    let input = Input::assemble(s.0);
    match (input.epoch.len(), input.ambiguous_keys.len()) {
        (4, 0) => Ok(()),
        other => Err(format!(
            "key floors: 4 jobs in one epoch and 0 ambiguous keys expected, got {other:?}"
        )),
    }
}

/// Two SIGSTOPs 3 ms apart are one freeze, with the 3 ms taken from the grace after it;
/// two far apart stay two.
fn freezes_back_to_back() -> Result<(), String> {
    let merged = execution::merge_freezes(&[(0, 100), (103, 200), (1_000, 1_100)], 50);
    if merged == vec![(0, 200, 47), (1_000, 1_100, 50)] {
        Ok(())
    } else {
        Err(format!("freeze windows merged wrongly: {merged:?}"))
    }
}

fn start_without_lease() -> Result<(), String> {
    let build = |start: i64| {
        let mut s = Synth::new();
        s.job(1, None, None, "done");
        s.event(1, 1, "claimed", 0, "owner-w0");
        s.0.expiries.push(Expiry {
            job_id: 1,
            generation: 1,
            owner: "owner-w0".into(),
            lease_until_us: us(2000),
            reaped_at_us: us(2100),
            reaped_by: "r".into(),
        });
        s.line("start", 0, 1, 1, None, start);
        s.line("end", 0, 1, 1, None, start + 10);
        s.run(execution::check)
    };
    expect("start_without_lease", build(2600), build(1500))
}

/// Job 1 of key "k", claimed by w0 at 0 ms with a lease until `until` ms.
fn claimed_keyed_job_leased_until(until: i64) -> Synth {
    let mut s = Synth::new();
    s.job(1, Some("k"), Some(1), "done");
    s.event(1, 1, "claimed", 0, "owner-w0");
    s.0.leases.push(LeaseWrite {
        job_id: 1,
        generation: 1,
        lease_until_us: us(until),
        written_at_us: us(0),
    });
    s
}

/// A claimed job that waits (unrenewed) past its lease and then starts, not reaped yet.
fn start_after_lease_ran_out() -> Result<(), String> {
    let build = |renewed: bool| {
        let mut s = claimed_keyed_job_leased_until(2000);
        if renewed {
            s.0.leases.push(LeaseWrite {
                job_id: 1,
                generation: 1,
                lease_until_us: us(3500),
                written_at_us: us(1500),
            });
        }
        s.line("start", 0, 1, 1, Some("k"), 2300);
        s.line("end", 0, 1, 1, Some("k"), 2310);
        s.run(execution::check)
    };
    expect("start_without_lease", build(false), build(true))
}

/// A handler whose process was frozen between its lease check and its first line starts
/// after the lease ran out: excused if it stopped within the grace after resuming, not if
/// it ran on.
fn start_after_a_freeze() -> Result<(), String> {
    let build = |end: i64| {
        let mut s = claimed_keyed_job_leased_until(2000);
        s.fault("sigstop", "w0", 1500, 4000, vec![]);
        s.line("start", 0, 1, 1, Some("k"), 4001);
        s.line("end", 0, 1, 1, Some("k"), end);
        s.run(execution::check)
    };
    // Grace is renew (500 ms) + 1 s after SIGCONT at 4000.
    expect("start_without_lease", build(7000), build(4010))
}

fn start_after_release() -> Result<(), String> {
    let build = |start: i64| {
        let mut s = Synth::new();
        s.job(1, None, None, "done");
        s.event(1, 1, "claimed", 0, "owner-w0");
        s.event(1, 1, "released", 1000, "owner-w0");
        s.line("start", 0, 1, 1, None, start);
        s.line("end", 0, 1, 1, None, start + 10);
        s.run(execution::check)
    };
    expect("start_without_lease", build(1100), build(500))
}

fn stale_effect() -> Result<(), String> {
    let build = |effect_at: i64| {
        let mut s = Synth::new();
        s.job(1, None, None, "done");
        s.attempt(0, 1, 1, None, 100, None);
        s.line("effect", 0, 1, 1, None, effect_at);
        s.line("end", 0, 1, 1, None, 4000);
        s.attempt(1, 1, 2, None, 3000, Some(3100));
        s.run(execution::check)
    };
    expect("stale_effect", build(3500), build(2000))
}

fn clock_bound() -> Result<(), String> {
    let build = |offset: i64| {
        let mut s = Synth::new();
        s.0.run.clock.max_offset_us = offset;
        s.run(execution::check)
    };
    expect("clock_bound", build(20_000), build(100))
}

fn stranded_key() -> Result<(), String> {
    let build = |head: &str| {
        let mut s = Synth::new();
        s.job(1, Some("k"), Some(1), head);
        s.job(2, Some("k"), Some(2), "waiting");
        s.run(retention::check)
    };
    // A dead head blocks the key (an operator can move it); a done head with a
    // successor still waiting is a key nothing will move.
    expect("stranded_key", build("done"), build("dead"))
}

fn pruned_dead() -> Result<(), String> {
    let build = |state: &str| {
        let mut s = Synth::new();
        s.job(1, None, None, state).deleted_at_us = Some(us(500));
        s.run(retention::check)
    };
    expect("pruned_dead", build("dead"), build("done"))
}

fn orphan_running() -> Result<(), String> {
    let build = |state: &str| {
        let mut s = Synth::new();
        s.job(1, None, None, state).owner = Some("owner-w0".into());
        s.run(retention::check)
    };
    expect("orphan_running", build("running"), build("done"))
}

/// A poison job that ended dead of expiries: a violation when a healthy worker let its
/// lease lapse (it could not contain the poison), not when faults used up its attempts
/// before any worker got to it (`killed`: its worker was killed at the expiry).
fn poison_expired(expect_as: &str, killed: bool) -> Findings {
    let mut s = Synth::new();
    s.up(0);
    s.job(1, None, None, "dead").last_error = Some("lease expired (generation 3)".into());
    s.expect(1, expect_as);
    s.expiry(1, 3, 0, 1_000, 1_100);
    if killed {
        s.process_end(0, 900, "killed(signal: 9 (SIGKILL))");
    }
    s.run(poison::check)
}

fn poison_result() -> Result<(), String> {
    let build = |state: &str, reason: &str| {
        let mut s = Synth::new();
        s.job(1, None, None, state).last_error = Some(reason.into());
        s.expect(1, "poison_result");
        s.run(poison::check)
    };
    expect(
        "poison_result",
        build("done", ""),
        build("dead", "result cannot be stored: contains NUL"),
    )?;
    expect(
        "poison_result",
        poison_expired("poison_result", false),
        build("dead", "result of 70000 bytes exceeds the cap"),
    )?;
    expect(
        "poison_result",
        poison_expired("poison_result", false),
        poison_expired("poison_result", true),
    )
}

fn poison_payload() -> Result<(), String> {
    let build = |reason: &str| {
        let mut s = Synth::new();
        s.job(1, None, None, "dead").last_error = Some(reason.into());
        s.expect(1, "poison_payload");
        s.run(poison::check)
    };
    expect(
        "poison_payload",
        poison_expired("poison_payload", false),
        build("payload cannot be decoded: recursion limit exceeded"),
    )?;
    expect(
        "poison_payload",
        poison_expired("poison_payload", false),
        poison_expired("poison_payload", true),
    )
}

/// A job claimed in the same statement as a deep payload, never run and reaped: it
/// suffered for its neighbour, unless a fault hit its worker.
fn poison_neighbour() -> Result<(), String> {
    let build = |faulted: bool| {
        let mut s = Synth::new();
        s.up(0);
        s.job(1, None, None, "dead").last_error = Some("payload cannot be decoded".into());
        s.expect(1, "poison_payload");
        s.job(2, None, None, "done");
        s.event(1, 1, "claimed", 100, "owner-w0");
        s.event(2, 1, "claimed", 100, "owner-w0");
        s.event(1, 1, "dead", 110, "owner-w0");
        s.event(2, 1, "reaped", 2200, "reaper");
        if faulted {
            s.fault("sigstop", "w0", 50, 3000, vec![]);
        }
        s.run(poison::check)
    };
    expect("poison_neighbour", build(false), build(true))
}

/// A result neighbour: returned ok beside a poisoned result, never completed.
fn poison_result_neighbour() -> Result<(), String> {
    let build = |completed: bool| {
        let mut s = Synth::new();
        s.up(0);
        s.job(1, None, None, "dead").last_error = Some("result contains NUL".into());
        s.expect(1, "poison_result");
        s.job(2, None, None, "done");
        s.attempt(0, 1, 1, None, 100, Some(200));
        s.attempt(0, 2, 1, None, 120, Some(210));
        s.event(
            2,
            1,
            if completed { "completed" } else { "reaped" },
            2300,
            "x",
        );
        s.run(poison::check)
    };
    expect("poison_neighbour", build(false), build(true))
}

/// A result neighbour whose own row a session locked past the lease: the lock, not the
/// poison, cost it its generation; a lock on another row explains nothing.
fn poison_neighbour_row_locked() -> Result<(), String> {
    let build = |its_own: bool| {
        let mut s = Synth::new();
        s.up(0);
        s.job(1, None, None, "dead").last_error = Some("result contains NUL".into());
        s.expect(1, "poison_result");
        s.job(2, None, None, "done");
        s.job(3, None, None, "done");
        s.attempt(0, 1, 1, None, 100, Some(200));
        s.attempt(0, 2, 1, None, 120, Some(210));
        s.event(2, 1, "reaped", 2300, "x");
        s.fault(
            "row_lock",
            "w0",
            150,
            3500,
            vec![if its_own { 2 } else { 3 }],
        );
        s.run(poison::check)
    };
    expect("poison_neighbour", build(false), build(true))
}

/// A handler returned ok and its completion landed three seconds later (a lease is two)
/// with nothing wrong with its worker or the database; or the same with a session
/// holding its row meanwhile, which explains the wait. A generation the racing reaper
/// took (its reap recorded at its own clock, ahead) is not judged.
fn ending_late() -> Result<(), String> {
    let build = |row_locked: bool| {
        let mut s = Synth::new();
        s.up(0);
        s.job(1, None, None, "done");
        s.job(2, None, None, "done");
        s.attempt(0, 1, 1, None, 100, Some(120));
        s.attempt(0, 2, 1, None, 100, Some(130));
        s.event(1, 1, "completed", 3120, "owner-w0");
        s.event(2, 1, "completed", 140, "owner-w0");
        if row_locked {
            s.fault("row_lock", "w0", 110, 3000, vec![1]);
        }
        // Stolen by the racing reaper 0.7 s after its handler returned, its reap recorded
        // 1.6 s ahead (2.3 s by that clock): not judged.
        s.job(3, None, None, "done");
        s.attempt(0, 3, 1, None, 100, Some(120));
        s.event(3, 1, "reaped", 2400, "chaos-reaper-race");
        s.0.expiries.push(Expiry {
            job_id: 3,
            generation: 1,
            owner: "owner-w0".into(),
            lease_until_us: us(2010),
            reaped_at_us: us(2400),
            reaped_by: execution::RACE_REAPER.into(),
        });
        s.run(endings::check)
    };
    expect("ending_late", build(false), build(true))
}

/// A row lock explains the expiry of the row it locked, not of the worker's others.
fn row_lock_explains_only_its_rows() -> Result<(), String> {
    let build = |job: i64| {
        let mut s = Synth::new();
        s.up(0);
        s.0.run.finished_us = us(100_000);
        s.fault("row_lock", "w0", 0, 5000, vec![1]);
        s.0.expiries.push(Expiry {
            job_id: job,
            generation: 1,
            owner: "owner-w0".into(),
            lease_until_us: us(2500),
            reaped_at_us: us(2600),
            reaped_by: "r".into(),
        });
        let input = Input::assemble(s.0);
        let (mut f, mut st) = (Findings::default(), Stats::default());
        leases::expiries(&input, &mut f, &mut st);
        f
    };
    expect("lease_lost_while_healthy", build(2), build(1))
}

/// A rolled-back host enqueue must leave no row.
fn rolled_back_enqueue() -> Result<(), String> {
    let build = |row: bool| {
        let mut s = Synth::new();
        s.0.enq.push(EnqueueRecord {
            cid: 7,
            kind: "charge".into(),
            key: Some("hot-0".into()),
            status: "rolled_back".into(),
            id: None,
            error: None,
            expect: "done".into(),
            max_attempts: 12,
            t_us: us(0),
            scenario: Some("host_enqueue_rollback".into()),
        });
        if row {
            s.job(7, Some("hot-0"), Some(1), "done");
        }
        s.run(super::jobs::enqueues)
    };
    expect("unexpected", build(true), build(false))
}

type Case = (&'static str, fn() -> Result<(), String>);

pub const CASES: [Case; 40] = [
    ("key_overlap", key_overlap),
    (
        "completed_in_transaction",
        completed_in_transaction_ends_at_commit,
    ),
    ("cancelled_head_overlaps", cancelled_head_overlaps),
    ("job_generations_overlap", job_generations_overlap),
    ("race_reaped_excused", race_reaped_excused),
    ("killed_attempt_ends_at_reap", killed_attempt_ends_at_reap),
    ("frozen_process_grace", frozen_process_grace),
    (
        "frozen_before_first_line_grace",
        frozen_before_first_line_grace,
    ),
    ("key_start_order", key_start_order),
    ("key_epochs", key_epochs),
    ("key_floors_one_epoch", key_floors_one_epoch),
    ("freezes_back_to_back", freezes_back_to_back),
    ("start_without_lease", start_without_lease),
    ("start_after_a_freeze", start_after_a_freeze),
    ("start_after_lease_ran_out", start_after_lease_ran_out),
    ("start_after_release", start_after_release),
    ("stale_effect", stale_effect),
    ("clock_bound", clock_bound),
    ("stranded_key", stranded_key),
    ("pruned_dead", pruned_dead),
    ("orphan_running", orphan_running),
    ("poison_result", poison_result),
    ("poison_payload", poison_payload),
    ("poison_neighbour", poison_neighbour),
    ("poison_result_neighbour", poison_result_neighbour),
    ("poison_neighbour_row_locked", poison_neighbour_row_locked),
    ("ending_late", ending_late),
    (
        "row_lock_explains_only_its_rows",
        row_lock_explains_only_its_rows,
    ),
    ("rolled_back_enqueue", rolled_back_enqueue),
    ("drop_guard_end_counts", drop_guard_end_counts),
    ("dead_never_started", dead_never_started),
    ("cancelled_unasked", cancelled_unasked),
    ("reap_late", reap_late),
    ("host_tx_broken", host_tx_broken),
    ("neighbour_effect_shared", neighbour_effect_shared),
    ("poison_outcome", poison_outcome),
    ("false_stale", false_stale),
    ("stale_reports_parse", stale_reports_parse),
    ("result_over_limit", result_over_limit),
    ("periodic_fire", periodic_fire),
];

/// Periodic fires: each schedule's rule fires on a run that breaks it and stays quiet on
/// one that keeps it.
fn periodic_fire() -> Result<(), String> {
    use super::periodic::{Fire, Periodic};
    let t = |s: &str| {
        s.parse::<chrono::DateTime<chrono::Utc>>()
            .unwrap()
            .timestamp_micros()
    };
    let build = |episode: &str, schedule: &str, times: &[i64], clock_end: i64| {
        let mut p = Periodic::default();
        for (i, at) in times.iter().enumerate() {
            p.fires.push(Fire {
                episode: episode.into(),
                schedule: schedule.into(),
                job_id: i as i64 + 1,
                run_at_us: *at,
                fire_at_us: Some(*at),
            });
        }
        p.clock_end_us.insert(episode.into(), clock_end);
        let mut f = Findings::default();
        super::periodic::check(&p, &mut f, &mut Stats::default());
        f
    };
    let s0 = t("2027-03-28T00:50:00Z");
    let secs = |from: i64, step: i64, n: i64| {
        (0..n)
            .map(|i| from + i * step * 1_000_000)
            .collect::<Vec<_>>()
    };
    // tick: a missed second, and a doubled one.
    let mut missed = secs(s0, 1, 10);
    missed.remove(4);
    expect(
        "periodic_fire",
        build("spring", "tick", &missed, s0),
        build("spring", "tick", &secs(s0, 1, 10), s0),
    )?;
    let mut doubled = secs(s0, 1, 10);
    doubled.push(s0 + 3_000_000);
    expect(
        "periodic_fire",
        build("spring", "tick", &doubled, s0),
        build("spring", "tick", &secs(s0, 1, 10), s0),
    )?;
    // deploy: a missed 2 s time; the switch from the 2 s grid to the 3 s grid is fine.
    let mut switch = secs(s0, 2, 5);
    switch.extend(secs(s0 + 9_000_000, 3, 4));
    let mut gap = secs(s0, 2, 5);
    gap.remove(2);
    expect(
        "periodic_fire",
        build("spring", "deploy", &gap, s0),
        build("spring", "deploy", &switch, s0),
    )?;
    // gap: skipped (the clock passed the night), or fired at 02:00 local time.
    let after = t("2027-03-28T01:05:00Z");
    expect(
        "periodic_fire",
        build("spring", "gap", &[], after),
        build("spring", "gap", &[t("2027-03-28T01:00:00Z")], after),
    )?;
    expect(
        "periodic_fire",
        build("spring", "gap", &[t("2027-03-28T01:00:05Z")], after),
        build("spring", "gap", &[], s0),
    )?;
    // overlap: a fire in the second hour 1.
    let first = secs(t("2027-11-07T05:59:00Z"), 5, 12);
    let mut twice = first.clone();
    twice.push(t("2027-11-07T06:00:00Z"));
    let end = t("2027-11-07T06:10:00Z");
    expect(
        "periodic_fire",
        build("autumn", "overlap", &twice, end),
        build("autumn", "overlap", &first, end),
    )
}

/// A job whose effect outcome could not be recorded: dead naming the outcome with its
/// effect applied once keeps the rule; done, or applied a second time, breaks it.
fn poison_outcome() -> Result<(), String> {
    let build = |state: &str, applies: u64| {
        let mut s = Synth::new();
        s.job(1, None, None, state).last_error =
            Some("effect … happened, but its outcome cannot be recorded".into());
        s.expect(1, "poison_outcome");
        for seq in 1..=applies {
            s.0.effects.push(crate::model::EffectLog {
                seq,
                t_us: us(seq as i64 * 10),
                effect_key: "0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c21/1/s0".into(),
                job: 1,
                step: "s0".into(),
                generation: seq as i64,
                key: None,
                key_seq: None,
                worker: "w0.1".into(),
                decision: "applied".into(),
                reply_dropped: false,
            });
        }
        s.run(poison::check)
    };
    expect("poison_outcome", build("done", 1), build("dead", 1))?;
    expect("poison_outcome", build("dead", 2), build("dead", 1))
}

/// A stale count for a generation whose completion committed breaks the rule; one for a
/// generation that another ended does not.
fn false_stale() -> Result<(), String> {
    let build = |completed_gen: i64| {
        let mut s = Synth::new();
        s.job(1, None, None, "done");
        s.event(1, 1, "claimed", 100, "owner-w0");
        s.event(1, 1, "reaped", 2200, "reaper");
        s.event(1, 2, "claimed", 2300, "owner-w1");
        s.event(1, completed_gen, "completed", 2400, "owner-w0");
        s.0.stale_reports.push(super::input::StaleReport {
            log: "w0.1.log".into(),
            job: 1,
            generation: 1,
            what: "failure".into(),
        });
        s.run(super::endings::false_stale)
    };
    expect("false_stale", build(1), build(2))
}

/// The log lines `false_stale` reads, as the worker's tracing writes them.
fn stale_reports_parse() -> Result<(), String> {
    let log = "2026-12-07T18:00:00.123456Z  WARN leasehold.attempt{job=7 job.generation=3}: \
               leasehold::executor: leasehold failure refused: this worker no longer owns the job \
               job=7 generation=3\n\
               2026-12-07T18:00:01Z  INFO leasehold::executor: something else job=8 generation=1\n";
    let got = super::input::stale_reports("w0.1.log", log);
    match got.as_slice() {
        [r] if r.job == 7 && r.generation == 3 && r.what == "failure" => Ok(()),
        other => Err(format!("stale reports parsed as {other:?}")),
    }
}

/// A stored result over the cap breaks the rule, whatever the job's state.
fn result_over_limit() -> Result<(), String> {
    let build = |bytes: usize| {
        let mut s = Synth::new();
        s.0.run.max_result_bytes = 100;
        s.job(1, None, None, "dead").result = Some(serde_json::json!("r".repeat(bytes)));
        s.run(super::jobs::results)
    };
    expect("result_over_limit", build(200), build(50))
}

/// A neighbour schema's job 1 applies its effect after this schema's job 1 did: a
/// finding when the store answers it with job 1's receipt (one key for both), none when
/// it is applied (keys of their own); and this schema's rules never count it.
fn neighbour_effect_shared() -> Result<(), String> {
    let build = |decision: &str| {
        let mut s = Synth::new();
        s.job(1, None, None, "done");
        for (seq, worker, decision) in [
            (1, "w0.1", "applied"),
            (2, crate::nemesis_operator::NEIGHBOUR_WORKER, decision),
        ] {
            s.0.effects.push(crate::model::EffectLog {
                seq,
                t_us: us(seq as i64 * 10),
                effect_key: format!("0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c2{seq}/1/s0"),
                job: 1,
                step: "s0".into(),
                generation: 1,
                key: None,
                key_seq: None,
                worker: worker.into(),
                decision: decision.into(),
                reply_dropped: false,
            });
        }
        s.run(super::effects::check)
    };
    let (fires, quiet) = (build("already"), build("applied"));
    if quiet.count("effect_applied_twice") != 0 {
        return Err("a neighbour's effect counted as this schema's job 1's".into());
    }
    expect("neighbour_effect_shared", fires, quiet)
}

/// A lease reaped four seconds after it ended while only the heartbeat was refused: a
/// finding; the same delay while the database restarted, or a reap within the bound, is
/// none.
fn reap_late() -> Result<(), String> {
    let build = |explained: bool| {
        let mut s = Synth::new();
        s.0.run.reaper_ms = 300;
        s.up(0);
        s.job(1, None, None, "done");
        s.expiry(1, 1, 0, 1000, 5000);
        s.job(2, None, None, "done");
        s.expiry(2, 1, 0, 1000, 2500);
        s.fault("informational_write_fails", "schedulers", 0, 6000, vec![]);
        if explained {
            s.fault("pg_restart_fast", "pg", 900, 3000, vec![]);
        }
        s.run(super::leases::reaps)
    };
    expect("reap_late", build(false), build(true))
}

/// The good enqueue of a host transaction after refused calls failed because the
/// transaction was aborted: a finding; failed on a lost connection: none.
fn host_tx_broken() -> Result<(), String> {
    let build = |error: &str| {
        let mut s = Synth::new();
        s.0.enq.push(EnqueueRecord {
            cid: 9,
            kind: "charge".into(),
            key: Some("hot-1".into()),
            status: "info".into(),
            id: None,
            error: Some(error.into()),
            expect: "done".into(),
            max_attempts: 12,
            t_us: us(0),
            scenario: Some("host_bad_input".into()),
        });
        s.run(super::jobs::enqueues)
    };
    expect(
        "host_tx_broken",
        build("enqueue_in after the refused calls: current transaction is aborted, commands ignored until end of transaction block"),
        build("commit: error communicating with database: connection reset by peer"),
    )
}

/// A job made dead by an expired lease: a finding when that generation's handler never
/// started (it waited in the process for a slot), none when it ran.
fn dead_never_started() -> Result<(), String> {
    let build = |ran: bool| {
        let mut s = Synth::new();
        s.up(0);
        s.job(1, None, None, "dead");
        if ran {
            s.attempt(0, 1, 1, None, 100, None);
        }
        s.event(1, 1, "claimed", 90, "owner-w0");
        s.event(1, 1, "reaped", 2500, "reaper");
        s.0.events.last_mut().unwrap().detail =
            Some("lease of owner-w0 expired at t; now dead".into());
        s.run(starts::check)
    };
    expect("dead_never_started", build(false), build(true))
}

/// A running handler's generation ended cancelled: a finding without a cancel request
/// for it, none with one.
fn cancelled_unasked() -> Result<(), String> {
    let build = |asked: bool| {
        let mut s = Synth::new();
        s.up(0);
        s.job(1, None, None, "cancelled");
        s.attempt(0, 1, 1, None, 100, Some(300));
        s.event(1, 1, "claimed", 90, "owner-w0");
        if asked {
            s.event(1, 1, "cancel_requested", 200, "operator");
        }
        s.event(1, 1, "cancelled", 310, "owner-w0");
        // Job 2 ran, failed, and was cancelled by an operator while pending: written at
        // the same generation, by the operator. Not a stopped handler.
        s.job(2, None, None, "cancelled");
        s.attempt(0, 2, 1, None, 100, Some(150));
        s.event(2, 1, "claimed", 90, "owner-w0");
        s.event(2, 1, "failed", 160, "owner-w0");
        s.event(2, 1, "cancelled", 400, "operator");
        s.run(starts::check)
    };
    expect("cancelled_unasked", build(false), build(true))
}

/// An `end` written by the drop guard (outcome `dropped`) ends the attempt like any.
fn drop_guard_end_counts() -> Result<(), String> {
    let build = |outcome: &str| {
        let mut s = Synth::new();
        s.job(1, Some("k"), Some(1), "done");
        s.job(2, Some("k"), Some(2), "done");
        s.attempt(0, 1, 1, Some("k"), 100, Some(300));
        s.0.history.last_mut().unwrap().outcome = outcome.into();
        s.attempt(1, 2, 1, Some("k"), 400, Some(500));
        let input = Input::assemble(s.0);
        let (mut f, mut st) = (Findings::default(), Stats::default());
        execution::check(&input, &mut f, &mut st);
        (f.count("key_overlap"), st.ends_dropped)
    };
    match (build("dropped"), build("ok")) {
        ((0, 1), (0, 0)) => Ok(()),
        other => Err(format!("drop-guard ends: got {other:?}")),
    }
}

/// Run every case; print one line each. Exit 0 if all pass.
pub fn main() -> ! {
    let mut failed = 0;
    for (name, case) in CASES {
        match case() {
            Ok(()) => println!("selftest {name}: ok"),
            Err(e) => {
                failed += 1;
                println!("selftest {name}: FAILED: {e}");
            }
        }
    }
    println!(
        "selftest: {} of {} cases passed",
        CASES.len() - failed,
        CASES.len()
    );
    std::process::exit(if failed == 0 { 0 } else { 1 })
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_rule_fires_and_stays_quiet() {
        for (name, case) in super::CASES {
            if let Err(e) = case() {
                panic!("{name}: {e}");
            }
        }
    }
}
