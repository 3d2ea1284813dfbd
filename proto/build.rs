//! Compiles every `.proto` under this crate with the pure-Rust `protox`
//! compiler (no system `protoc`), generates tonic code, and writes the encoded
//! descriptor set that the servers hand to gRPC reflection.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "automesh/v1/placement.proto",
        "automesh/v1/automations.proto",
        "automesh/v1/runs.proto",
        "automesh/v1/notifications.proto",
        "automesh/internal/v1/caller.proto",
        "automesh/scheduler/v1/scheduler.proto",
        "automesh/coordinator/v1/coordinator.proto",
        "automesh/worker/v1/lifecycle.proto",
        "automesh/runner/v1/runner.proto",
        "automesh/executor/v1/executor.proto",
        "automesh/agent/v1/agent.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let fds = protox::compile(files, ["."])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("automesh_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // The runner RPC is named `Connect`; the generated `connect` constructor
        // would collide with it. Clients build their channel and call `new`.
        .build_transport(false)
        // Request decode errors are INVALID_ARGUMENT (src/codec.rs).
        .codec_path("crate::codec::Codec")
        .compile_fds(fds)?;
    Ok(())
}
