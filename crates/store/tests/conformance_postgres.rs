//! The store conformance suite on PostgreSQL. An unreachable server fails
//! every test here: the suite never skips silently.

mod common;

conformance_suite!(automesh_store::Backend::Postgres);
