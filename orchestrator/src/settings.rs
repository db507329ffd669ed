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

    /// How long before its slot each job is decided: the hand-off's lead and the batch
    /// window (a job waits in its open batch for at most the window).
    #[must_use]
    pub fn dispatch_ahead(&self) -> Duration {
        self.hand_off_lead() + self.batch_window()
    }

    /// How long before its slot a job must reach the invoker at the latest: a batch goes
    /// this long before its first job's slot.
    #[must_use]
    pub fn hand_off_lead(&self) -> Duration {
        self.orchestrator.dispatch_ahead(self.workers)
    }

    /// The most jobs a worker invocation carries.
    #[must_use]
    pub fn worker_batch(&self) -> u32 {
        self.orchestrator.worker_batch(self.workers)
    }

    /// How far apart the slots of one batch's jobs may be: `batch_window`, shortened to
    /// what fills `worker_batch` at the quota's sustained pace (at 10,000/s, 1,000 jobs
    /// take 100 ms); zero without batches or without a lead (jobs go at their slot).
    #[must_use]
    pub fn batch_window(&self) -> Duration {
        let batch = self.worker_batch();
        if batch <= 1 || self.hand_off_lead().is_zero() {
            return Duration::ZERO;
        }
        let pace = self.quota.sustained_per_second();
        let fills_in = if pace.is_finite() && pace > 0.0 { Duration::from_secs_f64(f64::from(batch) / pace) } else { self.orchestrator.batch_window };
        self.orchestrator.batch_window.min(fills_in)
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
