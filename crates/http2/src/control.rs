//! The connection-level frames (RFC 9113 §6.5-§6.9): SETTINGS, PING,
//! GOAWAY and WINDOW_UPDATE, and the rapid-reset bound.

use super::frame::{self, Head, Reason, flag, setting};
use super::{Calls, ConnError, Connection, Handled, Io, Phase, SendBody};

impl<S: Calls<B>, B: SendBody, T: Io> Connection<S, B, T> {
    /// One more stream the peer reset before its answer was over; too many
    /// in a second end the connection.
    pub(super) fn count_early_reset(&mut self) -> Handled {
        let now = std::time::Instant::now();
        let (since, count) = &mut self.early_resets;
        if now.duration_since(*since) >= std::time::Duration::from_secs(1) {
            *since = now;
            *count = 0;
        }
        *count += 1;
        if *count > super::MAX_EARLY_RESETS {
            return Err(ConnError::protocol(
                Reason::ENHANCE_YOUR_CALM,
                "too many streams reset before their answer",
            ));
        }
        Ok(())
    }

    pub(super) fn on_settings(&mut self, head: Head, payload: &[u8]) -> Handled {
        if head.stream != 0 {
            return Err(ConnError::protocol(
                Reason::PROTOCOL_ERROR,
                "SETTINGS on a stream",
            ));
        }
        if head.has(flag::ACK) {
            return if payload.is_empty() {
                Ok(())
            } else {
                Err(ConnError::protocol(
                    Reason::FRAME_SIZE_ERROR,
                    "a SETTINGS acknowledgement with a payload",
                ))
            };
        }
        if !payload.len().is_multiple_of(6) {
            return Err(ConnError::protocol(
                Reason::FRAME_SIZE_ERROR,
                "SETTINGS of a length that is not a multiple of 6",
            ));
        }
        for entry in payload.chunks_exact(6) {
            let id = u16::from_be_bytes([entry[0], entry[1]]);
            let value = frame::u32_at(&entry[2..]);
            match id {
                setting::ENABLE_PUSH if value > 1 => {
                    return Err(ConnError::protocol(
                        Reason::PROTOCOL_ERROR,
                        "SETTINGS_ENABLE_PUSH other than 0 or 1",
                    ));
                }
                setting::INITIAL_WINDOW_SIZE => {
                    let value = i64::from(value);
                    if value > frame::MAX_WINDOW {
                        return Err(ConnError::protocol(
                            Reason::FLOW_CONTROL_ERROR,
                            "SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1",
                        ));
                    }
                    let delta = value - self.peer_initial_window;
                    self.peer_initial_window = value;
                    for s in &mut self.streams {
                        s.send_window += delta;
                        if s.send_window > frame::MAX_WINDOW {
                            return Err(ConnError::protocol(
                                Reason::FLOW_CONTROL_ERROR,
                                "a stream's window above 2^31-1",
                            ));
                        }
                    }
                    if delta > 0 {
                        self.wake_senders();
                    }
                }
                setting::MAX_FRAME_SIZE => {
                    if !(frame::DEFAULT_MAX_FRAME..1 << 24).contains(&value) {
                        return Err(ConnError::protocol(
                            Reason::PROTOCOL_ERROR,
                            "SETTINGS_MAX_FRAME_SIZE out of range",
                        ));
                    }
                    self.peer_max_frame = value as usize;
                }
                // Our encoder keeps no table and pushes nothing; the other
                // settings bind the peer's side only (unknown ones are
                // ignored, RFC 9113 §6.5.2).
                _ => {}
            }
        }
        frame::settings_ack(&mut self.out);
        self.demanded()
    }

    /// One more acknowledgement the peer demanded is waiting to be written;
    /// past [`super::MAX_UNANSWERED`] the connection ends.
    fn demanded(&mut self) -> Handled {
        self.unanswered += 1;
        if self.unanswered > super::MAX_UNANSWERED {
            return Err(ConnError::protocol(
                Reason::ENHANCE_YOUR_CALM,
                "too many PINGs and SETTINGS unanswered: the peer does not read",
            ));
        }
        Ok(())
    }

    pub(super) fn on_ping(&mut self, head: Head, payload: &[u8]) -> Handled {
        if head.stream != 0 {
            return Err(ConnError::protocol(
                Reason::PROTOCOL_ERROR,
                "PING on a stream",
            ));
        }
        let Ok(payload) = <[u8; 8]>::try_from(payload) else {
            return Err(ConnError::protocol(
                Reason::FRAME_SIZE_ERROR,
                "PING of a length other than 8",
            ));
        };
        if head.has(flag::ACK) {
            if payload == super::keepalive::PAYLOAD {
                self.keepalive.answered();
            } else if payload == super::keepalive::DRAINING {
                self.keepalive.answered();
                self.last_goaway();
            }
        } else {
            frame::ping(&mut self.out, true, payload);
            return self.demanded();
        }
        Ok(())
    }

    pub(super) fn on_goaway(&mut self, head: Head, payload: &[u8]) -> Handled {
        if head.stream != 0 {
            return Err(ConnError::protocol(
                Reason::PROTOCOL_ERROR,
                "GOAWAY on a stream",
            ));
        }
        if payload.len() < 8 {
            return Err(ConnError::protocol(
                Reason::FRAME_SIZE_ERROR,
                "GOAWAY shorter than 8",
            ));
        }
        let reason = Reason(frame::u32_at(&payload[4..]));
        if reason != Reason::NO_ERROR {
            let debug = String::from_utf8_lossy(&payload[8..payload.len().min(8 + 128)]);
            self.close(Some(ConnError::PeerGoAway {
                reason,
                debug: debug.into_owned(),
            }));
        } else if self.phase != Phase::Closing {
            // The peer opens nothing more; what is open finishes.
            self.phase = Phase::Draining;
        }
        Ok(())
    }

    pub(super) fn on_window_update(&mut self, head: Head, payload: &[u8]) -> Handled {
        if payload.len() != 4 {
            return Err(ConnError::protocol(
                Reason::FRAME_SIZE_ERROR,
                "WINDOW_UPDATE of a length other than 4",
            ));
        }
        let increment = i64::from(frame::u31(payload));
        if head.stream == 0 {
            if increment == 0 {
                return Err(ConnError::protocol(
                    Reason::PROTOCOL_ERROR,
                    "a WINDOW_UPDATE of 0 for the connection",
                ));
            }
            self.send_window += increment;
            if self.send_window > frame::MAX_WINDOW {
                return Err(ConnError::protocol(
                    Reason::FLOW_CONTROL_ERROR,
                    "the connection's window above 2^31-1",
                ));
            }
            self.wake_senders();
            return Ok(());
        }
        let Some(i) = self.stream_index(head.stream) else {
            if head.stream > self.last_stream {
                return Err(ConnError::protocol(
                    Reason::PROTOCOL_ERROR,
                    "WINDOW_UPDATE on an idle stream",
                ));
            }
            return Ok(());
        };
        if increment == 0 {
            self.reset_stream(i, Reason::PROTOCOL_ERROR);
            return Ok(());
        }
        let s = &mut self.streams[i];
        s.send_window += increment;
        if s.send_window > frame::MAX_WINDOW {
            self.reset_stream(i, Reason::FLOW_CONTROL_ERROR);
            return Ok(());
        }
        self.ready.push(head.stream);
        Ok(())
    }
}
