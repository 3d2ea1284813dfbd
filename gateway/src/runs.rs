//! `automesh.v1.Runs`: served by the run-coordinator for the caller.

use std::pin::Pin;

use automesh_edge::convert;
use automesh_edge::status;
use automesh_proto::coordinator::v1 as cpb;
use automesh_proto::v1 as pb;
use automesh_proto::v1::runs_server::Runs;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::{Gateway, forwarded};

// Each call is passed on to the coordinator (see `pass.rs`); a watch
// streams the coordinator's updates through.
#[tonic::async_trait]
impl Runs for Gateway {
    crate::pass::passed! {
        get_run(GetRunRequest) -> GetRunResponse;
        list_runs(ListRunsRequest) -> ListRunsResponse;
        cancel_run(CancelRunRequest) -> CancelRunResponse;
        list_run_events(ListRunEventsRequest) -> ListRunEventsResponse;
        summarize_usage(SummarizeUsageRequest) -> SummarizeUsageResponse;
    }

    type WatchRunStream = Pin<Box<dyn Stream<Item = Result<pb::WatchRunResponse, Status>> + Send>>;

    async fn watch_run(
        &self,
        request: Request<pb::WatchRunRequest>,
    ) -> Result<Response<Self::WatchRunStream>, Status> {
        let call = self.accept(request, |r| convert::require_id(&r.run_id, "run_id"))?;
        let upstream = cpb::WatchRunRequest {
            caller: call.caller(),
            request: Some(call.req),
        };
        let answer = self.upstreams.coordinator().watch_run(upstream).await;
        // Each update passes through; an upstream error ends the stream as
        // it came.
        let stream = forwarded(answer)?.map(|item| {
            item.map(|m| m.update.unwrap_or_default())
                .map_err(status::forward)
        });
        Ok(Response::new(Box::pin(stream)))
    }
}
