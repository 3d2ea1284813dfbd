//! The coordinator's operations on runs, and the thin gRPC handlers in front
//! of them.

use std::sync::Arc;
use std::time::Duration;

use automesh_domain::{Principal, Run};
use automesh_edge::convert;
use automesh_proto::coordinator::v1 as cpb;
use automesh_proto::coordinator::v1::run_coordinator_service_server::RunCoordinatorService;
use automesh_proto::v1 as pb;
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
    /// The runs watched here, one poller each.
    feeds: Arc<watch::Feeds>,
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
            feeds: Arc::default(),
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
            // Said in the run's trace (the request is a trace of its own).
            let span = automesh_telemetry::propagation::run_span(
                "automesh.run.cancel",
                &run.id,
                run.traceparent.as_deref(),
            );
            tracing::info!(parent: &span, run_id = %run.id, "cancellation requested");
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
    automesh_edge::scoped_calls! {
        get_run(cpb::GetRunRequest) -> cpb::GetRunResponse => serve_get[id];
        list_runs(cpb::ListRunsRequest) -> cpb::ListRunsResponse => serve_list[request];
        cancel_run(cpb::CancelRunRequest) -> cpb::CancelRunResponse => serve_cancel[id];
        list_run_events(cpb::ListRunEventsRequest) -> cpb::ListRunEventsResponse
            => serve_events[request];
        summarize_usage(cpb::SummarizeUsageRequest) -> cpb::SummarizeUsageResponse
            => serve_usage[request];
    }

    type WatchRunStream = ReceiverStream<Result<cpb::WatchRunResponse, Status>>;

    async fn watch_run(
        &self,
        request: Request<cpb::WatchRunRequest>,
    ) -> Result<Response<Self::WatchRunStream>, Status> {
        let (owner, req) = convert::scoped(request)?;
        let watch_req = req.request.unwrap_or_default();
        convert::require_id(&watch_req.run_id, "run_id").map_err(Error::from)?;
        convert::not_negative(watch_req.after_sequence, "after_sequence").map_err(Error::from)?;
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

    pub(crate) fn feeds(&self) -> &watch::Feeds {
        &self.feeds
    }

    /// Resolves when the process is told to stop.
    pub(crate) async fn shutting_down(&self) {
        self.shutdown.cancelled().await
    }
}

/// What a call answers, or why not.
type Reply<T> = Result<T, Error>;

/// What each call does for its caller.
impl Coordinator {
    async fn serve_get(&self, owner: Principal, id: String) -> Reply<cpb::GetRunResponse> {
        Ok(cpb::GetRunResponse {
            run: Some(self.run_pb(&owner, &id).await?),
        })
    }

    async fn serve_list(
        &self,
        owner: Principal,
        list: pb::ListRunsRequest,
    ) -> Reply<cpb::ListRunsResponse> {
        let narrowed = convert::run_list_filter(&list)?;
        let filter = automesh_store::runs::RunFilter {
            automation_id: (!list.automation_id.is_empty()).then_some(list.automation_id.as_str()),
            states: narrowed.states,
            created_after: narrowed.created_after,
            created_before: narrowed.created_before,
            error_codes: narrowed.error_codes,
        };
        let size = convert::page_size(list.page_size, 50, "page_size")?;
        let cursor = Cursor::decode(&list.page_token)?;
        let page = self.store.list_runs(&owner, &filter, &cursor, size).await?;
        let mut receipts = self
            .store
            .receipts_of_run_page(&owner, &filter, &cursor, size)
            .await?;
        let runs = page
            .items
            .iter()
            .map(|run| {
                // A receipt written after the page was read waits for the
                // next read, with the run's end.
                let receipt = receipts.remove(&run.id).filter(|_| run.state.is_terminal());
                convert::run_to_pb(run, receipt.as_ref())
            })
            .collect();
        let (runs, next_page_token) = page.cut(runs, automesh_proto::bounds::fitting);
        let response = Some(pb::ListRunsResponse {
            runs,
            next_page_token,
        });
        Ok(cpb::ListRunsResponse { response })
    }

    async fn serve_usage(
        &self,
        owner: Principal,
        request: pb::SummarizeUsageRequest,
    ) -> Reply<cpb::SummarizeUsageResponse> {
        let query = convert::parse_usage_query(&request)?;
        if let Some(id) = &query.automation_id {
            // Another user's automation is the unknown one's NOT_FOUND, not
            // an empty summary.
            self.store.get_automation(&owner, id).await?;
        }
        let quarters = self.store.usage_by_quarter_hour(
            &owner,
            query.automation_id.as_deref(),
            query.start,
            query.end,
        );
        let response = Some(convert::usage_summary(&query, &quarters.await?));
        Ok(cpb::SummarizeUsageResponse { response })
    }

    async fn serve_cancel(&self, owner: Principal, id: String) -> Reply<cpb::CancelRunResponse> {
        let run = self.cancel(&owner, &id, Utc::now()).await?;
        Ok(cpb::CancelRunResponse {
            run: Some(self.to_pb(&run).await?),
        })
    }

    async fn serve_events(
        &self,
        owner: Principal,
        list: pb::ListRunEventsRequest,
    ) -> Reply<cpb::ListRunEventsResponse> {
        convert::require_id(&list.run_id, "run_id")?;
        let size = convert::page_size(list.page_size, 100, "page_size")?;
        convert::not_negative(list.after_sequence, "after_sequence")?;
        // Scope first: another tenant's run is not found.
        self.store.get_run(&owner, &list.run_id).await?;
        let internal = self.store.internal();
        let events = internal
            .events(&list.run_id, list.after_sequence, size)
            .await?;
        let mut events: Vec<pb::RunEvent> = events.iter().map(convert::event_to_pb).collect();
        // Within the page byte budget; `last_sequence` says where the next
        // page starts.
        events.truncate(automesh_proto::bounds::fitting(&events));
        let last_sequence = events.last().map_or(list.after_sequence, |e| e.sequence);
        let response = Some(pb::ListRunEventsResponse {
            events,
            last_sequence,
        });
        Ok(cpb::ListRunEventsResponse { response })
    }
}
