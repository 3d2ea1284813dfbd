//! The TypeScript example (`examples/typescript`), a web backend calling the
//! public gateway over gRPC with `@grpc/grpc-js`, built with `tsc` and run by
//! `run-against-dev.mjs` against this build's `automesh dev` on ephemeral
//! ports: it creates an automation, runs it now (twice with one idempotency
//! key), watches the run to its end and prints the receipt.
//!
//! It needs `node` and `examples/typescript/node_modules` (`npm ci --prefix
//! examples/typescript`); `scripts/test` installs them. Without them it
//! fails, saying what is missing: it never skips.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `command` to its end within `limit`, or kills it and fails naming
/// `what`.
fn run_bounded(what: &str, mut command: Command, limit: Duration) -> std::process::ExitStatus {
    let mut child = command
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "{what} could not start ({e}): node and npm are needed (apt-get install nodejs npm)"
            )
        });
    let give_up = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        if Instant::now() > give_up {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not finish within {} s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn the_typescript_example_runs_against_dev() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = root.join("examples/typescript");
    assert!(
        dir.join("node_modules/@grpc/grpc-js").is_dir(),
        "@grpc/grpc-js is not installed: run `npm ci --prefix examples/typescript` (scripts/test does)"
    );
    assert!(
        dir.join("node_modules/.bin/tsc").exists(),
        "typescript is not installed: run `npm ci --prefix examples/typescript` (scripts/test does)"
    );

    let mut build = Command::new("npm");
    build.args(["run", "--silent", "build"]).current_dir(&dir);
    let status = run_bounded("`npm run build` (tsc)", build, Duration::from_secs(300));
    assert!(
        status.success(),
        "the TypeScript example does not compile ({status}); see tsc's output above"
    );

    let mut example = Command::new("node");
    example
        .arg("run-against-dev.mjs")
        .current_dir(&dir)
        .env("AUTOMESH_BIN", env!("CARGO_BIN_EXE_automesh"));
    // Bounded: the script's own waits are 60 s for dev, 120 s for the
    // example and 15 s to stop dev.
    let status = run_bounded("run-against-dev.mjs", example, Duration::from_secs(300));
    assert!(
        status.success(),
        "the TypeScript example failed against automesh dev ({status}); see its output above"
    );
}
