//! A lean HTTP/2 server connection (RFC 9113), for listeners that hold
//! many idle connections: the desktop runner listener, where every runner
//! keeps one stream open for hours and says nothing while it idles.
//!
//! hyper's HTTP/2 (h2) gives every connection fixed buffers whatever it
//! carries: a 16 KiB write buffer, an 8 KiB read buffer and a 4 KiB HPACK
//! buffer, most of an idle runner's cost. Here a connection holds only what
//! it is using: input is read into the task's stack and only an incomplete
//! frame is kept (and freed once complete); output is written as soon as it
//! is made and its buffer freed when large; our HPACK encoder keeps no table.
//! One task per connection drives every stream of it: a stream's call and
//! its response body are polled in that task, woken per stream.
//!
//! What it serves is the same tower service as hyper's loop (spans,
//! deadlines, concurrency limit, errors as gRPC statuses). Keepalive is the
//! same contract too: a PING after `keepalive.0` without a byte from the
//! peer, the connection closed when its answer takes longer than
//! `keepalive.1`, both deadlines rounded up to the server's grid.
//!
//! Protocol errors end the connection with GOAWAY (or a stream with
//! RST_STREAM) and the code RFC 9113 names; every wait is bounded (the
//! preface and each answer by the keepalive, the closing handshake by
//! [`CLOSE_WITHIN`]).

mod control;
mod frame;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
mod grid;
mod hpack;
mod inbound;
mod io;
mod keepalive;
mod outbound;
mod stream;

#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::net::TcpStream;
use tower::Service;

pub use frame::Reason;
pub use grid::GridTimer;
pub use stream::{RecvBody, StreamError};

use keepalive::Keepalive;
use stream::{ConnShared, StreamShared};

/// A boxed error, as tower passes them.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Each stream's receive window (SETTINGS_INITIAL_WINDOW_SIZE), and the
/// connection's: what a peer may send before the service reads it.
const STREAM_WINDOW: i64 = 1 << 20;
const CONN_WINDOW: i64 = 1 << 20;

/// The decoded size of a header block this server accepts
/// (SETTINGS_MAX_HEADER_LIST_SIZE); a larger request is answered 431.
const MAX_HEADER_LIST: usize = 16 * 1024;

/// The encoded size of a header block (HEADERS and its CONTINUATIONs) past
/// which the connection ends (ENHANCE_YOUR_CALM): HPACK can only shrink a
/// block that would decode within [`MAX_HEADER_LIST`] so far.
const MAX_HEADER_BLOCK: usize = 4 * MAX_HEADER_LIST;

/// CONTINUATION frames one header block may take (an endless run of
/// empty ones costs a server time without memory: CVE-2024-27316's flood).
const MAX_CONTINUATIONS: u32 = 64;

/// Streams the peer may reset before their answer is over, within one
/// second, before the connection ends ENHANCE_YOUR_CALM (a stream opened
/// and reset at once costs the server a call each: CVE-2023-44487's
/// "rapid reset").
const MAX_EARLY_RESETS: u32 = 200;

/// Output waiting to be written past which the connection reads nothing
/// and polls no response body, until the peer reads; reading resumes as
/// soon as what waits drains to [`OUT_LOW`] (no timer involved).
const OUT_HIGH: usize = 64 * 1024;
const OUT_LOW: usize = 16 * 1024;

/// Replies the peer demanded (PING and SETTINGS acknowledgements) made and
/// not yet written, past which the connection ends ENHANCE_YOUR_CALM: a
/// peer that floods them without reading the answers costs the server
/// memory and work for nothing (CVE-2019-9512 "ping flood", CVE-2019-9515
/// "settings flood"). The answers are written after every read, so a peer
/// that reads its answers never comes near it.
const MAX_UNANSWERED: usize = 4096;

/// Input read in one go, into the task's stack.
const READ_CHUNK: usize = 32 * 1024;

