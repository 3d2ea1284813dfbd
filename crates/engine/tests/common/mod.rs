//! The shared fakes (see `automesh-testkit`).
#![allow(unused_imports)]
pub use automesh_testkit::*;
