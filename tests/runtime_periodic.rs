//! Periodic jobs: every fire time of a schedule is enqueued exactly once however many
//! schedulers keep it, a restart loses and duplicates none, the catch-up policies after
//! a stop enqueue exactly what they say, a changed schedule goes on from its position,
//! and two builds whose specs differ (a rolling deploy), or of which one no longer has
//! the schedule, fire each time of the stored spec once. Asserted on the jobs and the
//! fire rows, and on what the handler ran. The daylight-saving nights and clock skew are
//! in `runtime_periodic_clock.rs`.

mod common;
#[path = "common/periodic.rs"]
mod periodic;
#[path = "common/worker.rs"]
mod worker;

use std::time::Duration;

use common::{within, TestDb};
use leasehold::{CatchUp, NewJob, Periodic, Scheduler, StoreOptions};
use periodic::{every, every_second, fires, gaps, start, stored_spec, Tock};
use worker::{fast_config, run_in_system, wait_until, POOL};

#[test]
fn three_schedulers_enqueue_each_fire_time_of_a_one_second_schedule_exactly_once() {
    run_in_system(within(90, "periodic across three schedulers", async {
        let db = TestDb::with_options("rt_periodic_three", StoreOptions::default(), POOL).await;
        let h = Tock::default();
        let mut all = Vec::new();
        for _ in 0..3 {
            all.push(start(&db, &h, vec![every_second("tick")]).await);
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
        for s in &all {
            s.shutdown().await.unwrap();
        }
        let f = fires(&db, "tick").await;
        assert!(
            (9..=11).contains(&f.len()),
            "{} fire times in 10 s: {f:?}",
            f.len()
        );
        assert!(
            gaps(&f).iter().all(|g| *g == 1),
            "a fire time was lost: {f:?}"
        );
        assert!(f.iter().all(|(_, late)| !late));
        let enqueued: u64 = all
            .iter()
            .map(|s| s.metrics().counters.periodic_enqueued)
            .sum();
        assert_eq!(
            enqueued as usize,
            f.len(),
            "counted once, by whichever fired it"
        );
        assert!(h.runs() <= f.len() as u64);
        db.drop().await;
    }))
}

#[test]
fn a_restart_in_the_middle_loses_and_duplicates_no_fire_time() {
    run_in_system(within(90, "periodic across a restart", async {
        let db = TestDb::with_options("rt_periodic_restart", StoreOptions::default(), POOL).await;
        let h = Tock::default();
        let a = start(&db, &h, vec![every_second("tick")]).await;
        tokio::time::sleep(Duration::from_millis(3200)).await;
        a.shutdown().await.unwrap();
        let b = start(&db, &h, vec![every_second("tick")]).await;
        tokio::time::sleep(Duration::from_millis(3200)).await;
        b.shutdown().await.unwrap();
        let f = fires(&db, "tick").await;
        assert!(f.len() >= 5, "{f:?}");
        assert!(
            gaps(&f).iter().all(|g| *g == 1),
            "lost across the restart: {f:?}"
        );
        assert!(f.iter().all(|(_, late)| !late), "{f:?}");
        wait_until(10, "every periodic job to run", || async {
            db.count_where("jobs", "state = 'done'").await as usize == f.len()
        })
        .await;
        // Retention prunes the fire records (and the done jobs); the schedule's own
        // position keeps those times from firing again.
        common::prune_now(&db.store, 1000).await.unwrap();
        assert_eq!(db.count_where("periodic_fires", "true").await, 0);
        let c = start(&db, &h, vec![every_second("tick")]).await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        c.shutdown().await.unwrap();
        let again = fires(&db, "tick").await;
        assert!(!again.is_empty());
        assert!(
            again.iter().all(|(t, _)| *t > f.last().unwrap().0),
            "{again:?}"
        );
        db.drop().await;
    }))
}

#[test]
fn after_a_five_second_stop_each_catch_up_policy_enqueues_what_it_says() {
    run_in_system(within(90, "periodic catch-up", async {
        let db = TestDb::with_options("rt_periodic_catchup", StoreOptions::default(), POOL).await;
        let h = Tock::default();
        let schedules = || {
            vec![
                every_second("skip").catch_up(CatchUp::Skip),
                every_second("once").catch_up(CatchUp::RunOnce),
                every_second("backfill").catch_up(CatchUp::Backfill(2)),
            ]
        };
        let a = start(&db, &h, schedules()).await;
        tokio::time::sleep(Duration::from_millis(2500)).await;
        a.shutdown().await.unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        let b = start(&db, &h, schedules()).await;
        tokio::time::sleep(Duration::from_millis(2500)).await;
        b.shutdown().await.unwrap();
        // Missed: the fire times more than the 2 s grace old at the restart (about
        // three of the five); the ones within the grace fire on time.
        for (name, late) in [("skip", 0), ("once", 1), ("backfill", 2)] {
            let f = fires(&db, name).await;
            let n = f.iter().filter(|(_, l)| *l).count();
            assert_eq!(n, late, "{name}: {f:?}");
            let g = gaps(&f);
            let hole: i64 = g.iter().map(|g| g - 1).sum();
            assert!(
                hole >= 3 - late as i64 - 1,
                "{name}: the stop left no gap? {f:?}"
            );
        }
        // RunOnce and Backfill enqueue the latest missed fire times.
        let once = fires(&db, "once").await;
        let back = fires(&db, "backfill").await;
        let once_late = once.iter().find(|(_, l)| *l).unwrap().0;
        let back_late: Vec<_> = back.iter().filter(|(_, l)| *l).map(|(t, _)| *t).collect();
        assert_eq!(back_late[1], once_late, "the latest missed fire time");
        assert_eq!((back_late[1] - back_late[0]).num_seconds(), 1);
        db.drop().await;
    }))
}

#[test]
fn a_changed_schedule_goes_on_from_its_position_with_its_new_times() {
    run_in_system(within(90, "periodic schedule change", async {
        let db = TestDb::with_options("rt_periodic_change", StoreOptions::default(), POOL).await;
        let h = Tock::default();
        let a = start(&db, &h, vec![every_second("tick")]).await;
        tokio::time::sleep(Duration::from_millis(2200)).await;
        a.shutdown().await.unwrap();
        let before = fires(&db, "tick").await.len();
        let every_two = Periodic::every(
            "tick",
            Duration::from_secs(2),
            NewJob::from_json("tock", serde_json::json!({ "schedule": "tick" })),
        )
        .unwrap()
        .catch_up(CatchUp::Backfill(10));
        let b = start(&db, &h, vec![every_two]).await;
        tokio::time::sleep(Duration::from_millis(4500)).await;
        b.shutdown().await.unwrap();
        let f = fires(&db, "tick").await;
        let after = &f[before..];
        assert!(!after.is_empty(), "{f:?}");
        assert!(
            after
                .iter()
                .all(|(t, late)| t.timestamp() % 2 == 0 && !late),
            "{f:?}"
        );
        // No fire time between the two specs was lost: the new spec's first time is
        // its first after the old one's last.
        assert!(gaps(&f).iter().all(|g| *g <= 2), "{f:?}");
        assert_eq!(stored_spec(&db, "tick").await, ("every 2s".into(), 2));
        // Two schedules may not share a name.
        let err = Scheduler::builder(db.pool.clone(), fast_config(&db.schema))
            .register(h.clone())
            .periodic(every_second("dup"))
            .periodic(every_second("dup"))
            .start()
            .await
            .err()
            .expect("a duplicate schedule name is refused");
        assert!(err.to_string().contains("dup"), "{err}");
        db.drop().await;
    }))
}

/// Fire rows of `name` enqueued at or after `from` (database time).
fn since(
    f: &[(chrono::DateTime<chrono::Utc>, bool)],
    from: chrono::DateTime<chrono::Utc>,
) -> Vec<(chrono::DateTime<chrono::Utc>, bool)> {
    f.iter().copied().filter(|(t, _)| *t >= from).collect()
}

#[test]
fn two_builds_with_different_specs_fire_each_time_of_the_newer_spec_once() {
    run_in_system(within(90, "periodic rolling deploy", async {
        let db = TestDb::with_options("rt_periodic_deploy", StoreOptions::default(), POOL).await;
        let h = Tock::default();
        // The old build fires at even seconds; the new one, started beside it, at odd
        // ones, so no fire time is both builds'. Before this was fixed each rewrote the
        // other's spec at its own times and neither fired while both ran.
        let old = start(&db, &h, vec![every("tick", 2)]).await;
        periodic::wait_for_fires(&db, "tick", 1, 10).await;
        let odd = Periodic::cron("tick", "1/2 * * * * *", periodic::tock("tick")).unwrap();
        let new = start(&db, &h, vec![odd]).await;
        let both_from: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(6)).await;
        old.shutdown().await.unwrap();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        new.shutdown().await.unwrap();
        let f = fires(&db, "tick").await;
        // Even seconds until the new spec took over, then odd ones every two seconds,
        // each time once (the fire rows' primary key), none lost at the switch, none late.
        let switch = f
            .iter()
            .position(|(t, _)| t.timestamp() % 2 == 1)
            .expect("the new spec fired");
        assert!(
            f[..switch].iter().all(|(t, _)| t.timestamp() % 2 == 0),
            "{f:?}"
        );
        assert!(
            f[switch..].iter().all(|(t, _)| t.timestamp() % 2 == 1),
            "{f:?}"
        );
        let g = gaps(&f);
        assert!(g[..switch - 1].iter().all(|g| *g == 2), "{f:?}");
        assert_eq!(g[switch - 1], 1, "the switch lost a fire time: {f:?}");
        assert!(g[switch..].iter().all(|g| *g == 2), "{f:?}");
        assert!(f.iter().all(|(_, late)| !late), "{f:?}");
        let while_both = since(&f, both_from + chrono::Duration::seconds(1));
        assert!(
            while_both.len() >= 2,
            "fired while both builds ran: {while_both:?} of {f:?}"
        );
        assert_eq!(
            stored_spec(&db, "tick").await,
            ("cron 1/2 * * * * * UTC".into(), 2)
        );
        let enqueued: u64 = [&old, &new]
            .iter()
            .map(|s| s.metrics().counters.periodic_enqueued)
            .sum();
        assert_eq!(
            enqueued as usize,
            f.len(),
            "counted once, by whichever fired it"
        );
        db.drop().await;
    }))
}

