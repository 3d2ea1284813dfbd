//! A run page's live part: server-sent events fed from the API's
//! `WatchRun`. Each thread event goes out with its sequence number as the
//! SSE id, so a browser that lost its connection reconnects with
//! `Last-Event-ID` and the watch resumes after it: no gap, no repeat.
//!
//! Events (`event:` names the page's script listens for):
//! - `item`: one thread event, rendered (escaped) HTML, with its sequence as id;
//! - `run`: the run's summary, re-rendered at every state change;
//! - `end`: the run is over and the stream closes (the script stops);
//! - `gone`: the gateway stopped answering; the browser reconnects by
//!   itself after the `retry` interval and resumes;
//! - `fatal`: the run is not the user's or the session ended; no retry.

use std::convert::Infallible;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use automesh_proto::v1 as pb;
use axum::extract::{Path, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream, StreamExt};
use http::HeaderMap;
use tonic::Code;

use crate::AppState;
use crate::pages::runs::{event_item, started_at, summary};
use crate::session::Session;

/// How long a browser waits before it reconnects.
const RETRY: Duration = Duration::from_secs(2);

/// Live pages open in this process (all consoles of the process share it).
static OPEN: AtomicU64 = AtomicU64::new(0);

/// The count of live pages, reported as `automesh.console.live.watchers`.
#[derive(Clone, Debug, Default)]
pub struct Watchers;

impl Watchers {
    /// Counts a live page for as long as the guard lives.
    fn enter(&self) -> Open {
        static GAUGE: OnceLock<opentelemetry::metrics::ObservableGauge<u64>> = OnceLock::new();
        GAUGE.get_or_init(|| {
            automesh_telemetry::metrics::meter()
                .u64_observable_gauge("automesh.console.live.watchers")
                .with_unit("{page}")
                .with_description("Live run pages (server-sent event streams) this console serves")
                .with_callback(|o| o.observe(OPEN.load(Ordering::Relaxed), &[]))
                .build()
        });
        OPEN.fetch_add(1, Ordering::Relaxed);
        Open
    }

    /// Live pages open now.
    pub fn open() -> u64 {
        OPEN.load(Ordering::Relaxed)
    }
}

struct Open;

impl Drop for Open {
    fn drop(&mut self) {
        OPEN.fetch_sub(1, Ordering::Relaxed);
    }
}

type Events = std::pin::Pin<Box<dyn Stream<Item = Result<Event, Infallible>> + Send>>;

fn one(event: Event) -> Events {
    Box::pin(stream::once(async move { Ok(event) }))
}

fn sse(events: Events) -> Response {
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

pub async fn events(
    State(state): State<AppState>,
    session: Session,
    Path(id): Path<String>,
    headers: HeaderMap,
    uri: http::Uri,
) -> Response {
    // The browser's Last-Event-ID wins over the page's starting point.
    let after = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i64>().ok())
        .or_else(|| crate::Form::query(&uri).text("after").parse().ok())
        .unwrap_or(0)
        .max(0);
    let retry = Event::default().retry(RETRY);
    let opened = async {
        let mut client = state.api.watch(session.token())?;
        let request = pb::WatchRunRequest {
            run_id: id.clone(),
            after_sequence: after,
        };
        match tokio::time::timeout(state.api.timeout(), client.watch_run(request)).await {
            Ok(answer) => answer.map(tonic::Response::into_inner),
            Err(_) => Err(tonic::Status::deadline_exceeded(
                "the gateway did not answer the watch",
            )),
        }
    };
    let upstream = match opened.await {
        Ok(s) => s,
        Err(s) if crate::api::unreachable(&s) => {
            tracing::warn!(run_id = %id, error = %s.message(), "live page: gateway unreachable");
            let gone = Event::default().event("gone").data(s.message());
            return sse(Box::pin(stream::iter([Ok(retry), Ok(gone)])));
        }
        Err(s) => {
            let fatal = Event::default().event("fatal").data(match s.code() {
                Code::Unauthenticated => "signed-out",
                Code::NotFound => "not-found",
                _ => "refused",
            });
            return sse(one(fatal));
        }
    };
    // A resumed page still shows when the run started.
    let mut started = None;
    if after > 0
        && let Ok(mut runs) = state.api.runs(session.token())
        && let Ok(events) = runs
            .list_run_events(pb::ListRunEventsRequest {
                run_id: id.clone(),
                after_sequence: 0,
                page_size: 1000,
            })
            .await
    {
        started = started_at(&events.into_inner().events);
    }
    if after > 0 {
        tracing::info!(run_id = %id, after, "live page resumed");
    }
    let open = state.live.enter();
    let shutdown = state.shutdown.clone();
    let updates = stream::unfold(
        (upstream, session, started, open, false),
        |(mut upstream, session, mut started, open, done)| async move {
            if done {
                return None;
            }
            let event = match upstream.message().await {
                Ok(Some(pb::WatchRunResponse {
                    update: Some(update),
                })) => match update {
                    pb::watch_run_response::Update::Event(e) => {
                        if started.is_none() {
                            started = started_at(std::slice::from_ref(&e));
                        }
                        Event::default()
                            .event("item")
                            .id(e.sequence.to_string())
                            .data(event_item(&session, &e).into_string())
                    }
                    pb::watch_run_response::Update::Run(r) => Event::default()
                        .event("run")
                        .data(summary(&session, &r, started.as_ref()).into_string()),
                },
                Ok(Some(_)) => Event::default().comment("empty update"),
                Ok(None) => {
                    let end = Event::default().event("end").data("the run is over");
                    return Some((Ok(end), (upstream, session, started, open, true)));
                }
                Err(s) => {
                    tracing::warn!(error = %s.message(), "live page: the watch ended early");
                    let gone = Event::default().event("gone").data(s.message());
                    return Some((Ok(gone), (upstream, session, started, open, true)));
                }
            };
            Some((Ok(event), (upstream, session, started, open, false)))
        },
    )
    .take_until(async move { shutdown.cancelled().await });
    sse(Box::pin(stream::once(async { Ok(retry) }).chain(updates)))
}
