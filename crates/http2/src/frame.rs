//! HTTP/2 frames (RFC 9113 §4, §6): the 9-octet header, the kinds, flags,
//! error codes and settings this server reads, and the writers of every
//! frame it sends. Frames are written straight into the connection's
//! output buffer; nothing here allocates on its own.

/// What a client sends first (RFC 9113 §3.4).
pub(super) const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The size of a frame header.
pub(super) const HEAD: usize = 9;

/// The largest payload this server reads, and the protocol's default for
/// what it may send until the peer says otherwise.
pub(super) const DEFAULT_MAX_FRAME: u32 = 16_384;

/// The largest stream id (2^31 - 1).
pub(super) const MAX_STREAM: u32 = (1 << 31) - 1;

/// The largest window the protocol allows (2^31 - 1).
pub(super) const MAX_WINDOW: i64 = (1 << 31) - 1;

/// The initial window of a connection and of a stream, until settings say
/// otherwise (RFC 9113 §6.9.2).
pub(super) const DEFAULT_WINDOW: i64 = 65_535;

pub(super) mod kind {
    pub const DATA: u8 = 0x0;
    pub const HEADERS: u8 = 0x1;
    pub const PRIORITY: u8 = 0x2;
    pub const RST_STREAM: u8 = 0x3;
    pub const SETTINGS: u8 = 0x4;
    pub const PUSH_PROMISE: u8 = 0x5;
    pub const PING: u8 = 0x6;
    pub const GOAWAY: u8 = 0x7;
    pub const WINDOW_UPDATE: u8 = 0x8;
    pub const CONTINUATION: u8 = 0x9;
}

pub(super) mod flag {
    pub const END_STREAM: u8 = 0x1;
    pub const ACK: u8 = 0x1;
    pub const END_HEADERS: u8 = 0x4;
    pub const PADDED: u8 = 0x8;
    pub const PRIORITY: u8 = 0x20;
}

pub(super) mod setting {
    pub const ENABLE_PUSH: u16 = 0x2;
    pub const MAX_CONCURRENT_STREAMS: u16 = 0x3;
    pub const INITIAL_WINDOW_SIZE: u16 = 0x4;
    pub const MAX_FRAME_SIZE: u16 = 0x5;
    pub const MAX_HEADER_LIST_SIZE: u16 = 0x6;
}

/// An HTTP/2 error code (RFC 9113 §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reason(pub u32);

impl Reason {
    pub const NO_ERROR: Reason = Reason(0x0);
    pub const PROTOCOL_ERROR: Reason = Reason(0x1);
    pub const INTERNAL_ERROR: Reason = Reason(0x2);
    pub const FLOW_CONTROL_ERROR: Reason = Reason(0x3);
    pub const STREAM_CLOSED: Reason = Reason(0x5);
    pub const FRAME_SIZE_ERROR: Reason = Reason(0x6);
    pub const REFUSED_STREAM: Reason = Reason(0x7);
    pub const CANCEL: Reason = Reason(0x8);
    pub const COMPRESSION_ERROR: Reason = Reason(0x9);
    pub const ENHANCE_YOUR_CALM: Reason = Reason(0xb);

    /// The code's name, as RFC 9113 spells it.
    pub fn name(self) -> &'static str {
        match self.0 {
            0x0 => "NO_ERROR",
            0x1 => "PROTOCOL_ERROR",
            0x2 => "INTERNAL_ERROR",
            0x3 => "FLOW_CONTROL_ERROR",
            0x4 => "SETTINGS_TIMEOUT",
            0x5 => "STREAM_CLOSED",
            0x6 => "FRAME_SIZE_ERROR",
            0x7 => "REFUSED_STREAM",
            0x8 => "CANCEL",
            0x9 => "COMPRESSION_ERROR",
            0xa => "CONNECT_ERROR",
            0xb => "ENHANCE_YOUR_CALM",
            0xc => "INADEQUATE_SECURITY",
            0xd => "HTTP_1_1_REQUIRED",
            _ => "an unknown error code",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A frame's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Head {
    pub len: usize,
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
}

impl Head {
    /// Reads a header from the first [`HEAD`] octets of `b`.
    pub fn parse(b: &[u8]) -> Head {
        Head {
            len: (usize::from(b[0]) << 16) | (usize::from(b[1]) << 8) | usize::from(b[2]),
            kind: b[3],
            flags: b[4],
            // The reserved bit is ignored on receipt (RFC 9113 §4.1).
            stream: u31(&b[5..]),
        }
    }

