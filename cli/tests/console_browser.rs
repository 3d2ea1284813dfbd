//! The web console's journey in a real browser (Debian's chromium driven by
//! playwright-core, `tests/browser/journey.mjs`) against this build's
//! `automesh dev`. Screenshots of each page land in
//! `target/browser-artifacts/`.
//!
//! It needs `node`, `tests/browser/node_modules` (`npm ci --prefix
//! tests/browser`) and `/usr/bin/chromium` (or `AUTOMESH_CHROMIUM`);
//! `scripts/test` installs them. Without them it fails, saying what is
//! missing: it never skips.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn the_console_journey_in_a_real_browser() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = root.join("tests/browser");
    assert!(
        dir.join("node_modules/playwright-core").is_dir(),
        "playwright-core is not installed: run `npm ci --prefix tests/browser` (scripts/test does)"
    );
    let chromium =
        std::env::var("AUTOMESH_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(
        std::path::Path::new(&chromium).exists(),
        "no browser at {chromium}: apt-get install chromium (scripts/test does), or set AUTOMESH_CHROMIUM"
    );
    let mut child = Command::new("node")
        .arg("journey.mjs")
        .current_dir(&dir)
        .env("AUTOMESH_BIN", env!("CARGO_BIN_EXE_automesh"))
        .env("AUTOMESH_CHROMIUM", &chromium)
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
            panic!("the browser journey did not finish within 600 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        status.success(),
        "the browser journey failed ({status}); see its output above"
    );
}
