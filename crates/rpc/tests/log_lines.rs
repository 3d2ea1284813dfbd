//! Log lines survive what sqlx does after every query: ask the `log` crate
//! whether a level is enabled (through `tracing-log`, a call to `enabled`
//! with no event after it). With per-layer filters that made the next log
//! line vanish whenever `RUST_LOG` enabled debug for any target
//! (tokio-rs/tracing#2519): "serving", "shutdown requested" and run log
//! lines were lost on PostgreSQL.
//!
//! The check runs in a child process of this test binary, started with
//! such a `RUST_LOG` (the environment of this process cannot be changed
//! safely), and installs that process's global subscriber.

use std::io::Write;
use std::sync::{Arc, Mutex};

const CHILD: &str = "AUTOMESH_LOG_LINES_CHILD";

#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_log_line_after_a_log_enabled_query_is_written() {
    if std::env::var_os(CHILD).is_some() {
        return child();
    }
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "a_log_line_after_a_log_enabled_query_is_written",
            "--nocapture",
        ])
        .env(CHILD, "1")
        // A debug directive for one target is what armed the bug.
        .env("RUST_LOG", "info,automesh_rpc=debug")
        .output()
        .expect("run the child");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn child() {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let _guard = runtime.enter();
    let lines = Lines::default();
    let sink = lines.clone();
    let _telemetry =
        automesh_rpc::telemetry::init_writing_to("automesh-log-test", move || sink.clone())
            .expect("telemetry");
    for i in 0..3 {
        tracing::info!(round = i, "before the query");
        // What sqlx's query logger asks after every statement.
        let _ = log::log_enabled!(target: "sqlx::query", log::Level::Debug);
        tracing::info!(round = i, "after the query");
    }
    let text = String::from_utf8_lossy(&lines.0.lock().expect("lock")).into_owned();
    for i in 0..3 {
        for what in ["before the query", "after the query"] {
            assert!(
                text.lines()
                    .any(|l| l.contains(what) && l.contains(&format!("round={i}"))),
                "{what} (round {i}) is missing from:\n{text}"
            );
        }
    }
}
