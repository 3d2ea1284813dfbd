//! The executor kit: what every executor of the executor contract
//! (`automesh.executor.v1` — the desktop-runner-gateway, the cloud lifecycle
//! service, the test executor) does alike. An executor implements
//! [`Executor`] in plain terms and [`Contract`] answers the contract's four
//! calls for it: a `StartRun` is checked the same way everywhere
//! ([`run_spec`]), a cancellation always carries a reason, and an
//! `ObserveRun` stream is fed through one [`Observer`]: a status only when it
//! changed, events in order, and the stream ends when the observer leaves.

use std::pin::Pin;

use automesh_domain::Violations;
use automesh_proto::executor::v1 as epb;
use automesh_proto::executor::v1::executor_service_server::ExecutorService;
use automesh_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use automesh_edge::status;

/// Updates one observe stream may have queued before its feeder waits.
const OBSERVE_BUFFER: usize = 64;

/// The stream an `ObserveRun` answers with.
pub type ObserveStream = Updates<epb::ObserveRunResponse>;

/// A stream of observe updates of kind `M`.
pub type Updates<M> = Pin<Box<dyn Stream<Item = Result<M, Status>> + Send>>;

/// A message of an observe stream: either a status or a run event. The
/// executor contract's `ObserveRun` and the worker agent's `ObserveThread`
/// both are, so both are fed through one [`Observer`].
pub trait Update: Send + 'static {
    /// What the observed thing's status is.
    type Status: Clone + PartialEq + Send + std::fmt::Debug;
    fn status(status: Self::Status) -> Self;
    fn event(event: pb::RunEvent) -> Self;
}

impl Update for epb::ObserveRunResponse {
    type Status = epb::ExecutionStatus;
    fn status(status: Self::Status) -> Self {
        Self {
            update: Some(epb::observe_run_response::Update::Status(status)),
        }
    }
    fn event(event: pb::RunEvent) -> Self {
        Self {
            update: Some(epb::observe_run_response::Update::Event(event)),
        }
    }
}

impl Update for automesh_proto::agent::v1::ObserveThreadResponse {
    type Status = automesh_proto::agent::v1::Thread;
    fn status(thread: Self::Status) -> Self {
        use automesh_proto::agent::v1::observe_thread_response::Update;
        Self {
            update: Some(Update::Thread(thread)),
        }
    }
    fn event(event: pb::RunEvent) -> Self {
        use automesh_proto::agent::v1::observe_thread_response::Update;
        Self {
            update: Some(Update::Event(event)),
        }
    }
}

/// What one executor of the executor contract does; [`Contract`] serves the
/// contract for it.
#[tonic::async_trait]
pub trait Executor: Send + Sync + 'static {
    /// Starts a checked run, idempotently by its run and message ids:
    /// whether this call submitted it, and its status now.
    async fn start(&self, spec: epb::RunSpec) -> Result<(bool, epb::ExecutionStatus), Status>;

    /// The run's events after sequence `after`, then its status until it
    /// finishes.
    async fn observe(&self, run_id: String, after: i64) -> Result<ObserveStream, Status>;

    /// Asks for the run to be cancelled for `reason` (never empty); its
    /// status now.
    async fn cancel(&self, run_id: &str, reason: &str) -> Result<epb::ExecutionStatus, Status>;

    /// The run's status ([`unknown_status`] for a run it does not know).
    async fn status(&self, run_id: &str) -> Result<epb::ExecutionStatus, Status>;
}

/// The executor contract's server for any [`Executor`].
#[derive(Debug, Clone)]
pub struct Contract<E>(pub E);

/// The reason a cancellation without one is given.
const CANCELLED: &str = "cancelled";

#[tonic::async_trait]
impl<E: Executor> ExecutorService for Contract<E> {
    async fn start_run(
        &self,
        request: Request<epb::StartRunRequest>,
    ) -> Result<Response<epb::StartRunResponse>, Status> {
        let (submitted, status) = self.0.start(run_spec(request.into_inner())?).await?;
        Ok(Response::new(epb::StartRunResponse {
            submitted,
            status: Some(status),
        }))
    }

    type ObserveRunStream = ObserveStream;

    async fn observe_run(
        &self,
        request: Request<epb::ObserveRunRequest>,
    ) -> Result<Response<ObserveStream>, Status> {
        let req = request.into_inner();
        Ok(Response::new(
            self.0.observe(req.run_id, req.after_sequence).await?,
        ))
    }

