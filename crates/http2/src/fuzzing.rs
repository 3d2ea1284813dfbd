//! Entry points for fuzzing what parses untrusted bytes (feature
//! `fuzzing`; the targets are in `crates/http2/fuzz`, see the README):
//! [`frames`] drives a whole connection — the frame decoder, HPACK, the
//! stream state machine, flow control, the service's calls and answers —
//! with arbitrary octets after the client preface, cut into reads at
//! arbitrary places; [`headers`] decodes arbitrary header blocks with one
//! decoder, as a connection's blocks share its table. Neither may panic,
//! loop or grow without bound, whatever the input.

use std::convert::Infallible;
use std::future::Future as _;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};
use tokio::io::{AsyncRead, ReadBuf};

use crate::{Connection, Limits, RecvBody};

thread_local! {
    /// The runtime the connection's timers register with (never driven:
    /// a fuzzed connection's timers do not fire).
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
}

/// A short answer with trailers, as a gRPC server gives.
struct Answer(u8);

impl Body for Answer {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let frame = match self.0 {
            0 => Frame::data(Bytes::from_static(b"\0\0\0\0\x02ok")),
            1 => {
                let mut trailers = http::HeaderMap::new();
                trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                Frame::trailers(trailers)
            }
            _ => return Poll::Ready(None),
        };
        self.0 += 1;
        Poll::Ready(Some(Ok(frame)))
    }
}

/// Reads a request's body to its end (bounded by what the peer sends),
/// then answers.
async fn answer(request: http::Request<RecvBody>) -> Result<http::Response<Answer>, Infallible> {
    let mut body = request.into_body();
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        if frame.is_err() {
            break;
        }
    }
    Ok(http::Response::new(Answer(0)))
}

/// One connection fed `input` after the client preface. The first octet
/// says where reads end (so incomplete frames are kept across reads); the
/// connection is polled after each read, and drained at the end.
pub fn frames(input: &[u8]) {
    RUNTIME.with(|runtime| {
        let _in_runtime = runtime.enter();
        let (mut peer, server) = tokio::io::duplex(1 << 16);
        let limits = Limits {
            max_concurrent_streams: 16,
            keepalive: (Duration::from_secs(3600), Duration::from_secs(3600)),
            ping_grid: Duration::from_millis(10),
        };
        let mut connection = Connection::new(server, tower::service_fn(answer), limits);
        let mut cx = Context::from_waker(Waker::noop());
        let step = usize::from(input.first().copied().unwrap_or(0)) + 1;
        let mut octets = crate::frame::PREFACE.to_vec();
        octets.extend_from_slice(input.get(1..).unwrap_or_default());
        let mut pending = Vec::new();
        for read in octets.chunks(step) {
            pending.extend_from_slice(read);
            match connection.on_input(&pending) {
                Ok(used) => {
                    pending.drain(..used);
                }
                Err(_) => return,
            }
            if Pin::new(&mut connection).poll(&mut cx).is_ready() {
                return;
            }
            drain(&mut peer, &mut cx);
        }
        connection.graceful_shutdown();
        for _ in 0..4 {
            if Pin::new(&mut connection).poll(&mut cx).is_ready() {
                return;
            }
            drain(&mut peer, &mut cx);
        }
    });
}

/// Reads (and drops) what the connection wrote, so it never blocks.
fn drain(peer: &mut tokio::io::DuplexStream, cx: &mut Context<'_>) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let mut read = ReadBuf::new(&mut buf);
        match Pin::new(&mut *peer).poll_read(cx, &mut read) {
            Poll::Ready(Ok(())) if !read.filled().is_empty() => {}
            _ => return,
        }
    }
}

/// Header blocks decoded one after another by one decoder: the first
/// octet says where the first block ends, the second whether the blocks
/// are trailers.
pub fn headers(input: &[u8]) {
    let [cut, trailers, blocks @ ..] = input else {
        return;
    };
    let mut decoder = loona_hpack::Decoder::new();
    decoder.set_max_allowed_table_size(4096);
    let (first, second) = blocks.split_at(usize::from(*cut).min(blocks.len()));
    for block in [first, second] {
        match crate::hpack::decode(
            &mut decoder,
            block,
            crate::MAX_HEADER_LIST,
            *trailers & 1 == 1,
        ) {
            Ok(decoded) => {
                let _ = decoded.into_request(());
            }
            Err(_) => return,
        }
    }
}
