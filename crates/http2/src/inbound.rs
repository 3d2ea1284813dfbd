//! What a connection does with each frame it reads (RFC 9113 §5, §6): a
//! breach of the protocol is a connection error (GOAWAY) or a stream error
//! (RST_STREAM) with the code the RFC names for it.

use bytes::Bytes;

use super::frame::{self, Head, PREFACE, Reason, flag, kind};
use super::stream::{End, RecvBody, StreamShared};
use super::{
    Calls, Closed, ConnError, Connection, Handled, Io, MAX_CONTINUATIONS, MAX_HEADER_BLOCK,
    MAX_HEADER_LIST, Out, PartialBlock, Phase, SendBody, Stream,
};

impl<S: Calls<B>, B: SendBody, T: Io> Connection<S, B, T> {
    /// Handles the preface and every complete frame at the start of
    /// `input`; returns how many octets it used (the rest is kept until
    /// more arrives).
    pub(super) fn on_input(&mut self, input: &[u8]) -> Handled<usize> {
        let mut at = 0;
        if self.phase == Phase::Preface {
            let n = input.len().min(PREFACE.len());
            if input[..n] != PREFACE[..n] {
                return Err(ConnError::Preface);
            }
            if n < PREFACE.len() {
                return Ok(0);
            }
            at = PREFACE.len();
            self.phase = Phase::Settings;
        }
        while self.ending.is_none() {
            let rest = &input[at..];
            if rest.len() < frame::HEAD {
                break;
            }
            let head = Head::parse(rest);
            if head.len > frame::DEFAULT_MAX_FRAME as usize {
                return Err(ConnError::protocol(
                    Reason::FRAME_SIZE_ERROR,
                    "a frame larger than SETTINGS_MAX_FRAME_SIZE",
                ));
            }
            if rest.len() < frame::HEAD + head.len {
                break;
            }
            let payload = &rest[frame::HEAD..frame::HEAD + head.len];
            at += frame::HEAD + head.len;
            self.on_frame(head, payload)?;
        }
        Ok(at)
    }

    fn on_frame(&mut self, head: Head, payload: &[u8]) -> Handled {
        if let Some(block) = &self.block
            && (head.kind != kind::CONTINUATION || head.stream != block.stream)
        {
            return Err(ConnError::protocol(
                Reason::PROTOCOL_ERROR,
                "a frame other than its CONTINUATION inside a header block",
            ));
        }
        if self.phase == Phase::Settings {
            if head.kind != kind::SETTINGS || head.has(flag::ACK) {
                return Err(ConnError::protocol(
                    Reason::PROTOCOL_ERROR,
                    "the client's preface must go on with SETTINGS",
                ));
            }
            self.phase = Phase::Open;
        }
        match head.kind {
            kind::DATA => self.on_data(head, payload),
            kind::HEADERS => self.on_headers(head, payload),
            kind::PRIORITY => self.on_priority(head, payload),
            kind::RST_STREAM => self.on_rst_stream(head, payload),
            kind::SETTINGS => self.on_settings(head, payload),
            kind::PUSH_PROMISE => Err(ConnError::protocol(
                Reason::PROTOCOL_ERROR,
                "a client may not push",
            )),
            kind::PING => self.on_ping(head, payload),
            kind::GOAWAY => self.on_goaway(head, payload),
            kind::WINDOW_UPDATE => self.on_window_update(head, payload),
            kind::CONTINUATION => self.on_continuation(head, payload),
            // Frames of unknown kinds are ignored (RFC 9113 §4.1).
            _ => Ok(()),
        }
    }

    fn on_data(&mut self, head: Head, payload: &[u8]) -> Handled {
        if head.stream == 0 {
            return Err(ConnError::protocol(
                Reason::PROTOCOL_ERROR,
                "DATA on stream 0",
            ));
        }
        let len = payload.len() as i64;
        if len > self.recv_window {
            return Err(ConnError::protocol(
                Reason::FLOW_CONTROL_ERROR,
                "DATA beyond the connection's window",
            ));
        }
        self.recv_window -= len;
        let Some(content) = frame::unpadded(&head, payload) else {
            return Err(ConnError::protocol(
                Reason::PROTOCOL_ERROR,
                "padding as long as the frame",
            ));
        };
        let Some(i) = self.stream_index(head.stream) else {
            // No stream to take it: it counts as read at once.
            self.recv_released += len;
            return self.on_frame_of_no_stream(head.stream);
        };
        let s = &mut self.streams[i];
        let open = s.shared.recv().end == End::Open;
        if !open || len > s.recv_window {
            self.recv_released += len;
            let reason = if open {
                Reason::FLOW_CONTROL_ERROR
            } else {
                Reason::STREAM_CLOSED
            };
            self.reset_stream(i, reason);
            return Ok(());
        }
        s.recv_window -= len;
        let data = &payload[content];
        s.received += data.len() as u64;
        // Padding counts as read at once.
        let mut read = len - data.len() as i64;
        let too_long = s.content_length.is_some_and(|n| s.received > n);
        let short = head.has(flag::END_STREAM) && s.content_length.is_some_and(|n| s.received < n);
        if too_long || short {
            self.recv_released += len;
            self.reset_stream(i, Reason::PROTOCOL_ERROR);
            return Ok(());
        }
        if !data.is_empty() && !s.shared.push_data(Bytes::copy_from_slice(data)) {
            // Nobody reads this stream any more.
            read = len;
        }
        if read > 0 {
            s.shared.recv().released += read as usize;
        }
        if head.has(flag::END_STREAM) {
            s.shared.end(End::Ended);
        }
        if read > 0 || head.has(flag::END_STREAM) {
            self.ready.push(head.stream);
        }
        Ok(())
    }

