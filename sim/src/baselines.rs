//! The usual ways to rate-limit calls from a queue, as dispatchers in the same harness:
//! a per-second token bucket (EventBridge API destinations), a fixed-window counter
//! (Bull's limiter) and a concurrency cap alone (an SQS event source mapping's maximum
//! concurrency). Each polls the jobs queue and hands jobs to the same simulated worker.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use paceline_shared::job::{Job, WorkerPayload};
use paceline_shared::ports::{Invoker, JobQueue};
use paceline_shared::quota::{Period, Quota};
use paceline_shared::time::{Clock, UnixMillis};

use crate::aws::{SimLambda, SimQueue, World};

/// Admits a call now, or says when to ask again.
pub trait Admission: Send {
    /// `Ok` to dispatch at `now` (the admission is spent); `Err(at)` to ask again at `at`.
    ///
    /// # Errors
    /// `Err(at)` is not a failure, only "not yet".
    fn admit(&mut self, now: UnixMillis, running: u64) -> Result<(), UnixMillis>;
}

/// The quota's shortest rolling tier, as (limit, window in ms): what a single-rule
/// limiter is set to.
#[must_use]
pub fn tightest_rolling(quota: &Quota) -> Option<(u64, u64)> {
    quota
        .tiers()
        .iter()
        .filter_map(|t| match t.period {
            Period::Rolling(d) => Some((t.limit, (d.as_millis() as u64).max(1))),
            Period::Day | Period::Month => None,
        })
        .min_by(|a, b| (a.0 * b.1).cmp(&(b.0 * a.1)))
}

/// A token bucket refilled at `limit / window`, holding one second's worth (at least
/// one token): EventBridge API destinations' "invocations per second". Exact integer
/// arithmetic: one token is `window_ms` units and each millisecond adds `limit` units.
pub struct TokenBucket {
    limit: u64,
    window_ms: u64,
    capacity: u64,
    units: u64,
    at: u64,
}

impl TokenBucket {
    #[must_use]
    pub fn new(limit: u64, window_ms: u64) -> Self {
        let capacity = (limit * 1_000).max(window_ms);
        Self { limit, window_ms, capacity, units: capacity, at: 0 }
    }
}

impl Admission for TokenBucket {
    fn admit(&mut self, now: UnixMillis, _running: u64) -> Result<(), UnixMillis> {
        self.units = self.units.saturating_add(now.0.saturating_sub(self.at).saturating_mul(self.limit)).min(self.capacity);
        self.at = now.0;
        if self.units >= self.window_ms {
            self.units -= self.window_ms;
            return Ok(());
        }
        Err(UnixMillis(now.0 + (self.window_ms - self.units).div_ceil(self.limit)))
    }
}

/// A counter per window, the window starting at the first call after the last one
/// expired (a Redis key with a TTL, as Bull's limiter keeps it).
pub struct FixedWindow {
    limit: u64,
    window_ms: u64,
    started: u64,
    count: u64,
}

impl FixedWindow {
    #[must_use]
    pub fn new(limit: u64, window_ms: u64) -> Self {
        Self { limit, window_ms, started: 0, count: 0 }
    }
}

impl Admission for FixedWindow {
    fn admit(&mut self, now: UnixMillis, _running: u64) -> Result<(), UnixMillis> {
        if self.count == 0 || now.0 >= self.started + self.window_ms {
            self.started = now.0;
            self.count = 0;
        }
        if self.count < self.limit {
            self.count += 1;
            return Ok(());
        }
        Err(UnixMillis(self.started + self.window_ms))
    }
}

/// At most `limit` workers running at once, whatever their rate.
pub struct ConcurrencyCap {
    pub limit: u64,
}

impl Admission for ConcurrencyCap {
    fn admit(&mut self, now: UnixMillis, running: u64) -> Result<(), UnixMillis> {
        if running < self.limit {
            Ok(())
        } else {
            Err(now.plus(Duration::from_millis(10)))
        }
    }
}

/// Polls the queue and dispatches as `admission` allows until `done` says stop.
pub async fn dispatch_loop(world: Arc<World>, queue: Arc<SimQueue>, lambda: Arc<SimLambda>, mut admission: Box<dyn Admission>, done: impl Fn() -> bool) {
    let visibility = Duration::from_secs(60);
    while !done() {
        let Ok(messages) = queue.receive(10, Duration::from_secs(20), visibility).await else { continue };
        let mut handed = Vec::with_capacity(messages.len());
        for message in messages {
            let Ok(job) = Job::parse(&message.body) else { continue };
            loop {
                let now = world.clock.now();
                match admission.admit(now, lambda.executions().running.load(Ordering::Relaxed)) {
                    Ok(()) => break,
                    Err(at) => world.clock.sleep_until(at).await,
                }
            }
            let now = world.clock.now();
            let payload =
                WorkerPayload::Job { job, attempt: message.attempt, circuit_epoch: 0, dispatched_at: now, slot: None, trip: None, report_limits: false };
            let lambda = lambda.clone();
            // Hand-offs run side by side, as a poller's would; the receipt goes once answered.
            handed.push((tokio::spawn(async move { lambda.invoke(&payload, None).await }), message.receipt));
        }
        let mut receipts = Vec::with_capacity(handed.len());
        for (invoke, receipt) in handed {
            if matches!(invoke.await, Ok(Ok(()))) {
                receipts.push(receipt);
            }
        }
        if !receipts.is_empty() {
            let _ = queue.delete(&receipts).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admitted(admission: &mut dyn Admission, at: &[u64]) -> Vec<bool> {
        at.iter().map(|t| admission.admit(UnixMillis(*t), 0).is_ok()).collect()
    }

    #[test]
    fn token_bucket_bursts_its_capacity_then_refills_at_its_rate() {
        let mut bucket = TokenBucket::new(2, 1_000);
        assert_eq!(admitted(&mut bucket, &[0, 0, 0, 499, 500, 1_000]), vec![true, true, false, false, true, true]);
        assert_eq!(bucket.admit(UnixMillis(1_000), 0), Err(UnixMillis(1_500)));
    }

    #[test]
    fn fixed_window_admits_the_limit_per_window_from_its_first_call() {
        let mut window = FixedWindow::new(2, 1_000);
        assert_eq!(admitted(&mut window, &[300, 900, 1_200, 1_300, 1_301, 2_299]), vec![true, true, false, true, true, false]);
        assert_eq!(window.admit(UnixMillis(2_299), 0), Err(UnixMillis(2_300)));
    }

    #[test]
    fn concurrency_cap_looks_only_at_running_workers() {
        let mut cap = ConcurrencyCap { limit: 2 };
        assert!(cap.admit(UnixMillis(0), 1).is_ok());
        assert_eq!(cap.admit(UnixMillis(0), 2), Err(UnixMillis(10)));
    }
}
