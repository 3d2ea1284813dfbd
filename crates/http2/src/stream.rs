//! One stream's shared half: what the connection has received for it,
//! read by the service through [`RecvBody`], and the waker that tells the
//! connection this stream has something to do (its call or response body
//! woke, or its reader took data and the window can open again).

use parking_lot::{Mutex, MutexGuard};
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use bytes::Bytes;
use http::HeaderMap;

use super::frame::Reason;

/// What a connection shares with its streams: which streams have woken,
/// and the connection task's waker.
#[derive(Debug, Default)]
pub(super) struct ConnShared {
    ready: Mutex<Vec<u32>>,
    waker: Mutex<Option<Waker>>,
    /// The connection task is polling: it looks at the ready list before it
    /// sleeps, so a stream woken meanwhile needs no wake-up of the task
    /// (which tokio would hand to another worker, a thread wake-up per
    /// call).
    polling: AtomicBool,
}

impl ConnShared {
    /// The connection task starts polling.
    pub fn enter(&self) {
        self.polling.store(true, Ordering::SeqCst);
    }

    /// The connection task is about to sleep: `true` when a stream woke
    /// meanwhile and it must look again. Wakes after this wake the task.
    pub fn leave(&self) -> bool {
        self.polling.store(false, Ordering::SeqCst);
        !lock(&self.ready).is_empty()
    }

    /// Remembers the connection task's waker.
    pub fn register(&self, cx: &Context<'_>) {
        let mut waker = lock(&self.waker);
        if !waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            *waker = Some(cx.waker().clone());
        }
    }

    /// Streams that woke since the last call.
    pub fn take_ready(&self, into: &mut Vec<u32>) {
        into.append(&mut lock(&self.ready));
    }

    fn wake(&self) {
        // Pushed to the ready list before this load (under its lock): a
        // task leaving its poll either sees the push or is woken here.
        if self.polling.load(Ordering::SeqCst) {
            return;
        }
        if let Some(w) = lock(&self.waker).as_ref() {
            w.wake_by_ref();
        }
    }
}

/// How the peer's side of a stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum End {
    /// Still sending.
    Open,
    /// END_STREAM.
    Ended,
    /// Reset by the peer with this code.
    Reset(Reason),
    /// Reset by this server with this code (a malformed request, a flow
    /// control breach, the response finished first).
    Refused(Reason),
    /// The connection ended before the stream did.
    Lost,
}

#[derive(Debug)]
pub(super) struct Recv {
    data: VecDeque<Bytes>,
    trailers: Option<HeaderMap>,
    pub end: End,
    reader: Option<Waker>,
    /// Octets the reader took that the peer has not been given back as
    /// window yet.
    pub released: usize,
    /// Octets received and not yet read.
    pub buffered: usize,
    /// The reader (the request body) is gone: what arrives is dropped.
    pub dropped: bool,
}

/// A stream's shared half.
#[derive(Debug)]
pub(super) struct StreamShared {
    pub id: u32,
    conn: Arc<ConnShared>,
    queued: AtomicBool,
    recv: Mutex<Recv>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock()
}

impl StreamShared {
    pub fn new(id: u32, conn: Arc<ConnShared>, end: End) -> Arc<Self> {
        Arc::new(Self {
            id,
            conn,
            queued: AtomicBool::new(false),
            recv: Mutex::new(Recv {
                data: VecDeque::new(),
                trailers: None,
                end,
                reader: None,
                released: 0,
                buffered: 0,
                dropped: false,
            }),
        })
    }

