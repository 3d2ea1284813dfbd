//! Engine events and outcomes on the wire (`automesh.v1` messages), shared
//! by everything that runs an engine for the mesh: the desktop runner and
//! the cloud worker agent.

use automesh_domain::ErrorCode;
use automesh_edge::convert;
use automesh_proto::v1 as pb;

use crate::adapter::{Ending, EngineAdapter, EngineEvent, EngineRequest, Outcome};

/// Now, as a protobuf timestamp.
pub fn now_ts() -> prost_types::Timestamp {
    convert::timestamp(chrono::Utc::now())
}

/// How many engine events may wait to be put on the wire.
const ENGINE_EVENTS: usize = 64;

/// Runs `request` on `engine` to its outcome, handing each of its events,
/// as run `run_id`'s wire event, to `each` in order (checkpoints stay local).
pub async fn run_forwarding<F: std::future::Future<Output = ()>>(
    engine: &dyn EngineAdapter,
    request: EngineRequest,
    run_id: &str,
    stop: tokio_util::sync::CancellationToken,
    mut each: impl FnMut(pb::RunEvent) -> F,
) -> Outcome {
    let (tx, mut rx) = tokio::sync::mpsc::channel(ENGINE_EVENTS);
    let forward = async {
        let mut n = 0;
        while let Some(e) = rx.recv().await {
            n += 1;
            if let Some(event) = run_event(run_id, n, &e) {
                each(event).await;
            }
        }
    };
    let (outcome, ()) = tokio::join!(engine.run(request, tx, stop), forward);
    outcome
}

/// The wire event for an engine event (checkpoints stay local).
pub fn run_event(run_id: &str, n: usize, e: &EngineEvent) -> Option<pb::RunEvent> {
    let payload = convert::payload_to_pb(&e.payload()?);
    // Within the event size bound wherever it goes (automesh_proto::bounds).
    Some(
        pb::RunEvent {
            run_id: run_id.to_owned(),
            sequence: 0,
            // Stable: the n-th event of this run on this runner.
            event_id: format!("{run_id}/{n}"),
            create_time: Some(now_ts()),
            payload: Some(payload),
        }
        .bounded(),
    )
}

/// The terminal state, error code and message, and usage of an outcome.
pub fn finished_parts(outcome: &Outcome) -> (pb::RunState, String, String, pb::Usage) {
    let (state, code, message) = match &outcome.ending {
        Ending::Succeeded { .. } => (pb::RunState::Succeeded, String::new(), String::new()),
        Ending::Cancelled => (
            pb::RunState::Cancelled,
            String::new(),
            "cancelled".to_owned(),
        ),
        Ending::Failed(e) => (
            if e.code == ErrorCode::DeadlineExceeded {
                pb::RunState::TimedOut
            } else {
                pb::RunState::Failed
            },
            e.code.as_str().to_owned(),
            e.message.clone(),
        ),
    };
    let usage = convert::usage_to_pb(&outcome.usage);
    (state, code, message, usage)
}
