//! Fuzz target: header blocks decoded one after another by one HPACK
//! decoder (`automesh_http2::fuzzing::headers`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| automesh_http2::fuzzing::headers(data));
