//! Header blocks (RFC 7541, RFC 9113 §8): a request's block decoded into
//! the parts of an `http::Request` and checked as HTTP/2 requires, and a
//! response's (or trailers') block encoded.
//!
//! Decoding uses `loona-hpack` (the dynamic table and Huffman code). Our
//! encoder never indexes: every field is a literal without indexing (a
//! sensitive one never indexed), so this side keeps no dynamic table at all
//! and the peer's `SETTINGS_HEADER_TABLE_SIZE` needs no answer.

use http::header::{HeaderMap, HeaderName, HeaderValue};

/// A decoded header block: the pseudo-header fields and the rest.
#[derive(Debug, Default)]
pub(super) struct Block {
    pub method: Option<String>,
    pub scheme: Option<String>,
    pub authority: Option<String>,
    pub path: Option<String>,
    pub fields: HeaderMap,
    /// Why the block is malformed (RFC 9113 §8.1.1), if it is: a stream
    /// error, the connection goes on.
    pub malformed: Option<&'static str>,
    /// Its decoded size passed the limit (RFC 9113 §6.5.2).
    pub too_large: bool,
}

/// Connection-specific fields, which HTTP/2 forbids (RFC 9113 §8.2.2).
const CONNECTION_SPECIFIC: [&str; 5] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
];

/// Decodes `block` with the connection's decoder. `Err` is a compression
/// error, which ends the connection: the decoder's table can no longer be
/// trusted. A block that decodes but breaks HTTP/2's rules is `Ok` with
/// [`Block::malformed`] set; it was still decoded whole, so the table stays
/// in step with the peer's.
pub(super) fn decode(
    decoder: &mut loona_hpack::Decoder<'static>,
    block: &[u8],
    limit: usize,
    trailers: bool,
) -> Result<Block, loona_hpack::decoder::DecoderError> {
    let mut out = Block::default();
    let mut size = 0usize;
    let mut regular_seen = false;
    decoder.decode_with_cb(block, |name, value| {
        size += name.len() + value.len() + 32;
        if size > limit {
            out.too_large = true;
        }
        if out.too_large || out.malformed.is_some() {
            return;
        }
        if let Some(pseudo) = name.strip_prefix(b":") {
            if trailers || regular_seen {
                out.malformed = Some("a pseudo-header field after the regular ones");
                return;
            }
            let slot = match pseudo {
                b"method" => &mut out.method,
                b"scheme" => &mut out.scheme,
                b"authority" => &mut out.authority,
                b"path" => &mut out.path,
                _ => {
                    out.malformed = Some("an unknown pseudo-header field");
                    return;
                }
            };
            let Ok(value) = std::str::from_utf8(&value) else {
                out.malformed = Some("a pseudo-header field that is not text");
                return;
            };
            if slot.replace(value.to_owned()).is_some() {
                out.malformed = Some("a repeated pseudo-header field");
            }
            return;
        }
        regular_seen = true;
        if name.iter().any(u8::is_ascii_uppercase) {
            out.malformed = Some("an uppercase field name");
            return;
        }
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(&name),
            HeaderValue::from_bytes(&value),
        ) else {
            out.malformed = Some("an invalid field name or value");
            return;
        };
        if CONNECTION_SPECIFIC.contains(&name.as_str()) {
            out.malformed = Some("a connection-specific field");
            return;
        }
        if name == http::header::TE && value.as_bytes() != b"trailers" {
            out.malformed = Some("a te field other than \"trailers\"");
            return;
        }
        out.fields.append(name, value);
    })?;
    Ok(out)
}

