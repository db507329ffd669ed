//! What the drain loop is given (the quota, the orchestrator's and the circuit's
//! settings, where workers run) and how a run can fail.

use std::time::Duration;

use paceline_shared::config::{CircuitConfig, Config, LanesConfig, OrchestratorConfig, WorkerHost};
use paceline_shared::job::MAX_LATE_START;
use paceline_shared::keys::Shard;
use paceline_shared::lane::LaneId;
use paceline_shared::order::{JobOrder, LaneOrdering};
use paceline_shared::ports::PortError;
use paceline_shared::quota::Quota;

use crate::late_starts::with_late_starts;

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
    /// `[quota] ordering`: how a stack without lanes orders its jobs (with lanes, each
    /// lane's `ordering` says).
    pub ordering: JobOrder,
    /// Which shard of the stack this orchestrator runs (its lanes, its lease, its share
    /// of the shared quota, which `quota` then is): the whole stack unless sharded.
    pub shard: Shard,
    /// In a stack of shards whose shares of the shared quota's rolling tiers move to where
    /// the work is (through the share book, `paceline_shared::shares`): the most this
    /// shard may pace under (those tiers whole, its even share of the calendar ones).
    /// `quota` is its even share, which sizes its batches and their stripes. `None`:
    /// `quota` is the shard's fixed share.
    pub share_most: Option<Quota>,
}

impl Settings {
    /// The loop's settings from a lane's configuration file, for workers in `workers`.
    #[must_use]
    pub fn from_config(config: &Config, workers: WorkerHost) -> Self {
        Self {
            quota: config.quota.clone(),
            orchestrator: config.orchestrator,
            circuit: config.circuit,
            workers,
            lanes: config.lanes.clone(),
            ordering: config.quota_ordering,
            shard: Shard::WHOLE,
            share_most: None,
        }
    }

    /// `quota` with every other setting's default, for workers in `workers` (tests and
    /// benchmarks).
    #[must_use]
    pub fn defaults_for(quota: Quota, workers: WorkerHost) -> Self {
        Self {
            quota,
            orchestrator: OrchestratorConfig::default(),
            circuit: CircuitConfig::default(),
            workers,
            lanes: None,
            ordering: JobOrder::None,
            shard: Shard::WHOLE,
            share_most: None,
        }
    }

    /// The quota the stack's pacer of the shared quota keeps its windows under: every part
    /// of it for a shard whose share moves (its share changes, its windows do not), else
    /// `quota`. Its snapshot is judged against this one.
    #[must_use]
    pub fn shared_pacer_quota(&self) -> &Quota {
        self.share_most.as_ref().unwrap_or(&self.quota)
    }

    /// How `lane`'s jobs are ordered.
    #[must_use]
    pub fn ordering_of(&self, lane: &LaneId) -> JobOrder {
        self.lanes.as_ref().map_or(self.ordering, |lanes| lanes.lane(lane).ordering)
    }

    /// Which of the stack's lanes are ordered.
    #[must_use]
    pub fn lane_ordering(&self) -> LaneOrdering {
        LanesConfig::ordering_of_stack(self.lanes.as_ref(), self.ordering)
    }

    /// How long before its slot each job is decided: the hand-off's lead and the batch
    /// window (a job waits in its open batch for at most the window).
    #[must_use]
    pub fn dispatch_ahead(&self) -> Duration {
        self.hand_off_lead() + self.batch_window()
    }

    /// The furthest before its slot a job may be decided: [`Self::dispatch_ahead`] and the
    /// most late starts of workers add to it (a second). Shards count on it: a share
    /// given up, or a lane moved, is another shard's once the calls decided before have
    /// gone.
    #[must_use]
    pub fn furthest_ahead(&self) -> Duration {
        with_late_starts(self.dispatch_ahead(), MAX_LATE_START)
    }

