//! Paceline's domain, pure and I/O-free (time, quotas, pacer, circuit breaker, jobs,
//! configuration), with the ports the orchestrator and worker use and their adapters.

pub mod adapters;
pub mod breaker;
pub mod check;
pub mod config;
pub mod job;
pub mod lambda_env;
pub mod pacer;
pub mod ports;
pub mod quota;
pub mod time;
