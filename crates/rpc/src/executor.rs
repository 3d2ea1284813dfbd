//! The executor kit: what every executor of the executor contract
//! (`automesh.executor.v1` — the desktop-runner-gateway, the cloud lifecycle
//! service, the test executor) does alike. A `StartRun` is checked the same
//! way everywhere ([`run_spec`]), and an `ObserveRun` stream is fed through
//! one [`Observer`]: a status only when it changed, events in order, and the
//! stream ends when the observer leaves.

use std::pin::Pin;

use automesh_domain::Violations;
use automesh_proto::executor::v1 as epb;
use automesh_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::Status;

use crate::status;

/// Updates one `ObserveRun` stream may have queued before its feeder waits.
const OBSERVE_BUFFER: usize = 64;

/// The stream an `ObserveRun` answers with.
pub type ObserveStream =
    Pin<Box<dyn Stream<Item = Result<epb::ObserveRunResponse, Status>> + Send>>;

/// The run of a `StartRun`, checked: the run, its id, its message id and
/// its owner are required (INVALID_ARGUMENT naming each missing field).
pub fn run_spec(request: epb::StartRunRequest) -> Result<epb::RunSpec, Status> {
    let Some(spec) = request.run else {
        return Err(status::invalid_field("run", "is required"));
    };
    let mut missing = Violations::default();
    for (field, value) in [
        ("run.run_id", &spec.run_id),
        ("run.message_id", &spec.message_id),
        ("run.organization_id", &spec.organization_id),
        ("run.owner_id", &spec.owner_id),
    ] {
        if value.is_empty() {
            missing.field(field, "is required");
        }
    }
    if missing.is_empty() {
        Ok(spec)
    } else {
        Err(status::invalid_argument(&missing))
    }
}

/// The feeding side of one `ObserveRun` stream.
#[derive(Debug)]
pub struct Observer {
    tx: mpsc::Sender<Result<epb::ObserveRunResponse, Status>>,
    last: Option<epb::ExecutionStatus>,
}

/// A new `ObserveRun` stream: its feeder and the stream to answer with.
pub fn observe() -> (Observer, ObserveStream) {
    let (tx, rx) = mpsc::channel(OBSERVE_BUFFER);
    (
        Observer { tx, last: None },
        Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
}

impl Observer {
    /// The status last sent, if any.
    pub fn last(&self) -> Option<&epb::ExecutionStatus> {
        self.last.as_ref()
    }

    /// Sends `status` unless it is the one last sent; false once the
    /// observer has gone.
    pub async fn status(&mut self, status: epb::ExecutionStatus) -> bool {
        if self.last.as_ref() == Some(&status) {
            return !self.tx.is_closed();
        }
        self.last = Some(status.clone());
        self.send(epb::observe_run_response::Update::Status(status))
            .await
    }

    /// Sends one event; false once the observer has gone.
    pub async fn event(&self, event: pb::RunEvent) -> bool {
        self.send(epb::observe_run_response::Update::Event(event))
            .await
    }

    /// Ends the stream with `error`.
    pub async fn fail(self, error: Status) {
        let _ = self.tx.send(Err(error)).await;
    }

    /// Resolves once the observer has gone.
    pub async fn closed(&self) {
        self.tx.closed().await;
    }

    async fn send(&self, update: epb::observe_run_response::Update) -> bool {
        self.tx
            .send(Ok(epb::ObserveRunResponse {
                update: Some(update),
            }))
            .await
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_without_its_identity_names_every_missing_field() {
        let error = run_spec(epb::StartRunRequest { run: None }).expect_err("no run");
        assert_eq!(status::field_violations(&error)[0].0, "run");
        let error = run_spec(epb::StartRunRequest {
            run: Some(epb::RunSpec {
                run_id: "r1".into(),
                ..Default::default()
            }),
        })
        .expect_err("no message id or owner");
        let fields: Vec<String> = status::field_violations(&error)
            .into_iter()
            .map(|(f, _)| f)
            .collect();
        assert_eq!(
            fields,
            ["run.message_id", "run.organization_id", "run.owner_id"]
        );
        let spec = epb::RunSpec {
            run_id: "r1".into(),
            message_id: "m1".into(),
            organization_id: "o".into(),
            owner_id: "u".into(),
            ..Default::default()
        };
        assert_eq!(
            run_spec(epb::StartRunRequest {
                run: Some(spec.clone())
            })
            .expect("complete"),
            spec
        );
    }

    #[tokio::test]
    async fn a_status_goes_out_once_per_change_and_events_in_order() {
        use tokio_stream::StreamExt;
        let (mut observer, mut stream) = observe();
        let running = epb::ExecutionStatus {
            phase: epb::ExecutionPhase::Running as i32,
            ..Default::default()
        };
        assert!(observer.status(running.clone()).await);
        assert!(
            observer.status(running.clone()).await,
            "unchanged: not sent"
        );
        for sequence in [1, 2] {
            assert!(
                observer
                    .event(pb::RunEvent {
                        sequence,
                        ..Default::default()
                    })
                    .await
            );
        }
        drop(observer);
        let mut got = vec![];
        while let Some(Ok(m)) = stream.next().await {
            got.push(match m.update {
                Some(epb::observe_run_response::Update::Status(s)) => format!("status {}", s.phase),
                Some(epb::observe_run_response::Update::Event(e)) => {
                    format!("event {}", e.sequence)
                }
                None => "none".into(),
            });
        }
        assert_eq!(got, ["status 3", "event 1", "event 2"]);
    }
}