#[test]
fn a_build_without_the_schedule_beside_one_that_keeps_it_changes_nothing() {
    run_in_system(within(
        90,
        "periodic schedule removed in one build",
        async {
            let db =
                TestDb::with_options("rt_periodic_removed", StoreOptions::default(), POOL).await;
            let h = Tock::default();
            let keeps = start(&db, &h, vec![every_second("tick")]).await;
            periodic::wait_for_fires(&db, "tick", 1, 10).await;
            // The new build no longer has "tick" (it has a schedule of its own).
            let removed = start(&db, &h, vec![every("other", 3)]).await;
            tokio::time::sleep(Duration::from_secs(4)).await;
            removed.shutdown().await.unwrap();
            keeps.shutdown().await.unwrap();
            let f = fires(&db, "tick").await;
            assert!(f.len() >= 4, "{f:?}");
            assert!(
                gaps(&f).iter().all(|g| *g == 1),
                "a fire time was lost: {f:?}"
            );
            assert!(f.iter().all(|(_, late)| !late), "{f:?}");
            assert_eq!(stored_spec(&db, "tick").await, ("every 1s".into(), 1));
            // Once no build keeps it, it stops: a build without it fires nothing of it.
            let last = f.last().unwrap().0;
            let removed = start(&db, &h, vec![every("other", 3)]).await;
            tokio::time::sleep(Duration::from_millis(1500)).await;
            removed.shutdown().await.unwrap();
            assert_eq!(fires(&db, "tick").await.last().unwrap().0, last);
            db.drop().await;
        },
    ))
}