/// Input handled in one poll before the task yields to others.
const READ_BUDGET: usize = 256 * 1024;

/// Rounds of reading, answering and writing in one poll before the task
/// yields to others.
const ROUNDS: usize = 16;

/// How long a closing connection waits to flush its last frames (GOAWAY)
/// and for the peer to close its side.
pub const CLOSE_WITHIN: Duration = Duration::from_secs(1);

/// Streams that closed lately, remembered so that frames the peer sent
/// before it heard are told apart from a peer's mistakes.
const RECENT: usize = 16;

/// How a stream that is no longer open closed, which decides what a frame
/// the peer sends on it means (RFC 9113 §5.1, "closed").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Closed {
    /// This server reset it: what the peer sent before it heard is
    /// ignored.
    ByUs,
    /// The peer reset it: anything but PRIORITY after that is a stream
    /// error STREAM_CLOSED.
    ByPeer,
    /// Both sides ended it (END_STREAM): a HEADERS on it is a connection
    /// error STREAM_CLOSED, other frames a stream error.
    Ended,
}

/// What a connection serves: a service of requests whose bodies are
/// [`RecvBody`], answering with response bodies `B`.
pub trait Calls<B>:
    Service<http::Request<RecvBody>, Response = http::Response<B>, Error: Into<BoxError>> + Unpin
{
}

impl<S, B> Calls<B> for S where
    S: Service<http::Request<RecvBody>, Response = http::Response<B>, Error: Into<BoxError>>
        + Unpin
{
}

/// What a connection runs over: a TCP socket, or (fuzzing, tests) any byte
/// stream.
pub trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin {}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> Io for T {}

/// A response body a connection sends.
pub trait SendBody: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Unpin {}

impl<B> SendBody for B where B: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Unpin {}

/// What handling a frame comes to: go on, or the connection's error.
type Handled<T = ()> = std::result::Result<T, ConnError>;

/// A connection's bounds, from the server's settings.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_concurrent_streams: u32,
    pub keepalive: (Duration, Duration),
    pub ping_grid: Duration,
}

/// Why a connection ended with an error.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("keep-alive timed out: no PING answer within {0:?}")]
    KeepAlive(Duration),
    #[error("connection error {reason}: {why}")]
    Protocol { reason: Reason, why: &'static str },
    #[error("the peer ended the connection with {reason}: {debug}")]
    PeerGoAway { reason: Reason, debug: String },
    #[error("not an HTTP/2 connection preface")]
    Preface,
    #[error("the connection closed before its preface")]
    ClosedEarly,
    #[error("the service failed: {0}")]
    Service(BoxError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl ConnError {
    fn protocol(reason: Reason, why: &'static str) -> Self {
        ConnError::Protocol { reason, why }
    }

    /// The `cause` label of `automesh.http2.connections_ended`.
    fn cause(&self) -> &'static str {
        match self {
            ConnError::KeepAlive(_) => "keepalive",
            ConnError::Protocol { .. } => "protocol",
            ConnError::PeerGoAway { .. } => "peer_error",
            ConnError::Preface | ConnError::ClosedEarly => "not_http2",
            ConnError::Service(_) => "service",
            ConnError::Io(_) => "io",
        }
    }
}

/// The meter this crate's metrics are on: automesh's (the process's
/// Prometheus endpoint and OTLP export read it).
fn meter() -> opentelemetry::metrics::Meter {
    opentelemetry::global::meter("automesh")
}

/// Counts a lean connection's end by cause (`closed` for a clean end).
fn count_end(ended: &Result<(), ConnError>) {
    static ENDED: std::sync::OnceLock<opentelemetry::metrics::Counter<u64>> =
        std::sync::OnceLock::new();
    let counter = ENDED.get_or_init(|| {
        meter()
            .u64_counter("automesh.http2.connections_ended")
            .with_description(
                "Connections of the lean HTTP/2 server (the runner listener) that ended, by \
                 cause: closed (by the peer, or drained), keepalive (a PING unanswered within \
                 the bound), protocol (a breach of HTTP/2, answered with GOAWAY), peer_error \
                 (the peer's GOAWAY with an error), not_http2 (no HTTP/2 preface), io, service",
            )
            .build()
    });
    let cause = ended.as_ref().err().map_or("closed", ConnError::cause);
    counter.add(1, &[opentelemetry::KeyValue::new("cause", cause)]);
}

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the client's preface.
    Preface,
    /// Waiting for the client's first SETTINGS.
    Settings,
    Open,
    /// GOAWAY sent (shutdown) or received: the open streams finish, no new
    /// one starts.
    Draining,
    /// Flushing the last frames, then waiting for the peer to close.
    Closing,
}

