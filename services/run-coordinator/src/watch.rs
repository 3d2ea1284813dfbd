//! `WatchRun`: a live, resumable stream of a run's events and state.
//!
//! The stream sends the run first, then every event after the requested
//! sequence in order, and the run again whenever its state changes. It ends
//! after the terminal state has been sent and every event before it drained.
//! It never waits unbounded: it ends at the run's deadline plus a grace
//! period with DEADLINE_EXCEEDED, and at shutdown with UNAVAILABLE.
//!
//! However many watch one run, one poller per process reads it (a feed):
//! each watcher first catches up from the store on its own, then follows
//! the feed's ticks, skipping what it already sent. A watcher that falls
//! behind the feed's buffer catches up from the store again, so memory is
//! bounded by the buffers and a slow reader never slows the others.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use automesh_domain::{Run, RunEvent};
use automesh_edge::convert;
use automesh_proto::coordinator::v1 as cpb;
use automesh_proto::v1 as pb;
use tokio::sync::{broadcast, mpsc};
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
/// Ticks a feed keeps for watchers that have not read them yet.
const FEED_BUFFER: usize = 64;

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

/// What one read of a watched run found: the run, then (read after it)
/// its next events, and whether those were all there were. Every event
/// committed before a terminal state is in a tick before or with the first
/// drained tick that carries that state.
#[derive(Debug)]
struct Tick {
    run: Run,
    events: Vec<RunEvent>,
    drained: bool,
}

type Fed = Arc<Result<Tick, Status>>;

/// The runs watched in this process, each read by one poller.
#[derive(Debug, Default)]
pub(crate) struct Feeds(Mutex<HashMap<String, broadcast::Sender<Fed>>>);

impl Feeds {
    /// The feed of `run_id`, started (reading events after `after`) unless
    /// one is running.
    fn subscribe(
        &self,
        coordinator: &Coordinator,
        run_id: &str,
        after: i64,
    ) -> broadcast::Receiver<Fed> {
        let mut feeds = self.0.lock();
        if let Some(feed) = feeds.get(run_id) {
            return feed.subscribe();
        }
        let (feed, rx) = broadcast::channel(FEED_BUFFER);
        feeds.insert(run_id.to_owned(), feed.clone());
        let span = tracing::info_span!("watch_feed", run_id = %run_id);
        let poller = poll(coordinator.clone(), run_id.to_owned(), after, feed);
        tokio::spawn(poller.instrument(span));
        rx
    }

    /// Ends the feed `feed` of `run_id` unless someone still follows it;
    /// whether it ended.
    fn end_if_unwatched(
        &self,
        run_id: &str,
        feed: &broadcast::Sender<Fed>,
        terminal: bool,
    ) -> bool {
        let mut feeds = self.0.lock();
        if !terminal && feed.receiver_count() > 0 {
            return false;
        }
        if feeds.get(run_id).is_some_and(|f| f.same_channel(feed)) {
            feeds.remove(run_id);
        }
        true
    }
}

/// Reads `run_id` once: the run, then up to a batch of its events after
/// `after`.
async fn read(coordinator: &Coordinator, run_id: &str, after: i64) -> Result<Tick, Status> {
    let store = coordinator.store().internal();
    let run = store.get_run(run_id).await.map_err(crate::Error::from)?;
    let events = store
        .events(run_id, after, BATCH)
        .await
        .map_err(crate::Error::from)?;
    let drained = events.len() < BATCH as usize;
    Ok(Tick {
        run,
        events,
        drained,
    })
}

/// One run's poller: reads it every poll interval (at once while a batch
/// came full) and sends what it found to every follower, until the run
/// ended, nobody follows, a read failed or the process stops.
async fn poll(
    coordinator: Coordinator,
    run_id: String,
    mut after: i64,
    feed: broadcast::Sender<Fed>,
) {
    let feeds = coordinator.feeds();
    loop {
        let tick = read(&coordinator, &run_id, after).await;
        let (terminal, drained) = match &tick {
            Ok(t) => {
                after = t.events.last().map_or(after, |e| e.sequence);
                (t.run.state.is_terminal() && t.drained, t.drained)
            }
            Err(_) => (true, true),
        };
        let _ = feed.send(Arc::new(tick));
        if feeds.end_if_unwatched(&run_id, &feed, terminal) {
            return;
        }
        if drained {
            tokio::select! {
                () = tokio::time::sleep(POLL_INTERVAL) => {}
                () = coordinator.shutting_down() => {
                    feeds.end_if_unwatched(&run_id, &feed, true);
                    return;
                }
            }
        }
    }
}

