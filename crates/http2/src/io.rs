//! A connection's socket: reading what arrived (into the task's stack,
//! keeping only an incomplete frame), writing what was made (and freeing a
//! burst's buffer), and the bounded closing handshake.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use tokio::io::ReadBuf;

use super::{
    Calls, ConnError, Connection, Io, OUT_HIGH, OUT_LOW, READ_BUDGET, READ_CHUNK, SendBody,
};

impl<S: Calls<B>, B: SendBody, T: Io> Connection<S, B, T> {
    /// Reads what the socket has, up to the budget, and handles every
    /// complete frame. `Ready(Ok(false))` at end of input.
    pub(super) fn poll_input(&mut self, cx: &mut Context<'_>) -> Poll<Result<bool, ConnError>> {
        let mut budget = READ_BUDGET;
        let mut stack = [std::mem::MaybeUninit::<u8>::uninit(); READ_CHUNK];
        loop {
            if self.ending.is_some() {
                return Poll::Pending;
            }
            let waiting = self.out.len() - self.written;
            if waiting > OUT_HIGH || (self.paused && waiting > OUT_LOW) {
                // The peer is not reading: read nothing more until it does
                // (the flush that drains the output resumes reading).
                self.paused = true;
                return Poll::Pending;
            }
            self.paused = false;
            let mut buf = ReadBuf::uninit(&mut stack);
            match Pin::new(&mut self.io).poll_read(cx, &mut buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
                Poll::Ready(Ok(())) => {}
            }
            let read = buf.filled();
            let n = read.len();
            if n == 0 {
                return Poll::Ready(Ok(false));
            }
            self.keepalive.heard();
            if self.input.is_empty() {
                let used = self.on_input(read)?;
                self.input.extend_from_slice(&read[used..]);
            } else {
                let mut input = std::mem::take(&mut self.input);
                input.extend_from_slice(read);
                let used = self.on_input(&input)?;
                input.drain(..used);
                self.input = input;
            }
            if self.input.is_empty() && self.input.capacity() > 0 {
                self.input = Vec::new();
            }
            // What this read demanded goes out before the next read, so the
            // answers of a peer that reads them never pile up.
            if self.unanswered > 0
                && let Poll::Ready(Err(e)) = self.poll_flush(cx)
            {
                return Poll::Ready(Err(e));
            }
            budget = budget.saturating_sub(n);
            if budget == 0 {
                // Others' turn; this task goes on at once.
                cx.waker().wake_by_ref();
                return Poll::Ready(Ok(true));
            }
        }
    }

    /// Writes what is waiting. `Ready` once all of it is written.
    pub(super) fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ConnError>> {
        while self.written < self.out.len() {
            match Pin::new(&mut self.io).poll_write(cx, &self.out[self.written..]) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(
                        std::io::Error::from(std::io::ErrorKind::WriteZero).into()
                    ));
                }
                Poll::Ready(Ok(n)) => self.written += n,
            }
        }
        self.written = 0;
        self.unanswered = 0;
        if self.out.capacity() > 4096 {
            // A burst's buffer goes; an idle connection keeps a small one.
            self.out = Vec::new();
        } else {
            self.out.clear();
        }
        if std::mem::take(&mut self.starved) {
            self.wake_senders();
        }
        Poll::Ready(Ok(()))
    }

    /// The closing handshake: flush, close our side, wait (bounded) for
    /// the peer to close its own.
    pub(super) fn poll_closing(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ConnError>> {
        let deadline = self.ending.as_ref().map(|(_, at)| *at);
        let give_up = deadline.is_none_or(|at| Instant::now() >= at)
            || matches!(
                self.ending,
                Some((Some(ConnError::Io(_) | ConnError::KeepAlive(_)), _))
            );
        let ended = |this: &mut Self| {
            let error = this.ending.as_mut().and_then(|(e, _)| e.take());
            Poll::Ready(error.map_or(Ok(()), Err))
        };
        if give_up {
            return ended(self);
        }
        if self.keepalive.poll_close_deadline(cx, deadline).is_ready() {
            return ended(self);
        }
        match self.poll_flush(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Err(_)) => return ended(self),
            Poll::Ready(Ok(())) => {}
        }
        if Pin::new(&mut self.io).poll_shutdown(cx).is_pending() {
            return Poll::Pending;
        }
        let mut stack = [0u8; 4096];
        loop {
            let mut buf = ReadBuf::new(&mut stack);
            match Pin::new(&mut self.io).poll_read(cx, &mut buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => continue,
                Poll::Ready(_) => return ended(self),
            }
        }
    }
}
