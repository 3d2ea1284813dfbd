//! The scheduler service as its own process.

automesh_rpc::service_binary!(
    automesh_scheduler,
    "automesh-scheduler",
    "The automesh scheduler service"
);