    /// A DATA, WINDOW_UPDATE or RST_STREAM frame for a stream that is not
    /// open.
    fn on_frame_of_no_stream(&mut self, id: u32) -> Handled {
        if id > self.last_stream {
            return Err(ConnError::protocol(
                Reason::PROTOCOL_ERROR,
                "a frame on an idle stream",
            ));
        }
        if self.recently(id) != Some(Closed::ByUs) {
            // Closed by the peer's reset or by both sides' END_STREAM, not
            // by a reset of ours whose news may be on its way.
            frame::rst_stream(&mut self.out, id, Reason::STREAM_CLOSED);
            self.remember(id, Closed::ByUs);
        }
        Ok(())
    }

    fn on_headers(&mut self, head: Head, payload: &[u8]) -> Handled {
        if head.stream == 0 {
            return Err(ConnError::protocol(
                Reason::PROTOCOL_ERROR,
                "HEADERS on stream 0",
            ));
        }
        let Some(range) = frame::unpadded(&head, payload) else {
            return Err(ConnError::protocol(
                Reason::PROTOCOL_ERROR,
                "padding as long as the frame",
            ));
        };
        let mut fragment = &payload[range];
        let mut self_dependent = false;
        if head.has(flag::PRIORITY) {
            if fragment.len() < 5 {
                return Err(ConnError::protocol(
                    Reason::FRAME_SIZE_ERROR,
                    "HEADERS too short for its priority",
                ));
            }
            self_dependent = frame::u31(fragment) == head.stream;
            fragment = &fragment[5..];
        }
        let block = PartialBlock {
            stream: head.stream,
            continuations: 0,
            end_stream: head.has(flag::END_STREAM),
            self_dependent,
            octets: fragment.to_vec(),
        };
        if head.has(flag::END_HEADERS) {
            self.on_block(block)
        } else {
            self.block = Some(block);
            Ok(())
        }
    }

    fn on_continuation(&mut self, head: Head, payload: &[u8]) -> Handled {
        let Some(mut block) = self.block.take() else {
            return Err(ConnError::protocol(
                Reason::PROTOCOL_ERROR,
                "CONTINUATION without HEADERS",
            ));
        };
        block.octets.extend_from_slice(payload);
        block.continuations += 1;
        if block.octets.len() > MAX_HEADER_BLOCK || block.continuations > MAX_CONTINUATIONS {
            return Err(ConnError::protocol(
                Reason::ENHANCE_YOUR_CALM,
                "a header block over the size limit",
            ));
        }
        if head.has(flag::END_HEADERS) {
            self.on_block(block)
        } else {
            self.block = Some(block);
            Ok(())
        }
    }

