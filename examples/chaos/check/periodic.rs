//! Periodic schedules under the faults (see `crate::periodic`): each fire time of the
//! stored spec enqueued exactly once while any build ran, read from the enqueued jobs.
//!
//! - every schedule: no fire time twice (two jobs with one run-at), and each job's
//!   run-at is its fire record's time;
//! - `tick` (every second): consecutive fires exactly 1 s apart, on whole seconds;
//! - `deploy` (every 2 s in one build, every 3 s in the other): each fire on the 2 s or
//!   the 3 s grid, consecutive fires at most 3 s apart (one missed time of either spec
//!   leaves a gap of 4 s or 6 s);
//! - `gap` (Berlin, every 5 s of local hour 2, which does not exist on the spring
//!   night): exactly one fire, at the first instant after the gap (01:00 UTC), once
//!   the database clock has passed it;
//! - `overlap` (New York, every 5 s of local hour 1, which happens twice on the autumn
//!   night): fires 5 s apart up to 05:59:55 UTC and none in the second hour 1.

use std::collections::BTreeMap;

use super::{Findings, Stats};

/// One saved fire: from `db/periodic.jsonl`.
#[derive(Clone, Debug, Default)]
pub struct Fire {
    pub episode: String,
    pub schedule: String,
    pub job_id: i64,
    pub run_at_us: i64,
    pub fire_at_us: Option<i64>,
}

/// What `db/periodic.jsonl` holds: the fires, and where each episode's clock ended.
#[derive(Clone, Debug, Default)]
pub struct Periodic {
    pub fires: Vec<Fire>,
    pub clock_end_us: BTreeMap<String, i64>,
}

impl Periodic {
    pub fn parse(text: &str) -> Result<Periodic, String> {
        let mut out = Periodic::default();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let v: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
            let episode = v["episode"].as_str().unwrap_or_default().to_string();
            if let Some(end) = v["clock_end_us"].as_i64() {
                out.clock_end_us.insert(episode, end);
                continue;
            }
            out.fires.push(Fire {
                episode,
                schedule: v["schedule"].as_str().unwrap_or_default().to_string(),
                job_id: v["job_id"].as_i64().unwrap_or_default(),
                run_at_us: v["run_at_us"].as_i64().unwrap_or_default(),
                fire_at_us: v["fire_at_us"].as_i64(),
            });
        }
        Ok(out)
    }
}

const S: i64 = 1_000_000;

fn at_us(rfc3339: &str) -> i64 {
    rfc3339
        .parse::<chrono::DateTime<chrono::Utc>>()
        .expect("an instant")
        .timestamp_micros()
}

pub fn check(p: &Periodic, f: &mut Findings, s: &mut Stats) {
    let mut by: BTreeMap<(&str, &str), Vec<i64>> = BTreeMap::new();
    for fire in &p.fires {
        if fire.fire_at_us != Some(fire.run_at_us) {
            f.add(
                "periodic_fire",
                format!(
                    "{}/{}: job {} runs at {} µs, its fire record says {:?}",
                    fire.episode, fire.schedule, fire.job_id, fire.run_at_us, fire.fire_at_us
                ),
            );
        }
        by.entry((fire.episode.as_str(), fire.schedule.as_str()))
            .or_default()
            .push(fire.run_at_us);
    }
    for ((episode, schedule), times) in &mut by {
        times.sort_unstable();
        s.periodic_fires += times.len() as u64;
        let mut say =
            |what: String| f.add("periodic_fire", format!("{episode}/{schedule}: {what}"));
        for w in times.windows(2) {
            if w[0] == w[1] {
                say(format!("fire time {} µs enqueued twice", w[0]));
            }
        }
        let gaps = || times.windows(2).map(|w| (w[0], w[1] - w[0]));
        match *schedule {
            "tick" => {
                for (t, gap) in gaps() {
                    if gap != S || t % S != 0 {
                        say(format!("fire at {t} µs followed {gap} µs later, not 1 s"));
                    }
                }
            }
            "deploy" => {
                for &t in times.iter() {
                    if t % (2 * S) != 0 && t % (3 * S) != 0 {
                        say(format!("fire at {t} µs is on neither spec's grid"));
                    }
                }
                for (t, gap) in gaps() {
                    if gap > 3 * S {
                        say(format!("no fire for {gap} µs after {t} µs (a missed time)"));
                    }
                }
            }
            "gap" => {
                let want = at_us("2027-03-28T01:00:00Z");
                if times.as_slice() != [want] {
                    say(format!("fired at {times:?} µs, want once at {want} µs (03:00 local, after the gap)"));
                }
            }
            "overlap" => {
                let second_hour = at_us("2027-11-07T06:00:00Z");
                for (t, gap) in gaps() {
                    if gap != 5 * S {
                        say(format!("fire at {t} µs followed {gap} µs later, not 5 s"));
                    }
                }
                if let Some(t) = times.iter().find(|t| **t >= second_hour) {
                    say(format!(
                        "fired at {t} µs, in the second (repeated) local hour 1"
                    ));
                }
            }
            other => say(format!("an unknown schedule {other:?}")),
        }
    }
    // The once-a-night schedules must have fired when their clock passed the night.
    for (episode, schedule, by_then) in [
        ("spring", "gap", "2027-03-28T01:00:10Z"),
        ("autumn", "overlap", "2027-11-07T06:00:10Z"),
    ] {
        let passed = p
            .clock_end_us
            .get(episode)
            .is_some_and(|end| *end >= at_us(by_then));
        let fired = by.get(&(episode, schedule)).map_or(0, Vec::len);
        if passed && fired == 0 {
            f.add(
                "periodic_fire",
                format!("{episode}/{schedule}: never fired, though the clock passed {by_then}"),
            );
        }
        if passed && schedule == "overlap" {
            let last = by.get(&(episode, schedule)).and_then(|t| t.last().copied());
            let want = at_us("2027-11-07T05:59:55Z");
            if last.is_some_and(|l| l != want) {
                f.add(
                    "periodic_fire",
                    format!("{episode}/{schedule}: last fire at {last:?} µs, want {want} µs (the end of the first hour 1)"),
                );
            }
        }
    }
}
