//! One accepted run on the runner: its engine, with the assignment's
//! deadline, its events journaled and streamed to the gateway as they come,
//! and its result journaled before it is reported.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

use automesh_engine::adapter::{EngineAdapter, EngineRequest};
use automesh_proto::runner::v1 as rpb;
use rpb::connect_request::Message as Up;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use automesh_engine::wire::run_forwarding;

use crate::{Record, finished, send_current, up};

/// What the agent is told of where it runs.
const GUIDANCE: &str = "You run headless on the owner's desktop through the automesh runner; \
     nobody can answer questions or prompts.";

pub(crate) async fn execute(
    engine: Arc<dyn EngineAdapter>,
    record: Arc<Record>,
    active: Arc<Mutex<HashMap<String, CancellationToken>>>,
    outbox: Arc<Mutex<Option<mpsc::Sender<rpb::ConnectRequest>>>>,
    a: rpb::Assignment,
    cancel: CancellationToken,
) {
    let run_id = a.run_id.clone();
    let request = EngineRequest {
        automation_id: a.automation_id.clone(),
        guidance: Some(GUIDANCE.into()),
        ..EngineRequest::due(
            &a.prompt,
            &a.model,
            &a.provider_model,
            a.deadline_time.as_ref(),
        )
        .within(a.budget.as_ref())
    };
    let stop = cancel.clone();
    let outcome = run_forwarding(engine.as_ref(), request, &run_id, stop, |event| {
        if let Err(error) = record.event(&run_id, &event) {
            tracing::error!(%error, "cannot record an event");
        }
        let events = rpb::RunEvents {
            run_id: run_id.clone(),
            events: vec![event],
        };
        send_current(&outbox, up(Up::RunEvents(events)))
    });
    let outcome = outcome.await;
    let result = finished(&run_id, engine.engine_id(), &outcome);
    tracing::info!(state = result.outcome, code = %result.error_code, "run finished on the runner");
    if let Err(error) = record.finish(&run_id, &result) {
        tracing::error!(%error, "cannot record the result");
    }
    active.lock().remove(&run_id);
    send_current(&outbox, up(Up::RunFinished(result))).await;
    if cancel.is_cancelled() {
        send_current(&outbox, up(Up::IdleObserved(rpb::IdleObserved { run_id }))).await;
    }
}