/// The watcher's state: the run as last sent, and the last event sent.
struct Sent {
    run: Run,
    after: i64,
}

impl Sent {
    /// Follows a feed's `tick`: what it holds that was not sent yet, or,
    /// when the feed started past this watcher (its first new event is not
    /// the next one), what the store holds; whether the stream is over.
    async fn tick(
        &mut self,
        coordinator: &Coordinator,
        tx: &Tx,
        tick: &Tick,
    ) -> Result<bool, Status> {
        let next = tick.events.iter().find(|e| e.sequence > self.after);
        if next.is_some_and(|e| e.sequence > self.after + 1) {
            return self.catch_up(coordinator, tx).await;
        }
        self.send(coordinator, tx, tick).await
    }

    /// Sends what `tick` holds that was not sent yet; whether the stream is
    /// over (the run ended and every event before its end was sent).
    async fn send(
        &mut self,
        coordinator: &Coordinator,
        tx: &Tx,
        tick: &Tick,
    ) -> Result<bool, Status> {
        let sent = self.after;
        for event in tick.events.iter().filter(|e| e.sequence > sent) {
            self.after = event.sequence;
            send(tx, event_update(convert::event_to_pb(event))).await?;
        }
        // A tick may be older than what a catch-up already sent: the run
        // only moves forward.
        let current = &tick.run;
        let newer = current.updated_at > self.run.updated_at
            || (current.updated_at == self.run.updated_at
                && current.state != self.run.state
                && !self.run.state.is_terminal());
        if newer {
            send(tx, run_update(coordinator.pb_of(current).await?)).await?;
            self.run = current.clone();
        }
        Ok(self.run.state.is_terminal() && tick.drained)
    }

    /// Catches up from the store on its own (before following a feed, and
    /// after falling behind one); whether the stream is over.
    async fn catch_up(&mut self, coordinator: &Coordinator, tx: &Tx) -> Result<bool, Status> {
        loop {
            let tick = read(coordinator, &self.run.id, self.after).await?;
            let over = self.send(coordinator, tx, &tick).await?;
            if over || tick.drained {
                return Ok(over);
            }
        }
    }
}

async fn follow(
    coordinator: &Coordinator,
    run: Run,
    after: i64,
    tx: &Tx,
    shutdown: &CancellationToken,
) -> Result<(), Status> {
    let give_up = run.deadline_at + chrono::Duration::from_std(GRACE).unwrap_or_default();
    let give_up = (give_up - chrono::Utc::now()).to_std().unwrap_or_default();
    let give_up = tokio::time::Instant::now() + give_up;
    send(tx, run_update(coordinator.pb_of(&run).await?)).await?;
    let mut sent = Sent { run, after };
    // Following first, catching up second: nothing committed in between is
    // missed (what both carry is sent once, by sequence).
    let mut feed = coordinator
        .feeds()
        .subscribe(coordinator, &sent.run.id, after);
    if sent.catch_up(coordinator, tx).await? {
        return Ok(());
    }
    loop {
        let fed = tokio::select! {
            fed = feed.recv() => fed,
            () = tx.closed() => return Ok(()),
            () = shutdown.cancelled() => return Err(automesh_edge::status::shutting_down("resume from the last sequence")),
            () = tokio::time::sleep_until(give_up) => return Err(Status::deadline_exceeded(
                "the run did not end by its deadline plus the grace period",
            )),
        };
        let over = match fed {
            Ok(fed) => match fed.as_ref() {
                Ok(tick) => sent.tick(coordinator, tx, tick).await?,
                Err(status) => return Err(status.clone()),
            },
            // Behind the feed's buffer: the store has what was skipped.
            Err(broadcast::error::RecvError::Lagged(_)) => sent.catch_up(coordinator, tx).await?,
            // The feed ended (the run ended, or its poller stopped): the
            // store says which; a new feed follows a run still going.
            Err(broadcast::error::RecvError::Closed) => {
                if shutdown.is_cancelled() {
                    return Err(automesh_edge::status::shutting_down(
                        "resume from the last sequence",
                    ));
                }
                feed = coordinator
                    .feeds()
                    .subscribe(coordinator, &sent.run.id, sent.after);
                sent.catch_up(coordinator, tx).await?
            }
        };
        if over {
            return Ok(());
        }
    }
}
