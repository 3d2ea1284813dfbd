//! The desktop-runner-gateway service as its own process.

automesh_rpc::service_binary!(
    automesh_desktop_runner_gateway,
    "automesh-desktop-runner-gateway",
    "The automesh desktop-runner-gateway service"
);
