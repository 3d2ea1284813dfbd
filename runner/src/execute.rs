//! One accepted run on the runner: its engine, with the assignment's
//! deadline, its events journaled and streamed to the gateway as they come,
//! and its result journaled before it is reported.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use automesh_engine::adapter::{EngineAdapter, EngineRequest};
use automesh_proto::runner::v1 as rpb;
use rpb::connect_request::Message as Up;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::{ENGINE_EVENTS, Record, finished, run_event, send_current, up};

pub(crate) async fn execute(
    engine: Arc<dyn EngineAdapter>,
    record: Arc<Record>,
    active: Arc<Mutex<HashMap<String, CancellationToken>>>,
    outbox: Arc<Mutex<Option<mpsc::Sender<rpb::ConnectRequest>>>>,
    a: rpb::Assignment,
    cancel: CancellationToken,
) {
    let run_id = a.run_id.clone();
    let deadline = a
        .deadline_time
        .and_then(|t| chrono::DateTime::from_timestamp(t.seconds, t.nanos.max(0) as u32))
        .map(|d| (d - chrono::Utc::now()).to_std().unwrap_or_default())
        .unwrap_or(Duration::from_secs(1800));
    let request = EngineRequest {
        prompt: a.prompt.clone(),
        model: a.model.clone(),
        provider_model: a.provider_model.clone(),
        automation_id: a.automation_id.clone(),
        guidance: Some("You run headless on the owner's desktop through the automesh runner; nobody can answer questions or prompts.".into()),
        deadline: tokio::time::Instant::now() + deadline,
        resume_from: None,
    };
    let (etx, mut erx) = mpsc::channel(ENGINE_EVENTS);
    let forward = {
        let record = record.clone();
        let outbox = outbox.clone();
        let run_id = run_id.clone();
        async move {
            let mut n = 0;
            while let Some(e) = erx.recv().await {
                n += 1;
                let Some(event) = run_event(&run_id, n, &e) else {
                    continue;
                };
                if let Err(error) = record.event(&run_id, &event) {
                    tracing::error!(%error, "cannot record an event");
                }
                send_current(
                    &outbox,
                    up(Up::RunEvents(rpb::RunEvents {
                        run_id: run_id.clone(),
                        events: vec![event],
                    })),
                )
                .await;
            }
        }
    };
    let (outcome, ()) = tokio::join!(engine.run(request, etx, cancel.clone()), forward);
    let result = finished(&run_id, engine.engine_id(), &outcome);
    tracing::info!(state = result.outcome, code = %result.error_code, "run finished on the runner");
    if let Err(error) = record.finish(&run_id, &result) {
        tracing::error!(%error, "cannot record the result");
    }
    if let Ok(mut a) = active.lock() {
        a.remove(&run_id);
    }
    send_current(&outbox, up(Up::RunFinished(result))).await;
    if cancel.is_cancelled() {
        send_current(&outbox, up(Up::IdleObserved(rpb::IdleObserved { run_id }))).await;
    }
}
