//! Adapters behind the ports: the embedded SQLite store, queue and in-process invoker,
//! and in-memory doubles for tests.

#[cfg(feature = "aws")]
pub mod aws;
#[cfg(feature = "embedded")]
pub mod embedded;
#[cfg(any(test, feature = "test-util"))]
pub mod memory;
