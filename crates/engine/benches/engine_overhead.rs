//! The native engine's own overhead per step, beside the round trips it
//! cannot avoid, all measured in the same run:
//!
//!   cargo bench -p automesh-engine --bench engine_overhead
//!   cargo bench --profile dev -p automesh-engine --bench engine_overhead -- --quick
//!
//! `--quick` is the short form CI runs once (5 steps, one repeat; figures
//! printed, not checked).
//!
//! Baselines: a bare HTTP POST of the same request to the same fake provider,
//! and a bare MCP tool call on an open session. Overhead per step = the
//! loop's time per step minus both. Medians over repeats; read the ratio.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use automesh_engine::adapter::Ending;
use automesh_engine::connect::{Connect, ConnectConfig};
use automesh_engine::native::{self, NativeRun};
use automesh_engine::provider::ProviderConfig;
use common::{FakeMcp, Reply, mcp, provider, text_completion, tool_call_completion};
use tokio_util::sync::CancellationToken;

/// Steps per run, and runs measured (fewer under `--quick`).
fn sizes() -> (u32, usize) {
    if std::env::args().any(|a| a == "--quick") {
        (5, 1)
    } else {
        (30, 7)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (steps, repeats) = sizes();
    let (purl, _p) = provider(move |_, body| {
        let tools = body["messages"]
            .as_array()
            .map_or(0, |m| m.iter().filter(|m| m["role"] == "tool").count());
        Reply::Json(if tools + 1 >= steps as usize {
            text_completion("done")
        } else {
            tool_call_completion(
                &format!("c{tools}"),
                "search_capabilities",
                r#"{"query":"x"}"#,
            )
        })
    })
    .await;
    let (murl, _stop) = mcp(
        FakeMcp::with_tools(&["search_capabilities", "execute_capability"]),
        "bench-token",
    )
    .await;
    let connect = ConnectConfig {
        url: murl.clone(),
        token: "bench-token".into(),
        call_timeout: Duration::from_secs(10),
    };

    // Baseline 1: a bare POST of a request like the loop's, to the same server.
    let http = reqwest::Client::new();
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
    let mut post = vec![];
    for _ in 0..200 {
        let t = Instant::now();
        let r = http
            .post(format!("{purl}/chat/completions"))
            .bearer_auth("k")
            .json(&body)
            .send()
            .await
            .expect("post");
        let _ = r.bytes().await.expect("body");
        post.push(t.elapsed().as_secs_f64() * 1e6);
    }
    // Baseline 2: a bare tool call on an open MCP session.
    let session = Connect::open(&connect).await.expect("connect");
    let mut tool = vec![];
    for _ in 0..200 {
        let t = Instant::now();
        session
            .call("search_capabilities", r#"{"query":"x"}"#)
            .await
            .expect("call");
        tool.push(t.elapsed().as_secs_f64() * 1e6);
    }
    session.close().await;
    let (post, tool) = (median(post), median(tool));

    let mut per_step = vec![];
    for _ in 0..repeats {
        let run = NativeRun {
            model: "m".into(),
            prompt: "bench".into(),
            guidance: None,
            provider: ProviderConfig {
                kind: "openai-compatible".into(),
                base_url: purl.clone(),
                api_key: "k".into(),
                request_timeout: Duration::from_secs(10),
                stream: false,
            },
            connect: connect.clone(),
            connect_token_expires_at: None,
            model_authorized: true,
            max_steps: steps + 1,
            deadline: tokio::time::Instant::now() + Duration::from_secs(60),
            resume_from: None,
            budget: Default::default(),
            price: None,
        };
        let (tx, mut rx) = tokio::sync::mpsc::channel(1024);
        let drain = tokio::spawn(async move { while rx.recv().await.is_some() {} });
        let t = Instant::now();
        let outcome = native::run(run, tx, CancellationToken::new()).await;
        let elapsed = t.elapsed().as_secs_f64() * 1e6;
        drain.await.expect("drain");
        assert!(
            matches!(outcome.ending, Ending::Succeeded { .. }),
            "{:?}",
            outcome.ending
        );
        // Steps with a tool call cost a model call and a tool call; the last
        // only a model call. Spread the one-off admission over the steps.
        per_step.push(elapsed / f64::from(outcome.steps));
    }
    let per_step = median(per_step);
    let unavoidable = post + tool * f64::from(steps - 1) / f64::from(steps);
    println!("native engine, {steps} steps per run, median of {repeats} runs");
    println!("baseline  bare provider POST round trip        {post:>8.0} µs");
    println!("baseline  bare MCP tool call round trip        {tool:>8.0} µs");
    println!("loop      time per step                        {per_step:>8.0} µs");
    println!(
        "engine    own overhead per step                {:>8.0} µs   ({:.2} × the unavoidable round trips)",
        per_step - unavoidable,
        (per_step - unavoidable) / unavoidable
    );
}
