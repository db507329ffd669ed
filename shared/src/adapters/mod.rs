//! Adapters behind the ports: the embedded SQLite store, queue and in-process invoker,
//! and in-memory doubles for tests.

pub mod embedded;
pub mod memory;