    /// How far past the end of a crashed run's lease its calls may still go: the furthest
    /// ahead it decided less the fifth of the lease's time-to-live it stops deciding
    /// before the lease runs out (it counts the lease lost then). The run that takes the
    /// lease after a crash holds dispatch that much longer than one window (nothing with
    /// the 30 s default).
    #[must_use]
    pub fn unclean_stop_overhang(&self) -> Duration {
        self.furthest_ahead().saturating_sub(self.orchestrator.lease_ttl / 5)
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

    /// How many batches gather at once, each job going to the next: as many as it takes
    /// for no worker to call faster than `worker_pace` (one where the pace is unbounded).
    #[must_use]
    pub fn worker_stripes(&self) -> usize {
        self.stripes_for(self.quota.sustained_per_second())
    }

    /// The most stripes the pace may need: for a shard whose share moves, at every part
    /// of the shared quota (`share_most`); else [`Settings::worker_stripes`].
    #[must_use]
    pub fn most_worker_stripes(&self) -> usize {
        self.stripes_for(self.shared_pacer_quota().sustained_per_second()).max(self.worker_stripes())
    }

    /// How many stripes of batches keep each worker at `worker_pace` when the stack hands
    /// off `pace` jobs a second (one without batches, or where the pace is unbounded).
    #[must_use]
    pub fn stripes_for(&self, pace: f64) -> usize {
        if self.worker_batch() <= 1 || !pace.is_finite() || pace <= 0.0 {
            return 1;
        }
        (pace / f64::from(self.orchestrator.worker_pace.max(1))).ceil().max(1.0) as usize
    }

    /// How far apart the slots of one batch's jobs may be: `batch_window`, shortened to
    /// what fills `worker_batch` at the quota's sustained pace (at 10,000/s, 1,000 jobs
    /// take 100 ms). Zero without batches, without a lead (jobs go at their slot), under a
    /// cap on calls in flight, or where the pace puts fewer than two jobs in a window: a
    /// slow lane's jobs then go alone, as soon as before, not a window early for nothing.
    #[must_use]
    pub fn batch_window(&self) -> Duration {
        let batch = self.worker_batch();
        // Under a cap on calls in flight the pace follows the calls' answers as they come:
        // slots decided a window earlier would follow older news.
        if batch <= 1 || self.hand_off_lead().is_zero() || self.quota.max_in_flight().is_some() {
            return Duration::ZERO;
        }
        let pace = self.quota.sustained_per_second();
        if !pace.is_finite() || pace <= 0.0 {
            return self.orchestrator.batch_window;
        }
        // Each stripe's batch fills at its share of the pace.
        let share = pace / self.worker_stripes() as f64;
        let window = self.orchestrator.batch_window.min(Duration::from_secs_f64(f64::from(batch) / share));
        if share * window.as_secs_f64() < 2.0 {
            Duration::ZERO
        } else {
            window
        }
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

#[cfg(test)]
mod tests {
    use paceline_shared::quota::chrono_tz;

    use super::*;

    fn lambda_settings(tier: &str) -> Settings {
        let quota = Quota::new(vec![tier.parse().unwrap()], chrono_tz::UTC, Duration::ZERO).unwrap();
        Settings::defaults_for(quota, WorkerHost::Lambda)
    }

    #[test]
    fn a_batch_window_is_what_fills_a_batch_at_the_pace_and_none_where_a_window_holds_one_job() {
        let window = |tier: &str| lambda_settings(tier).batch_window().as_millis();
        assert_eq!((window("100/s"), window("10000/s"), window("1000/s")), (500, 500, 500), "at most 500 ms");
        let stripes = |tier: &str| lambda_settings(tier).worker_stripes();
        assert_eq!((stripes("100/s"), stripes("500/s"), stripes("501/s"), stripes("10000/s")), (1, 1, 2, 20), "at most 500 calls/s a worker");
        let fast_workers =
            Settings { orchestrator: OrchestratorConfig { worker_pace: 100_000, ..OrchestratorConfig::default() }, ..lambda_settings("10000/s") };
        assert_eq!(fast_workers.batch_window().as_millis(), 100, "a batch of 1,000 at 10,000/s");
        assert_eq!((window("4/s"), window("3/s")), (500, 0), "a window must hold two jobs");
        let settings = lambda_settings("100/s");
        assert_eq!((settings.hand_off_lead().as_millis(), settings.dispatch_ahead().as_millis()), (500, 1_000));
        let in_process = Settings { workers: WorkerHost::InProcess, ..lambda_settings("100/s") };
        assert_eq!((in_process.batch_window(), in_process.worker_batch()), (Duration::ZERO, 1), "no batches in one process");
        let capped = Settings { quota: lambda_settings("100/s").quota.with_max_in_flight(Some(5)), ..lambda_settings("100/s") };
        assert_eq!(capped.batch_window(), Duration::ZERO, "a cap on calls in flight paces on fresh news");
    }
}
