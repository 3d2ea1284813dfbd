//! The lean HTTP/2 connection against a client written here from RFC 9113
//! that speaks raw frames over real loopback TCP: what a conforming server
//! answers, every protocol breach's code, flow control both ways,
//! keepalive, resets, lost connections and the graceful drain. (Real gRPC
//! clients — tonic's, grpcurl's — are driven against it by the runner
//! tests of `desktop-runner-gateway` and `cli`.)

mod client;
mod errors;
mod floods;
mod service;

use std::time::Duration;

use bytes::Bytes;

use super::frame::{Reason, flag, kind, setting};
use client::{Client, Server};
use service::Event;

#[tokio::test]
async fn a_request_is_answered_with_headers_data_and_trailers() {
    let server = Server::start().await;
    let mut c = Client::raw(server.addr).await;
    c.write(super::frame::PREFACE).await;
    c.settings(&[]).await;
    // The server's preface: SETTINGS first, then a larger window.
    let (head, payload) = c.frame().await.expect("SETTINGS");
    assert_eq!((head.kind, head.flags, head.stream), (kind::SETTINGS, 0, 0));
    let values = client::settings_of(&payload);
    assert!(
        values.contains(&(setting::MAX_CONCURRENT_STREAMS, 8)),
        "{values:?}"
    );
    assert!(
        values.contains(&(setting::INITIAL_WINDOW_SIZE, 1 << 20)),
        "{values:?}"
    );
    c.send(kind::SETTINGS, flag::ACK, 0, &[]).await;
    let (head, _) = c.frame().await.expect("WINDOW_UPDATE");
    assert_eq!((head.kind, head.stream), (kind::WINDOW_UPDATE, 0));
    let (head, _) = c.frame().await.expect("its ack of our settings");
    assert_eq!((head.kind, head.flags), (kind::SETTINGS, flag::ACK));

    // A header block split over HEADERS and two CONTINUATIONs, padded.
    let block = c.block(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/echo"),
        ("x-pad", &"p".repeat(40)),
    ]);
    let (a, rest) = block.split_at(10);
    let (b, d) = rest.split_at(10);
    let mut padded = vec![3];
    padded.extend_from_slice(a);
    padded.extend_from_slice(&[0, 0, 0]);
    c.send(kind::HEADERS, flag::PADDED, 1, &padded).await;
    c.send(kind::CONTINUATION, 0, 1, b).await;
    c.send(kind::CONTINUATION, flag::END_HEADERS, 1, d).await;
    c.send(kind::DATA, 0, 1, b"hello ").await;
    c.send(
        kind::DATA,
        flag::PADDED | flag::END_STREAM,
        1,
        b"\x02world\0\0",
    )
    .await;

    let answer = c.response(1).await;
    assert_eq!(answer.status, "200");
    assert_eq!(answer.data, b"hello world");
    assert_eq!(
        answer.trailers,
        [("grpc-status".to_owned(), "0".to_owned())]
    );
    // The same connection serves the next stream.
    c.request(3, "/echo", true).await;
    let answer = c.response(3).await;
    assert_eq!((answer.status.as_str(), answer.data.len()), ("200", 0));
}

#[tokio::test]
async fn a_response_with_no_body_ends_with_its_headers() {
    let server = Server::start().await;
    let mut c = Client::connect(server.addr).await;
    c.request(1, "/trailers-only", true).await;
    let (head, payload) = c.until(|h| h.kind == kind::HEADERS).await;
    assert!(head.has(flag::END_STREAM | flag::END_HEADERS), "{head:?}");
    let fields = c.decode(&payload);
    assert!(
        fields.contains(&("grpc-status".to_owned(), "12".to_owned())),
        "{fields:?}"
    );
}