impl Block {
    /// The request this block opens, or why it is malformed.
    pub fn into_request<B>(self, body: B) -> Result<http::Request<B>, &'static str> {
        if let Some(why) = self.malformed {
            return Err(why);
        }
        let method = self.method.ok_or("no :method")?;
        if method == "CONNECT" {
            return Err("CONNECT is not served here");
        }
        let method = http::Method::from_bytes(method.as_bytes()).map_err(|_| "a bad :method")?;
        let scheme = self.scheme.ok_or("no :scheme")?;
        let path = self.path.filter(|p| !p.is_empty()).ok_or("no :path")?;
        if !(path.starts_with('/') || (path == "*" && method == http::Method::OPTIONS)) {
            return Err("a :path that is neither absolute nor *");
        }
        let mut uri = http::Uri::builder().path_and_query(path);
        if let Some(authority) = self.authority {
            uri = uri.scheme(scheme.as_str()).authority(authority);
        }
        let uri = uri
            .build()
            .map_err(|_| "a bad :scheme, :authority or :path")?;
        let mut request = http::Request::new(body);
        *request.method_mut() = method;
        *request.uri_mut() = uri;
        *request.version_mut() = http::Version::HTTP_2;
        *request.headers_mut() = self.fields;
        Ok(request)
    }
}

