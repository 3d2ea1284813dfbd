//! The public API gateway as its own process.

automesh_rpc::service_binary!(
    automesh_gateway,
    "automesh-gateway",
    "The automesh public API gateway"
);