#[tokio::test]
async fn pings_are_answered_and_an_unanswered_ping_ends_the_connection() {
    let mut server = Server::start().await;
    let mut c = Client::connect(server.addr).await;
    c.auto_pong = false;
    c.send(kind::PING, 0, 0, b"12345678").await;
    let (head, payload) = c.until(|h| h.kind == kind::PING).await;
    assert_eq!(
        (head.flags, payload.as_slice()),
        (flag::ACK, &b"12345678"[..])
    );

    // Silent, it is PINGed (200 ms); answering keeps it open.
    for _ in 0..3 {
        let (head, payload) = c.until(|h| h.kind == kind::PING).await;
        assert_eq!(head.flags, 0);
        c.send(kind::PING, flag::ACK, 0, &payload).await;
    }
    c.still_serves(1).await;
    // Not answering, it is closed once the answer is 300 ms late.
    let t = std::time::Instant::now();
    let _ = c.until(|h| h.kind == kind::PING).await;
    assert!(c.eof().await, "the connection closes");
    assert!(
        t.elapsed() >= Duration::from_millis(290),
        "{:?}",
        t.elapsed()
    );
    let ended = server.ended().await;
    assert!(ended.contains("keep-alive timed out"), "{ended}");
}

#[tokio::test]
async fn the_response_waits_for_the_peers_window() {
    let server = Server::start().await;
    let mut c = Client::raw(server.addr).await;
    c.write(super::frame::PREFACE).await;
    // Streams may carry 10 octets until told more.
    c.settings(&[(setting::INITIAL_WINDOW_SIZE, 10)]).await;
    c.request(1, "/big", true).await;
    let mut got = 0;
    while got < 10 {
        let (_, payload) = c.until(|h| h.kind == kind::DATA).await;
        got += payload.len();
    }
    assert_eq!(got, 10);
    assert!(
        c.quiet(Duration::from_millis(200), |h| h.kind == kind::DATA)
            .await
    );
    c.send(kind::WINDOW_UPDATE, 0, 1, &90u32.to_be_bytes())
        .await;
    let answer = c.response(1).await;
    assert_eq!(answer.data.len(), 90);
    assert_eq!(
        answer.trailers,
        [("grpc-status".to_owned(), "0".to_owned())]
    );
}

#[tokio::test]
async fn a_cancelled_stream_ends_its_reader_and_drops_its_response() {
    let mut server = Server::start().await;
    let mut c = Client::connect(server.addr).await;
    c.request(1, "/hold", false).await;
    let (head, _) = c.until(|h| h.kind == kind::HEADERS).await;
    assert_eq!(head.stream, 1);
    c.send(kind::DATA, 0, 1, b"part").await;
    assert_eq!(server.event().await, Event::Read(4));
    c.send(kind::RST_STREAM, 0, 1, &Reason::CANCEL.0.to_be_bytes())
        .await;
    server
        .ended_and_dropped(super::StreamError::Reset {
            reason: Reason::CANCEL,
            by_peer: true,
        })
        .await;
    // Frames the client sent before it heard are no error.
    c.send(kind::DATA, 0, 1, b"late").await;
    c.still_serves(3).await;
}

#[tokio::test]
async fn a_lost_connection_ends_its_readers_as_cancelled() {
    let mut server = Server::start().await;
    let mut c = Client::connect(server.addr).await;
    c.request(1, "/hold", false).await;
    let _ = c.until(|h| h.kind == kind::HEADERS).await;
    drop(c);
    server.ended_and_dropped(super::StreamError::Lost).await;
}

#[tokio::test]
async fn graceful_shutdown_finishes_open_streams_and_refuses_new_ones() {
    let mut server = Server::start().await;
    let mut c = Client::connect(server.addr).await;
    c.request(1, "/echo", false).await;
    c.send(kind::DATA, 0, 1, b"before").await;
    server.drain();
    // First a GOAWAY that names no last stream, and a PING: what the
    // client sent before it heard is still taken.
    let (_, payload) = c.until(|h| h.kind == kind::GOAWAY).await;
    assert_eq!(&payload[..8], &[0x7f, 0xff, 0xff, 0xff, 0, 0, 0, 0]);
    // Once the PING is answered (by the client, as it reads), the last.
    let (_, payload) = c.until(|h| h.kind == kind::GOAWAY).await;
    assert_eq!(
        &payload[..8],
        &[0, 0, 0, 1, 0, 0, 0, 0],
        "last stream 1, NO_ERROR"
    );
    // Opened after the GOAWAY: ignored, so the client may retry it.
    c.request(3, "/echo", true).await;
    c.send(kind::DATA, flag::END_STREAM, 1, b" after").await;
    let answer = c.response(1).await;
    assert_eq!(answer.data, b"before after");
    assert!(c.eof().await, "closed once its streams are done");
    assert_eq!(server.ended().await, "ok");
}

