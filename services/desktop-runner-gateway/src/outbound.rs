//! What a replica sends down a runner's stream: the assignment and
//! cancellation messages, the bounded hand-over to the stream's queue, and
//! the sending of a claimed assignment (whose claim is given back when the
//! stream does not take it), in the run's own trace.

use std::time::Duration;

use automesh_proto::executor::v1 as epb;
use automesh_proto::runner::v1 as rpb;
use automesh_store::Store;
use automesh_store::desktop::DesktopAssignment;
use chrono::Utc;
use prost::Message as _;

/// Bound on handing one message to a runner's stream.
pub(crate) const SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// A run's spec, as its assignment stores it (`None`, logged, when it does
/// not decode).
pub(crate) fn spec_of(a: &DesktopAssignment) -> Option<epb::RunSpec> {
    let spec = epb::RunSpec::decode(a.spec.as_slice());
    spec.inspect_err(|_| tracing::error!(run_id = %a.run_id, "undecodable desktop run spec"))
        .ok()
}

/// A span of work on `run_id` in its run's trace (the traceparent its spec
/// carries), so delivery and its log lines belong to the run.
pub(crate) fn run_span(
    name: &'static str,
    run_id: &str,
    spec: Option<&epb::RunSpec>,
) -> tracing::Span {
    let traceparent = spec.map(|s| s.traceparent.as_str());
    automesh_telemetry::propagation::run_span(name, run_id, traceparent)
}

/// [`run_span`] for a run known only by its id: its trace is read from its
/// assignment (a span outside any trace when it cannot be read).
pub(crate) async fn stored_run_span(
    store: &Store,
    name: &'static str,
    run_id: &str,
) -> tracing::Span {
    let spec = store.desktop_run(run_id).await.ok().flatten();
    run_span(name, run_id, spec.as_ref().and_then(spec_of).as_ref())
}

/// Sends `spec`, claimed for `session`'s runner; gives the claim back when
/// the stream does not take it.
pub(crate) async fn send_assignment(
    store: &Store,
    session: &crate::stream::Session,
    spec: &epb::RunSpec,
    again: bool,
) -> Result<bool, automesh_store::StoreError> {
    let (runner_id, tx, run_id) = (session.runner_id.as_str(), &session.tx, &spec.run_id);
    if send(tx, assignment(spec)).await {
        tracing::info!(%run_id, runner_id, again, "run assigned to a runner");
        crate::metrics::delivered(again);
        Ok(true)
    } else {
        tracing::warn!(%run_id, runner_id, "the runner's stream did not take the assignment");
        store
            .release_unaccepted_desktop_runs(runner_id, &session.stream_id, Utc::now())
            .await?;
        Ok(false)
    }
}

/// Sends one message to a runner, bounded.
pub(crate) async fn send(tx: &crate::stream::ToRunner, message: rpb::ConnectResponse) -> bool {
    matches!(
        tokio::time::timeout(SEND_TIMEOUT, tx.send(Ok(Box::new(message)))).await,
        Ok(Ok(()))
    )
}

/// The assignment message for a run.
pub(crate) fn assignment(spec: &epb::RunSpec) -> rpb::ConnectResponse {
    rpb::ConnectResponse {
        message: Some(rpb::connect_response::Message::Assignment(
            rpb::Assignment {
                run_id: spec.run_id.clone(),
                automation_id: spec.automation_id.clone(),
                prompt: spec.prompt.clone(),
                model: spec.model.clone(),
                deadline_time: spec.deadline_time,
                traceparent: spec.traceparent.clone(),
                provider_model: spec.provider_model.clone(),
                budget: spec.budget,
            },
        )),
    }
}

/// The cancellation message for a run.
pub(crate) fn cancel_message(run_id: &str, reason: &str) -> rpb::ConnectResponse {
    rpb::ConnectResponse {
        message: Some(rpb::connect_response::Message::CancelAssignment(
            rpb::CancelAssignment {
                run_id: run_id.to_owned(),
                reason: reason.to_owned(),
            },
        )),
    }
}
