//! The `paceline` command's library: building an embedded lane from a config file, the
//! commands, the summary, and the quota-enforcing fake API that `demo` and the
//! end-to-end tests run against.

pub mod commands;
pub mod fake_api;
pub mod lane;
pub mod summary;