/// What the response side of a stream is doing.
enum Out<F, B> {
    /// The request waits for the service to be ready.
    Waiting(Option<Box<http::Request<RecvBody>>>),
    /// The service is answering.
    Calling(Pin<Box<F>>),
    /// The response's headers are sent; its body is read. `data` is what is
    /// left of a data frame the windows did not let through yet.
    Body { body: B, data: Option<Bytes> },
    /// END_STREAM or RST_STREAM sent.
    Done,
}

/// One open stream.
struct Stream<F, B> {
    id: u32,
    shared: Arc<StreamShared>,
    /// What this server may still send (the peer's window).
    send_window: i64,
    /// What the peer may still send before it is given more, and what was
    /// read since and not yet given back.
    recv_window: i64,
    unacked: i64,
    /// A content-length the request declared, and what came so far.
    content_length: Option<u64>,
    received: u64,
    out: Out<F, B>,
}

/// A header block waiting for its CONTINUATION frames.
struct PartialBlock {
    stream: u32,
    /// CONTINUATION frames so far.
    continuations: u32,
    end_stream: bool,
    /// Its priority names the stream itself (a stream error once decoded).
    self_dependent: bool,
    octets: Vec<u8>,
}

/// One HTTP/2 connection served by `service`, a future that ends when the
/// connection does.
pub struct Connection<S, B, T = TcpStream>
where
    S: Service<http::Request<RecvBody>>,
{
    io: T,
    service: S,
    limits: Limits,
    shared: Arc<ConnShared>,
    phase: Phase,
    /// Octets of an incomplete frame (or preface), kept across reads.
    input: Vec<u8>,
    /// Frames made and not yet written, from `written` on.
    out: Vec<u8>,
    written: usize,
    decoder: loona_hpack::Decoder<'static>,
    block: Option<PartialBlock>,
    streams: Vec<Stream<S::Future, B>>,
    /// Streams to look at in this poll (woken, new, given window).
    ready: Vec<u32>,
    /// Requests waiting for the service, oldest first.
    waiting: VecDeque<u32>,
    /// The highest stream id the peer opened.
    last_stream: u32,
    /// Lately closed streams: id, and how each closed, oldest first from
    /// `next_recent`.
    recent: [(u32, Closed); RECENT],
    next_recent: usize,
    /// The peer's settings that bind what this server sends.
    peer_initial_window: i64,
    peer_max_frame: usize,
    /// The connection's send window, and what the peer may still send.
    send_window: i64,
    recv_window: i64,
    /// Octets read (or dropped) and not yet given back to the peer.
    recv_released: i64,
    /// Some stream could not send for the output buffer was full.
    starved: bool,
    /// Reading stopped for the output waiting to be written (see
    /// [`OUT_HIGH`]).
    paused: bool,
    /// PING and SETTINGS acknowledgements made and not yet written.
    unanswered: usize,
    /// The last stream id a GOAWAY of ours named.
    goaway: Option<u32>,
    /// Streams the peer reset before their answer was over, in the second
    /// that started at the instant given.
    early_resets: (Instant, u32),
    keepalive: Keepalive,
    /// Why the connection is closing, and until when it may take.
    ending: Option<(Option<ConnError>, Instant)>,
}

