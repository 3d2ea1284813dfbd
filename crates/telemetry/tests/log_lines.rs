//! Log lines as the services write them, each check in a child process of
//! this test binary that installs that process's global subscriber as a
//! service does (the environment of this process cannot be changed safely).
//!
//! Log lines survive what sqlx does after every query: ask the `log` crate
//! whether a level is enabled (through `tracing-log`, a call to `enabled`
//! with no event after it). With per-layer filters that made the next log
//! line vanish whenever `RUST_LOG` enabled debug for any target
//! (tokio-rs/tracing#2519): "serving", "shutdown requested" and run log
//! lines were lost on PostgreSQL.
//!
//! JSON log lines name the trace of the span they were logged in — also
//! when that span is given explicitly (`parent: &span`) rather than entered:
//! how a loop or a stream says something about one run in the run's trace
//! (`propagation::run_span`), whatever span is current.

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

/// Runs `test` of this binary again in a child process with `env`; fails
/// with its output unless it passes.
fn in_child(test: &str, env: &[(&str, &str)]) {
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", test, "--nocapture"])
        .env(CHILD, "1")
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .output()
        .expect("run the child");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The process's logging as a service installs it, writing into `lines`.
fn install(lines: &Lines) -> (tokio::runtime::Runtime, automesh_telemetry::Telemetry) {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let sink = lines.clone();
    let telemetry = {
        let _guard = runtime.enter();
        automesh_telemetry::init_writing_to("automesh-log-test", move || sink.clone())
            .expect("telemetry")
    };
    (runtime, telemetry)
}

#[test]
fn a_log_line_after_a_log_enabled_query_is_written() {
    if std::env::var_os(CHILD).is_some() {
        return child();
    }
    // A debug directive for one target is what armed the bug.
    in_child(
        "a_log_line_after_a_log_enabled_query_is_written",
        &[("RUST_LOG", "info,automesh_rpc=debug")],
    );
}

fn child() {
    let lines = Lines::default();
    let (_runtime, _telemetry) = install(&lines);
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

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
const TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";

#[test]
fn a_json_line_logged_with_an_explicit_parent_names_the_parents_trace() {
    if std::env::var_os(CHILD).is_some() {
        return json_child();
    }
    in_child(
        "a_json_line_logged_with_an_explicit_parent_names_the_parents_trace",
        &[("AUTOMESH_LOG_FORMAT", "json")],
    );
}

fn json_child() {
    let lines = Lines::default();
    let (_runtime, _telemetry) = install(&lines);
    let run = automesh_telemetry::propagation::run_span("test.run", "run-1", Some(TRACEPARENT));
    let stream = tracing::info_span!("stream");
    {
        let _in_stream = stream.enter();
        tracing::info!(parent: &run, run_id = "run-1", "about the run, from a stream");
        tracing::info!("about the stream");
    }
    tracing::info!(parent: &run, run_id = "run-1", "about the run, outside any span");
    let text = String::from_utf8_lossy(&lines.0.lock().expect("lock")).into_owned();
    let line = |message: &str| -> serde_json::Value {
        let l = text
            .lines()
            .find(|l| l.contains(message))
            .unwrap_or_else(|| panic!("{message:?} missing from:\n{text}"));
        serde_json::from_str(l).expect("JSON")
    };
    for message in [
        "about the run, from a stream",
        "about the run, outside any span",
    ] {
        let l = line(message);
        assert_eq!(l["trace_id"], TRACE_ID, "{l}");
        assert!(l["span_id"].is_string(), "{l}");
        assert_eq!(l["span"]["run_id"], "run-1", "{l}");
    }
    let l = line("about the stream");
    assert_ne!(l["trace_id"], TRACE_ID, "{l}");
    assert_eq!(l["span"]["name"], "stream", "{l}");
}
