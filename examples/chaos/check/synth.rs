//! Small synthetic runs for the checker's self-test: a builder for the artifacts
//! (jobs, events, history lines, faults, processes) in milliseconds from an arbitrary
//! origin on both clocks, and the one assertion every case makes.

use super::input::{Event, Expiry, Input, Job, Parts};
use super::{Findings, Stats};
use crate::model::{ClockInfo, EnqueueRecord, FaultRecord, HistoryLine, ProcessRecord, RunInfo};

pub const WALL0_US: i64 = 1_700_000_000_000_000;
pub const MONO0_NS: i64 = 5_000_000_000_000;

pub fn us(ms: i64) -> i64 {
    WALL0_US + ms * 1000
}

pub fn ns(ms: i64) -> i64 {
    MONO0_NS + ms * 1_000_000
}

/// A synthetic run under construction.
pub struct Synth(pub Parts);

impl Synth {
    pub fn new() -> Synth {
        Synth(Parts {
            run: RunInfo {
                lease_ms: 2000,
                renew_ms: 500,
                clock: ClockInfo {
                    samples: 10,
                    good_samples: 10,
                    max_offset_us: 300,
                    max_rtt_us: 400,
                    bound_us: crate::model::DB_CLOCK_BOUND_US,
                },
                ..RunInfo::default()
            },
            ..Parts::default()
        })
    }

    pub fn job(&mut self, id: i64, key: Option<&str>, seq: Option<i64>, state: &str) -> &mut Job {
        self.0.jobs.push(Job {
            id,
            queue: "default".into(),
            kind: "charge".into(),
            job_key: key.map(str::to_string),
            key_seq: seq,
            state: state.into(),
            max_attempts: 12,
            cid: Some(id),
            ..Job::default()
        });
        self.0.jobs.last_mut().unwrap()
    }

    pub fn expect(&mut self, id: i64, expect: &str) {
        self.0.enq.push(EnqueueRecord {
            cid: id as u64,
            kind: "charge".into(),
            key: None,
            status: "ok".into(),
            id: Some(id),
            error: None,
            expect: expect.into(),
            max_attempts: 3,
            t_us: us(0),
            scenario: None,
        });
    }

    pub fn event(&mut self, job: i64, gen: i64, event: &str, at_ms: i64, owner: &str) {
        let id = self.0.events.len() as i64 + 1;
        self.0.events.push(Event {
            id,
            job_id: job,
            generation: gen,
            event: event.into(),
            at_us: us(at_ms),
            owner: Some(owner.into()),
            detail: None,
        });
    }

    pub fn line(&mut self, ev: &str, w: usize, job: i64, gen: i64, key: Option<&str>, t_ms: i64) {
        self.0.history.push(HistoryLine {
            t_us: us(t_ms),
            mono_ns: ns(t_ms),
            w,
            inc: 1,
            ev: ev.into(),
            job,
            generation: gen,
            key: key.map(str::to_string),
            ..HistoryLine::default()
        });
    }

    /// A claimed attempt on worker `w` from `from` to `to` (ms; `None`: no end line).
    pub fn attempt(
        &mut self,
        w: usize,
        job: i64,
        gen: i64,
        key: Option<&str>,
        from: i64,
        to: Option<i64>,
    ) {
        self.event(job, gen, "claimed", from - 5, &format!("owner-w{w}"));
        self.line("start", w, job, gen, key, from);
        if let Some(to) = to {
            self.line("end", w, job, gen, key, to);
            self.0.history.last_mut().unwrap().outcome = "ok".into();
        }
    }

    pub fn up(&mut self, w: usize) {
        self.0.history.push(HistoryLine {
            ev: "up".into(),
            w,
            inc: 1,
            owner: Some(format!("owner-w{w}")),
            ..HistoryLine::default()
        });
    }

    pub fn fault(&mut self, kind: &str, target: &str, from: i64, to: i64, jobs: Vec<i64>) {
        let mut f = FaultRecord::new(kind, target.into(), us(from), true, String::new());
        f.end_us = us(to);
        f.start_mono_ns = ns(from);
        f.end_mono_ns = ns(to);
        f.jobs = jobs;
        self.0.faults.push(f);
    }

    /// The lease of `job`'s generation `gen`, held by worker `w`, expired at
    /// `until_ms` and was reaped at `reaped_ms` (by a worker's reaper).
    pub fn expiry(&mut self, job: i64, gen: i64, w: usize, until_ms: i64, reaped_ms: i64) {
        self.0.expiries.push(Expiry {
            job_id: job,
            generation: gen,
            owner: format!("owner-w{w}"),
            lease_until_us: us(until_ms),
            reaped_at_us: us(reaped_ms),
            reaped_by: "owner-w9".into(),
        });
    }

    pub fn process_end(&mut self, w: usize, at_ms: i64, how: &str) {
        self.0.processes.push(ProcessRecord {
            w,
            inc: 1,
            pid: 1,
            started_us: us(0),
            ended_us: us(at_ms),
            ended_mono_ns: ns(at_ms),
            how: how.into(),
        });
    }

    pub fn run(self, check: fn(&Input, &mut Findings, &mut Stats)) -> Findings {
        let input = Input::assemble(self.0);
        let (mut f, mut s) = (Findings::default(), Stats::default());
        check(&input, &mut f, &mut s);
        f
    }
}

/// `rule` fired on `fires` and not on `quiet`.
pub fn expect(rule: &str, fires: Findings, quiet: Findings) -> Result<(), String> {
    if fires.count(rule) == 0 {
        return Err(format!("{rule} did not fire on a run that breaks it"));
    }
    if quiet.count(rule) != 0 {
        return Err(format!(
            "{rule} fired on a run that keeps it: {:?}",
            quiet.witnesses(rule)
        ));
    }
    Ok(())
}
