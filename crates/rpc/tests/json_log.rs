//! JSON log lines name the trace of the span they were logged in — also when
//! that span is given explicitly (`parent: &span`) rather than entered: how
//! a loop or a stream says something about one run in the run's trace
//! (`propagation::run_span`), whatever span is current.
//!
//! The check runs in a child process of this test binary, which installs
//! the process's global subscriber as a service does
//! (`AUTOMESH_LOG_FORMAT=json`).

use std::io::Write;
use std::sync::{Arc, Mutex};

const CHILD: &str = "AUTOMESH_JSON_LOG_CHILD";
const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
const TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";

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
fn a_line_logged_with_an_explicit_parent_names_the_parents_trace() {
    if std::env::var_os(CHILD).is_some() {
        return child();
    }
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "a_line_logged_with_an_explicit_parent_names_the_parents_trace",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .env("AUTOMESH_LOG_FORMAT", "json")
        .env_remove("RUST_LOG")
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
        automesh_rpc::telemetry::init_writing_to("automesh-json-log-test", move || sink.clone())
            .expect("telemetry");
    let run = automesh_rpc::propagation::run_span("test.run", "run-1", Some(TRACEPARENT));
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
