//! `WatchRun`: a live, resumable stream of a run's events and state.
//!
//! The stream sends the run first, then every event after the requested
//! sequence in order, and the run again whenever its state changes. It ends
//! after the terminal state has been sent and every event before it drained.
//! It never waits unbounded: it ends at the run's deadline plus a grace
//! period with DEADLINE_EXCEEDED, and at shutdown with UNAVAILABLE. Memory is
//! bounded by the channel: a slow reader slows the poller, nothing queues.

use std::time::Duration;

use automesh_domain::Run;
use automesh_proto::coordinator::v1 as cpb;
use automesh_proto::v1 as pb;
use automesh_rpc::convert;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tracing::Instrument;

use crate::service::Coordinator;

/// How often the store is polled for new events and state.
const POLL_INTERVAL: Duration = Duration::from_millis(200);
/// Events read per query.
const BATCH: u32 = 256;
/// How long past its deadline a watch may wait for a run to end.
const GRACE: Duration = Duration::from_secs(300);
/// Responses buffered per stream.
const BUFFER: usize = 64;

type Tx = mpsc::Sender<Result<cpb::WatchRunResponse, Status>>;

pub(crate) fn spawn(
    coordinator: Coordinator,
    run: Run,
    after: i64,
    shutdown: CancellationToken,
) -> ReceiverStream<Result<cpb::WatchRunResponse, Status>> {
    let (tx, rx) = mpsc::channel(BUFFER);
    let span = tracing::info_span!("watch_run", run_id = %run.id);
    tokio::spawn(
        async move {
            if let Err(status) = follow(&coordinator, run, after, &tx, &shutdown).await {
                let _ = tx.send(Err(status)).await;
            }
        }
        .instrument(span),
    );
    ReceiverStream::new(rx)
}

fn run_update(run: pb::Run) -> cpb::WatchRunResponse {
    cpb::WatchRunResponse {
        update: Some(pb::WatchRunResponse {
            update: Some(pb::watch_run_response::Update::Run(run)),
        }),
    }
}

fn event_update(event: pb::RunEvent) -> cpb::WatchRunResponse {
    cpb::WatchRunResponse {
        update: Some(pb::WatchRunResponse {
            update: Some(pb::watch_run_response::Update::Event(event)),
        }),
    }
}

/// How long a reader may leave the buffer full before the watch ends.
const SLOW_READER: Duration = Duration::from_secs(60);

/// Sends, or reports that the reader went away or stopped reading.
async fn send(tx: &Tx, msg: cpb::WatchRunResponse) -> Result<(), Status> {
    match tokio::time::timeout(SLOW_READER, tx.send(Ok(msg))).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(Status::cancelled("watcher went away")),
        Err(_) => Err(Status::resource_exhausted(
            "the watcher stopped reading; resume from the last sequence",
        )),
    }
}

async fn follow(
    coordinator: &Coordinator,
    mut run: Run,
    mut after: i64,
    tx: &Tx,
    shutdown: &CancellationToken,
) -> Result<(), Status> {
    let store = coordinator.store();
    let give_up = run.deadline_at + chrono::Duration::from_std(GRACE).unwrap_or_default();
    send(tx, run_update(coordinator.pb_of(&run).await?)).await?;
    loop {
        // Read the state before draining events: every event committed before
        // a terminal state is then seen before the stream ends.
        let current = store
            .internal()
            .get_run(&run.id)
            .await
            .map_err(crate::Error::from)?;
        loop {
            let events = store
                .internal()
                .events(&run.id, after, BATCH)
                .await
                .map_err(crate::Error::from)?;
            let full = events.len() == BATCH as usize;
            for event in &events {
                after = event.sequence;
                send(tx, event_update(convert::event_to_pb(event))).await?;
            }
            if !full {
                break;
            }
        }
        if current.state != run.state || current.updated_at != run.updated_at {
            send(tx, run_update(coordinator.pb_of(&current).await?)).await?;
        }
        run = current;
        if run.state.is_terminal() {
            return Ok(());
        }
        if chrono::Utc::now() > give_up {
            return Err(Status::deadline_exceeded(
                "the run did not end by its deadline plus the grace period",
            ));
        }
        tokio::select! {
            () = tokio::time::sleep(POLL_INTERVAL) => {}
            () = tx.closed() => return Ok(()),
            () = shutdown.cancelled() => return Err(automesh_rpc::status::shutting_down("resume from the last sequence")),
        }
    }
}
