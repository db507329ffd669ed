//! The `paceline` command's library: building an embedded lane from a config file,
//! opening a lane (embedded or AWS) for the operator commands, the commands, `serve`'s HTTP API and console, the summary, and the quota-enforcing fake API that `demo` and the
//! end-to-end tests run against.

pub mod access;
pub mod cli;
pub mod commands;
pub mod dlq_scan;
pub mod fake_api;
pub mod serve;
pub mod stack;
pub mod summary;
pub mod tasks;