#[tokio::test]
async fn a_connection_drained_before_its_preface_just_closes() {
    let mut server = Server::start().await;
    let mut c = Client::raw(server.addr).await;
    // The server's preface arrives; the client has sent nothing yet.
    let (head, _) = c.frame().await.expect("SETTINGS");
    assert_eq!(head.kind, kind::SETTINGS);
    server.drain();
    assert!(c.eof().await, "closed, nothing to finish");
    assert_eq!(server.ended().await, "ok");
}

#[tokio::test]
async fn streams_past_the_limit_are_refused() {
    let server = Server::start().await;
    let mut c = Client::connect(server.addr).await;
    for id in (1..=15).step_by(2) {
        c.request(id, "/hold", false).await;
    }
    c.request(17, "/hold", false).await;
    let (_, payload) = c
        .until(|h| h.kind == kind::RST_STREAM && h.stream == 17)
        .await;
    assert_eq!(payload, Reason::REFUSED_STREAM.0.to_be_bytes());
    // One ends; then a new one is taken.
    c.send(kind::RST_STREAM, 0, 1, &Reason::CANCEL.0.to_be_bytes())
        .await;
    c.still_serves(19).await;
}

#[tokio::test]
async fn a_request_whose_header_list_is_too_large_is_answered_431() {
    let server = Server::start().await;
    let mut c = Client::connect(server.addr).await;
    let big: Vec<String> = (0..5).map(|i| format!("{i}{}", "v".repeat(5000))).collect();
    let fields: Vec<(&str, &str)> = [(":method", "POST"), (":scheme", "http"), (":path", "/echo")]
        .into_iter()
        .chain(big.iter().map(|v| ("x-big", v.as_str())))
        .collect();
    let block = c.block(&fields);
    assert!(block.len() > 16_384, "{}", block.len());
    let (first, rest) = block.split_at(16_000);
    c.send(kind::HEADERS, flag::END_STREAM, 1, first).await;
    c.send(kind::CONTINUATION, flag::END_HEADERS, 1, rest).await;
    assert_eq!(c.response(1).await.status, "431");
    c.still_serves(3).await;
}

#[tokio::test]
async fn what_the_reader_takes_is_given_back_as_window() {
    let server = Server::start().await;
    let mut c = Client::connect(server.addr).await;
    c.request(1, "/echo", false).await;
    // Three times the connection's window, which only flows if the server
    // gives back what its reader took.
    let chunk = vec![7u8; 16_384];
    // The connection's window and the stream's, as the server grants them.
    let mut windows = [1i64 << 20, 1 << 20];
    let mut sent = 0usize;
    while sent < 3 << 20 {
        while windows.iter().any(|w| *w < chunk.len() as i64) {
            let (head, payload) = c.until(|h| h.kind == kind::WINDOW_UPDATE).await;
            assert_eq!(head.len, 4);
            let increment = super::frame::u32_at(&payload);
            windows[head.stream.min(1) as usize] += i64::from(increment);
        }
        c.send(kind::DATA, 0, 1, &chunk).await;
        windows.iter_mut().for_each(|w| *w -= chunk.len() as i64);
        sent += chunk.len();
    }
    c.send(kind::DATA, flag::END_STREAM, 1, &[]).await;
    c.allow(u32::MAX >> 2).await;
    let answer = c.response(1).await;
    assert_eq!(answer.data.len(), 3 << 20);
    assert_eq!(
        Bytes::from(answer.data).iter().filter(|b| **b != 7).count(),
        0
    );
}

/// The fuzz targets' entry points run over the committed corpus (what the
/// fuzzer starts from) without a panic: the harness builds and runs in
/// every test run, not only under `scripts/fuzz-http2`.
#[test]
fn the_fuzz_corpus_runs_clean() {
    let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    for (target, run) in [
        ("frames", super::fuzzing::frames as fn(&[u8])),
        ("headers", super::fuzzing::headers as fn(&[u8])),
    ] {
        let mut inputs = 0;
        for entry in std::fs::read_dir(corpus.join(target)).expect("the corpus") {
            let input = std::fs::read(entry.expect("an input").path()).expect("readable");
            run(&input);
            inputs += 1;
        }
        assert!(inputs > 0, "{target} has a corpus");
    }
}
