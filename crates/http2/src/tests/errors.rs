//! Every breach of RFC 9113 the connection must catch, each on a fresh
//! connection: connection errors end it with GOAWAY and the code the RFC
//! names; stream errors reset the one stream (RST_STREAM) and the
//! connection goes on serving others.

use super::super::frame::{PREFACE, Reason, flag, kind, setting};
use super::client::{Client, Server};

/// A frame to send: kind, flags, stream, payload.
type Frame = (u8, u8, u32, Vec<u8>);

fn settings(values: &[(u16, u32)]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|(id, v)| id.to_be_bytes().into_iter().chain(v.to_be_bytes()))
        .collect()
}

fn u32s(v: u32) -> Vec<u8> {
    v.to_be_bytes().to_vec()
}

#[tokio::test]
async fn connection_errors_end_it_with_the_code_the_rfc_names() {
    use Reason as R;
    let server = Server::start().await;
    let mut probe = Client::connect(server.addr).await;
    let open = probe.block(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/unread"),
    ]);
    let headers = |id: u32| (kind::HEADERS, flag::END_HEADERS, id, open.clone());
    let cases: Vec<(&str, Vec<Frame>, Reason)> = vec![
        (
            "DATA on stream 0",
            vec![(kind::DATA, 0, 0, b"x".to_vec())],
            R::PROTOCOL_ERROR,
        ),
        ("HEADERS on stream 0", vec![headers(0)], R::PROTOCOL_ERROR),
        ("an even stream id", vec![headers(2)], R::PROTOCOL_ERROR),
        (
            "a lower stream id",
            vec![headers(5), headers(3)],
            R::PROTOCOL_ERROR,
        ),
        (
            "DATA on an idle stream",
            vec![(kind::DATA, 0, 7, b"x".to_vec())],
            R::PROTOCOL_ERROR,
        ),
        (
            "RST_STREAM on an idle stream",
            vec![(kind::RST_STREAM, 0, 9, u32s(8))],
            R::PROTOCOL_ERROR,
        ),
        (
            "RST_STREAM on stream 0",
            vec![(kind::RST_STREAM, 0, 0, u32s(8))],
            R::PROTOCOL_ERROR,
        ),
        (
            "RST_STREAM of 3 octets",
            vec![headers(1), (kind::RST_STREAM, 0, 1, vec![0; 3])],
            R::FRAME_SIZE_ERROR,
        ),
        (
            "a frame over 16384",
            vec![headers(1), (kind::DATA, 0, 1, vec![0; 16_385])],
            R::FRAME_SIZE_ERROR,
        ),
        (
            "SETTINGS of 5 octets",
            vec![(kind::SETTINGS, 0, 0, vec![0; 5])],
            R::FRAME_SIZE_ERROR,
        ),
        (
            "a SETTINGS ack with a payload",
            vec![(kind::SETTINGS, flag::ACK, 0, vec![0; 6])],
            R::FRAME_SIZE_ERROR,
        ),
        (
            "SETTINGS on a stream",
            vec![(kind::SETTINGS, 0, 1, vec![])],
            R::PROTOCOL_ERROR,
        ),
        (
            "ENABLE_PUSH 2",
            vec![(kind::SETTINGS, 0, 0, settings(&[(setting::ENABLE_PUSH, 2)]))],
            R::PROTOCOL_ERROR,
        ),
        (
            "INITIAL_WINDOW_SIZE 2^31",
            vec![(
                kind::SETTINGS,
                0,
                0,
                settings(&[(setting::INITIAL_WINDOW_SIZE, 1 << 31)]),
            )],
            R::FLOW_CONTROL_ERROR,
        ),
        (
            "MAX_FRAME_SIZE 16383",
            vec![(
                kind::SETTINGS,
                0,
                0,
                settings(&[(setting::MAX_FRAME_SIZE, 16_383)]),
            )],
            R::PROTOCOL_ERROR,
        ),
        (
            "PING of 7 octets",
            vec![(kind::PING, 0, 0, vec![0; 7])],
            R::FRAME_SIZE_ERROR,
        ),
        (
            "PING on a stream",
            vec![(kind::PING, 0, 1, vec![0; 8])],
            R::PROTOCOL_ERROR,
        ),
        (
            "GOAWAY on a stream",
            vec![(kind::GOAWAY, 0, 1, vec![0; 8])],
            R::PROTOCOL_ERROR,
        ),
        (
            "WINDOW_UPDATE of 0",
            vec![(kind::WINDOW_UPDATE, 0, 0, u32s(0))],
            R::PROTOCOL_ERROR,
        ),
        (
            "WINDOW_UPDATE of 3 octets",
            vec![(kind::WINDOW_UPDATE, 0, 0, vec![0, 0, 1])],
            R::FRAME_SIZE_ERROR,
        ),
        (
            "a connection window over 2^31-1",
            vec![(kind::WINDOW_UPDATE, 0, 0, u32s(0x7fff_ffff))],
            R::FLOW_CONTROL_ERROR,
        ),
        (
            "WINDOW_UPDATE on an idle stream",
            vec![(kind::WINDOW_UPDATE, 0, 11, u32s(1))],
            R::PROTOCOL_ERROR,
        ),
        (
            "CONTINUATION without HEADERS",
            vec![(kind::CONTINUATION, flag::END_HEADERS, 1, open.clone())],
            R::PROTOCOL_ERROR,
        ),
        (
            "a PING inside a header block",
            vec![
                (kind::HEADERS, 0, 1, open[..2].to_vec()),
                (kind::PING, 0, 0, vec![0; 8]),
            ],
            R::PROTOCOL_ERROR,
        ),
        (
            "CONTINUATION of another stream",
            vec![
                (kind::HEADERS, 0, 1, open[..2].to_vec()),
                (kind::CONTINUATION, flag::END_HEADERS, 3, open[2..].to_vec()),
            ],
            R::PROTOCOL_ERROR,
        ),
        (
            "an index past the tables",
            vec![(kind::HEADERS, flag::END_HEADERS, 1, vec![0xbf])],
            R::COMPRESSION_ERROR,
        ),
        (
            "PUSH_PROMISE from a client",
            vec![(kind::PUSH_PROMISE, flag::END_HEADERS, 1, vec![0, 0, 0, 2])],
            R::PROTOCOL_ERROR,
        ),
        (
            "padding as long as DATA",
            vec![headers(1), (kind::DATA, flag::PADDED, 1, vec![3, 0, 0])],
            R::PROTOCOL_ERROR,
        ),
        (
            "DATA past the connection's window",
            std::iter::once(headers(1))
                .chain((0..65).map(|_| (kind::DATA, 0, 1, vec![0; 16_384])))
                .collect(),
            R::FLOW_CONTROL_ERROR,
        ),
    ];
    let empty_continuations: Vec<Frame> =
        std::iter::once((kind::HEADERS, 0, 1, open[..2].to_vec()))
            .chain((0..100).map(|_| (kind::CONTINUATION, 0, 1, vec![])))
            .collect();
    let rapid_resets: Vec<Frame> = (0..300u32)
        .flat_map(|i| {
            [
                headers(2 * i + 1),
                (kind::RST_STREAM, 0, 2 * i + 1, u32s(8)),
            ]
        })
        .collect();
    let cases = cases.into_iter().chain([
        (
            "a flood of empty CONTINUATIONs",
            empty_continuations,
            R::ENHANCE_YOUR_CALM,
        ),
        (
            "streams opened and reset at once",
            rapid_resets,
            R::ENHANCE_YOUR_CALM,
        ),
    ]);
    for (what, frames, want) in cases {
        let mut c = Client::connect(server.addr).await;
        for (k, flags, stream, payload) in &frames {
            c.send(*k, *flags, *stream, payload).await;
        }
        assert_eq!(c.goaway().await, want, "{what}");
    }
}