    pub fn has(&self, flag: u8) -> bool {
        self.flags & flag == flag
    }
}

/// A 32-bit value from the first four octets of `b`.
pub(super) fn u32_at(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// A 31-bit value from four octets (its reserved bit ignored).
pub(super) fn u31(b: &[u8]) -> u32 {
    u32_at(b) & 0x7fff_ffff
}

/// Writes a frame header.
pub(super) fn head(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    debug_assert!(len < 1 << 24);
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
}

pub(super) fn settings(out: &mut Vec<u8>, values: &[(u16, u32)]) {
    head(out, values.len() * 6, kind::SETTINGS, 0, 0);
    for (id, value) in values {
        out.extend_from_slice(&id.to_be_bytes());
        out.extend_from_slice(&value.to_be_bytes());
    }
}

pub(super) fn settings_ack(out: &mut Vec<u8>) {
    head(out, 0, kind::SETTINGS, flag::ACK, 0);
}

pub(super) fn ping(out: &mut Vec<u8>, ack: bool, payload: [u8; 8]) {
    head(out, 8, kind::PING, if ack { flag::ACK } else { 0 }, 0);
    out.extend_from_slice(&payload);
}

pub(super) fn goaway(out: &mut Vec<u8>, last_stream: u32, reason: Reason, debug: &str) {
    let debug = &debug.as_bytes()[..debug.len().min(256)];
    head(out, 8 + debug.len(), kind::GOAWAY, 0, 0);
    out.extend_from_slice(&(last_stream & 0x7fff_ffff).to_be_bytes());
    out.extend_from_slice(&reason.0.to_be_bytes());
    out.extend_from_slice(debug);
}

pub(super) fn rst_stream(out: &mut Vec<u8>, stream: u32, reason: Reason) {
    head(out, 4, kind::RST_STREAM, 0, stream);
    out.extend_from_slice(&reason.0.to_be_bytes());
}

pub(super) fn window_update(out: &mut Vec<u8>, stream: u32, increment: u32) {
    debug_assert!(increment > 0 && i64::from(increment) <= MAX_WINDOW);
    head(out, 4, kind::WINDOW_UPDATE, 0, stream);
    out.extend_from_slice(&increment.to_be_bytes());
}

pub(super) fn data(out: &mut Vec<u8>, stream: u32, end_stream: bool, payload: &[u8]) {
    let flags = if end_stream { flag::END_STREAM } else { 0 };
    head(out, payload.len(), kind::DATA, flags, stream);
    out.extend_from_slice(payload);
}

/// A header block as one HEADERS frame and as many CONTINUATION frames as
/// the peer's frame size asks for.
pub(super) fn headers(
    out: &mut Vec<u8>,
    stream: u32,
    end_stream: bool,
    block: &[u8],
    max_frame: usize,
) {
    let mut chunks = block.chunks(max_frame.max(1)).peekable();
    let first = chunks.next().unwrap_or(&[]);
    let mut flags = if end_stream { flag::END_STREAM } else { 0 };
    if chunks.peek().is_none() {
        flags |= flag::END_HEADERS;
    }
    head(out, first.len(), kind::HEADERS, flags, stream);
    out.extend_from_slice(first);
    while let Some(chunk) = chunks.next() {
        let flags = if chunks.peek().is_none() {
            flag::END_HEADERS
        } else {
            0
        };
        head(out, chunk.len(), kind::CONTINUATION, flags, stream);
        out.extend_from_slice(chunk);
    }
}

/// A frame's payload without its padding (RFC 9113 §6.1, §6.2): the
/// content, or `None` when the padding is as long as the payload or longer.
pub(super) fn unpadded(head: &Head, payload: &[u8]) -> Option<std::ops::Range<usize>> {
    if !head.has(flag::PADDED) {
        return Some(0..payload.len());
    }
    let pad = usize::from(*payload.first()?);
    (pad < payload.len()).then(|| 1..payload.len() - pad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_reads_back_what_was_written() {
        let mut out = vec![];
        head(
            &mut out,
            0x01_02_03,
            kind::HEADERS,
            flag::END_HEADERS,
            0x8000_0007,
        );
        let h = Head::parse(&out);
        assert_eq!(
            h,
            Head {
                len: 0x01_02_03,
                kind: kind::HEADERS,
                flags: flag::END_HEADERS,
                // The reserved bit is never written and never read.
                stream: 7,
            }
        );
    }

    #[test]
    fn a_header_block_is_split_at_the_peers_frame_size() {
        let mut out = vec![];
        headers(&mut out, 3, true, &[7u8; 25], 10);
        let mut frames = vec![];
        let mut at = 0;
        while at < out.len() {
            let h = Head::parse(&out[at..]);
            frames.push((h.kind, h.flags, h.len));
            at += HEAD + h.len;
        }
        assert_eq!(
            frames,
            [
                (kind::HEADERS, flag::END_STREAM, 10),
                (kind::CONTINUATION, 0, 10),
                (kind::CONTINUATION, flag::END_HEADERS, 5),
            ]
        );
    }

    #[test]
    fn padding_is_removed_and_too_much_of_it_refused() {
        let padded = Head {
            len: 5,
            kind: kind::DATA,
            flags: flag::PADDED,
            stream: 1,
        };
        assert_eq!(unpadded(&padded, &[2, b'a', b'b', 0, 0]), Some(1..3));
        // Padding as long as the payload (its length octet included) or longer.
        assert_eq!(unpadded(&padded, &[4, 0, 0, 0, 0]), Some(1..1));
        assert_eq!(unpadded(&padded, &[5, 0, 0, 0, 0]), None);
        assert_eq!(unpadded(&padded, &[]), None);
        let plain = Head { flags: 0, ..padded };
        assert_eq!(unpadded(&plain, b"abc"), Some(0..3));
    }
}
