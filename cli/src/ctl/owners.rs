//! What `ctl` shows owners beyond one automation: their runners, their
//! usage over a period, and what a batch change did to each automation.

use automesh_proto::v1 as pb;
use automesh_proto::v1::automations_client::AutomationsClient;
use automesh_proto::v1::runs_client::RunsClient;

use super::print::automation_state;
use super::{Authed, explain, ts};

/// Every runner of the caller: online or not, and when last seen.
pub(super) async fn runners(automations: &mut AutomationsClient<Authed>) -> anyhow::Result<()> {
    let listed = automations.list_runners(pb::ListRunnersRequest {}).await;
    let listed = listed.map_err(explain)?.into_inner();
    println!(
        "{:<38}  {:<9}  {:<22}  NAME",
        "RUNNER", "STATUS", "LAST SEEN"
    );
    for r in listed.runners {
        let status = if r.connected { "online" } else { "offline" };
        let seen = if r.last_seen_time.is_some() {
            ts(&r.last_seen_time)
        } else {
            "never".to_owned()
        };
        println!("{:<38}  {status:<9}  {seen:<22}  {}", r.runner_id, r.name);
    }
    Ok(())
}

/// The usage of the caller's runs (or one automation's) in a period, per
/// day of `tz`.
pub(super) async fn usage(
    runs: &mut RunsClient<Authed>,
    automation: Option<String>,
    since: Option<prost_types::Timestamp>,
    until: Option<prost_types::Timestamp>,
    tz: String,
) -> anyhow::Result<()> {
    let now = chrono::Utc::now();
    let at = |t: chrono::DateTime<chrono::Utc>| prost_types::Timestamp {
        seconds: t.timestamp(),
        nanos: 0,
    };
    let summary = runs
        .summarize_usage(pb::SummarizeUsageRequest {
            automation_id: automation.unwrap_or_default(),
            start_time: since.or_else(|| Some(at(now - chrono::Duration::days(30)))),
            end_time: until.or_else(|| Some(at(now + chrono::Duration::seconds(1)))),
            time_zone: tz,
        })
        .await
        .map_err(explain)?
        .into_inner();
    let total = summary.total.unwrap_or_default();
    println!(
        "{:<10}  {:>6}  {:>12}  {:>12}  {:>14}",
        "DAY", "RUNS", "INPUT", "OUTPUT", "COST (µ)"
    );
    for d in &summary.days {
        let u = d.usage.unwrap_or_default();
        if d.runs > 0 {
            println!(
                "{:<10}  {:>6}  {:>12}  {:>12}  {:>14}",
                d.date, d.runs, u.input_tokens, u.output_tokens, u.cost_micros
            );
        }
    }
    println!(
        "{:<10}  {:>6}  {:>12}  {:>12}  {:>14}   (days in {})",
        "total",
        summary.runs,
        total.input_tokens,
        total.output_tokens,
        total.cost_micros,
        summary.time_zone
    );
    Ok(())
}

/// Each automation of a batch and what became of it; an error when any
/// change failed.
pub(super) fn print_results(results: Vec<pb::AutomationResult>) -> anyhow::Result<()> {
    let mut failed = 0;
    for r in results {
        if r.code == 0 {
            let state = r.automation.map(|a| a.state).unwrap_or_default();
            println!("{}  {}", r.id, automation_state(state));
        } else {
            failed += 1;
            println!(
                "{}  not changed: {:?}: {}",
                r.id,
                tonic::Code::from(r.code),
                r.message
            );
        }
    }
    if failed > 0 {
        anyhow::bail!("{failed} automation(s) not changed");
    }
    Ok(())
}
