//! Test support, behind the `test-util` feature: the port contract suites every adapter
//! runs, fault injection for any port, and the recording invoker.

pub mod alloc;
pub mod contract;
pub mod faults;
