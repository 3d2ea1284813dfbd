//! A connection that floods a server with the HTTP/2 frames that demand an
//! answer — PINGs and empty SETTINGS, in bursts, as fast as it can — and
//! reads the answers as they come, counting them; it connects again when the
//! server ends it (counted too). Used to show that one connection's flood
//! does not delay another runner's assignments (a test, and `bench-desktop`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const PING: u8 = 0x6;
const SETTINGS: u8 = 0x4;
const ACK: u8 = 0x1;

/// What a flood did so far.
#[derive(Debug, Default)]
pub struct Flooded {
    /// Frames sent that demand an answer.
    pub sent: AtomicU64,
    /// Their answers read (PING and SETTINGS acknowledgements).
    pub answered: AtomicU64,
    /// Connections the server ended (and the flood made again).
    pub ended: AtomicU64,
}

/// A running flood; it stops when dropped.
#[derive(Debug)]
pub struct Flood {
    pub counts: Arc<Flooded>,
    stop: CancellationToken,
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn head(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8) {
    let len = u32::try_from(len).unwrap_or(0).to_be_bytes();
    out.extend_from_slice(&len[1..]);
    out.extend_from_slice(&[kind, flags, 0, 0, 0, 0]);
}

/// One burst: `n` PINGs and `n` empty SETTINGS, interleaved.
fn burst(n: u64) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..n {
        head(&mut out, 8, PING, 0);
        out.extend_from_slice(&i.to_be_bytes());
        head(&mut out, 0, SETTINGS, 0);
    }
    out
}

impl Flood {
    /// Floods `addr` (`host:port`, no scheme) until dropped.
    pub fn start(addr: &str) -> Flood {
        let counts = Arc::new(Flooded::default());
        let stop = CancellationToken::new();
        let addr = addr.trim_start_matches("http://").to_owned();
        let (c, s) = (counts.clone(), stop.clone());
        tokio::spawn(async move {
            while !s.is_cancelled() {
                tokio::select! {
                    () = one_connection(&addr, &c) => {
                        c.ended.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    () = s.cancelled() => return,
                }
            }
        });
        Flood { counts, stop }
    }
}

/// One connection's flood, until the server ends it.
async fn one_connection(addr: &str, counts: &Flooded) {
    let Ok(tcp) = tokio::net::TcpStream::connect(addr).await else {
        return;
    };
    let _ = tcp.set_nodelay(true);
    let (mut read, mut write) = tcp.into_split();
    let writing = async {
        let mut hello = PREFACE.to_vec();
        head(&mut hello, 0, SETTINGS, 0);
        if write.write_all(&hello).await.is_err() {
            return;
        }
        let burst = burst(500);
        loop {
            if write.write_all(&burst).await.is_err() {
                return;
            }
            counts.sent.fetch_add(1000, Ordering::Relaxed);
            tokio::task::yield_now().await;
        }
    };
    let reading = async {
        let mut input = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => input.extend_from_slice(&buf[..n]),
            }
            let mut at = 0;
            while input.len() - at >= 9 {
                let len = usize::from(input[at]) << 16
                    | usize::from(input[at + 1]) << 8
                    | usize::from(input[at + 2]);
                if input.len() - at < 9 + len {
                    break;
                }
                let (kind, flags) = (input[at + 3], input[at + 4]);
                if (kind == PING || kind == SETTINGS) && flags & ACK != 0 {
                    counts.answered.fetch_add(1, Ordering::Relaxed);
                }
                at += 9 + len;
            }
            input.drain(..at);
        }
    };
    // The server ending either side ends this connection.
    tokio::select! {
        () = writing => {}
        () = reading => {}
    }
}
