//! `automesh ctl`: the public API for people.

mod args;
use args::{CtlCommand, SurfaceArg};
mod owners;
mod print;
mod webhooks;

use std::time::Duration;

use anyhow::Context;
use automesh_edge::convert;
use automesh_proto::v1 as pb;
use automesh_proto::v1::automations_client::AutomationsClient;
use automesh_proto::v1::runs_client::RunsClient;
use clap::Args;
use tokio_stream::StreamExt;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use print::{
    automation_state, is_terminal, placement, print_automation, print_event, print_receipt,
    print_run, print_state, run_state,
};

#[derive(Debug, Args)]
pub struct CtlArgs {
    /// The public gateway.
    #[arg(
        long,
        env = "AUTOMESH_ADDR",
        default_value = "http://127.0.0.1:50051",
        global = true
    )]
    addr: String,
    /// Bearer token; defaults to AUTOMESH_TOKEN, then <data-dir>/dev-token.
    #[arg(long, env = "AUTOMESH_TOKEN", hide_env_values = true, global = true)]
    token: Option<automesh_domain::Secret>,
    #[command(flatten)]
    data_dir: crate::dev::DataDir,
    #[command(subcommand)]
    command: CtlCommand,
}

type Authed = InterceptedService<Channel, automesh_rpc::client::Bearer>;

/// A status as a person should read it: code, message, offending fields.
/// The gateway's answer, or its refusal explained.
fn answer<T>(answered: Result<tonic::Response<T>, tonic::Status>) -> anyhow::Result<T> {
    Ok(answered.map_err(explain)?.into_inner())
}

fn explain(status: tonic::Status) -> anyhow::Error {
    let violations = automesh_edge::status::field_violations(&status);
    if violations.is_empty() {
        return anyhow::anyhow!("{:?}: {}", status.code(), status.message());
    }
    let mut msg = format!("{:?}:", status.code());
    for (field, description) in violations {
        msg.push_str(&format!("\n  {field}: {description}"));
    }
    anyhow::anyhow!(msg)
}

fn token(args: &CtlArgs) -> anyhow::Result<String> {
    if let Some(t) = &args.token {
        return Ok(t.expose().to_owned());
    }
    let path = args.data_dir.path.join("dev-token");
    std::fs::read_to_string(&path)
        .map(|t| t.trim().to_owned())
        .with_context(|| {
            format!(
                "no token: pass --token, set AUTOMESH_TOKEN, or start `automesh dev` (which writes {})",
                path.display()
            )
        })
}

fn ts(t: &Option<prost_types::Timestamp>) -> String {
    t.as_ref()
        .and_then(convert::from_timestamp)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        .unwrap_or_else(|| "-".into())
}

