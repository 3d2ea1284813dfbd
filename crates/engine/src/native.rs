//! The native engine's loop: model call → tool calls → tool results, up to a
//! bounded number of steps, with token usage per step, an event per
//! assistant message, tool call and tool result, and a transcript checkpoint
//! at every step boundary that a reattached run can resume from.
//!
//! Nothing here holds a credential beyond the two configs; events, the
//! checkpoint and errors never contain one.

use std::time::Duration;

use automesh_domain::{ErrorCode, Usage};
use chrono::{DateTime, Utc};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::adapter::{Checkpoint, Ending, EngineEvent, Outcome};
use crate::connect::{Connect, ConnectConfig, REVIEWED_TOOLS};
use crate::provider::{ChatRequest, Message, Provider, ProviderConfig};
use automesh_domain::CodedError;

/// The default bound on model calls per run.
pub const DEFAULT_MAX_STEPS: u32 = 32;

/// One native run.
#[derive(Debug, Clone)]
pub struct NativeRun {
    /// The model name the provider is asked for.
    pub model: String,
    pub prompt: String,
    /// Runtime guidance (where the agent runs, what it may do).
    pub guidance: Option<String>,
    pub provider: ProviderConfig,
    pub connect: ConnectConfig,
    /// When the Connect token stops being valid.
    pub connect_token_expires_at: Option<DateTime<Utc>>,
    /// Whether the model is authorised for the owner (checked by the caller
    /// against its catalogue; a run refuses to start otherwise).
    pub model_authorized: bool,
    pub max_steps: u32,
    pub deadline: Instant,
    /// Resume from here instead of from the prompt.
    pub resume_from: Option<Checkpoint>,
    /// What the run may spend, checked after every step.
    pub budget: automesh_domain::RunBudget,
    /// The price its cost is counted at.
    pub price: Option<automesh_domain::Price>,
}

fn token_expired(at: Option<DateTime<Utc>>) -> bool {
    at.is_some_and(|t| t <= Utc::now())
}

/// Runs the loop to its end. Cancelling `cancel` (or reaching the
/// deadline) drops whatever request is in flight.
pub async fn run(
    run: NativeRun,
    events: mpsc::Sender<EngineEvent>,
    cancel: CancellationToken,
) -> Outcome {
    let mut usage = run
        .resume_from
        .as_ref()
        .map(|c| c.usage)
        .unwrap_or_default();
    let mut steps = run.resume_from.as_ref().map_or(0, |c| c.step);
    let ending = drive(&run, &events, &cancel, &mut usage, &mut steps).await;
    Outcome {
        ending,
        usage,
        steps,
    }
}

enum Interrupt {
    Cancelled,
    Deadline,
}

/// Races `f` against cancellation and the deadline.
async fn bounded<T>(
    f: impl std::future::Future<Output = T>,
    cancel: &CancellationToken,
    deadline: Instant,
) -> Result<T, Interrupt> {
    tokio::select! {
        biased;
        () = cancel.cancelled() => Err(Interrupt::Cancelled),
        () = tokio::time::sleep_until(deadline) => Err(Interrupt::Deadline),
        v = f => Ok(v),
    }
}

fn interrupted(i: Interrupt) -> Ending {
    match i {
        Interrupt::Cancelled => Ending::Cancelled,
        Interrupt::Deadline => Ending::Failed(CodedError::new(
            ErrorCode::DeadlineExceeded,
            "the run reached its deadline",
        )),
    }
}

async fn drive(
    run: &NativeRun,
    events: &mpsc::Sender<EngineEvent>,
    cancel: &CancellationToken,
    usage: &mut Usage,
    steps: &mut u32,
) -> Ending {
    // Authority and token expiry before anything starts.
    if !run.model_authorized {
        return Ending::Failed(CodedError::new(
            ErrorCode::ModelNotAuthorized,
            format!("model {} is not authorised for the owner", run.model),
        ));
    }
    if let Some(expired) = expired_token(run, "before the run started") {
        return expired;
    }
    let provider = match Provider::new(run.provider.clone()) {
        Ok(p) => p,
        Err(e) => return Ending::Failed(e),
    };
    // Admission: the tool inventory is checked before the provider is called.
    let connect = match bounded(Connect::open(&run.connect), cancel, run.deadline).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Ending::Failed(e),
        Err(i) => return interrupted(i),
    };
    let ending = steps_loop(run, &provider, &connect, events, cancel, usage, steps).await;
    connect.close().await;
    ending
}

