//! The cloud-worker-lifecycle service as its own process.

automesh_rpc::service_binary!(
    automesh_cloud_worker_lifecycle,
    "automesh-cloud-worker-lifecycle",
    "The automesh cloud-worker-lifecycle service"
);
