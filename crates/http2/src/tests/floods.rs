//! Output a peer does not read, and floods of the frames that demand an
//! answer (PING, SETTINGS): reading stops while the output piles up and
//! resumes as soon as it drains, never on a timer; a peer that reads its
//! answers gets every one at once, however many it sends; a peer that
//! does not read them is cut off with ENHANCE_YOUR_CALM once the unanswered
//! pile past a bound (CVE-2019-9512, CVE-2019-9515).

use std::time::Duration;

use tokio::io::AsyncWriteExt;

use super::super::Limits;
use super::super::frame::{self, flag, kind};
use super::client::{Client, Server};

/// A server whose keepalive would take a minute to wake a stalled
/// connection: a wait on it shows.
async fn slow_keepalive_server() -> Server {
    Server::with(Limits {
        max_concurrent_streams: 8,
        keepalive: (Duration::from_secs(60), Duration::from_secs(30)),
        ping_grid: Duration::from_millis(10),
    })
    .await
}

/// `n` frames of `kind` (PING with payloads counting up, or empty
/// SETTINGS), as one burst of octets.
fn burst(kind: u8, n: u32) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..n {
        if kind == kind::PING {
            frame::head(&mut out, 8, kind::PING, 0, 0);
            out.extend_from_slice(&u64::from(i).to_be_bytes());
        } else {
            frame::head(&mut out, 0, kind::SETTINGS, 0, 0);
        }
    }
    out
}

/// A peer that reads its answers gets all of them, in order, promptly: the
/// answers pile past the output's high mark several times over, and each
/// time reading resumes as the output drains (with the old wait on the
/// keepalive timer, a minute here, this took that long).
#[tokio::test]
async fn a_reading_peer_gets_every_answer_to_its_flood_at_once() {
    let server = slow_keepalive_server().await;
    for (what, n) in [(kind::PING, 20_000u32), (kind::SETTINGS, 20_000)] {
        let mut c = Client::connect(server.addr).await;
        c.auto_pong = false;
        c.write(&burst(what, n)).await;
        let answered = tokio::time::timeout(Duration::from_secs(20), async {
            let mut next = 0u64;
            while next < u64::from(n) {
                let (head, payload) = c.frame().await.expect("the connection stays open");
                if head.kind == what && head.has(flag::ACK) {
                    if what == kind::PING {
                        assert_eq!(payload, next.to_be_bytes(), "in order");
                    }
                    next += 1;
                }
            }
        })
        .await;
        assert!(answered.is_ok(), "every answer of a {what} flood in time");
        c.still_serves(1).await;
    }
}

/// A peer that floods PINGs and never reads an answer: once the answers
/// fill the socket and the server's output, the unanswered ones pass the
/// bound and the connection ends ENHANCE_YOUR_CALM — it does not sit on
/// them, and reads no more of the flood meanwhile.
#[tokio::test]
async fn a_peer_that_floods_without_reading_is_told_to_calm_down() {
    let mut server = slow_keepalive_server().await;
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    // A small receive window, so the kernel holds few answers for it.
    socket.set_recv_buffer_size(4096).expect("buffer");
    let tcp = socket.connect(server.addr).await.expect("connect");
    let (read, mut write) = tcp.into_split();
    let mut hello = frame::PREFACE.to_vec();
    frame::settings(&mut hello, &[]);
    write.write_all(&hello).await.expect("preface");
    let flood = tokio::spawn(async move {
        let chunk = burst(kind::PING, 10_000);
        let mut sent = 0usize;
        // Until the server stops reading it (or ends the connection).
        while sent < 400 * chunk.len() {
            match tokio::time::timeout(Duration::from_secs(3), write.write_all(&chunk)).await {
                Ok(Ok(())) => sent += chunk.len(),
                _ => break,
            }
        }
        sent
    });
    let sent = flood.await.expect("the flood");
    assert!(
        sent < 400 * 10_000 * 17,
        "the server read the whole flood without answering it"
    );
    // Its GOAWAY waits behind the answers the peer does not read; the
    // server gives up on writing it within its closing bound.
    let ended = tokio::time::timeout(Duration::from_secs(20), server.ended())
        .await
        .expect("the connection ends in time");
    assert!(ended.contains("ENHANCE_YOUR_CALM"), "{ended}");
    drop(read);
}

/// Responses a peer does not read pile up past the output's high mark and
/// reading stops; once the peer reads them all, the next request is read
/// and answered at once — reading resumes when the output drains, not when
/// the keepalive timer (a minute here) next wakes the connection.
#[tokio::test]
async fn reading_resumes_as_soon_as_the_output_drains() {
    let server = slow_keepalive_server().await;
    let mut c = Client::connect_small_window(server.addr).await;
    // Room for every response in the client's windows: only the socket
    // holds them back.
    c.settings(&[(super::super::frame::setting::INITIAL_WINDOW_SIZE, 1 << 24)])
        .await;
    c.send(kind::WINDOW_UPDATE, 0, 0, &(1u32 << 24).to_be_bytes())
        .await;
    let body = vec![b'e'; 16_384];
    for id in [1u32, 3, 5, 7] {
        c.request(id, "/echo", false).await;
        for last in [false, false, false, true] {
            let flags = if last { flag::END_STREAM } else { 0 };
            c.send(kind::DATA, flags, id, &body).await;
        }
    }
    // Not reading: 256 KiB of responses wait in the server's output.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The four responses, interleaved: each ends with its trailers.
    let mut data = std::collections::BTreeMap::<u32, usize>::new();
    let mut ended = 0;
    while ended < 4 {
        let (head, payload) = c.until(|h| h.stream != 0).await;
        match head.kind {
            kind::DATA => *data.entry(head.stream).or_default() += payload.len(),
            kind::HEADERS if head.has(flag::END_STREAM) => ended += 1,
            _ => {}
        }
    }
    assert!(data.values().all(|n| *n == 4 * 16_384), "{data:?}");
    let served = tokio::time::timeout(Duration::from_secs(20), c.still_serves(9)).await;
    assert!(served.is_ok(), "the next request waited for a timer");
}
