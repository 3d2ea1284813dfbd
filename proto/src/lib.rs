//! Generated code for the automesh protobuf contracts, one module per
//! versioned package, plus the encoded descriptor set for server reflection.
//!
//! Proto types stay at the edges: services convert them into domain types in
//! their handlers and never hand them to the store.

pub mod bounds;
pub mod codec;

/// The encoded `FileDescriptorSet` of every automesh contract.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/automesh_descriptor.bin"));

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    //! `automesh.v1`: the public API used by the web backend and clients.
    tonic::include_proto!("automesh.v1");
}

/// One module per internal package, `<area>::v1`, holding its generated
/// code.
macro_rules! internal_packages {
    ($($(#[doc = $doc:literal])* $area:ident => $package:literal;)+) => {$(
        $(#[doc = $doc])*
        #[allow(clippy::all, missing_docs)]
        pub mod $area {
            pub mod v1 {
                tonic::include_proto!($package);
            }
        }
    )+};
}

internal_packages! {
    /// `automesh.internal.v1`: types shared by internal contracts.
    internal => "automesh.internal.v1";
    /// `automesh.scheduler.v1`: the scheduler's internal API.
    scheduler => "automesh.scheduler.v1";
    /// `automesh.coordinator.v1`: the run-coordinator's internal API.
    coordinator => "automesh.coordinator.v1";
    /// `automesh.worker.v1`: the cloud-worker-lifecycle internal API.
    worker => "automesh.worker.v1";
    /// `automesh.runner.v1`: the desktop runner stream protocol and runner tokens.
    runner => "automesh.runner.v1";
    /// `automesh.executor.v1`: how the coordinator drives a run on an executor.
    executor => "automesh.executor.v1";
    /// `automesh.agent.v1`: the worker agent inside a user's cloud worker.
    agent => "automesh.agent.v1";
}
