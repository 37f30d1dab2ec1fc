//! Child processes: spawned from one long-lived thread, registered for cleanup, and
//! tied to the harness's life.
//!
//! `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not the
//! process, so every child is forked by one dedicated spawner thread that lives as long
//! as the harness. Each child gets its own process group; cleanup signals the group.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

type Request = (Command, libc::c_int, mpsc::Sender<std::io::Result<Child>>);

static SPAWNER: OnceLock<Mutex<mpsc::Sender<Request>>> = OnceLock::new();
/// Process groups to kill on cleanup, with the signal that stops each cleanly.
static GROUPS: Mutex<BTreeMap<i32, libc::c_int>> = Mutex::new(BTreeMap::new());

fn spawner() -> mpsc::Sender<Request> {
    SPAWNER
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<Request>();
            std::thread::Builder::new()
                .name("chaos-spawner".into())
                .spawn(move || {
                    for (mut cmd, death_signal, reply) in rx {
                        let parent = std::process::id() as libc::pid_t;
                        unsafe {
                            cmd.pre_exec(move || {
                                if libc::prctl(
                                    libc::PR_SET_PDEATHSIG,
                                    death_signal as libc::c_ulong,
                                ) != 0
                                {
                                    return Err(std::io::Error::last_os_error());
                                }
                                // The harness died between fork and prctl: do not outlive it.
                                if libc::getppid() != parent {
                                    libc::_exit(1);
                                }
                                Ok(())
                            });
                        }
                        cmd.process_group(0);
                        let _ = reply.send(cmd.spawn());
                    }
                    // The sender is never dropped: this thread lives as long as the process.
                    loop {
                        std::thread::park();
                    }
                })
                .expect("spawn the spawner thread");
            Mutex::new(tx)
        })
        .lock()
        .unwrap()
        .clone()
}

/// Spawn `cmd` in its own process group; it receives `death_signal` if the harness
/// dies. Registered for [`kill_all`].
pub fn spawn(cmd: Command, death_signal: libc::c_int) -> std::io::Result<Child> {
    let (tx, rx) = mpsc::channel();
    spawner()
        .send((cmd, death_signal, tx))
        .map_err(|_| std::io::Error::other("spawner thread gone"))?;
    let child = rx
        .recv()
        .map_err(|_| std::io::Error::other("spawner thread gone"))??;
    GROUPS
        .lock()
        .unwrap()
        .insert(child.id() as i32, death_signal);
    Ok(child)
}

/// The process (group) ended and was reaped: no longer ours to kill.
pub fn forget(pid: u32) {
    GROUPS.lock().unwrap().remove(&(pid as i32));
}

pub fn signal(pid: u32, sig: libc::c_int) -> bool {
    unsafe { libc::kill(pid as libc::pid_t, sig) == 0 }
}

/// Signal every registered group with its stop signal, then SIGKILL what is left.
pub fn kill_all() {
    let groups: Vec<(i32, libc::c_int)> = GROUPS
        .lock()
        .unwrap()
        .iter()
        .map(|(p, s)| (*p, *s))
        .collect();
    for (pgid, sig) in &groups {
        unsafe {
            libc::kill(-pgid, libc::SIGCONT);
            libc::kill(-pgid, *sig);
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    for (pgid, _) in &groups {
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
    }
    GROUPS.lock().unwrap().clear();
}

/// Wait for a child with a limit; `None` if it is still running.
pub fn wait_timeout(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => return None,
        }
    }
}

/// At `deadline`, kill every child, run `cleanup` (stop the cluster, remove its
/// directory) and exit with status 3. Covers hangs the harness itself cannot escape.
pub fn watchdog(deadline: Instant, cleanup: impl FnOnce() + Send + 'static) {
    std::thread::Builder::new()
        .name("chaos-watchdog".into())
        .spawn(move || {
            while Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(200));
            }
            eprintln!("chaos: WATCHDOG: hard deadline reached; killing every child and exiting");
            kill_all();
            cleanup();
            std::process::exit(3);
        })
        .expect("spawn the watchdog");
}
