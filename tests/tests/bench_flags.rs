//! Every benchmark checks its command line before it starts anything:
//! `--help` explains it, and a flag it does not take or a value that is not
//! what a flag takes is refused naming it (exit status 2), never silently
//! replaced by a default.

use std::process::Command;

const BENCHES: [(&str, &str); 5] = [
    ("bench-lifecycle", env!("CARGO_BIN_EXE_bench-lifecycle")),
    ("bench-mesh", env!("CARGO_BIN_EXE_bench-mesh")),
    ("bench-desktop", env!("CARGO_BIN_EXE_bench-desktop")),
    ("bench-telemetry", env!("CARGO_BIN_EXE_bench-telemetry")),
    ("bench-console", env!("CARGO_BIN_EXE_bench-console")),
];

fn run(bin: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(bin)
        .args(args)
        .output()
        .expect("run benchmark");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn every_benchmark_explains_its_flags_and_refuses_bad_ones() {
    for (name, bin) in BENCHES {
        let (code, out, _) = run(bin, &["--help"]);
        assert_eq!(code, Some(0), "{name} --help");
        assert!(
            out.contains(&format!("Usage: {name}")) && out.contains("--quick"),
            "{name} --help lists its flags: {out}"
        );

        let (code, _, err) = run(bin, &["--no-such-flag"]);
        assert_eq!(code, Some(2), "{name} refuses an unknown flag");
        assert!(err.contains("--no-such-flag"), "{name} names it: {err}");

        let (code, _, err) = run(bin, &["--repeats", "three"]);
        let takes_repeats = !matches!(name, "bench-desktop" | "bench-console");
        assert_eq!(code, Some(2), "{name} refuses --repeats three");
        if takes_repeats {
            assert!(
                err.contains("--repeats takes a positive whole number, not \"three\""),
                "{name}: {err}"
            );
        }

        let (code, _, err) = run(bin, &["--quick", "--repeats"]);
        assert_eq!(code, Some(2), "{name} refuses a flag without its value");
        assert!(err.contains("--repeats"), "{name}: {err}");
    }
    let (code, _, err) = run(BENCHES[1].1, &["--runner-http2", "h2"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("one of lean, hyper"), "{err}");
}