/// The run's end when its Connect token has expired (`when`, in words).
fn expired_token(run: &NativeRun, when: &str) -> Option<Ending> {
    token_expired(run.connect_token_expires_at).then(|| {
        let message = format!("the run's Connect token expired {when}");
        Ending::Failed(CodedError::new(ErrorCode::ConnectTokenExpired, message))
    })
}

async fn emit(events: &mpsc::Sender<EngineEvent>, e: EngineEvent) {
    // A consumer that went away does not stop the run; its end is recorded.
    let _ = tokio::time::timeout(Duration::from_secs(10), events.send(e)).await;
}

async fn steps_loop(
    run: &NativeRun,
    provider: &Provider,
    connect: &Connect,
    events: &mpsc::Sender<EngineEvent>,
    cancel: &CancellationToken,
    usage: &mut Usage,
    steps: &mut u32,
) -> Ending {
    let mut messages = match &run.resume_from {
        Some(c) => c.messages.clone(),
        None => {
            let mut m = vec![];
            if let Some(g) = &run.guidance {
                m.push(Message::system(g.clone()));
            }
            m.push(Message::user(run.prompt.clone()));
            m
        }
    };
    loop {
        if *steps >= run.max_steps {
            return Ending::Failed(CodedError::new(
                ErrorCode::StepLimitExceeded,
                format!("the loop reached its limit of {} steps", run.max_steps),
            ));
        }
        if let Some(expired) = expired_token(run, "during the run") {
            return expired;
        }
        *steps += 1;
        let step = *steps;
        let request = ChatRequest {
            model: run.model.clone(),
            messages: messages.clone(),
            tools: connect.tools().to_vec(),
        };
        // A CLIENT span under the OpenTelemetry GenAI conventions.
        let (address, port) = provider.server();
        let span = tracing::info_span!(
            "gen_ai.chat",
            otel.name = %format!("chat {}", run.model),
            otel.kind = "client",
            otel.status_code = tracing::field::Empty,
            gen_ai.operation.name = "chat",
            gen_ai.provider.name = "openai",
            gen_ai.request.model = %run.model,
            gen_ai.response.model = tracing::field::Empty,
            gen_ai.response.id = tracing::field::Empty,
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            gen_ai.response.finish_reasons = tracing::field::Empty,
            server.address = %address,
            server.port = port,
            error.type = tracing::field::Empty,
            step,
        );
        let called = std::time::Instant::now();
        let response = match bounded(
            provider
                .complete(&request, run.deadline)
                .instrument(span.clone()),
            cancel,
            run.deadline,
        )
        .await
        {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                failed_span(&span, e.code);
                crate::metrics::metrics().operation(
                    "chat",
                    &run.model,
                    called.elapsed(),
                    Some(e.code.as_str()),
                );
                return Ending::Failed(e);
            }
            Err(i) => return interrupted(i),
        };
        if let Some(m) = &response.model {
            span.record("gen_ai.response.model", m.as_str());
        }
        if let Some(id) = &response.id {
            span.record("gen_ai.response.id", id.as_str());
        }
        let m = crate::metrics::metrics();
        m.operation("chat", &run.model, called.elapsed(), None);
        m.tokens(
            &run.model,
            response.usage.prompt_tokens,
            response.usage.completion_tokens,
        );
        span.record("gen_ai.usage.input_tokens", response.usage.prompt_tokens);
        span.record(
            "gen_ai.usage.output_tokens",
            response.usage.completion_tokens,
        );
        if let Some(r) = &response.finish_reason {
            span.record("gen_ai.response.finish_reasons", r.as_str());
        }
        let step_usage = Usage {
            input_tokens: response.usage.prompt_tokens,
            output_tokens: response.usage.completion_tokens,
            // Priced by the run-coordinator from the catalogue: an engine
            // knows tokens, not prices.
            cost_micros: 0,
        };
        usage.input_tokens += step_usage.input_tokens;
        usage.output_tokens += step_usage.output_tokens;
        usage.cost_micros += step_usage.cost_micros;
        emit(
            events,
            EngineEvent::Usage {
                step,
                usage: step_usage,
            },
        )
        .await;
        if let Some(text) = response.content.as_ref().filter(|t| !t.is_empty()) {
            emit(
                events,
                EngineEvent::AssistantText {
                    step,
                    text: text.clone(),
                },
            )
            .await;
        }
        // The step boundary: a run over its budget stops here, before any
        // tool acts on this step's calls and before the provider is asked
        // again.
        if let Some(over) = run.budget.exceeded(usage, run.price) {
            tracing::warn!(step, error_code = over.code.as_str(), "{}", over.message);
            return Ending::Failed(CodedError::new(
                over.code,
                format!("{} after step {step}", over.message),
            ));
        }
        messages.push(Message {
            role: "assistant".into(),
            content: response.content.clone(),
            tool_calls: response.tool_calls.clone(),
            tool_call_id: None,
        });
        if response.tool_calls.is_empty() {
            return Ending::Succeeded {
                answer: response.content.unwrap_or_default(),
            };
        }
        for call in &response.tool_calls {
            let name = call.function.name.as_str();
            emit(
                events,
                EngineEvent::ToolCall {
                    step,
                    call_id: call.id.clone(),
                    tool: name.to_owned(),
                    input_json: call.function.arguments.clone(),
                },
            )
            .await;
            let (output, is_error) = if !REVIEWED_TOOLS.contains(&name) {
                tracing::warn!(
                    tool = name,
                    "the model called a tool outside the reviewed pair; refused"
                );
                (
                    format!(
                        "tool {name:?} is not available; use search_capabilities or execute_capability"
                    ),
                    true,
                )
            } else {
                let (address, port) = connect.server();
                let span = tracing::info_span!(
                    "gen_ai.execute_tool",
                    otel.name = %format!("execute_tool {name}"),
                    otel.kind = "client",
                    otel.status_code = tracing::field::Empty,
                    gen_ai.operation.name = "execute_tool",
                    gen_ai.tool.name = name,
                    gen_ai.tool.call.id = %call.id,
                    server.address = %address,
                    server.port = *port,
                    error.type = tracing::field::Empty,
                );
                match bounded(
                    connect
                        .call(name, &call.function.arguments)
                        .instrument(span.clone()),
                    cancel,
                    run.deadline,
                )
                .await
                {
                    Ok(Ok(r)) => {
                        if r.1 {
                            // The tool reported an error: the model sees it.
                            failed_span(&span, ErrorCode::ToolError);
                        }
                        r
                    }
                    Ok(Err(e)) => {
                        failed_span(&span, e.code);
                        return Ending::Failed(e);
                    }
                    Err(i) => return interrupted(i),
                }
            };
            emit(
                events,
                EngineEvent::ToolResult {
                    step,
                    call_id: call.id.clone(),
                    tool: name.to_owned(),
                    output: output.clone(),
                    is_error,
                },
            )
            .await;
            messages.push(Message::tool_result(&call.id, output));
        }
        emit(
            events,
            EngineEvent::Checkpoint(Checkpoint {
                step,
                messages: messages.clone(),
                usage: *usage,
            }),
        )
        .await;
    }
}

/// Marks a span ERROR with `error.type` = the error code (OpenTelemetry's
/// convention for a failed operation).
fn failed_span(span: &tracing::Span, code: ErrorCode) {
    span.record("otel.status_code", "ERROR");
    span.record("error.type", code.as_str());
}
