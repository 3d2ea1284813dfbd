//! Fuzz target: a whole lean HTTP/2 connection fed arbitrary octets after
//! the client preface (`automesh_http2::fuzzing::frames`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| automesh_http2::fuzzing::frames(data));
