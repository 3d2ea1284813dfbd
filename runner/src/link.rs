//! The runner's connection to its gateway, and what it hears on it.
//!
//! With PING liveness the gateway PINGs an idle stream every half dead-after
//! bound. The runner sends no PINGs of its own: at ten thousand runners,
//! answering theirs would cost the gateway as much as sending its own, at
//! instants it cannot batch. Instead the connection notes when the gateway
//! last sent a byte — its PINGs included — and a [`Watch`] reads that: after
//! three fifths of the bound without a byte (the gateway PINGs only a runner
//! it does not hear from, so a busy runner hears nothing), the runner asks
//! with a heartbeat, which the gateway acks; after the whole bound the
//! gateway is declared gone, and the stream ends.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// When the gateway last sent a byte on one connection.
#[derive(Debug, Clone)]
pub(crate) struct Heard {
    start: Instant,
    /// Milliseconds after `start`.
    at: Arc<AtomicU64>,
}

impl Heard {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            at: Arc::new(AtomicU64::new(0)),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn note(&self) {
        self.at.store(self.now(), Ordering::Relaxed);
    }

    /// How long the gateway has been silent.
    pub(crate) fn quiet(&self) -> Duration {
        Duration::from_millis(self.now().saturating_sub(self.at.load(Ordering::Relaxed)))
    }

    /// When the gateway last sent a byte, in this connection's clock.
    fn last(&self) -> u64 {
        self.at.load(Ordering::Relaxed)
    }
}

/// Connects to the gateway on a TCP connection that notes every byte read.
pub(crate) async fn connect(
    endpoint: &Endpoint,
) -> Result<(Channel, Heard), tonic::transport::Error> {
    let heard = Heard::new();
    let noted = heard.clone();
    let connector = tower::service_fn(move |uri: Uri| {
        let heard = noted.clone();
        async move {
            let host = uri.host().unwrap_or("127.0.0.1");
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let port = uri.port_u16().unwrap_or(80);
            let tcp = TcpStream::connect((host, port)).await?;
            tcp.set_nodelay(true)?;
            heard.note();
            Ok::<_, std::io::Error>(TokioIo::new(Noted { tcp, heard }))
        }
    });
    let channel = endpoint.connect_with_connector(connector).await?;
    Ok((channel, heard))
}

/// A TCP stream that notes when it last read a byte.
struct Noted {
    tcp: TcpStream,
    heard: Heard,
}

impl AsyncRead for Noted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.tcp).poll_read(cx, buf);
        if matches!(read, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.heard.note();
        }
        read
    }
}

impl AsyncWrite for Noted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// What the watch says after a look at the connection.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The gateway was heard recently enough.
    Fine,
    /// Quiet for a while: ask with a heartbeat (once per quiet spell).
    Ask,
    /// Quiet for the whole bound: the gateway is gone.
    Gone,
}

/// Reads a connection's [`Heard`] against the dead-after bound.
#[derive(Debug)]
pub(crate) struct Watch {
    heard: Heard,
    dead_after: Duration,
    /// The quiet spell a heartbeat was sent in (by when it began).
    asked_in: Option<u64>,
}

impl Watch {
    pub(crate) fn new(heard: Heard, dead_after: Duration) -> Self {
        Self {
            heard,
            dead_after,
            asked_in: None,
        }
    }

    /// How often to look.
    pub(crate) fn period(&self) -> Duration {
        (self.dead_after / 10).max(Duration::from_millis(50))
    }

    pub(crate) fn look(&mut self) -> Verdict {
        self.decide(self.heard.quiet(), self.heard.last())
    }

    /// The verdict after `quiet` of silence in the spell that began at
    /// `since` (when the gateway was last heard).
    fn decide(&mut self, quiet: Duration, since: u64) -> Verdict {
        if quiet >= self.dead_after {
            return Verdict::Gone;
        }
        if quiet >= self.dead_after * 3 / 5 && self.asked_in != Some(since) {
            self.asked_in = Some(since);
            return Verdict::Ask;
        }
        Verdict::Fine
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quiet_gateway_is_asked_once_per_spell_then_declared_gone() {
        let mut watch = Watch::new(Heard::new(), Duration::from_secs(10));
        let s = Duration::from_secs;
        assert_eq!(
            watch.decide(s(5), 1),
            Verdict::Fine,
            "the gateway PINGs every 5 s"
        );
        assert_eq!(watch.decide(s(6), 1), Verdict::Ask);
        assert_eq!(
            watch.decide(s(7), 1),
            Verdict::Fine,
            "asked once per quiet spell"
        );
        // Heard again (at 2): a new spell, asked again when it grows long.
        assert_eq!(watch.decide(s(1), 2), Verdict::Fine);
        assert_eq!(watch.decide(s(6), 2), Verdict::Ask);
        assert_eq!(watch.decide(s(10), 2), Verdict::Gone);
        assert_eq!(watch.period(), Duration::from_secs(1));
    }

    #[test]
    fn the_connection_notes_when_the_gateway_was_last_heard() {
        let heard = Heard::new();
        let before = heard.last();
        std::thread::sleep(Duration::from_millis(5));
        heard.note();
        assert!(heard.last() > before);
        assert!(heard.quiet() < Duration::from_secs(3600));
    }
}