    /// A whole header block: a new request, or trailers.
    fn on_block(&mut self, block: PartialBlock) -> Handled {
        let id = block.stream;
        let open = self.stream_index(id);
        // Decoded whatever becomes of it, so the table stays in step.
        let decoded = super::hpack::decode(
            &mut self.decoder,
            &block.octets,
            MAX_HEADER_LIST,
            open.is_some(),
        )
        .map_err(|_| {
            ConnError::protocol(
                Reason::COMPRESSION_ERROR,
                "a header block that does not decode",
            )
        })?;
        if let Some(i) = open {
            let s = &self.streams[i];
            if s.shared.recv().end != End::Open {
                self.reset_stream(i, Reason::STREAM_CLOSED);
            } else if !block.end_stream
                || block.self_dependent
                || decoded.malformed.is_some()
                || decoded.too_large
                || s.content_length.is_some_and(|n| s.received != n)
            {
                // Trailers end the stream and carry no pseudo-header.
                self.reset_stream(i, Reason::PROTOCOL_ERROR);
            } else {
                s.shared.push_trailers(decoded.fields);
                self.ready.push(id);
            }
            return Ok(());
        }
        if id <= self.last_stream {
            return match self.recently(id) {
                Some(Closed::ByUs) => Ok(()),
                Some(Closed::ByPeer) => self.refuse(id, Reason::STREAM_CLOSED),
                Some(Closed::Ended) => Err(ConnError::protocol(
                    Reason::STREAM_CLOSED,
                    "HEADERS on a closed stream",
                )),
                None => Err(ConnError::protocol(
                    Reason::PROTOCOL_ERROR,
                    "a stream id not above the ones before it",
                )),
            };
        }
        if id.is_multiple_of(2) {
            return Err(ConnError::protocol(
                Reason::PROTOCOL_ERROR,
                "an even stream id from a client",
            ));
        }
        self.last_stream = id;
        if self.goaway.is_some_and(|last| id > last) {
            // Opened after our GOAWAY: ignored, the client retries it.
            return Ok(());
        }
        if block.self_dependent {
            return self.refuse(id, Reason::PROTOCOL_ERROR);
        }
        if self.streams.len() >= self.limits.max_concurrent_streams as usize {
            return self.refuse(id, Reason::REFUSED_STREAM);
        }
        if decoded.too_large {
            let mut answer = vec![];
            super::hpack::encode_response(
                &mut answer,
                http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                &http::HeaderMap::new(),
            );
            frame::headers(&mut self.out, id, true, &answer, self.peer_max_frame);
            if !block.end_stream {
                frame::rst_stream(&mut self.out, id, Reason::NO_ERROR);
            }
            self.remember(id, Closed::ByUs);
            return Ok(());
        }
        let end = if block.end_stream {
            End::Ended
        } else {
            End::Open
        };
        let shared = StreamShared::new(id, self.shared.clone(), end);
        let Ok(request) = decoded.into_request(RecvBody::new(shared.clone())) else {
            return self.refuse(id, Reason::PROTOCOL_ERROR);
        };
        let content_length = match request.headers().get(http::header::CONTENT_LENGTH) {
            None => None,
            Some(v) => match v.to_str().ok().and_then(|v| v.parse::<u64>().ok()) {
                Some(n) if !(block.end_stream && n > 0) => Some(n),
                _ => return self.refuse(id, Reason::PROTOCOL_ERROR),
            },
        };
        self.streams.push(Stream {
            id,
            shared,
            send_window: self.peer_initial_window,
            recv_window: super::STREAM_WINDOW,
            unacked: 0,
            content_length,
            received: 0,
            out: Out::Waiting(Some(Box::new(request))),
        });
        self.waiting.push_back(id);
        Ok(())
    }

    fn on_priority(&mut self, head: Head, payload: &[u8]) -> Handled {
        if head.stream == 0 {
            return Err(ConnError::protocol(
                Reason::PROTOCOL_ERROR,
                "PRIORITY on stream 0",
            ));
        }
        if payload.len() != 5 {
            return self.refuse_any(head.stream, Reason::FRAME_SIZE_ERROR);
        }
        if frame::u31(payload) == head.stream {
            return self.refuse_any(head.stream, Reason::PROTOCOL_ERROR);
        }
        // Priorities are a hint this server does not take.
        Ok(())
    }

    fn on_rst_stream(&mut self, head: Head, payload: &[u8]) -> Handled {
        if head.stream == 0 {
            return Err(ConnError::protocol(
                Reason::PROTOCOL_ERROR,
                "RST_STREAM on stream 0",
            ));
        }
        if payload.len() != 4 {
            return Err(ConnError::protocol(
                Reason::FRAME_SIZE_ERROR,
                "RST_STREAM of a length other than 4",
            ));
        }
        let reason = Reason(frame::u32_at(payload));
        match self.stream_index(head.stream) {
            Some(i) => {
                if !matches!(self.streams[i].out, Out::Done) {
                    self.count_early_reset()?;
                }
                self.streams[i].shared.end(End::Reset(reason));
                self.remove_stream(i);
                self.remember(head.stream, Closed::ByPeer);
                Ok(())
            }
            None if head.stream > self.last_stream => Err(ConnError::protocol(
                Reason::PROTOCOL_ERROR,
                "RST_STREAM on an idle stream",
            )),
            None => Ok(()),
        }
    }

    /// A stream error on a stream that never opened (or is not open).
    fn refuse(&mut self, id: u32, reason: Reason) -> Handled {
        frame::rst_stream(&mut self.out, id, reason);
        self.remember(id, Closed::ByUs);
        Ok(())
    }

    /// A stream error on any stream, open or not.
    fn refuse_any(&mut self, id: u32, reason: Reason) -> Handled {
        match self.stream_index(id) {
            Some(i) => {
                self.reset_stream(i, reason);
                Ok(())
            }
            None => self.refuse(id, reason),
        }
    }

    /// Resets open stream `i` (RST_STREAM `reason`): its reader hears it,
    /// its call or response is dropped.
    pub(super) fn reset_stream(&mut self, i: usize, reason: Reason) {
        let id = self.streams[i].id;
        frame::rst_stream(&mut self.out, id, reason);
        self.streams[i].shared.end(End::Refused(reason));
        self.remove_stream(i);
        self.remember(id, Closed::ByUs);
    }
}
