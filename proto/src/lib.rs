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

#[allow(clippy::all, missing_docs)]
pub mod internal {
    //! `automesh.internal.v1`: types shared by internal contracts.
    pub mod v1 {
        tonic::include_proto!("automesh.internal.v1");
    }
}

#[allow(clippy::all, missing_docs)]
pub mod scheduler {
    //! `automesh.scheduler.v1`: the scheduler's internal API.
    pub mod v1 {
        tonic::include_proto!("automesh.scheduler.v1");
    }
}

#[allow(clippy::all, missing_docs)]
pub mod coordinator {
    //! `automesh.coordinator.v1`: the run-coordinator's internal API.
    pub mod v1 {
        tonic::include_proto!("automesh.coordinator.v1");
    }
}

#[allow(clippy::all, missing_docs)]
pub mod worker {
    //! `automesh.worker.v1`: the cloud-worker-lifecycle internal API.
    pub mod v1 {
        tonic::include_proto!("automesh.worker.v1");
    }
}

#[allow(clippy::all, missing_docs)]
pub mod runner {
    //! `automesh.runner.v1`: the desktop runner stream protocol and runner tokens.
    pub mod v1 {
        tonic::include_proto!("automesh.runner.v1");
    }
}

#[allow(clippy::all, missing_docs)]
pub mod executor {
    //! `automesh.executor.v1`: how the coordinator drives a run on an executor.
    pub mod v1 {
        tonic::include_proto!("automesh.executor.v1");
    }
}

#[allow(clippy::all, missing_docs)]
pub mod agent {
    //! `automesh.agent.v1`: the worker agent inside a user's cloud worker.
    pub mod v1 {
        tonic::include_proto!("automesh.agent.v1");
    }
}