pub async fn run(args: CtlArgs) -> anyhow::Result<()> {
    if let CtlCommand::Token { user, org, hours } = &args.command {
        let path = args.data_dir.path.join("jwt-secret");
        let secret = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "minting needs the dev mesh's signing key at {}",
                path.display()
            )
        })?;
        let token = automesh_gateway::mint(
            secret.trim().as_bytes(),
            org,
            user,
            chrono::Duration::hours(*hours),
        )?;
        println!("{token}");
        return Ok(());
    }
    let token = token(&args)?;
    anyhow::ensure!(
        format!("Bearer {token}")
            .parse::<MetadataValue<Ascii>>()
            .is_ok(),
        "the token is not valid ASCII"
    );
    let bearer = automesh_rpc::client::Bearer::new(&token).with_timeout(Duration::from_secs(30));
    let channel = automesh_rpc::client::channel(&args.addr)?;
    let authed: Authed = InterceptedService::new(channel, bearer);
    let mut automations = AutomationsClient::new(authed.clone());
    let mut runs = RunsClient::new(authed.clone());

    match args.command {
        CtlCommand::Create {
            name,
            prompt,
            model,
            surface,
            schedule,
            pause_after_failures,
            max_cost_micros,
            max_tokens,
            monthly_budget_micros,
        } => {
            let surface = match surface {
                SurfaceArg::Desktop => pb::Surface::Desktop,
                SurfaceArg::Web => pb::Surface::Web,
                SurfaceArg::CloudChat => pb::Surface::CloudChat,
            };
            let schedule = schedule
                .to_pb()?
                .context("a schedule is required: --once, --daily or --weekly")?;
            let created = automations
                .create_automation(pb::CreateAutomationRequest {
                    automation: Some(pb::Automation {
                        name,
                        prompt,
                        model,
                        schedule: Some(schedule),
                        pause_after_failures,
                        max_cost_micros,
                        max_tokens,
                        monthly_budget_micros,
                        ..Default::default()
                    }),
                    surface: surface as i32,
                })
                .await;
            print_automation(answer(created)?.automation);
        }
        CtlCommand::List { all } => {
            let mut token = String::new();
            println!(
                "{:<36}  {:<15}  {:<7}  {:<20}  NAME",
                "ID", "STATE", "PLACE", "NEXT RUN"
            );
            loop {
                let page = automations
                    .list_automations(pb::ListAutomationsRequest {
                        page_size: 100,
                        page_token: token,
                        show_archived: all,
                    })
                    .await
                    .map_err(explain)?
                    .into_inner();
                for a in &page.automations {
                    let (state, place) = (automation_state(a.state), placement(a.placement));
                    println!(
                        "{:<36}  {:<15}  {:<7}  {:<20}  {}",
                        a.id,
                        state,
                        place,
                        ts(&a.next_run_time),
                        a.name
                    );
                }
                if page.next_page_token.is_empty() {
                    break;
                }
                token = page.next_page_token;
            }
        }
        CtlCommand::Get { id } => {
            let got = automations.get_automation(pb::GetAutomationRequest { id });
            print_automation(answer(got.await)?.automation);
        }
        CtlCommand::Update {
            id,
            name,
            prompt,
            model,
            schedule,
            pause_after_failures,
            max_cost_micros,
            max_tokens,
            monthly_budget_micros,
            etag,
        } => {
            let mut paths = vec![];
            let schedule = schedule.to_pb()?;
            if name.is_some() {
                paths.push("name".to_owned());
            }
            if prompt.is_some() {
                paths.push("prompt".to_owned());
            }
            if model.is_some() {
                paths.push("model".to_owned());
            }
            if schedule.is_some() {
                paths.push("schedule".to_owned());
            }
            if pause_after_failures.is_some() {
                paths.push("pause_after_failures".to_owned());
            }
            if max_cost_micros.is_some() {
                paths.push("max_cost_micros".to_owned());
            }
            if max_tokens.is_some() {
                paths.push("max_tokens".to_owned());
            }
            if monthly_budget_micros.is_some() {
                paths.push("monthly_budget_micros".to_owned());
            }
            anyhow::ensure!(
                !paths.is_empty(),
                "nothing to update: pass --name, --prompt, --model, a schedule, --pause-after-failures, --max-cost-micros, --max-tokens or --monthly-budget-micros"
            );
            let updated = automations
                .update_automation(pb::UpdateAutomationRequest {
                    automation: Some(pb::Automation {
                        id,
                        name: name.unwrap_or_default(),
                        prompt: prompt.unwrap_or_default(),
                        model: model.unwrap_or_default(),
                        schedule,
                        pause_after_failures,
                        max_cost_micros: max_cost_micros.and_then(|c| c.0),
                        max_tokens: max_tokens.and_then(|c| c.0),
                        monthly_budget_micros: monthly_budget_micros.and_then(|c| c.0),
                        etag: etag.unwrap_or_default(),
                        ..Default::default()
                    }),
                    update_mask: Some(prost_types::FieldMask { paths }),
                })
                .await;
            print_automation(answer(updated)?.automation);
        }
        CtlCommand::Activate { ids } if ids.len() == 1 => {
            let request = pb::ActivateAutomationRequest {
                id: ids[0].clone(),
                etag: String::new(),
            };
            print_automation(answer(automations.activate_automation(request).await)?.automation);
        }
        CtlCommand::Activate { ids } => {
            let batch = pb::BatchActivateAutomationsRequest { ids };
            let results = automations.batch_activate_automations(batch).await;
            owners::print_results(answer(results)?.results)?;
        }
        CtlCommand::Deactivate { ids, reason } if ids.len() == 1 => {
            let deactivated = automations.deactivate_automation(pb::DeactivateAutomationRequest {
                id: ids[0].clone(),
                etag: String::new(),
                reason: reason.unwrap_or_default(),
            });
            print_automation(answer(deactivated.await)?.automation);
        }
        CtlCommand::Deactivate { ids, reason } => {
            let batch = pb::BatchDeactivateAutomationsRequest {
                ids,
                reason: reason.unwrap_or_default(),
            };
            let results = automations.batch_deactivate_automations(batch).await;
            owners::print_results(answer(results)?.results)?;
        }
        CtlCommand::Archive { id } => {
            let archive = pb::ArchiveAutomationRequest {
                id,
                ..Default::default()
            };
            let archived = answer(automations.archive_automation(archive).await)?;
            print_automation(archived.automation);
        }
        CtlCommand::RunNow { id, key } => {
            let key = key.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
            let r = automations
                .run_automation_now(pb::RunAutomationNowRequest {
                    id,
                    idempotency_key: key.clone(),
                })
                .await
                .map_err(explain)?;
            println!("idempotency key: {key}");
            print_run(r.into_inner().run);
        }
        CtlCommand::Runs {
            automation,
            limit,
            states,
            reasons,
            since,
            until,
        } => {
            let page = runs
                .list_runs(pb::ListRunsRequest {
                    automation_id: automation.unwrap_or_default(),
                    page_size: limit,
                    page_token: String::new(),
                    states,
                    created_after: since,
                    created_before: until,
                    error_codes: reasons,
                })
                .await
                .map_err(explain)?
                .into_inner();
            println!(
                "{:<36}  {:<10}  {:<20}  {:<22}  AUTOMATION",
                "RUN", "STATE", "CREATED", "ERROR"
            );
            for r in &page.runs {
                println!(
                    "{:<36}  {:<10}  {:<20}  {:<22}  {}",
                    r.id,
                    run_state(r.state),
                    ts(&r.create_time),
                    r.error_code,
                    r.automation_id
                );
            }
        }
        CtlCommand::Run { id } => {
            print_run(answer(runs.get_run(pb::GetRunRequest { id }).await)?.run)
        }
        CtlCommand::Cancel { id } => {
            let cancelled = runs.cancel_run(pb::CancelRunRequest { id }).await;
            print_run(answer(cancelled)?.run);
        }
        CtlCommand::Events { id, after } => {
            let mut after = after;
            loop {
                let page = runs
                    .list_run_events(pb::ListRunEventsRequest {
                        run_id: id.clone(),
                        after_sequence: after,
                        page_size: 500,
                    })
                    .await
                    .map_err(explain)?
                    .into_inner();
                page.events.iter().for_each(print_event);
                if page.events.is_empty() {
                    break;
                }
                after = page.last_sequence;
            }
        }
        CtlCommand::Watch { id, after } => {
            let mut stream = runs
                .watch_run(pb::WatchRunRequest {
                    run_id: id.clone(),
                    after_sequence: after,
                })
                .await
                .map_err(explain)?
                .into_inner();
            // The stream opens with the run as it is; a watch attached after
            // the end gets the terminal state before the events. The end is
            // printed last either way: after every event, then the receipt.
            let mut ended = None;
            while let Some(item) = stream.next().await {
                match item.map_err(explain)?.update {
                    Some(pb::watch_run_response::Update::Event(e)) => print_event(&e),
                    Some(pb::watch_run_response::Update::Run(r)) if is_terminal(r.state) => {
                        ended = Some(r);
                    }
                    Some(pb::watch_run_response::Update::Run(r)) => print_state(&r),
                    None => {}
                }
            }
            if let Some(r) = &ended {
                print_state(r);
            }
            // The stream ends after the terminal state: the receipt is there.
            let run = runs
                .get_run(pb::GetRunRequest { id })
                .await
                .map_err(explain)?
                .into_inner()
                .run
                .unwrap_or_default();
            if let Some(receipt) = &run.receipt {
                print_receipt(receipt);
            }
        }
        CtlCommand::RunnerToken { name } => {
            let r = automations
                .create_runner_token(pb::CreateRunnerTokenRequest { runner_name: name })
                .await
                .map_err(explain)?
                .into_inner();
            println!("runner id: {}", r.runner_id);
            println!("token (shown once): {}", r.token);
        }
        CtlCommand::RevokeRunner { runner_id } => {
            automations
                .revoke_runner_token(pb::RevokeRunnerTokenRequest {
                    runner_id: runner_id.clone(),
                })
                .await
                .map_err(explain)?;
            println!("runner {runner_id} revoked");
        }
        CtlCommand::Runners => owners::runners(&mut automations).await?,
        CtlCommand::Usage {
            automation,
            since,
            until,
            tz,
        } => owners::usage(&mut runs, automation, since, until, tz).await?,
        CtlCommand::Webhooks(command) => webhooks::run(authed, command).await?,
        CtlCommand::Token { .. } => unreachable!("handled above"),
    }
    Ok(())
}
