//! What the drain loop is given (the quota, the orchestrator's and the circuit's
//! settings, where workers run) and how a run can fail.

use std::time::Duration;

use paceline_shared::config::{CircuitConfig, Config, LanesConfig, OrchestratorConfig, WorkerHost};
use paceline_shared::ports::PortError;
use paceline_shared::quota::Quota;

/// The settings the loop needs.
#[derive(Clone, Debug)]
pub struct Settings {
    pub quota: Quota,
    pub orchestrator: OrchestratorConfig,
    pub circuit: CircuitConfig,
    /// Where the workers run (it sets the default `dispatch_ahead`).
    pub workers: WorkerHost,
    /// `[lanes]`: many lanes under `quota`, shared (`None`: `quota` is the one lane's).
    pub lanes: Option<LanesConfig>,
}

impl Settings {
    /// The loop's settings from a lane's configuration file, for workers in `workers`.
    #[must_use]
    pub fn from_config(config: &Config, workers: WorkerHost) -> Self {
        Self { quota: config.quota.clone(), orchestrator: config.orchestrator, circuit: config.circuit, workers, lanes: config.lanes.clone() }
    }

    /// How long before its slot each job is handed off.
    #[must_use]
    pub fn dispatch_ahead(&self) -> Duration {
        self.orchestrator.dispatch_ahead(self.workers)
    }
}

/// Why a run could not go on.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("another orchestrator holds the lease: {0}")]
    LeaseHeld(String),
    #[error(transparent)]
    Port(#[from] PortError),
}

impl RunError {
    /// Whether a later run may succeed where this one failed: the lease was held, or the
    /// store, queue or invoker met a passing fault. Not: a missing resource or permission.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::LeaseHeld(_) => true,
            Self::Port(e) => e.is_retryable(),
        }
    }
}
