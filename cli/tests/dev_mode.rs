//! `automesh dev` as a real child process, driven by a client that knows
//! nothing but server reflection: grpcurl.
//!
//! grpcurl is found through `AUTOMESH_GRPCURL`, then `.tools/venv/bin/grpcurl`
//! (installed by `scripts/test`), then `PATH`. Without it the test fails: it
//! never skips.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

fn grpcurl() -> PathBuf {
    if let Ok(p) = std::env::var("AUTOMESH_GRPCURL") {
        return PathBuf::from(p);
    }
    let local = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/venv/bin/grpcurl");
    if local.exists() {
        return local;
    }
    let found = Command::new("sh")
        .args(["-c", "command -v grpcurl"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim().to_owned()));
    found.expect("grpcurl not found: run scripts/test once (it installs it into .tools/), or set AUTOMESH_GRPCURL")
}

struct Dev {
    child: Child,
    data_dir: PathBuf,
}

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.data_dir);
    }
}

fn grpc(tool: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(tool)
        .args(["-max-time", "20"])
        .args(args)
        .output()
        .expect("run grpcurl");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn json_field(json: &str, key: &str) -> String {
    let v: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("not JSON ({e}): {json}"));
    v.pointer(key)
        .and_then(|x| x.as_str())
        .unwrap_or_else(|| panic!("no {key} in {json}"))
        .to_owned()
}

#[test]
fn grpcurl_with_reflection_drives_the_dev_mesh() {
    let tool = grpcurl();
    let data_dir = std::env::temp_dir().join(format!("automesh-dev-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&data_dir);
    let mut child = Command::new(env!("CARGO_BIN_EXE_automesh"))
        .arg("dev")
        .arg("--data-dir")
        .arg(&data_dir)
        .args([
            "--gateway-listen",
            "127.0.0.1:0",
            "--runner-gateway-listen",
            "127.0.0.1:0",
            "--scheduler-listen",
            "127.0.0.1:0",
            "--coordinator-listen",
            "127.0.0.1:0",
            "--lifecycle-listen",
            "127.0.0.1:0",
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start automesh dev");
    let stdout = child.stdout.take().expect("stdout");
    let dev = Dev { child, data_dir };

    // Read the banner on a thread, so the wait for it is bounded.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut gateway = None;
    let mut token = None;
    let mut expect_token = false;
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("automesh dev printed `ready` within 60 s");
        if expect_token {
            token = Some(line.trim().to_owned());
            expect_token = false;
        } else if line.trim_start().starts_with("public gateway") {
            gateway = line
                .split_whitespace()
                .find(|w| w.starts_with("http://"))
                .map(|w| w.trim_start_matches("http://").to_owned());
        } else if line.starts_with("development token") {
            expect_token = true;
        } else if line.trim() == "ready" {
            break;
        }
    }
    let gateway = gateway.expect("gateway address printed");
    let token = token.expect("token printed");
    let on_disk = std::fs::read_to_string(dev.data_dir.join("dev-token")).expect("dev-token file");
    assert_eq!(on_disk.trim(), token);
    let auth = format!("authorization: Bearer {token}");

    let (ok, listing) = grpc(&tool, &["-plaintext", &gateway, "list"]);
    assert!(ok, "{listing}");
    for service in [
        "automesh.v1.Automations",
        "automesh.v1.Runs",
        "grpc.health.v1.Health",
    ] {
        assert!(
            listing.lines().any(|l| l.trim() == service),
            "{service} missing from:\n{listing}"
        );
    }

    let create = r#"{"automation":{"name":"from grpcurl","prompt":"say hello","model":"fake/echo",
        "schedule":{"daily":{"timeOfDay":{"hours":9,"minutes":15},"timeZone":"Europe/Paris"}}},
        "surface":"SURFACE_DESKTOP"}"#;
    let (ok, created) = grpc(
        &tool,
        &[
            "-plaintext",
            "-H",
            &auth,
            "-d",
            create,
            &gateway,
            "automesh.v1.Automations/CreateAutomation",
        ],
    );
    assert!(ok, "{created}");
    let id = json_field(&created, "/automation/id");
    let etag = json_field(&created, "/automation/etag");

    let (ok, listed) = grpc(
        &tool,
        &[
            "-plaintext",
            "-H",
            &auth,
            "-d",
            "{}",
            &gateway,
            "automesh.v1.Automations/ListAutomations",
        ],
    );
    assert!(ok, "{listed}");
    assert!(listed.contains(&id), "{listed}");

    let update = format!(
        r#"{{"automation":{{"id":"{id}","name":"renamed by grpcurl","etag":"{etag}"}},"updateMask":{{"paths":["name"]}}}}"#
    );
    let (ok, updated) = grpc(
        &tool,
        &[
            "-plaintext",
            "-H",
            &auth,
            "-d",
            &update,
            &gateway,
            "automesh.v1.Automations/UpdateAutomation",
        ],
    );
    assert!(ok, "{updated}");
    assert_eq!(
        json_field(&updated, "/automation/name"),
        "renamed by grpcurl"
    );

    // The same stale etag again: ABORTED, and grpcurl can read the status.
    let (ok, stale) = grpc(
        &tool,
        &[
            "-plaintext",
            "-H",
            &auth,
            "-d",
            &update,
            &gateway,
            "automesh.v1.Automations/UpdateAutomation",
        ],
    );
    assert!(!ok && stale.contains("Aborted"), "{stale}");
    // No token: UNAUTHENTICATED.
    let (ok, anonymous) = grpc(
        &tool,
        &[
            "-plaintext",
            "-d",
            "{}",
            &gateway,
            "automesh.v1.Automations/ListAutomations",
        ],
    );
    assert!(!ok && anonymous.contains("Unauthenticated"), "{anonymous}");

    // SIGTERM drains and exits on its own, bounded.
    let pid = dev.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill")
            .success()
    );
    let mut dev = dev;
    let started = std::time::Instant::now();
    loop {
        if let Some(status) = dev.child.try_wait().expect("wait") {
            assert!(status.success(), "automesh dev exited with {status}");
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "automesh dev did not stop within 30 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
