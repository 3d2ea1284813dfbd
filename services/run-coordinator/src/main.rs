//! The run-coordinator service as its own process.

automesh_rpc::service_binary!(
    automesh_run_coordinator,
    "automesh-run-coordinator",
    "The automesh run-coordinator service"
);