#[tokio::test]
async fn headers_on_a_closed_stream_end_the_connection_stream_closed() {
    let server = Server::start().await;
    let mut c = Client::connect(server.addr).await;
    c.still_serves(1).await;
    c.request(1, "/echo", true).await;
    assert_eq!(c.goaway().await, Reason::STREAM_CLOSED);
}

#[tokio::test]
async fn a_connection_that_is_not_http2_is_closed() {
    let mut server = Server::start().await;
    let mut c = Client::raw(server.addr).await;
    c.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(c.eof().await);
    assert_eq!(server.ended().await, "not an HTTP/2 connection preface");
    // The preface must go on with SETTINGS.
    let mut c = Client::raw(server.addr).await;
    c.write(PREFACE).await;
    c.send(kind::PING, 0, 0, &[0; 8]).await;
    assert_eq!(c.goaway().await, Reason::PROTOCOL_ERROR);
}

#[tokio::test]
async fn stream_errors_reset_one_stream_and_the_connection_goes_on() {
    let server = Server::start().await;
    let mut c = Client::connect(server.addr).await;
    let mut id = 1;
    let malformed: [&[(&str, &str)]; 5] = [
        &[
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/echo"),
            ("X-Upper", "1"),
        ],
        &[(":method", "POST"), (":scheme", "http")],
        &[
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/echo"),
            ("connection", "close"),
        ],
        &[
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/echo"),
            (":protocol", "x"),
        ],
        &[
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/echo"),
            ("content-length", "4"),
        ],
    ];
    for fields in malformed {
        let block = c.block(fields);
        c.send(
            kind::HEADERS,
            flag::END_HEADERS | flag::END_STREAM,
            id,
            &block,
        )
        .await;
        assert_eq!(c.reset_of(id).await, Reason::PROTOCOL_ERROR, "{fields:?}");
        id += 2;
    }
    // DATA after the stream's END_STREAM.
    c.request(id, "/hold", true).await;
    c.send(kind::DATA, 0, id, b"late").await;
    assert_eq!(c.reset_of(id).await, Reason::STREAM_CLOSED);
    id += 2;
    // A stream WINDOW_UPDATE of 0.
    c.request(id, "/hold", false).await;
    c.send(kind::WINDOW_UPDATE, 0, id, &0u32.to_be_bytes())
        .await;
    assert_eq!(c.reset_of(id).await, Reason::PROTOCOL_ERROR);
    id += 2;
    // PRIORITY of 4 octets; a stream that depends on itself.
    c.send(kind::PRIORITY, 0, id, &[0; 4]).await;
    assert_eq!(c.reset_of(id).await, Reason::FRAME_SIZE_ERROR);
    id += 2;
    let block = c.block(&[(":method", "POST"), (":scheme", "http"), (":path", "/echo")]);
    let mut payload = id.to_be_bytes().to_vec();
    payload.push(16);
    payload.extend_from_slice(&block);
    c.send(
        kind::HEADERS,
        flag::END_HEADERS | flag::PRIORITY,
        id,
        &payload,
    )
    .await;
    assert_eq!(c.reset_of(id).await, Reason::PROTOCOL_ERROR);
    id += 2;
    // Trailers that do not end the stream; more DATA than content-length.
    c.request(id, "/hold", false).await;
    let trailers = c.block(&[("x-trailer", "1")]);
    c.send(kind::HEADERS, flag::END_HEADERS, id, &trailers)
        .await;
    assert_eq!(c.reset_of(id).await, Reason::PROTOCOL_ERROR);
    id += 2;
    let block = c.block(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/echo"),
        ("content-length", "2"),
    ]);
    c.send(kind::HEADERS, flag::END_HEADERS, id, &block).await;
    c.send(kind::DATA, 0, id, b"abc").await;
    assert_eq!(c.reset_of(id).await, Reason::PROTOCOL_ERROR);
    id += 2;
    // Through all of it the connection kept serving.
    c.request(id, "/echo", false).await;
    c.send(kind::DATA, flag::END_STREAM, id, b"still here")
        .await;
    assert_eq!(c.response(id).await.data, b"still here");
}