impl<S: Calls<B>, B: SendBody, T: Io> Connection<S, B, T> {
    pub fn new(io: T, service: S, limits: Limits) -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        // Our SETTINGS_HEADER_TABLE_SIZE is the default, 4096.
        decoder.set_max_allowed_table_size(4096);
        let mut out = Vec::with_capacity(64);
        // The server's preface: its settings, then a larger connection window.
        frame::settings(
            &mut out,
            &[
                (
                    frame::setting::MAX_CONCURRENT_STREAMS,
                    limits.max_concurrent_streams,
                ),
                (frame::setting::INITIAL_WINDOW_SIZE, STREAM_WINDOW as u32),
                (frame::setting::MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST as u32),
            ],
        );
        frame::window_update(&mut out, 0, (CONN_WINDOW - frame::DEFAULT_WINDOW) as u32);
        Self {
            io,
            service,
            keepalive: Keepalive::new(limits.keepalive, limits.ping_grid),
            limits,
            shared: Arc::default(),
            phase: Phase::Preface,
            input: Vec::new(),
            out,
            written: 0,
            decoder,
            block: None,
            streams: Vec::new(),
            ready: Vec::new(),
            waiting: VecDeque::new(),
            last_stream: 0,
            recent: [(0, Closed::Ended); RECENT],
            next_recent: 0,
            peer_initial_window: frame::DEFAULT_WINDOW,
            peer_max_frame: frame::DEFAULT_MAX_FRAME as usize,
            send_window: frame::DEFAULT_WINDOW,
            recv_window: CONN_WINDOW,
            recv_released: 0,
            starved: false,
            paused: false,
            unanswered: 0,
            goaway: None,
            early_resets: (Instant::now(), 0),
            ending: None,
        }
    }

    /// Stops taking new streams; the connection ends once the open ones
    /// have. In two steps, so that no stream the client sent before it
    /// heard is lost: a GOAWAY naming no last stream and a PING, then, once
    /// the PING is answered (everything sent before it has been read), the
    /// GOAWAY naming the last stream taken.
    pub fn graceful_shutdown(&mut self) {
        if matches!(self.phase, Phase::Preface | Phase::Settings) {
            // Nothing asked yet: nothing to finish.
            self.close(None);
            return;
        }
        if self.goaway.is_none() && self.ending.is_none() {
            frame::goaway(&mut self.out, frame::MAX_STREAM, Reason::NO_ERROR, "");
            frame::ping(&mut self.out, false, keepalive::DRAINING);
            // Answered within the keepalive's bound, or the connection ends.
            self.keepalive.expect_answer();
            self.goaway = Some(frame::MAX_STREAM);
            self.phase = Phase::Draining;
        }
    }

    /// The second step of a graceful shutdown: the GOAWAY that names the
    /// last stream taken.
    fn last_goaway(&mut self) {
        if self.goaway == Some(frame::MAX_STREAM) {
            frame::goaway(&mut self.out, self.last_stream, Reason::NO_ERROR, "");
            self.goaway = Some(self.last_stream);
        }
    }

    /// Ends the connection: `error` is why (none for a clean end). A
    /// protocol error is told to the peer first.
    fn close(&mut self, error: Option<ConnError>) {
        if self.ending.is_some() {
            return;
        }
        match &error {
            Some(ConnError::Protocol { reason, why }) => {
                frame::goaway(&mut self.out, self.last_stream, *reason, why);
            }
            None => self.last_goaway(),
            Some(_) => {}
        }
        self.phase = Phase::Closing;
        self.ending = Some((error, Instant::now() + CLOSE_WITHIN));
        self.lose_streams();
    }

    /// Every open stream ends as lost: their readers hear it, their calls
    /// and response bodies are dropped.
    fn lose_streams(&mut self) {
        for s in self.streams.drain(..) {
            s.shared.end(stream::End::Lost);
        }
        self.waiting.clear();
    }

    fn stream_index(&self, id: u32) -> Option<usize> {
        self.streams.iter().position(|s| s.id == id)
    }

    /// Remembers how stream `id` closed.
    fn remember(&mut self, id: u32, how: Closed) {
        self.recent[self.next_recent] = (id, how);
        self.next_recent = (self.next_recent + 1) % RECENT;
    }

    /// How stream `id` closed, when it did lately (the latest news of it).
    fn recently(&self, id: u32) -> Option<Closed> {
        (0..RECENT)
            .map(|k| self.recent[(self.next_recent + k) % RECENT])
            .filter(|(i, _)| *i == id && id != 0)
            .last()
            .map(|(_, how)| how)
    }

    /// Forgets open stream `i`: what its reader holds unread or read and
    /// not given back returns to the connection's window now, since no
    /// stream window is left to give it to.
    fn remove_stream(&mut self, i: usize) {
        let s = self.streams.swap_remove(i);
        let mut recv = s.shared.recv();
        self.recv_released += (std::mem::take(&mut recv.released) + recv.buffered) as i64;
    }

    fn poll_connection(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ConnError>> {
        self.shared.register(cx);
        self.shared.enter();
        let polled = self.poll_rounds(cx);
        // A stream that woke after the last look is looked at now.
        if self.shared.leave() && polled.is_pending() {
            cx.waker().wake_by_ref();
        }
        polled
    }

    fn poll_rounds(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ConnError>> {
        for _ in 0..ROUNDS {
            if self.phase == Phase::Closing {
                return self.poll_closing(cx);
            }
            match self.poll_input(cx) {
                Poll::Ready(Ok(true)) | Poll::Pending => {}
                Poll::Ready(Ok(false)) => {
                    let early = matches!(self.phase, Phase::Preface | Phase::Settings);
                    self.close(early.then_some(ConnError::ClosedEarly));
                    continue;
                }
                Poll::Ready(Err(e)) => {
                    self.close(Some(e));
                    continue;
                }
            }
            if self.phase == Phase::Closing {
                continue;
            }
            if let Err(e) = self.poll_streams(cx) {
                self.close(Some(e));
                continue;
            }
            if let Poll::Ready(e) = self.keepalive.poll(cx, &mut self.out) {
                self.close(Some(e));
                continue;
            }
            match self.poll_flush(cx) {
                Poll::Ready(Err(e)) => {
                    self.close(Some(e));
                    continue;
                }
                // The output drained while reading was stopped for it:
                // read again now, not when some timer next wakes the task
                // (nothing else would: the socket was not asked to).
                Poll::Ready(Ok(())) if self.paused => continue,
                _ => {}
            }
            if self.phase == Phase::Draining
                && self.streams.is_empty()
                && self.goaway != Some(frame::MAX_STREAM)
            {
                self.close(None);
                continue;
            }
            // Anything woken while this ran is looked at before sleeping.
            if self.ready.is_empty() {
                self.shared.take_ready(&mut self.ready);
                if self.ready.is_empty() {
                    return Poll::Pending;
                }
            }
        }
        // Still busy: others' turn first (a stream that keeps waking itself,
        // as tokio's budget makes it, must not hold the worker).
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl<S: Calls<B>, B: SendBody, T: Io> Future for Connection<S, B, T> {
    type Output = Result<(), ConnError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let ended = std::task::ready!(self.get_mut().poll_connection(cx));
        count_end(&ended);
        Poll::Ready(ended)
    }
}

impl<S, B, T> Drop for Connection<S, B, T>
where
    S: Service<http::Request<RecvBody>>,
{
    fn drop(&mut self) {
        // However the connection ends (its task aborted too), every reader
        // hears that its stream is gone.
        for s in &self.streams {
            s.shared.end(stream::End::Lost);
        }
    }
}
