//! The web console's journey in real browsers (`tests/browser/journey.mjs`,
//! driven by playwright-core) against this build's `automesh dev`: Debian's
//! chromium, and Debian's firefox-esr over WebDriver BiDi. Screenshots of
//! each page land in `target/browser-artifacts/<browser>/`.
//!
//! They need `node`, `tests/browser/node_modules` (`npm ci --prefix
//! tests/browser`), `/usr/bin/chromium` (or `AUTOMESH_CHROMIUM`) and
//! `/usr/bin/firefox-esr` (or `AUTOMESH_FIREFOX`); `.ci/run` and
//! `scripts/test` install them. Without them a test fails, saying what is
//! missing: it never skips.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn the_console_journey_in_chromium() {
    journey(
        "chromium",
        "AUTOMESH_CHROMIUM",
        "/usr/bin/chromium",
        "chromium",
    );
}

#[test]
fn the_console_journey_in_firefox() {
    journey(
        "firefox",
        "AUTOMESH_FIREFOX",
        "/usr/bin/firefox-esr",
        "firefox-esr",
    );
}

/// Runs the journey in `browser` (the executable `variable` names, or
/// `default`; Debian's package `package`).
fn journey(browser: &str, variable: &str, default: &str, package: &str) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = root.join("tests/browser");
    assert!(
        dir.join("node_modules/playwright-core").is_dir(),
        "playwright-core is not installed: run `npm ci --prefix tests/browser` (scripts/test does)"
    );
    let executable = std::env::var(variable).unwrap_or_else(|_| default.into());
    assert!(
        std::path::Path::new(&executable).exists(),
        "no browser at {executable}: apt-get install {package} (.ci/run does), or set {variable}"
    );
    let mut child = Command::new("node")
        .arg("journey.mjs")
        .current_dir(&dir)
        .env("AUTOMESH_BIN", env!("CARGO_BIN_EXE_automesh"))
        .env("AUTOMESH_BROWSER", browser)
        .env(variable, &executable)
        .env(
            "AUTOMESH_BROWSER_ARTIFACTS",
            root.join("target/browser-artifacts"),
        )
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("node is needed for the browser test (apt-get install nodejs)");
    // Bounded: the journey's own waits are 30–90 s each.
    let give_up = Instant::now() + Duration::from_secs(600);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > give_up {
            let _ = child.kill();
            panic!("the {browser} journey did not finish within 600 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        status.success(),
        "the {browser} journey failed ({status}); see its output above"
    );
}
