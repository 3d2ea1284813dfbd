//! A TCP relay on loopback that can lose one direction of its traffic: the
//! network fault "what the client sends never arrives, what the server sends
//! still does" (a half-broken Wi-Fi link, a NAT that dropped one mapping).
//! Real sockets on both sides, so gRPC and HTTP/2 behave as they would on a
//! real network.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// A relay to one upstream address; dropping it stops it.
#[derive(Debug)]
pub struct Relay {
    /// Where clients connect (`http://127.0.0.1:port`).
    pub url: String,
    lose_upstream: Arc<AtomicBool>,
    stop: CancellationToken,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Relay {
    /// Relays connections on a fresh loopback port to `upstream`.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Relay> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let lose_upstream = Arc::new(AtomicBool::new(false));
        let stop = CancellationToken::new();
        let (lose, done) = (lose_upstream.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    () = done.cancelled() => return,
                };
                let Ok((client, _)) = accepted else { continue };
                let (lose, done) = (lose.clone(), done.clone());
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::select! {
                        () = pump(cr, sw, Some(lose)) => {}
                        () = pump(sr, cw, None) => {}
                        () = done.cancelled() => {}
                    }
                });
            }
        });
        Ok(Relay {
            url,
            lose_upstream,
            stop,
        })
    }

    /// While true, what clients send is read and thrown away (on every
    /// connection, old and new); what the upstream sends still arrives.
    pub fn lose_upstream(&self, lose: bool) {
        self.lose_upstream.store(lose, Ordering::SeqCst);
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    lose: Option<Arc<AtomicBool>>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if lose.as_ref().is_some_and(|l| l.load(Ordering::SeqCst)) {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
