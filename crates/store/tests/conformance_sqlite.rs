//! The store conformance suite on SQLite.

mod common;

conformance_suite!(automesh_store::Backend::Sqlite);
