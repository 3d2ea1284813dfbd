//! The coordinator's operations on runs, and the thin gRPC handlers in front
//! of them.

use std::sync::Arc;
use std::time::Duration;

use automesh_domain::{Principal, Run};
use automesh_proto::coordinator::v1 as cpb;
use automesh_proto::coordinator::v1::run_coordinator_service_server::RunCoordinatorService;
use automesh_proto::v1 as pb;
use automesh_rpc::convert;
use automesh_store::Store;
use automesh_store::page::Cursor;
use chrono::{DateTime, Utc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::drive::Context;
use crate::error::Error;
use crate::watch;

/// The coordinator's state. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Coordinator {
    store: Store,
    context: Arc<Context>,
    shutdown: CancellationToken,
}

/// How long `CancelRun` waits for the run to end before answering with the
/// run as it is (the cancellation goes on; `WatchRun` shows the end).
const CANCEL_ANSWER_WAIT: Duration = Duration::from_secs(5);

impl Coordinator {
    pub fn new(context: Arc<Context>, shutdown: CancellationToken) -> Self {
        Self {
            store: context.store.clone(),
            context,
            shutdown,
        }
    }

    /// A run of `owner` in its protobuf form, with its receipt once terminal.
    pub async fn run_pb(&self, owner: &Principal, id: &str) -> Result<pb::Run, Error> {
        let run = self.store.get_run(owner, id).await?;
        self.to_pb(&run).await
    }

    async fn to_pb(&self, run: &Run) -> Result<pb::Run, Error> {
        let receipt = if run.state.is_terminal() {
            self.store.internal().receipt(&run.id).await?
        } else {
            None
        };
        Ok(convert::run_to_pb(run, receipt.as_ref()))
    }

    /// Asks for a run's cancellation: its drive forwards it to the
    /// executor and ends the run once the executor is observed idle (or the
    /// cancellation bound passes). Answers with the run once it ended, or
    /// as it is after a short wait. A terminal run is returned unchanged.
    pub async fn cancel(
        &self,
        owner: &Principal,
        id: &str,
        now: DateTime<Utc>,
    ) -> Result<Run, Error> {
        let run = self.store.get_run(owner, id).await?;
        if run.state.is_terminal() {
            return Ok(run);
        }
        if self.store.internal().request_cancel(&run.id, now).await? {
            tracing::info!(run_id = %run.id, "cancellation requested");
            self.context.signal_cancel(&run.id);
        }
        let give_up = tokio::time::Instant::now() + CANCEL_ANSWER_WAIT;
        loop {
            let current = self.store.get_run(owner, id).await?;
            if current.state.is_terminal() || tokio::time::Instant::now() >= give_up {
                return Ok(current);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[tonic::async_trait]
impl RunCoordinatorService for Coordinator {
    async fn get_run(
        &self,
        request: Request<cpb::GetRunRequest>,
    ) -> Result<Response<cpb::GetRunResponse>, Status> {
        let (owner, req) = convert::scoped(request)?;
        convert::require_id(&req.id, "id").map_err(Error::from)?;
        Ok(Response::new(cpb::GetRunResponse {
            run: Some(self.run_pb(&owner, &req.id).await?),
        }))
    }

    async fn list_runs(
        &self,
        request: Request<cpb::ListRunsRequest>,
    ) -> Result<Response<cpb::ListRunsResponse>, Status> {
        let (owner, req) = convert::scoped(request)?;
        let list = req.request.unwrap_or_default();
        let size = convert::page_size(list.page_size, 50, "page_size").map_err(Error::from)?;
        let cursor = Cursor::decode(&list.page_token).map_err(Error::from)?;
        let filter = (!list.automation_id.is_empty()).then_some(list.automation_id.as_str());
        let page = self
            .store
            .list_runs(&owner, filter, &cursor, size)
            .await
            .map_err(Error::from)?;
        let mut runs = Vec::with_capacity(page.items.len());
        for run in &page.items {
            runs.push(self.to_pb(run).await?);
        }
        let kept = automesh_proto::bounds::fitting(&runs);
        runs.truncate(kept);
        Ok(Response::new(cpb::ListRunsResponse {
            response: Some(pb::ListRunsResponse {
                runs,
                next_page_token: page.next_token(kept),
            }),
        }))
    }

    async fn cancel_run(
        &self,
        request: Request<cpb::CancelRunRequest>,
    ) -> Result<Response<cpb::CancelRunResponse>, Status> {
        let (owner, req) = convert::scoped(request)?;
        convert::require_id(&req.id, "id").map_err(Error::from)?;
        let run = self.cancel(&owner, &req.id, Utc::now()).await?;
        Ok(Response::new(cpb::CancelRunResponse {
            run: Some(self.to_pb(&run).await?),
        }))
    }

    async fn list_run_events(
        &self,
        request: Request<cpb::ListRunEventsRequest>,
    ) -> Result<Response<cpb::ListRunEventsResponse>, Status> {
        let (owner, req) = convert::scoped(request)?;
        let list = req.request.unwrap_or_default();
        convert::require_id(&list.run_id, "run_id").map_err(Error::from)?;
        let size = convert::page_size(list.page_size, 100, "page_size").map_err(Error::from)?;
        if list.after_sequence < 0 {
            return Err(automesh_rpc::status::invalid_field(
                "after_sequence",
                "must not be negative",
            ));
        }
        // Scope first: another tenant's run is not found.
        self.store
            .get_run(&owner, &list.run_id)
            .await
            .map_err(Error::from)?;
        let events = self
            .store
            .internal()
            .events(&list.run_id, list.after_sequence, size)
            .await
            .map_err(Error::from)?;
        let mut events: Vec<pb::RunEvent> = events.iter().map(convert::event_to_pb).collect();
        // Within the page byte budget; `last_sequence` says where the next
        // page starts.
        events.truncate(automesh_proto::bounds::fitting(&events));
        let last_sequence = events.last().map_or(list.after_sequence, |e| e.sequence);
        Ok(Response::new(cpb::ListRunEventsResponse {
            response: Some(pb::ListRunEventsResponse {
                events,
                last_sequence,
            }),
        }))
    }

    type WatchRunStream = ReceiverStream<Result<cpb::WatchRunResponse, Status>>;

    async fn watch_run(
        &self,
        request: Request<cpb::WatchRunRequest>,
    ) -> Result<Response<Self::WatchRunStream>, Status> {
        let (owner, req) = convert::scoped(request)?;
        let watch_req = req.request.unwrap_or_default();
        convert::require_id(&watch_req.run_id, "run_id").map_err(Error::from)?;
        if watch_req.after_sequence < 0 {
            return Err(automesh_rpc::status::invalid_field(
                "after_sequence",
                "must not be negative",
            ));
        }
        let run = self
            .store
            .get_run(&owner, &watch_req.run_id)
            .await
            .map_err(Error::from)?;
        Ok(Response::new(watch::spawn(
            self.clone(),
            run,
            watch_req.after_sequence,
            self.shutdown.clone(),
        )))
    }
}

impl Coordinator {
    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    pub(crate) async fn pb_of(&self, run: &Run) -> Result<pb::Run, Error> {
        self.to_pb(run).await
    }
}