/// After the client's own RST_STREAM, anything but PRIORITY it sends on
/// that stream is a stream error STREAM_CLOSED (RFC 9113 §5.1, "closed";
/// h2spec http2/5.1/8 and 5.1/9): a DATA frame, and a HEADERS frame (whose
/// block is still decoded, so the table stays in step); a PRIORITY changes
/// nothing; the connection goes on serving.
#[tokio::test]
async fn frames_after_the_clients_reset_are_stream_closed() {
    let server = Server::start().await;
    let mut c = Client::connect(server.addr).await;
    c.request(1, "/hold", false).await;
    c.send(kind::RST_STREAM, 0, 1, &u32s(Reason::CANCEL.0))
        .await;
    c.send(kind::PRIORITY, 0, 1, &[0, 0, 0, 0, 16]).await;
    c.send(kind::DATA, 0, 1, b"late").await;
    assert_eq!(c.reset_of(1).await, Reason::STREAM_CLOSED);
    c.request(3, "/hold", false).await;
    c.send(kind::RST_STREAM, 0, 3, &u32s(Reason::CANCEL.0))
        .await;
    let trailers = c.block(&[("grpc-status", "0")]);
    c.send(
        kind::HEADERS,
        flag::END_HEADERS | flag::END_STREAM,
        3,
        &trailers,
    )
    .await;
    assert_eq!(c.reset_of(3).await, Reason::STREAM_CLOSED);
    // What it sends after our answer is ignored; the connection serves on.
    c.send(kind::DATA, 0, 3, b"later").await;
    c.still_serves(5).await;
}
