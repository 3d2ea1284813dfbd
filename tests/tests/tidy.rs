//! Tidiness a reader relies on, checked over the whole workspace: every Rust
//! source file opens with a `//!` comment saying what it is for; no
//! production source file grows past 600 lines (a file that does is doing
//! more than one thing; split it along its seams); and UNAVAILABLE and
//! INTERNAL answers are built only in `crates/edge/src/status.rs`, the one
//! error edge (so a corrupt row can never be answered as retryable in one
//! service and not in another).

use std::path::{Path, PathBuf};

/// The longest a production source file may be.
const MAX_LINES: usize = 600;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace holds the tests crate")
        .to_owned()
}

/// Every `.rs` file below `dir`, skipping build output and tools.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if !matches!(name.as_ref(), "target" | ".tools" | ".git" | "node_modules") {
                sources(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

/// Test code: the tests crate, integration tests and benchmarks.
fn is_test_code(relative: &Path) -> bool {
    relative.starts_with("tests")
        || relative
            .components()
            .any(|c| matches!(c.as_os_str().to_str(), Some("tests" | "benches")))
}

#[test]
fn every_source_file_says_what_it_is_for_and_no_production_file_is_over_600_lines() {
    let root = workspace();
    let mut files = vec![];
    sources(&root, &mut files);
    assert!(files.len() > 50, "the workspace was not found at {root:?}");
    let mut undocumented = vec![];
    let mut too_long = vec![];
    for path in &files {
        let text = std::fs::read_to_string(path).expect("readable source");
        let relative = path.strip_prefix(&root).expect("below the root");
        if !text.starts_with("//!") {
            undocumented.push(relative.display().to_string());
        }
        let lines = text.lines().count();
        if !is_test_code(relative) && lines > MAX_LINES {
            too_long.push(format!("{} ({lines} lines)", relative.display()));
        }
    }
    assert!(
        undocumented.is_empty(),
        "files that do not open with a `//!` comment: {undocumented:#?}"
    );
    assert!(
        too_long.is_empty(),
        "production files over {MAX_LINES} lines: {too_long:#?}"
    );
}

#[test]
fn unavailable_and_internal_answers_are_built_only_at_the_error_edge() {
    let root = workspace();
    let mut files = vec![];
    sources(&root, &mut files);
    let edge = Path::new("crates/edge/src/status.rs");
    let mut elsewhere = vec![];
    for path in &files {
        let relative = path.strip_prefix(&root).expect("below the root");
        if is_test_code(relative) || relative == edge {
            continue;
        }
        let text = std::fs::read_to_string(path).expect("readable source");
        for (n, line) in text.lines().enumerate() {
            if line.contains("Status::unavailable(") || line.contains("Status::internal(") {
                elsewhere.push(format!("{}:{}: {}", relative.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        elsewhere.is_empty(),
        "build these through automesh_edge::status (failure, internal, unavailable, \
         shutting_down, connection_lost): {elsewhere:#?}"
    );
}

/// One rule for locks (issue 31, item 4): production code takes
/// `parking_lot` locks, which cannot poison, so no lock site chooses
/// between skipping its work, panicking and recovering the guard. A panic
/// while one is held (a bug) leaves the data as the panic left it, as a
/// recovered std guard would, and the next taker goes on.
#[test]
fn production_code_takes_locks_that_cannot_poison() {
    let root = workspace();
    let mut files = vec![];
    sources(&root, &mut files);
    let poisoning = names_a_poisoning_lock;
    let mut found = vec![];
    for path in &files {
        let relative = path.strip_prefix(&root).expect("below the root");
        if is_test_code(relative) {
            continue;
        }
        let text = std::fs::read_to_string(path).expect("readable source");
        for (n, line) in text.lines().enumerate() {
            if poisoning(line) {
                found.push(format!("{}:{}: {}", relative.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "take parking_lot::{{Mutex, RwLock}} instead of std's: {found:#?}"
    );
}

/// Whether `line` names one of std's poisoning locks.
fn names_a_poisoning_lock(line: &str) -> bool {
    if line.contains("PoisonError")
        || line.contains("std::sync::Mutex")
        || line.contains("std::sync::RwLock")
    {
        return true;
    }
    line.split_once("std::sync::{").is_some_and(|(_, rest)| {
        let names = rest.split('}').next().unwrap_or_default();
        names
            .split(',')
            .any(|n| matches!(n.trim(), "Mutex" | "RwLock" | "MutexGuard"))
    })
}

/// The engine runs inside a desktop runner and a worker agent, not a
/// server: it depends on the domain, the protobuf edge and telemetry, and
/// on none of the server side (`automesh-rpc`, `automesh-http2`, the
/// executor kit) — issue 31, item 3.
#[test]
fn the_engine_does_not_depend_on_the_server_side() {
    let manifest = std::fs::read_to_string(workspace().join("crates/engine/Cargo.toml"))
        .expect("the engine's manifest");
    let deps = manifest
        .split("[dependencies]")
        .nth(1)
        .and_then(|rest| rest.split("\n[").next())
        .expect("a [dependencies] table");
    for server in ["automesh-rpc", "automesh-http2", "automesh-executor"] {
        assert!(
            !deps.contains(server),
            "crates/engine must not depend on {server}"
        );
    }
}

/// ARCHITECTURE.md names only what is in the repo (issue 31, item 5):
/// every path it names in backticks — a token with a `/`, or a file name
/// with an extension — exists, from the root or from the directory of the
/// code-map section it is in (`### \`crates/store\`` reads `writer.rs` as
/// `crates/store/src/writer.rs`; a bare file name may be anywhere below
/// that directory). Placeholders (`<backend>`), globs, URLs
/// and the few protocol names that look like paths are not paths.
#[test]
fn every_path_architecture_md_names_exists() {
    let root = workspace();
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    // An MCP method and an npm package, not paths.
    let not_paths = ["tools/list", "@grpc/grpc-js"];
    let mut section = String::new();
    let mut missing = vec![];
    let mut named = 0;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("### `") {
            section = rest
                .split('`')
                .next()
                .unwrap_or_default()
                .trim_end_matches('/')
                .to_owned();
            continue;
        }
        if line.starts_with("## ") {
            section.clear();
        }
        for (i, token) in line.split('`').enumerate() {
            let is_file = [".rs", ".md", ".proto", ".yml", ".toml", ".mjs"]
                .iter()
                .any(|e| token.ends_with(e));
            if i % 2 == 0
                || token.contains(char::is_whitespace)
                || !(token.contains('/') || is_file)
                || token.contains(['<', '*', '{', ':', '(', '@'])
                || token.starts_with('/')
                || not_paths.contains(&token)
            {
                continue;
            }
            named += 1;
            let token = token.trim_end_matches('/');
            let mut candidates = vec![root.join(token)];
            if !section.is_empty() {
                candidates.push(root.join(&section).join(token));
                candidates.push(root.join(&section).join("src").join(token));
            }
            let bare = !token.contains('/');
            let below = if section.is_empty() {
                root.clone()
            } else {
                root.join(&section)
            };
            let found =
                candidates.iter().any(|c| c.exists()) || (bare && holds_file(&below, token));
            if !found {
                missing.push(format!("{token} (in section {section:?})"));
            }
        }
    }
    assert!(
        named > 50,
        "only {named} paths found: is the parsing broken?"
    );
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names paths that do not exist: {missing:#?}"
    );
}

/// Every invariant in ARCHITECTURE.md names the tests that prove it (issue
/// 31, item 5): each `**…**` paragraph of *Architecture invariants* names at
/// least one test after "Proved", and every test it names is a `fn` in the
/// workspace (a renamed or deleted test fails here, not silently).
#[test]
fn every_invariant_in_architecture_md_names_tests_that_exist() {
    let root = workspace();
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let invariants = text
        .split("## Architecture invariants")
        .nth(1)
        .expect("ARCHITECTURE.md has an *Architecture invariants* section");
    let mut files = vec![];
    sources(&root, &mut files);
    let code: String = files
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .collect();
    let mut checked = 0;
    let mut problems = vec![];
    for paragraph in invariants.split("\n\n").filter(|p| p.starts_with("**")) {
        let title = paragraph.split("**").nth(1).unwrap_or_default().to_owned();
        let Some(proof) = paragraph.split("Proved").nth(1) else {
            problems.push(format!("{title:?} names no test (no \"Proved by\")"));
            continue;
        };
        let tests: Vec<&str> = proof
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|t| {
                t.contains('_')
                    && t.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            })
            .collect();
        if tests.is_empty() {
            problems.push(format!("{title:?} names no test"));
        }
        for test in tests {
            checked += 1;
            if !code.contains(&format!("fn {test}(")) {
                problems.push(format!("{title:?} names `{test}`, which is no fn"));
            }
        }
    }
    assert!(
        checked > 30,
        "only {checked} tests named: is the parsing broken?"
    );
    assert!(problems.is_empty(), "{problems:#?}");
}

/// The store conformance suite reaches every public store function (issue
/// 31: "covers every public store function that writes"): each `pub fn` in
/// `crates/store/src` is called by a case in `crates/store/tests`, or is
/// named below as one that writes nothing a backend could get wrong. A new
/// public function must be given a case or a place here.
#[test]
fn every_public_store_function_is_reached_by_the_conformance_suite() {
    // Reads, wiring and serde, each with why no conformance case needs it.
    let exempt = [
        // Reads only (each backs a service's listing, gauge or pass).
        "cancelling_desktop_runs",
        "desktop_runs_for_runner",
        "get_runner",
        "last_run",
        "last_runs_of_page",
        "next_due_at",
        "next_token",
        "ready_workers",
        "receipts_of_run_page",
        "run_queue",
        "runners_revoked_since",
        "status_event_id",
        "usage_by_quarter_hour",
        "worker_endpoint",
        "workers_by_state",
        // Opening a store and its test databases (every case goes through them).
        "connect_and_migrate",
        "from_env",
        "from_url",
        "postgres",
        "postgres_admin_url",
        "sqlite",
        "readiness_probe",
        "close",
        // A test database's scan for a secret (tests of secrets use it).
        "tables_holding",
        // Counters and gauges of this process, no SQL.
        "observe_pool",
        "statements",
        "replayed",
        // Values without SQL: a cursor, a page's cut, a note's run id.
        "after",
        "cut",
        "run_id",
        // serde's derive-alike impls of the store's serde types.
        "serialize",
        "deserialize",
    ];
    let root = workspace();
    let mut files = vec![];
    sources(&root.join("crates/store/src"), &mut files);
    let mut public = std::collections::BTreeSet::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("a store source");
        for line in text.lines() {
            let line = line.trim_start();
            let rest = line
                .strip_prefix("pub async fn ")
                .or_else(|| line.strip_prefix("pub fn "));
            if let Some(name) = rest.and_then(|r| r.split(['(', '<']).next()) {
                public.insert(name.to_owned());
            }
        }
    }
    let mut tests = vec![];
    sources(&root.join("crates/store/tests"), &mut tests);
    let suite: String = tests
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .collect();
    let called = |name: &str| {
        suite
            .match_indices(name)
            .any(|(i, _)| suite[i + name.len()..].starts_with(['(', '<', ':']))
    };
    let unreached: Vec<&String> = public
        .iter()
        .filter(|name| !exempt.contains(&name.as_str()) && !called(name))
        .collect();
    assert!(
        public.len() > 80,
        "only {} found: is the parsing broken?",
        public.len()
    );
    assert!(
        unreached.is_empty(),
        "public store functions no conformance case calls: {unreached:#?}"
    );
    let stale: Vec<&&str> = exempt
        .iter()
        .filter(|name| !public.contains(**name))
        .collect();
    assert!(stale.is_empty(), "exempt, but no longer public: {stale:#?}");
}

/// Whether a file named `name` is anywhere below `dir` (build output and
/// tools skipped).
fn holds_file(dir: &Path, name: &str) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|entry| {
        let path = entry.path();
        let file = entry.file_name();
        if path.is_dir() {
            !matches!(
                file.to_str(),
                Some("target" | ".tools" | ".git" | "node_modules")
            ) && holds_file(&path, name)
        } else {
            file == name
        }
    })
}

/// Proto types never reach the store: the store crate does not even
/// depend on the generated protobuf code (handlers convert at the edge).
#[test]
fn the_store_does_not_depend_on_the_protos() {
    let manifest = std::fs::read_to_string(workspace().join("crates/store/Cargo.toml"))
        .expect("the store's manifest");
    assert!(
        !manifest.contains("automesh-proto"),
        "crates/store must not depend on automesh-proto"
    );
}

/// The console is a client of the public API: nothing it ships reaches the
/// database (its dev-dependencies start a mesh for its tests).
#[test]
fn the_console_does_not_depend_on_the_store() {
    let manifest = std::fs::read_to_string(workspace().join("console/Cargo.toml"))
        .expect("the console's manifest");
    let shipped = manifest
        .split("[dev-dependencies]")
        .next()
        .expect("the manifest before its dev-dependencies");
    for crate_name in ["automesh-store", "sqlx"] {
        assert!(
            !shipped.contains(crate_name),
            "console/ must not depend on {crate_name} outside its dev-dependencies"
        );
    }
}

#[test]
fn test_code_is_told_apart_from_production_code() {
    assert!(is_test_code(Path::new("tests/src/lib.rs")));
    assert!(is_test_code(Path::new("cli/tests/chaos.rs")));
    assert!(is_test_code(Path::new(
        "crates/engine/benches/engine_overhead.rs"
    )));
    assert!(!is_test_code(Path::new("crates/engine/src/native.rs")));
    assert!(!is_test_code(Path::new(
        "services/run-coordinator/src/drive/mod.rs"
    )));
}

/// One form for each write (issue 31, item 1): the store's statements are
/// written once for both backends. What still differs is named here, each
/// for a reason; a new backend-specific statement fails this test until it
/// is added with its reason (16 such statements before the bulk writes).
///
/// - `writer.rs` `LOCK_RUNS_PG`, `desktop/write.rs` `LOCK_ASSIGNMENTS_PG`,
///   `automations.rs` `LOCK_AUTOMATIONS_PG` (the automations whose runs a
///   batch ends, after its runs): a batch locks the rows it writes in one
///   order (SQLite has one writer and no row locks).
/// - `leases.rs` `CLAIM_PG`/`CLAIM_SQLITE`, `desktop/mod.rs` `CLAIM_PG`,
///   `scheduling.rs` `DUE_PG`: one shared text with PostgreSQL's row-lock
///   clause (`FOR UPDATE SKIP LOCKED`) appended.
/// - `scheduling.rs` `synchronous_commit = off` (a scheduling transaction)
///   and the same setting in `desktop/mod.rs` `CLAIM_PG` (a runner's
///   claim): they commit asynchronously, a PostgreSQL setting.
/// - `signal.rs` `pg_notify`: notifications are PostgreSQL's; SQLite's
///   are in-process.
///
/// Besides, a bulk statement's input relation is spelled per backend by
/// `bulk!` (in `sql.rs`) from the one field list, and nothing else builds
/// SQL with a macro: shared fragments are `const`s joined with `concatcp!`.
#[test]
fn the_stores_writes_take_one_form_for_both_backends() {
    let src = workspace().join("crates/store/src");
    let mut files = vec![];
    sources(&src, &mut files);
    let allowed_consts = [
        ("writer.rs", "LOCK_RUNS_PG"),
        ("desktop/write.rs", "LOCK_ASSIGNMENTS_PG"),
        ("automations.rs", "LOCK_AUTOMATIONS_PG"),
        ("leases.rs", "CLAIM_PG"),
        ("leases.rs", "CLAIM_SQLITE"),
        ("desktop/mod.rs", "CLAIM_PG"),
        ("scheduling.rs", "DUE_PG"),
    ];
    // The macros of the store: `bulk!` builds SQL; the rest bind and
    // decode values (`rows.rs`).
    let allowed_macros = [
        ("sql.rs", "bulk"),
        ("rows.rs", "params"),
        ("rows.rs", "plain"),
        ("rows.rs", "json"),
        ("rows.rs", "columns"),
        ("rows.rs", "named"),
    ];
    let mut consts = vec![];
    let mut macros = vec![];
    let mut stray = vec![];
    for path in &files {
        let relative = path.strip_prefix(&src).expect("below src");
        let name = relative.to_string_lossy().replace('\\', "/");
        let text = std::fs::read_to_string(path).expect("readable source");
        for (n, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            let declared = code
                .strip_prefix("const ")
                .or_else(|| code.split_once(") const ").map(|(_, rest)| rest));
            if let Some(rest) = declared {
                let ident = rest.split(':').next().unwrap_or_default().trim();
                // `Job::LOCK_PG` names one of the statements listed.
                let names_one = ident == "LOCK_PG";
                if !names_one && (ident.ends_with("_PG") || ident.ends_with("_SQLITE")) {
                    consts.push((name.clone(), ident.to_owned()));
                }
            }
            if let Some(rest) = code.strip_prefix("macro_rules! ") {
                let ident = rest.split([' ', '{']).next().unwrap_or_default();
                macros.push((name.clone(), ident.to_owned()));
            }
            let at = format!("{name}:{}: {}", n + 1, code);
            if code.contains("concat!(") {
                stray.push(format!("{at} (join SQL with concatcp!)"));
            }
            if code.contains("synchronous_commit")
                && !matches!(name.as_str(), "scheduling.rs" | "desktop/mod.rs")
            {
                stray.push(format!("{at} (a backend setting outside scheduling.rs)"));
            }
            if code.contains("pg_notify") && name != "signal.rs" {
                stray.push(format!("{at} (notify through signal::notify)"));
            }
        }
    }
    let named = |list: &[(&str, &str)]| -> Vec<(String, String)> {
        let mut list: Vec<_> = list
            .iter()
            .map(|(f, c)| ((*f).to_owned(), (*c).to_owned()))
            .collect();
        list.sort();
        list
    };
    consts.sort();
    macros.sort();
    assert_eq!(
        consts,
        named(&allowed_consts),
        "backend-specific statements of the store (see this test's docs)"
    );
    assert_eq!(
        macros,
        named(&allowed_macros),
        "macros of the store: only bulk! builds SQL"
    );
    assert!(stray.is_empty(), "{stray:#?}");
    // And no production code outside the store notifies by hand.
    let root = workspace();
    let mut all = vec![];
    sources(&root, &mut all);
    let notifying: Vec<_> = all
        .iter()
        .filter(|p| {
            let relative = p.strip_prefix(&root).expect("below the root");
            !is_test_code(relative)
                && !relative.ends_with("crates/store/src/signal.rs")
                && std::fs::read_to_string(p).is_ok_and(|t| t.contains("pg_notify"))
        })
        .collect();
    assert!(
        notifying.is_empty(),
        "pg_notify only in signal.rs: {notifying:?}"
    );
}