    async fn cancel_run(
        &self,
        request: Request<epb::CancelRunRequest>,
    ) -> Result<Response<epb::CancelRunResponse>, Status> {
        let req = request.into_inner();
        let reason = Some(req.reason.as_str()).filter(|r| !r.is_empty());
        let status = self.0.cancel(&req.run_id, reason.unwrap_or(CANCELLED));
        Ok(Response::new(epb::CancelRunResponse {
            status: Some(status.await?),
        }))
    }

    async fn get_run_status(
        &self,
        request: Request<epb::GetRunStatusRequest>,
    ) -> Result<Response<epb::GetRunStatusResponse>, Status> {
        let status = self.0.status(&request.into_inner().run_id).await?;
        Ok(Response::new(epb::GetRunStatusResponse {
            status: Some(status),
        }))
    }
}

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

/// The feeding side of one observe stream.
#[derive(Debug)]
pub struct Observer<M: Update = epb::ObserveRunResponse> {
    tx: mpsc::Sender<Result<M, Status>>,
    last: Option<M::Status>,
}

/// A new `ObserveRun` stream: its feeder and the stream to answer with.
pub fn observe() -> (Observer, ObserveStream) {
    updates()
}

/// A new observe stream of `M`: its feeder and the stream to answer with.
pub fn updates<M: Update>() -> (Observer<M>, Updates<M>) {
    let (tx, rx) = mpsc::channel(OBSERVE_BUFFER);
    (
        Observer { tx, last: None },
        Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
}

impl<M: Update> Observer<M> {
    /// The status last sent, if any.
    pub fn last(&self) -> Option<&M::Status> {
        self.last.as_ref()
    }

    /// Sends `status` unless it is the one last sent; false once the
    /// observer has gone.
    pub async fn status(&mut self, status: M::Status) -> bool {
        if self.last.as_ref() == Some(&status) {
            return !self.tx.is_closed();
        }
        self.last = Some(status.clone());
        self.tx.send(Ok(M::status(status))).await.is_ok()
    }

    /// Sends one event; false once the observer has gone.
    pub async fn event(&self, event: pb::RunEvent) -> bool {
        self.tx.send(Ok(M::event(event))).await.is_ok()
    }

    /// Ends the stream with `error`.
    pub async fn fail(self, error: Status) {
        let _ = self.tx.send(Err(error)).await;
    }

    /// Resolves once the observer has gone.
    pub async fn closed(&self) {
        self.tx.closed().await;
    }

    /// Waits for `changed` (a wake-up from whatever the stream reports on),
    /// for `at_most`, or for the observer to leave; false in that last case.
    pub async fn wait(
        &self,
        changed: impl std::future::Future<Output = ()>,
        at_most: std::time::Duration,
    ) -> bool {
        tokio::select! {
            () = changed => true,
            () = tokio::time::sleep(at_most) => true,
            () = self.tx.closed() => false,
        }
    }
}

impl<M: Update> Observer<M> {
    /// Feeds the stream from `read` until it ends: `read` gives what
    /// happened after a sequence — the events, then the status now — or
    /// `None` once there is nothing to observe. The events go out first,
    /// then the status; the stream ends after a status `is_end` calls the
    /// last, or when the observer leaves. Between reads it waits for
    /// `changed` or at most `poll`.
    pub async fn follow(
        mut self,
        mut after: i64,
        changed: &tokio::sync::Notify,
        poll: std::time::Duration,
        mut read: impl FnMut(i64) -> Option<(Vec<pb::RunEvent>, M::Status)> + Send,
        is_end: impl Fn(&M::Status) -> bool + Send,
    ) {
        loop {
            let notified = changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let Some((events, status)) = read(after) else {
                return;
            };
            for event in events {
                after = event.sequence;
                if !self.event(event).await {
                    return;
                }
            }
            let end = is_end(&status);
            if !self.status(status).await || end || !self.wait(notified, poll).await {
                return;
            }
        }
    }
}

/// The status of a run this executor does not know: idle, no outcome.
pub fn unknown_status() -> epb::ExecutionStatus {
    epb::ExecutionStatus {
        phase: epb::ExecutionPhase::Unknown as i32,
        idle: true,
        outcome: None,
        unaccepted: false,
    }
}

/// The status of a run that finished with `outcome`.
pub fn finished(outcome: epb::Outcome) -> epb::ExecutionStatus {
    epb::ExecutionStatus {
        phase: epb::ExecutionPhase::Finished as i32,
        idle: true,
        outcome: Some(outcome),
        unaccepted: false,
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