/// Appends an HPACK integer with an `n`-bit prefix (RFC 7541 §5.1) whose
/// first octet starts with `high`.
fn integer(out: &mut Vec<u8>, value: usize, n: u8, high: u8) {
    let max = (1usize << n) - 1;
    if value < max {
        out.push(high | value as u8);
        return;
    }
    out.push(high | max as u8);
    let mut rest = value - max;
    while rest >= 128 {
        out.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    out.push(rest as u8);
}

/// Appends a string literal, not Huffman-coded (RFC 7541 §5.2).
fn string(out: &mut Vec<u8>, s: &[u8]) {
    integer(out, s.len(), 7, 0);
    out.extend_from_slice(s);
}

/// Appends a response's `:status` and fields.
pub(super) fn encode_response(out: &mut Vec<u8>, status: http::StatusCode, fields: &HeaderMap) {
    // The statuses of the static table (RFC 7541 Appendix A, 8 to 14).
    let indexed = match status.as_u16() {
        200 => Some(8),
        204 => Some(9),
        206 => Some(10),
        304 => Some(11),
        400 => Some(12),
        404 => Some(13),
        500 => Some(14),
        _ => None,
    };
    match indexed {
        Some(index) => integer(out, index, 7, 0x80),
        None => {
            // Literal without indexing, the name :status (index 8).
            integer(out, 8, 4, 0x00);
            string(out, status.as_str().as_bytes());
        }
    }
    encode_fields(out, fields);
}

/// Appends fields (trailers, or a response's regular fields), leaving out
/// connection-specific ones.
pub(super) fn encode_fields(out: &mut Vec<u8>, fields: &HeaderMap) {
    for (name, value) in fields {
        if CONNECTION_SPECIFIC.contains(&name.as_str()) {
            continue;
        }
        // Literal without indexing, or never indexed, with a new name.
        out.push(if value.is_sensitive() { 0x10 } else { 0x00 });
        string(out, name.as_str().as_bytes());
        string(out, value.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request_block(fields: &[(&str, &str)]) -> Vec<u8> {
        let mut encoder = loona_hpack::Encoder::new();
        encoder.encode(fields.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())))
    }

    fn decoded(fields: &[(&str, &str)]) -> Block {
        let mut decoder = loona_hpack::Decoder::new();
        decode(&mut decoder, &request_block(fields), 16_384, false).expect("decodes")
    }

    const GRPC: [(&str, &str); 5] = [
        (":method", "POST"),
        (":scheme", "http"),
        (":authority", "127.0.0.1:50052"),
        (":path", "/automesh.runner.v1.DesktopRunnerService/Connect"),
        ("content-type", "application/grpc"),
    ];

    #[test]
    fn a_grpc_request_decodes_into_its_parts() {
        let request = decoded(&GRPC).into_request(()).expect("a request");
        assert_eq!(request.method(), http::Method::POST);
        assert_eq!(
            request.uri().to_string(),
            "http://127.0.0.1:50052/automesh.runner.v1.DesktopRunnerService/Connect"
        );
        assert_eq!(request.headers()["content-type"], "application/grpc");
        assert_eq!(request.version(), http::Version::HTTP_2);
    }

    #[test]
    fn requests_that_break_http2s_rules_are_malformed() {
        let with = |extra: &[(&str, &str)]| {
            let mut fields = GRPC.to_vec();
            fields.extend_from_slice(extra);
            decoded(&fields).into_request(())
        };
        assert!(with(&[("connection", "keep-alive")]).is_err());
        assert!(with(&[("te", "gzip")]).is_err());
        assert!(with(&[("te", "trailers")]).is_ok());
        assert!(with(&[("X-Upper", "1")]).is_err());
        assert!(
            with(&[(":path", "/again")]).is_err(),
            "a repeated pseudo field"
        );
        assert!(with(&[(":status", "200")]).is_err(), "a response field");
        let late = [
            (":method", "POST"),
            ("content-type", "application/grpc"),
            (":scheme", "http"),
            (":path", "/x"),
        ];
        assert!(
            decoded(&late).into_request(()).is_err(),
            "a pseudo field late"
        );
        let no_path = [(":method", "POST"), (":scheme", "http")];
        assert!(decoded(&no_path).into_request(()).is_err());
        let connect = [(":method", "CONNECT"), (":authority", "a:1")];
        assert!(decoded(&connect).into_request(()).is_err());
    }

    #[test]
    fn a_block_over_the_size_limit_is_marked_yet_decoded_whole() {
        let mut decoder = loona_hpack::Decoder::new();
        let mut encoder = loona_hpack::Encoder::new();
        let big = "x".repeat(200);
        let fields = [(":method", "POST"), ("x-big", big.as_str())];
        let block = encoder.encode(fields.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())));
        let out = decode(&mut decoder, &block, 100, false).expect("decodes");
        assert!(out.too_large);
        // The table still follows the encoder: the next block refers to
        // what the first one indexed.
        let again = encoder.encode(fields.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())));
        assert!(again.len() < 10, "indexed: {again:?}");
        let out = decode(&mut decoder, &again, 16_384, false).expect("decodes");
        assert_eq!(out.fields["x-big"], big.as_str());
    }

    #[test]
    fn responses_decode_with_another_implementation() {
        let mut fields = HeaderMap::new();
        fields.insert("content-type", HeaderValue::from_static("application/grpc"));
        fields.insert("grpc-status", HeaderValue::from_static("0"));
        let long = "m".repeat(300);
        fields.insert("grpc-message", HeaderValue::from_str(&long).expect("value"));
        let mut secret = HeaderValue::from_static("Bearer abc");
        secret.set_sensitive(true);
        fields.insert("authorization", secret);
        fields.insert("connection", HeaderValue::from_static("close"));
        for status in [200u16, 415, 500] {
            let mut out = vec![];
            encode_response(
                &mut out,
                http::StatusCode::from_u16(status).expect("status"),
                &fields,
            );
            let got = loona_hpack::Decoder::new().decode(&out).expect("decodes");
            let got: Vec<(String, String)> = got
                .into_iter()
                .map(|(n, v)| {
                    (
                        String::from_utf8(n).expect("name"),
                        String::from_utf8(v).expect("value"),
                    )
                })
                .collect();
            assert_eq!(got[0], (":status".to_owned(), status.to_string()));
            assert!(got.contains(&("grpc-message".to_owned(), long.clone())));
            assert!(got.contains(&("authorization".to_owned(), "Bearer abc".to_owned())));
            assert!(!got.iter().any(|(n, _)| n == "connection"), "{got:?}");
        }
    }

    #[test]
    fn integers_use_their_prefix_then_continuation_octets() {
        // RFC 7541 C.1.2: 1337 with a 5-bit prefix.
        let mut out = vec![];
        integer(&mut out, 1337, 5, 0);
        assert_eq!(out, [31, 154, 10]);
        let mut out = vec![];
        integer(&mut out, 10, 5, 0);
        assert_eq!(out, [10]);
    }
}
