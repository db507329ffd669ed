//! Paceline's domain, pure and I/O-free (time, quotas, pacer, circuit breaker, jobs,
//! configuration), with the ports the orchestrator and worker use and their adapters.

pub mod adapters;
pub mod adaptive;
pub mod breaker;
pub mod calls_coming;
pub mod check;
pub mod config;
pub mod dlq;
pub mod figures;
pub mod homes;
pub mod job;
pub mod keys;
pub mod lambda_env;
pub mod lane;
pub mod metrics;
pub mod order;
pub mod outcome;
pub mod pacer;
pub mod ports;
pub mod priority;
pub mod quota;
pub mod retry;
pub mod shares;
#[cfg(feature = "tables")]
pub mod table;
#[cfg(any(test, feature = "test-util"))]
pub mod testing;
pub mod time;

/// An error with all its sources, `outer: inner: innermost`, for logs and messages.
#[must_use]
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
