//! A raw HTTP/2 client for the tests (frames written and read by hand, as
//! RFC 9113 lays them out), and the test server it talks to: the lean
//! connection over real loopback TCP, one task per connection.

use std::net::SocketAddr;
use std::pin::pin;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use super::super::frame::{self, Head, Reason, flag, kind};
use super::super::{Connection, Limits, StreamError};
use super::service::{Event, answer};

/// How long any one read of the tests may wait.
const WAIT: Duration = Duration::from_secs(5);

pub struct Server {
    pub addr: SocketAddr,
    events: mpsc::UnboundedReceiver<Event>,
    ended: mpsc::UnboundedReceiver<String>,
    drain: watch::Sender<bool>,
}

impl Server {
    /// At most 8 streams a connection; PINGs after 200 ms of silence,
    /// answered within 300 ms.
    pub async fn start() -> Self {
        Self::with(Limits {
            max_concurrent_streams: 8,
            keepalive: (Duration::from_millis(200), Duration::from_millis(300)),
            ping_grid: Duration::from_millis(10),
        })
        .await
    }

    pub async fn with(limits: Limits) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (events_tx, events) = mpsc::unbounded_channel();
        let (ended_tx, ended) = mpsc::unbounded_channel();
        let (drain, draining) = watch::channel(false);
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let events = events_tx.clone();
                let service = tower::service_fn(move |r| answer(r, events.clone()));
                let connection = Connection::new(tcp, service, limits);
                let (ended, mut draining) = (ended_tx.clone(), draining.clone());
                tokio::spawn(async move {
                    let mut connection = pin!(connection);
                    let drained = tokio::select! {
                        r = connection.as_mut() => Err(r),
                        r = draining.wait_for(|d| *d) => Ok(r.is_ok()),
                    };
                    let result = match drained {
                        Err(r) => r,
                        Ok(_) => {
                            connection.as_mut().get_mut().graceful_shutdown();
                            connection.await
                        }
                    };
                    let _ = ended.send(result.map_or_else(|e| e.to_string(), |()| "ok".into()));
                });
            }
        });
        Self {
            addr,
            events,
            ended,
            drain,
        }
    }

    /// The next thing a held stream saw.
    pub async fn event(&mut self) -> Event {
        tokio::time::timeout(WAIT, self.events.recv())
            .await
            .expect("an event in time")
            .expect("the server runs")
    }

    /// The held stream's reader heard `how` it ended early, and its
    /// response was dropped (in either order).
    pub async fn ended_and_dropped(&mut self, how: StreamError) {
        let mut events = vec![self.event().await, self.event().await];
        events.sort_by_key(|e| format!("{e:?}"));
        let want = [Event::BodyEnded(Err(how)), Event::ResponseDropped];
        assert_eq!(events, want);
    }

    /// How the next connection ended: "ok", or its error.
    pub async fn ended(&mut self) -> String {
        tokio::time::timeout(WAIT, self.ended.recv())
            .await
            .expect("a connection ends in time")
            .expect("the server runs")
    }

    /// Drains every connection (graceful shutdown).
    pub fn drain(&self) {
        let _ = self.drain.send(true);
    }
}

/// A response as the client read it.
#[derive(Debug, Default)]
pub struct Answer {
    pub status: String,
    pub data: Vec<u8>,
    pub trailers: Vec<(String, String)>,
}

pub struct Client {
    tcp: TcpStream,
    input: Vec<u8>,
    encoder: loona_hpack::Encoder<'static>,
    decoder: loona_hpack::Decoder<'static>,
    /// Answers the server's PINGs as they are read.
    pub auto_pong: bool,
}

pub fn settings_of(payload: &[u8]) -> Vec<(u16, u32)> {
    payload
        .chunks_exact(6)
        .map(|e| (u16::from_be_bytes([e[0], e[1]]), frame::u32_at(&e[2..])))
        .collect()
}

impl Client {
    /// A TCP connection, nothing sent.
    pub async fn raw(addr: SocketAddr) -> Self {
        Self {
            tcp: TcpStream::connect(addr).await.expect("connect"),
            input: vec![],
            encoder: loona_hpack::Encoder::new(),
            decoder: loona_hpack::Decoder::new(),
            auto_pong: true,
        }
    }

    /// A TCP connection whose receive buffer is as small as the kernel
    /// allows, nothing sent: what the server writes piles up in its own
    /// output while this client does not read.
    pub async fn raw_small_window(addr: SocketAddr) -> Self {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_recv_buffer_size(4096).expect("buffer");
        Self {
            tcp: socket.connect(addr).await.expect("connect"),
            ..Self::raw(addr).await
        }
    }

    /// Connected, prefaces exchanged and acknowledged both ways.
    pub async fn connect(addr: SocketAddr) -> Self {
        let c = Self::raw(addr).await;
        c.handshake().await
    }

    /// [`Client::connect`] on a connection made by [`Client::raw_small_window`].
    pub async fn connect_small_window(addr: SocketAddr) -> Self {
        Self::raw_small_window(addr).await.handshake().await
    }

    async fn handshake(mut self) -> Self {
        let c = &mut self;
        c.write(frame::PREFACE).await;
        c.settings(&[]).await;
        for (want, flags) in [
            (kind::SETTINGS, 0),
            (kind::WINDOW_UPDATE, 0),
            (kind::SETTINGS, flag::ACK),
        ] {
            let (head, _) = c.frame().await.expect("the server's preface");
            assert_eq!((head.kind, head.flags), (want, flags), "{head:?}");
            if want == kind::SETTINGS && flags == 0 {
                c.send(kind::SETTINGS, flag::ACK, 0, &[]).await;
            }
        }
        self
    }

    pub async fn write(&mut self, octets: &[u8]) {
        self.tcp.write_all(octets).await.expect("write");
    }

