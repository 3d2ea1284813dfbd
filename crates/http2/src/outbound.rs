//! What a connection sends for its streams: it starts each request's call
//! when the service is ready, polls the calls and response bodies of the
//! streams that woke, writes their headers, data (within both windows) and
//! trailers, and gives the peer back the window its reads freed.

use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use bytes::Buf;

use super::frame::{self, Reason};
use super::stream::End;
use super::{
    BoxError, CONN_WINDOW, Calls, Closed, ConnError, Connection, Handled, Io, OUT_HIGH, Out,
    STREAM_WINDOW, SendBody,
};

impl<S: Calls<B>, B: SendBody, T: Io> Connection<S, B, T> {
    /// Starts what waits for the service, then looks at every stream that
    /// is ready.
    pub(super) fn poll_streams(&mut self, cx: &mut Context<'_>) -> Handled {
        self.start_waiting(cx)?;
        self.shared.take_ready(&mut self.ready);
        let mut ready = std::mem::take(&mut self.ready);
        for id in ready.drain(..) {
            if let Some(i) = self.stream_index(id) {
                self.poll_stream(i);
            }
        }
        // Streams marked while these ran are looked at in the next round.
        ready.append(&mut self.ready);
        self.ready = ready;
        if self.recv_released >= CONN_WINDOW / 2 {
            frame::window_update(&mut self.out, 0, self.recv_released as u32);
            self.recv_window += self.recv_released;
            self.recv_released = 0;
        }
        Ok(())
    }

    /// Calls the service for waiting requests, oldest first, as long as it
    /// is ready.
    fn start_waiting(&mut self, cx: &mut Context<'_>) -> Handled {
        while let Some(&id) = self.waiting.front() {
            let request = self
                .stream_index(id)
                .and_then(|i| match &mut self.streams[i].out {
                    Out::Waiting(request) => Some(i).zip(request.take()),
                    _ => None,
                });
            let Some((i, request)) = request else {
                self.waiting.pop_front();
                continue;
            };
            match self.service.poll_ready(cx) {
                Poll::Pending => {
                    self.streams[i].out = Out::Waiting(Some(request));
                    return Ok(());
                }
                Poll::Ready(Err(e)) => return Err(ConnError::Service(e.into())),
                Poll::Ready(Ok(())) => {}
            }
            self.waiting.pop_front();
            let call = self.service.call(*request);
            self.streams[i].out = Out::Calling(Box::pin(call));
            self.ready.push(id);
        }
        Ok(())
    }

    /// Every stream with a response body in progress is looked at (the
    /// windows opened, or the output buffer drained).
    pub(super) fn wake_senders(&mut self) {
        for s in &self.streams {
            if matches!(s.out, Out::Body { .. }) {
                self.ready.push(s.id);
            }
        }
    }

    /// Gives back what the stream's reader freed, then moves its response
    /// on as far as it goes without waiting.
    fn poll_stream(&mut self, i: usize) {
        self.streams[i].shared.unqueue();
        self.give_back(i);
        let waker = Waker::from(self.streams[i].shared.clone());
        let mut scx = Context::from_waker(&waker);
        let Self {
            streams,
            out,
            written,
            send_window,
            peer_max_frame,
            starved,
            ..
        } = self;
        let s = &mut streams[i];
        // A reset of ours ends both sides at once.
        let mut reset = None;
        loop {
            match &mut s.out {
                Out::Waiting(_) | Out::Done => break,
                Out::Calling(call) => match call.as_mut().poll(&mut scx) {
                    Poll::Pending => break,
                    Poll::Ready(Err(e)) => {
                        let e: BoxError = e.into();
                        tracing::debug!(stream = s.id, error = %e, "the service failed a call");
                        reset = Some(Reason::INTERNAL_ERROR);
                        break;
                    }
                    Poll::Ready(Ok(response)) => {
                        let (parts, body) = response.into_parts();
                        let end = body.is_end_stream();
                        let mut block = Vec::with_capacity(64);
                        super::hpack::encode_response(&mut block, parts.status, &parts.headers);
                        frame::headers(out, s.id, end, &block, *peer_max_frame);
                        s.out = if end {
                            Out::Done
                        } else {
                            Out::Body { body, data: None }
                        };
                    }
                },
                Out::Body { body, data } => {
                    if out.len() - *written > OUT_HIGH {
                        *starved = true;
                        break;
                    }
                    if let Some(d) = data {
                        let n = (d.len() as i64)
                            .min(*send_window)
                            .min(s.send_window)
                            .min(*peer_max_frame as i64);
                        if n <= 0 {
                            // Waits for a WINDOW_UPDATE.
                            break;
                        }
                        frame::data(out, s.id, false, &d[..n as usize]);
                        d.advance(n as usize);
                        *send_window -= n;
                        s.send_window -= n;
                        if d.is_empty() {
                            *data = None;
                        }
                        continue;
                    }
                    match Pin::new(&mut *body).poll_frame(&mut scx) {
                        Poll::Pending => break,
                        Poll::Ready(None) => {
                            frame::data(out, s.id, true, &[]);
                            s.out = Out::Done;
                        }
                        Poll::Ready(Some(Err(e))) => {
                            let e: BoxError = e.into();
                            tracing::debug!(stream = s.id, error = %e, "a response body failed");
                            reset = Some(Reason::INTERNAL_ERROR);
                            break;
                        }
                        Poll::Ready(Some(Ok(f))) => match f.into_data() {
                            Ok(d) => {
                                if !d.is_empty() {
                                    *data = Some(d);
                                }
                            }
                            Err(f) => {
                                if let Ok(trailers) = f.into_trailers() {
                                    let mut block = Vec::with_capacity(64);
                                    super::hpack::encode_fields(&mut block, &trailers);
                                    frame::headers(out, s.id, true, &block, *peer_max_frame);
                                    s.out = Out::Done;
                                }
                            }
                        },
                    }
                }
            }
        }
        match reset {
            Some(reason) => self.reset_stream(i, reason),
            None => self.finish_if_done(i),
        }
    }

    /// What the stream's reader freed goes back to the connection's window,
    /// and to the stream's once enough of it has.
    fn give_back(&mut self, i: usize) {
        let s = &mut self.streams[i];
        let (freed, open) = {
            let mut recv = s.shared.recv();
            (
                std::mem::take(&mut recv.released) as i64,
                recv.end == End::Open,
            )
        };
        self.recv_released += freed;
        if open {
            s.unacked += freed;
            if s.unacked >= STREAM_WINDOW / 2 {
                frame::window_update(&mut self.out, s.id, s.unacked as u32);
                s.recv_window += s.unacked;
                s.unacked = 0;
            }
        }
    }

    /// Forgets a stream whose response is sent once the peer's side is
    /// over too; while the peer may still send and nobody reads, the rest
    /// of its request is refused (RST_STREAM NO_ERROR, RFC 9113 §8.1).
    fn finish_if_done(&mut self, i: usize) {
        let s = &self.streams[i];
        if !matches!(s.out, Out::Done) {
            return;
        }
        let (open, dropped) = {
            let recv = s.shared.recv();
            (recv.end == End::Open, recv.dropped)
        };
        let id = s.id;
        if !open {
            self.remove_stream(i);
            self.remember(id, Closed::Ended);
        } else if dropped {
            self.reset_stream(i, Reason::NO_ERROR);
        }
    }
}
