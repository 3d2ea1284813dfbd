//! Processes on this host, by pid: whether one lives, and signalling it. The
//! local-process worker driver stops agents another replica started this
//! way, and the crash tests kill and stall service processes with it.

use std::path::Path;
use std::time::Duration;

pub use rustix::process::Signal;

/// The file a long-lived child (a worker agent) keeps its pid in, inside its
/// working directory, so that any process on the host can find and stop it
/// (trusting the pid only while [`works_in`] holds).
pub const PID_FILE: &str = "agent.pid";

/// A crash point: when `AUTOMESH_FAILPOINTS` (comma separated) names
/// `name`, this process kills itself here with SIGKILL — nothing after this
/// point runs, nothing is flushed or cleaned up. Tests use it to lose a
/// service process at an exact point (right after a commit, say); unset, it
/// costs one comparison.
pub fn failpoint(name: &str) {
    static ARMED: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let armed = ARMED.get_or_init(|| {
        std::env::var("AUTOMESH_FAILPOINTS")
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    });
    if armed.iter().any(|a| a == name) {
        eprintln!("failpoint {name}: this process dies here (SIGKILL)");
        let _ = rustix::process::kill_process(rustix::process::getpid(), Signal::KILL);
    }
}

/// Sends `signal` to `pid`; false when there is no such process.
pub fn signal(pid: u32, signal: Signal) -> bool {
    let Some(pid) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
        return false;
    };
    rustix::process::kill_process(pid, signal).is_ok()
}

/// Whether `pid` is a live process (an exited one that its parent has not
/// reaped yet — a zombie — counts as gone).
pub fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `pid (comm) S …`: the state follows the last parenthesis.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next());
    !matches!(state, None | Some('Z' | 'X' | 'x'))
}

/// Whether `pid` runs with `dir` as its working directory: how a pid read
/// from a file is told apart from an unrelated process that reused it.
pub fn works_in(pid: u32, dir: &Path) -> bool {
    let Ok(cwd) = std::fs::read_link(format!("/proc/{pid}/cwd")) else {
        return false;
    };
    let want = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    cwd == want
}

/// Every live process working in `dir` (a worker's agent, and whatever
/// started it — a wrapper that has not exec'd it yet, say).
pub fn working_in(dir: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    let me = std::process::id();
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != me && alive(*pid) && works_in(*pid, dir))
        .collect()
}

/// Stops `pid`: SIGTERM, then SIGKILL if it still lives after `grace`.
/// Returns once it is gone, or after a bounded wait for the SIGKILL.
pub async fn terminate(pid: u32, grace: Duration) -> bool {
    if !alive(pid) {
        return true;
    }
    signal(pid, Signal::TERM);
    if gone_within(pid, grace).await {
        return true;
    }
    tracing::warn!(pid, "process did not stop on SIGTERM; killing it");
    signal(pid, Signal::KILL);
    gone_within(pid, Duration::from_secs(5)).await
}

/// Waits (bounded) until `pid` is gone.
pub async fn gone_within(pid: u32, within: Duration) -> bool {
    let give_up = tokio::time::Instant::now() + within;
    loop {
        if !alive(pid) {
            return true;
        }
        if tokio::time::Instant::now() >= give_up {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_child_is_seen_alive_then_terminated() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let pid = child.id();
        assert!(alive(pid));
        assert!(works_in(pid, &std::env::current_dir().expect("cwd")));
        assert!(working_in(&std::env::current_dir().expect("cwd")).contains(&pid));
        assert!(!works_in(pid, Path::new("/nonexistent")));
        // Reaped concurrently, as a parent's reaper task would.
        let reaper = std::thread::spawn(move || child.wait());
        assert!(terminate(pid, Duration::from_secs(5)).await);
        assert!(!reaper.join().expect("join").expect("wait").success());
        assert!(!alive(pid));
        assert!(!signal(pid, Signal::TERM) || !alive(pid));
    }
}