    pub fn recv(&self) -> MutexGuard<'_, Recv> {
        lock(&self.recv)
    }

    /// Clears the mark that this stream is in the ready list (the
    /// connection is about to look at it).
    pub fn unqueue(&self) {
        self.queued.store(false, Ordering::Release);
    }

    /// Data for the reader; `false` when there is no reader any more (the
    /// octets count as read at once).
    pub fn push_data(&self, data: Bytes) -> bool {
        let mut recv = self.recv();
        if recv.dropped {
            return false;
        }
        recv.buffered += data.len();
        recv.data.push_back(data);
        if let Some(w) = recv.reader.take() {
            w.wake();
        }
        true
    }

    /// The peer's trailers, which end its side.
    pub fn push_trailers(&self, trailers: HeaderMap) {
        let mut recv = self.recv();
        recv.trailers = Some(trailers);
        recv.end = End::Ended;
        if let Some(w) = recv.reader.take() {
            w.wake();
        }
    }

    /// Ends the peer's side (if still open); what the reader has not read
    /// yet, when it is reset or lost, is dropped and counted as released.
    pub fn end(&self, end: End) {
        let mut recv = self.recv();
        if recv.end != End::Open {
            return;
        }
        recv.end = end;
        if end != End::Ended {
            let dropped: usize = recv.data.drain(..).map(|d| d.len()).sum();
            recv.buffered -= dropped;
            recv.released += dropped;
        }
        if let Some(w) = recv.reader.take() {
            w.wake();
        }
    }
}

impl Wake for StreamShared {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if !self.queued.swap(true, Ordering::AcqRel) {
            lock(&self.conn.ready).push(self.id);
        }
        self.conn.wake();
    }
}

/// Why a request's body ended before its END_STREAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// The connection ended before the stream did.
    #[error("the connection was lost")]
    Lost,
    /// The stream was reset: by the peer (`by_peer`), or by this server (a
    /// malformed request, a flow control breach, the response over first).
    #[error("{} reset the stream (RST_STREAM {})", if *by_peer { "the caller" } else { "this server" }, reason.name())]
    Reset { reason: Reason, by_peer: bool },
}

/// A request's body as the service reads it.
#[derive(Debug)]
pub struct RecvBody {
    shared: Arc<StreamShared>,
}

impl RecvBody {
    pub(super) fn new(shared: Arc<StreamShared>) -> Self {
        Self { shared }
    }
}

/// Releases are told to the connection in steps of this many octets (or
/// when the buffer runs dry), not for every frame read.
const RELEASE_STEP: usize = 16 * 1024;

impl http_body::Body for RecvBody {
    type Data = Bytes;
    type Error = StreamError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, StreamError>>> {
        let mut recv = self.shared.recv();
        if let Some(data) = recv.data.pop_front() {
            recv.buffered -= data.len();
            recv.released += data.len();
            let tell = recv.released >= RELEASE_STEP || recv.buffered == 0;
            drop(recv);
            if tell {
                self.shared.wake_by_ref();
            }
            return Poll::Ready(Some(Ok(http_body::Frame::data(data))));
        }
        if let Some(trailers) = recv.trailers.take() {
            return Poll::Ready(Some(Ok(http_body::Frame::trailers(trailers))));
        }
        match recv.end {
            End::Open => {
                if !recv
                    .reader
                    .as_ref()
                    .is_some_and(|w| w.will_wake(cx.waker()))
                {
                    recv.reader = Some(cx.waker().clone());
                }
                Poll::Pending
            }
            End::Ended => Poll::Ready(None),
            End::Lost => Poll::Ready(Some(Err(StreamError::Lost))),
            End::Reset(reason) => Poll::Ready(Some(Err(StreamError::Reset {
                reason,
                by_peer: true,
            }))),
            End::Refused(reason) => Poll::Ready(Some(Err(StreamError::Reset {
                reason,
                by_peer: false,
            }))),
        }
    }

    fn is_end_stream(&self) -> bool {
        let recv = self.shared.recv();
        recv.data.is_empty() && recv.trailers.is_none() && recv.end == End::Ended
    }
}

impl Drop for RecvBody {
    fn drop(&mut self) {
        let mut recv = self.shared.recv();
        recv.dropped = true;
        let unread: usize = recv.data.drain(..).map(|d| d.len()).sum();
        recv.buffered -= unread;
        recv.released += unread;
        drop(recv);
        self.shared.wake_by_ref();
    }
}