    pub async fn send(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        let mut out = vec![];
        frame::head(&mut out, payload.len(), kind, flags, stream);
        out.extend_from_slice(payload);
        self.write(&out).await;
    }

    pub async fn settings(&mut self, values: &[(u16, u32)]) {
        let mut out = vec![];
        frame::settings(&mut out, values);
        self.write(&out).await;
    }

    /// More window for the connection and stream 1.
    pub async fn allow(&mut self, increment: u32) {
        for stream in [0, 1] {
            self.send(kind::WINDOW_UPDATE, 0, stream, &increment.to_be_bytes())
                .await;
        }
    }

    pub fn block(&mut self, fields: &[(&str, &str)]) -> Vec<u8> {
        self.encoder
            .encode(fields.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())))
    }

    pub fn decode(&mut self, block: &[u8]) -> Vec<(String, String)> {
        self.decoder
            .decode(block)
            .expect("the server's block decodes")
            .into_iter()
            .map(|(n, v)| {
                (
                    String::from_utf8_lossy(&n).into_owned(),
                    String::from_utf8_lossy(&v).into_owned(),
                )
            })
            .collect()
    }

    /// Opens stream `id` with a gRPC-like POST to `path`.
    pub async fn request(&mut self, id: u32, path: &str, end_stream: bool) {
        let block = self.block(&[
            (":method", "POST"),
            (":scheme", "http"),
            (":authority", "test"),
            (":path", path),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]);
        let flags = flag::END_HEADERS | if end_stream { flag::END_STREAM } else { 0 };
        self.send(kind::HEADERS, flags, id, &block).await;
    }

    /// The next frame; `None` once the server closed the connection.
    pub async fn frame(&mut self) -> Option<(Head, Vec<u8>)> {
        tokio::time::timeout(WAIT, self.next_frame())
            .await
            .expect("a frame (or the end) in time")
    }

    async fn next_frame(&mut self) -> Option<(Head, Vec<u8>)> {
        loop {
            if self.input.len() >= frame::HEAD {
                let head = Head::parse(&self.input);
                if self.input.len() >= frame::HEAD + head.len {
                    let payload = self.input[frame::HEAD..frame::HEAD + head.len].to_vec();
                    self.input.drain(..frame::HEAD + head.len);
                    if self.auto_pong && head.kind == kind::PING && !head.has(flag::ACK) {
                        self.send(kind::PING, flag::ACK, 0, &payload).await;
                    }
                    return Some((head, payload));
                }
            }
            let mut buf = [0u8; 16 * 1024];
            match self.tcp.read(&mut buf).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.input.extend_from_slice(&buf[..n]),
            }
        }
    }

    /// Frames are read until one matches (within twice [`WAIT`] in all:
    /// the server's own PINGs never keep a wait going).
    pub async fn until(&mut self, matches: impl Fn(&Head) -> bool) -> (Head, Vec<u8>) {
        let give_up = tokio::time::Instant::now() + 2 * WAIT;
        loop {
            assert!(
                tokio::time::Instant::now() < give_up,
                "no matching frame within {:?}",
                2 * WAIT
            );
            let (head, payload) = self.frame().await.expect("the connection stays open");
            if matches(&head) {
                return (head, payload);
            }
            if head.kind == kind::GOAWAY {
                panic!("GOAWAY {:?}", &payload[4..8]);
            }
        }
    }

    /// No frame that matches arrives within `within`.
    pub async fn quiet(&mut self, within: Duration, matches: impl Fn(&Head) -> bool) -> bool {
        let give_up = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(give_up, self.next_frame()).await {
                Err(_) => return true,
                Ok(None) => return true,
                Ok(Some((head, _))) if matches(&head) => return false,
                Ok(Some(_)) => {}
            }
        }
    }

    /// Reads on until the server closes: `true` if it did in time.
    pub async fn eof(&mut self) -> bool {
        tokio::time::timeout(WAIT, async { while self.next_frame().await.is_some() {} })
            .await
            .is_ok()
    }

    /// The code of the GOAWAY the server ends with (after which it closes).
    pub async fn goaway(&mut self) -> Reason {
        let (_, payload) = loop {
            let (head, payload) = self.frame().await.expect("a GOAWAY before the end");
            if head.kind == kind::GOAWAY {
                break (head, payload);
            }
        };
        assert!(self.eof().await, "the server closes after its GOAWAY");
        Reason(frame::u32_at(&payload[4..]))
    }

    /// The code of the RST_STREAM the server sends on `id`.
    pub async fn reset_of(&mut self, id: u32) -> Reason {
        let (_, payload) = self
            .until(|h| h.kind == kind::RST_STREAM && h.stream == id)
            .await;
        Reason(frame::u32_at(&payload))
    }

    /// The connection still answers: a request on stream `id` is served.
    pub async fn still_serves(&mut self, id: u32) {
        self.request(id, "/echo", true).await;
        assert_eq!(self.response(id).await.status, "200", "stream {id}");
    }

    /// The response on stream `id`, read to its end.
    pub async fn response(&mut self, id: u32) -> Answer {
        let mut answer = Answer::default();
        loop {
            let (head, payload) = self.until(|h| h.stream == id || h.stream == 0).await;
            match head.kind {
                kind::HEADERS => {
                    let fields = self.decode(&payload);
                    match fields.iter().find(|(n, _)| n == ":status") {
                        Some((_, status)) => answer.status = status.clone(),
                        None => answer.trailers = fields,
                    }
                }
                kind::DATA => answer.data.extend_from_slice(&payload),
                kind::RST_STREAM => panic!("stream {id} reset: {payload:?}"),
                _ => continue,
            }
            if head.has(flag::END_STREAM) {
                return answer;
            }
        }
    }
}
