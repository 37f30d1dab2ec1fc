//! Finding the PostgreSQL server binaries (`initdb`, `postgres`, `pg_ctl`, `pg_isready`)
//! the way users' machines have them, and the user to run them as.
//!
//! Where: `$PG_BIN` if set; else `pg_config --bindir`; else the newest
//! `/usr/lib/postgresql/<version>/bin` (Debian and Ubuntu keep the server off PATH);
//! else PATH. A directory counts only if it has `initdb`: `pg_config` comes with the
//! client headers too, and may name a directory without the server.
//!
//! As whom: PostgreSQL refuses to run as root, so under root the tools run as the
//! `postgres` user; anyone else runs them as themselves.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The tool whose presence marks a directory as holding the server binaries.
const MARKER: &str = "initdb";

/// The server binaries found on this machine, and the user they run as.
#[derive(Clone, Debug)]
pub struct PgServer {
    /// The directory of the binaries; `None` when they are found through PATH.
    dir: Option<PathBuf>,
    /// `(uid, gid)` to switch to (when we are root), or `None` to run as ourselves.
    run_as: Option<(u32, u32)>,
}

impl PgServer {
    /// Find the binaries and the user, or say what is missing.
    pub fn find() -> Result<PgServer, String> {
        Ok(PgServer {
            dir: find_bin_dir()?,
            run_as: run_as()?,
        })
    }

    /// A command for one of the server's tools, set to run as the right user.
    pub fn command(&self, tool: &str) -> Command {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(self.path_of(tool));
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid).gid(gid);
        }
        cmd
    }

    /// The user's ids the cluster's files must belong to, when that is not ours.
    pub fn owner(&self) -> Option<(u32, u32)> {
        self.run_as
    }

    fn path_of(&self, tool: &str) -> PathBuf {
        match &self.dir {
            Some(dir) => dir.join(tool),
            None => PathBuf::from(tool),
        }
    }

    /// `postgres --version`, or empty if it cannot run.
    pub fn version(&self) -> String {
        Command::new(self.path_of("postgres"))
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    }
}

/// The binaries' directory (`None`: through PATH), in the order the module docs give.
fn find_bin_dir() -> Result<Option<PathBuf>, String> {
    if let Some(dir) = std::env::var_os("PG_BIN") {
        let dir = PathBuf::from(dir);
        return if has_server(&dir) {
            Ok(Some(dir))
        } else {
            Err(format!(
                "PG_BIN={} has no `{MARKER}`: point it at the PostgreSQL server binaries",
                dir.display()
            ))
        };
    }
    if let Some(dir) = pg_config_bindir().filter(|d| has_server(d)) {
        return Ok(Some(dir));
    }
    if let Some(dir) = newest_debian_bin_dir() {
        return Ok(Some(dir));
    }
    if on_path(MARKER) {
        return Ok(None);
    }
    Err(format!(
        "PostgreSQL server binaries not found: no `{MARKER}` in $PG_BIN (unset), \
         `pg_config --bindir`, /usr/lib/postgresql/*/bin or PATH. Install the PostgreSQL \
         server (e.g. the `postgresql` package) or set PG_BIN to the directory holding \
         `initdb` and `postgres`"
    ))
}

fn has_server(dir: &Path) -> bool {
    dir.join(MARKER).is_file()
}

fn pg_config_bindir() -> Option<PathBuf> {
    let out = Command::new("pg_config").arg("--bindir").output().ok()?;
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !dir.is_empty()).then(|| PathBuf::from(dir))
}

/// The newest `/usr/lib/postgresql/<version>/bin` with the server in it, by version
/// number (16 before 9.6).
fn newest_debian_bin_dir() -> Option<PathBuf> {
    let entries = std::fs::read_dir("/usr/lib/postgresql").ok()?;
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| Some((version_key(e.file_name().to_str()?)?, e.path().join("bin"))))
        .filter(|(_, bin)| has_server(bin))
        .max_by(|a, b| a.0.cmp(&b.0))
        .map(|(_, bin)| bin)
}

/// `"9.6"` → `[9, 6]`, `"16"` → `[16]`; `None` for a name that is not a version.
fn version_key(name: &str) -> Option<Vec<u32>> {
    name.split('.').map(|part| part.parse().ok()).collect()
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(tool).is_file()))
}

/// Root runs the server as `postgres` (PostgreSQL refuses root); others as themselves.
fn run_as() -> Result<Option<(u32, u32)>, String> {
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    let name = std::ffi::CString::new("postgres").unwrap();
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    if pw.is_null() {
        return Err(
            "running as root, and PostgreSQL refuses root: no `postgres` user to run the \
             server as (create one, or run as an ordinary user)"
                .into(),
        );
    }
    Ok(Some(unsafe { ((*pw).pw_uid, (*pw).pw_gid) }))
}

#[cfg(test)]
mod tests {
    use super::version_key;

    #[test]
    fn newer_major_versions_sort_after_older_ones() {
        let mut names = vec!["9.6", "16", "15", "10"];
        names.sort_by_key(|n| version_key(n));
        assert_eq!(names, ["9.6", "10", "15", "16"]);
        assert_eq!(version_key("main"), None);
    }
}
