//! The drive loop of a run on OpenCode: readiness, the session and its
//! prompt (with the catalogue's provider name), then events until the run's
//! ending is decided and the session is idle — every wait bounded by the
//! idle watchdog, the deadline or the cancellation bound.

use std::time::Duration;

use automesh_domain::ErrorCode;
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::adapter::{Ending, EngineRequest};
use automesh_domain::CodedError;

use super::session::Drive;

/// OpenCode's model: the provider is the catalogue id's prefix, the model
/// the catalogue's provider name (or the id's rest).
pub(super) fn split_model(model: &str, provider_model: &str) -> Option<Value> {
    let (provider, rest) = model.split_once('/')?;
    let model = if provider_model.is_empty() {
        rest
    } else {
        provider_model
    };
    (!provider.is_empty() && !model.is_empty())
        .then(|| json!({ "providerID": provider, "modelID": model }))
}

fn failed(code: ErrorCode, message: impl Into<String>) -> Ending {
    Ending::Failed(CodedError::new(code, message))
}

pub(super) async fn drive(
    d: &mut Drive<'_>,
    request: &EngineRequest,
    cancel: &CancellationToken,
) -> Ending {
    let deadline = request.deadline;
    let before = async {
        d.wait_ready(deadline).await?;
        let stream = d.open_events().await?;
        let (status, session) = d
            .call(
                reqwest::Method::POST,
                "/session",
                Some(json!({ "title": "automesh run" })),
            )
            .await?;
        let Some(id) = session["id"].as_str().filter(|_| status == 200) else {
            return Err(CodedError::new(
                ErrorCode::RuntimeFailed,
                format!("OpenCode did not create a session (status {status})"),
            ));
        };
        Ok::<_, CodedError>((stream, id.to_owned()))
    };
    let (mut stream, root) = tokio::select! {
        r = before => match r {
            Ok(r) => r,
            Err(e) => return Ending::Failed(e),
        },
        () = cancel.cancelled() => return Ending::Cancelled,
        () = tokio::time::sleep_until(deadline) => return failed(ErrorCode::DeadlineExceeded, "the run reached its deadline before OpenCode was ready"),
    };
    d.root = root.clone();
    d.sessions.insert(root.clone());
    let mut body = json!({ "parts": [{ "type": "text", "text": request.prompt }] });
    if let Some(m) = split_model(&request.model, &request.provider_model) {
        body["model"] = m;
    }
    if let Some(g) = &request.guidance {
        body["system"] = json!(g);
    }
    match d
        .call(
            reqwest::Method::POST,
            &format!("/session/{root}/prompt_async"),
            Some(body),
        )
        .await
    {
        Ok((200..=299, _)) => {}
        Ok((s, v)) => {
            return failed(
                ErrorCode::RuntimeFailed,
                format!("OpenCode refused the prompt ({s}): {v}"),
            );
        }
        Err(e) => return Ending::Failed(e),
    }

    let mut last_progress = Instant::now();
    let mut reconnect_backoff = Duration::from_millis(100);
    let mut stream_ok = true;
    loop {
        if d.root_idle {
            break;
        }
        // After an abort, idle is awaited for `cancel_timeout`, no longer.
        if let Some(at) = d.aborted
            && Instant::now() >= at + d.cfg.cancel_timeout
        {
            tracing::warn!("OpenCode was not observed idle after the abort");
            break;
        }
        let idle_at = last_progress + d.cfg.idle_timeout;
        let poll_at = Instant::now() + Duration::from_millis(500);
        tokio::select! {
            biased;
            () = cancel.cancelled(), if d.ending.is_none() => {
                d.decide(Ending::Cancelled).await;
            }
            () = tokio::time::sleep_until(deadline), if d.ending.is_none() => {
                d.decide(failed(ErrorCode::DeadlineExceeded, "the run reached its deadline")).await;
            }
            () = tokio::time::sleep_until(idle_at), if d.ending.is_none() => {
                let e = match &d.pending {
                    Some(p) => failed(ErrorCode::PermissionPending, format!("permission {p} was still unanswered after {:?} without progress", d.cfg.idle_timeout)),
                    None => failed(ErrorCode::IdleTimeout, format!("the OpenCode session made no progress for {:?}", d.cfg.idle_timeout)),
                };
                d.decide(e).await;
            }
            // While aborting, or with the stream down: look, don't wait.
            () = tokio::time::sleep_until(poll_at), if d.aborted.is_some() || !stream_ok => {
                if !stream_ok {
                    match d.open_events().await {
                        Ok(s) => {
                            tracing::info!("OpenCode event stream reopened; recovering state");
                            stream = s;
                            stream_ok = true;
                            reconnect_backoff = Duration::from_millis(100);
                        }
                        Err(e) => {
                            tracing::warn!(error = %e.message, "reopening OpenCode's event stream failed");
                            tokio::time::sleep(reconnect_backoff.min(deadline.saturating_duration_since(Instant::now()))).await;
                            reconnect_backoff = (reconnect_backoff * 2).min(Duration::from_secs(2));
                        }
                    }
                }
                d.recover().await;
            }
            next = stream.next(), if stream_ok => match next {
                Some(v) => {
                    if d.handle(&v).await {
                        last_progress = Instant::now();
                    }
                }
                None => {
                    tracing::warn!("OpenCode's event stream dropped; reopening and recovering");
                    stream_ok = false;
                }
            },
        }
    }
    if !d.root_idle && d.aborted.is_none() {
        // Not reachable without an abort, kept for safety.
        d.abort().await;
    }
    // Confirm the end from the messages (and emit anything missed).
    d.read_messages().await;
    let idle = d.root_idle;
    match d.ending.take() {
        Some(Ending::Cancelled) if !idle => failed(
            ErrorCode::CancelUnobserved,
            "OpenCode was not observed idle after the abort",
        ),
        Some(e) => e,
        None => match d.model_error.take() {
            Some(e) => Ending::Failed(e),
            None => Ending::Succeeded {
                answer: d.last_answer.clone(),
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_split_into_provider_and_model() {
        assert_eq!(
            split_model("fake/fake-model", ""),
            Some(json!({"providerID": "fake", "modelID": "fake-model"}))
        );
        assert_eq!(
            split_model("fake/alias", "fake-model-2026"),
            Some(json!({"providerID": "fake", "modelID": "fake-model-2026"}))
        );
        assert_eq!(split_model("bare", ""), None);
    }
}
