//! The circuit breaker as a pure state machine with epochs, and the rules that move it.
//!
//! - **Closed**: jobs flow. A failed call (5xx, timeout, connection error) is counted in
//!   a failure bucket and retried alone, with back-off. The circuit opens when the
//!   failures among the recent calls pass a threshold ([`TripRule`], which the
//!   orchestrator sends with each job: it knows the pace, so it knows how many calls a
//!   window holds). Successes cost nothing: no write per call.
//! - **Open**: no jobs; a health check after a break, which doubles each time the
//!   circuit opens again without having closed fully (up to a cap). An operator's hold
//!   keeps it open: health checks are not even sent.
//! - **Half-open**: a healthy check lets jobs flow again at a fraction of the pace that
//!   doubles every step ([`ramp_fraction`]); a trip re-opens it with a longer break; the
//!   orchestrator closes it once the ramp reaches the full pace.
//!
//! Every transition bumps the epoch and is only valid from the epoch its writer saw, so
//! a stale writer (a worker dispatched before the outage, a slow probe from an earlier
//! open period) cannot undo a newer state. The store applies the result with a
//! compare-and-swap on the epoch.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::time::UnixMillis;

/// Whether jobs may flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CircuitStatus {
    Closed,
    Open,
    /// Jobs flow at a ramping fraction of the pace after a healthy check.
    HalfOpen,
}

impl std::fmt::Display for CircuitStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half-open",
        })
    }
}

impl std::str::FromStr for CircuitStatus {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "closed" => Ok(Self::Closed),
            "open" => Ok(Self::Open),
            "half-open" => Ok(Self::HalfOpen),
            other => Err(format!("unknown circuit status `{other}`")),
        }
    }
}

/// The circuit as stored: status, epoch, and since when and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Circuit {
    pub status: CircuitStatus,
    pub epoch: u64,
    pub since: UnixMillis,
    pub reason: String,
    /// Times it opened again from half-open since it last closed fully: each doubles the
    /// break before the next health check.
    #[serde(default)]
    pub reopened: u32,
    /// An operator's hold (`paceline circuit open --hold`): open until an operator
    /// closes it; no health check is sent.
    #[serde(default)]
    pub held: bool,
}

/// Why a transition was not made. None of these is an error for the caller: the state
/// it wanted is already there, or a newer one is, or an operator holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the circuit is already {0}")]
    Already(CircuitStatus),
    #[error("stale: the writer saw epoch {seen}, the circuit is at epoch {current}")]
    Stale { seen: u64, current: u64 },
    #[error("an operator holds the circuit open")]
    Held,
}

impl Default for Circuit {
    fn default() -> Self {
        Self { status: CircuitStatus::Closed, epoch: 0, since: UnixMillis(0), reason: String::new(), reopened: 0, held: false }
    }
}

impl Circuit {
    /// True while jobs may be dispatched (closed or half-open).
    #[must_use]
    pub fn is_closed(&self) -> bool {
        self.status != CircuitStatus::Open
    }

    fn transition(&self, to: CircuitStatus, seen_epoch: u64, reason: &str, now: UnixMillis) -> Result<Self, Refusal> {
        if self.status == to {
            return Err(Refusal::Already(to));
        }
        if seen_epoch != self.epoch {
            return Err(Refusal::Stale { seen: seen_epoch, current: self.epoch });
        }
        Ok(Self { status: to, epoch: self.epoch + 1, since: now, reason: reason.to_owned(), reopened: self.reopened, held: false })
    }

    /// Opens the circuit because calls failed, seen by a writer at `seen_epoch`. From
    /// half-open, the next break is twice as long.
    ///
    /// # Errors
    /// [`Refusal`] when it is open already or the writer is stale.
    pub fn open(&self, seen_epoch: u64, reason: &str, now: UnixMillis) -> Result<Self, Refusal> {
        let reopened = match self.status {
            CircuitStatus::HalfOpen => self.reopened.saturating_add(1),
            CircuitStatus::Closed | CircuitStatus::Open => 0,
        };
        self.transition(CircuitStatus::Open, seen_epoch, reason, now).map(|next| Self { reopened, ..next })
    }

    /// Half-opens the circuit after a healthy check sent while it was open at
    /// `seen_epoch`.
    ///
    /// # Errors
    /// [`Refusal`] when it is not open, the check is stale, or an operator holds it.
    pub fn half_open(&self, seen_epoch: u64, reason: &str, now: UnixMillis) -> Result<Self, Refusal> {
        if self.status != CircuitStatus::Open {
            return Err(Refusal::Already(self.status));
        }
        if self.held {
            return Err(Refusal::Held);
        }
        self.transition(CircuitStatus::HalfOpen, seen_epoch, reason, now)
    }

    /// Closes the circuit fully: the ramp reached the full pace (from half-open), or an
    /// operator says so (from any state, lifting a hold).
    ///
    /// # Errors
    /// [`Refusal`] when it is closed already or the writer is stale.
    pub fn close(&self, seen_epoch: u64, reason: &str, now: UnixMillis) -> Result<Self, Refusal> {
        self.transition(CircuitStatus::Closed, seen_epoch, reason, now).map(|next| Self { reopened: 0, ..next })
    }

    /// An operator's hold: open, and it stays open until an operator closes it.
    ///
    /// # Errors
    /// [`Refusal`] when it is held already or the writer is stale.
    pub fn hold(&self, seen_epoch: u64, reason: &str, now: UnixMillis) -> Result<Self, Refusal> {
        if self.held {
            return Err(Refusal::Held);
        }
        if seen_epoch != self.epoch {
            return Err(Refusal::Stale { seen: seen_epoch, current: self.epoch });
        }
        Ok(Self { status: CircuitStatus::Open, epoch: self.epoch + 1, since: now, reason: reason.to_owned(), reopened: self.reopened, held: true })
    }

    /// The break before the `k`-th health check of this open period (from 0):
    /// `interval`, doubled for each re-opening and each check before it (whose answer
    /// left it open), at most `max_break` (never under `interval`).
    #[must_use]
    pub fn break_length(&self, k: u32, interval: Duration, max_break: Duration) -> Duration {
        let doublings = self.reopened.saturating_add(k).min(16);
        interval.saturating_mul(1u32 << doublings).min(max_break.max(interval))
    }

    /// While open and not held: the first health check due at or after `from`. Checks
    /// follow a schedule fixed by the opening: the first one break after it (a provider
    /// that just fell over gets a moment), each next one a longer break later. Any run
    /// finds the same schedule, without counting what earlier runs sent. `None`
    /// otherwise.
    #[must_use]
    pub fn next_health_check(&self, from: UnixMillis, interval: Duration, max_break: Duration) -> Option<UnixMillis> {
        if self.status != CircuitStatus::Open || self.held {
            return None;
        }
        let mut due = self.since;
        for k in 0.. {
            let step = self.break_length(k, interval, max_break);
            due = due.plus(step);
            if due >= from {
                return Some(due);
            }
            if step >= max_break.max(interval) {
                // The breaks are at their cap from here on: jump over the whole ones.
                let whole = from.since(due).as_millis() / step.as_millis().max(1);
                due = due.plus(step * u32::try_from(whole).unwrap_or(u32::MAX));
                if due >= from {
                    return Some(due);
                }
            }
        }
        unreachable!("the schedule passes any instant")
    }
}

/// The share of the pace allowed `elapsed` into a ramp that starts at `start` (0 to 1)
/// and doubles every `step`: 1.0 once it has reached the full pace.
#[must_use]
pub fn ramp_fraction(elapsed: Duration, start: f64, step: Duration) -> f64 {
    if step.is_zero() || start >= 1.0 {
        return 1.0;
    }
    let steps = u32::try_from(elapsed.as_millis() / step.as_millis().max(1)).unwrap_or(u32::MAX).min(64);
    (start.max(0.001) * 2f64.powi(i32::try_from(steps).unwrap_or(64))).min(1.0)
}

/// When failures open the circuit: a worker whose call failed adds it to the bucket of
/// its slot (`bucket_ms` long) and opens the circuit when that bucket and the one
/// before hold `failures` or more. The orchestrator sizes the buckets so that one holds
/// about half of `minimum_calls` at the current pace, so the two hold between half and
/// all of them, and `failures` is the threshold's share of `minimum_calls` (at least
/// `minimum_failures`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TripRule {
    pub bucket_ms: u64,
    pub failures: u64,
}

/// The breaker's settings the orchestrator turns into a [`TripRule`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TripSettings {
    /// Share of failed calls (0 to 1) that opens the circuit.
    pub failure_rate_threshold: f64,
    /// The calls a decision looks at, at least.
    pub minimum_calls: u64,
    /// The fewest failures that open the circuit, however slow the pace.
    pub minimum_failures: u64,
}

/// The usage keys of failure buckets start with this.
pub const FAILURE_BUCKET_PREFIX: &str = "failures#";

/// How long a failure bucket is kept after it is written (DynamoDB: the table's TTL;
/// the embedded store sweeps older ones when it counts a failure).
pub const FAILURE_BUCKET_TTL: Duration = Duration::from_secs(86_400);

/// When the failure bucket with usage key `key` ends (`None` for other keys).
#[must_use]
pub fn failure_bucket_end(key: &str) -> Option<UnixMillis> {
    let (bucket_ms, index) = key.strip_prefix(FAILURE_BUCKET_PREFIX)?.split_once('#')?;
    let (bucket_ms, index): (u64, u64) = (bucket_ms.parse().ok()?, index.parse().ok()?);
    Some(UnixMillis(index.saturating_add(1).saturating_mul(bucket_ms)))
}

/// Buckets are at least this long (fewer items at a high pace) and at most a minute.
const BUCKET_BOUNDS_MS: (u64, u64) = (50, 60_000);

impl TripRule {
    /// The rule at a pace of `calls_per_second` (the ramp's share included).
    #[must_use]
    pub fn at_pace(settings: &TripSettings, calls_per_second: f64) -> Self {
        let half = settings.minimum_calls as f64 / 2.0;
        let bucket_ms =
            if calls_per_second.is_finite() && calls_per_second > 0.0 { (half / calls_per_second * 1000.0).ceil() as u64 } else { BUCKET_BOUNDS_MS.1 };
        let failures = ((settings.failure_rate_threshold * settings.minimum_calls as f64).ceil() as u64).max(settings.minimum_failures).max(1);
        Self { bucket_ms: bucket_ms.clamp(BUCKET_BOUNDS_MS.0, BUCKET_BOUNDS_MS.1), failures }
    }

    /// The state-store keys (usage counters) of the bucket holding `slot` and the one
    /// before it.
    #[must_use]
    pub fn bucket_keys(&self, slot: UnixMillis) -> [String; 2] {
        let index = slot.0 / self.bucket_ms.max(1);
        let key = |index: u64| format!("{FAILURE_BUCKET_PREFIX}{}#{index}", self.bucket_ms);
        [key(index), key(index.saturating_sub(1))]
    }

    /// Whether `failed` failures in the two buckets open the circuit.
    #[must_use]
    pub fn trips(&self, failed: u64) -> bool {
        failed >= self.failures
    }
}

/// The delay before a failed job's next attempt: "full jitter" (a uniform draw between
/// zero and `base * 2^attempt`, capped at `max`), drawn from a hash of the job and
/// attempt so that jobs failing together spread out, and the same job retries the same
/// way each time it is replayed (simulations repeat).
#[must_use]
pub fn retry_delay(job_id: &str, attempt: u32, base: Duration, max: Duration) -> Duration {
    use std::hash::{Hash, Hasher};
    let ceiling = base.saturating_mul(1u32.checked_shl(attempt.min(20)).unwrap_or(u32::MAX)).min(max);
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (job_id, attempt).hash(&mut hasher);
    let draw = (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64;
    ceiling.mul_f64(draw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_opens_and_a_healthy_check_closes_with_epochs() {
        let closed = Circuit::default();
        let open = closed.open(0, "HTTP 503", UnixMillis(1_000)).unwrap();
        assert_eq!((open.status, open.epoch, open.since), (CircuitStatus::Open, 1, UnixMillis(1_000)));
        let closed_again = open.close(1, "health check ok", UnixMillis(4_000)).unwrap();
        assert_eq!((closed_again.status, closed_again.epoch), (CircuitStatus::Closed, 2));
    }

    #[test]
    fn stale_writers_cannot_undo_newer_state() {
        let open = Circuit::default().open(0, "timeout", UnixMillis(1)).unwrap();
        let closed = open.close(1, "ok", UnixMillis(2)).unwrap();
        // A worker dispatched at epoch 0 fails late: the circuit has moved on.
        assert_eq!(closed.open(0, "late failure", UnixMillis(3)), Err(Refusal::Stale { seen: 0, current: 2 }));
        // A probe from the first open period answers after a reopen.
        let reopened = closed.open(2, "HTTP 500", UnixMillis(4)).unwrap();
        assert_eq!(reopened.close(1, "old probe", UnixMillis(5)), Err(Refusal::Stale { seen: 1, current: 3 }));
        assert_eq!(reopened.open(3, "again", UnixMillis(6)), Err(Refusal::Already(CircuitStatus::Open)));
    }

    #[test]
    fn health_checks_follow_the_interval_from_opening() {
        let (interval, cap) = (Duration::from_secs(5), Duration::from_secs(30));
        let at = |s: u64| UnixMillis(s * 1_000);
        assert_eq!(Circuit::default().next_health_check(at(0), interval, cap), None);
        let open = Circuit::default().open(0, "x", at(10)).unwrap();
        // Opened at 10 s: checks at 15, 25, 45, 75 s (breaks 5, 10, 20, 30), then every 30 s.
        let due: Vec<u64> = [10, 15, 16, 25, 46, 75, 76, 105, 1_000].iter().map(|s| open.next_health_check(at(*s), interval, cap).unwrap().0 / 1_000).collect();
        assert_eq!(due, vec![15, 15, 25, 25, 75, 75, 105, 105, 1_005]);
    }

    #[test]
    fn a_healthy_check_half_opens_and_a_trip_while_half_open_doubles_the_break_up_to_the_cap() {
        let (interval, cap) = (Duration::from_secs(5), Duration::from_secs(30));
        let mut circuit = Circuit::default().open(0, "HTTP 503", UnixMillis(0)).unwrap();
        let mut breaks = Vec::new();
        for round in 0..5u64 {
            let due = circuit.next_health_check(circuit.since, interval, cap).unwrap();
            breaks.push(due.since(circuit.since).as_secs());
            let half = circuit.half_open(circuit.epoch, "health check ok", due).unwrap();
            assert_eq!((half.status, half.epoch), (CircuitStatus::HalfOpen, 2 * round + 2));
            assert!(half.is_closed(), "jobs flow while half-open");
            circuit = half.open(half.epoch, "tripped while half-open", due.plus(Duration::from_secs(1))).unwrap();
        }
        assert_eq!(breaks, vec![5, 10, 20, 30, 30]);
        let half = circuit.half_open(circuit.epoch, "ok", UnixMillis(1_000_000)).unwrap();
        let closed = half.close(half.epoch, "ramp done", UnixMillis(1_010_000)).unwrap();
        assert_eq!((closed.status, closed.reopened), (CircuitStatus::Closed, 0));
        let next = closed.open(closed.epoch, "HTTP 500", UnixMillis(2_000_000)).unwrap();
        assert_eq!(next.next_health_check(next.since, interval, cap), Some(UnixMillis(2_005_000)), "a full close forgets the re-openings");
    }

    #[test]
    fn an_operators_hold_sends_no_health_check_and_only_an_operator_lifts_it() {
        let held = Circuit::default().hold(0, "operator: maintenance", UnixMillis(0)).unwrap();
        assert_eq!((held.status, held.held), (CircuitStatus::Open, true));
        assert_eq!(held.next_health_check(UnixMillis(0), Duration::from_secs(5), Duration::from_secs(30)), None);
        assert_eq!(held.half_open(held.epoch, "health check ok", UnixMillis(9)), Err(Refusal::Held));
        assert_eq!(held.hold(held.epoch, "again", UnixMillis(9)), Err(Refusal::Held));
        let lifted = held.close(held.epoch, "operator", UnixMillis(10)).unwrap();
        assert_eq!((lifted.status, lifted.held), (CircuitStatus::Closed, false));
    }

    #[test]
    fn the_ramp_doubles_every_step_from_its_start() {
        let step = Duration::from_secs(2);
        let at = |ms: u64| ramp_fraction(Duration::from_millis(ms), 0.1, step);
        assert_eq!([at(0), at(1_999), at(2_000), at(4_000), at(6_000), at(8_000)], [0.1, 0.1, 0.2, 0.4, 0.8, 1.0]);
        assert_eq!(ramp_fraction(Duration::ZERO, 1.0, step), 1.0, "a ramp from the full pace is none");
    }

    #[test]
    fn the_trip_rule_sizes_buckets_from_the_pace() {
        let settings = TripSettings { failure_rate_threshold: 0.5, minimum_calls: 20, minimum_failures: 5 };
        // 100/s: a bucket holds 10 calls (100 ms); 10 failures in two buckets trip.
        assert_eq!(TripRule::at_pace(&settings, 100.0), TripRule { bucket_ms: 100, failures: 10 });
        // 1/s: a bucket of 10 s.
        assert_eq!(TripRule::at_pace(&settings, 1.0).bucket_ms, 10_000);
        // Very fast or unknown paces stay within bounds.
        assert_eq!(TripRule::at_pace(&settings, 100_000.0).bucket_ms, 50);
        assert_eq!(TripRule::at_pace(&settings, f64::INFINITY).bucket_ms, 60_000);
        let strict = TripSettings { failure_rate_threshold: 0.1, minimum_calls: 20, minimum_failures: 5 };
        assert_eq!(TripRule::at_pace(&strict, 100.0).failures, 5, "never fewer than minimum_failures");
        let rule = TripRule { bucket_ms: 100, failures: 10 };
        assert_eq!(rule.bucket_keys(UnixMillis(1_250)), ["failures#100#12".to_owned(), "failures#100#11".to_owned()]);
        assert!(!rule.trips(9) && rule.trips(10));
    }

    #[test]
    fn retry_delays_are_jittered_within_the_growing_ceiling() {
        let (base, max) = (Duration::from_secs(1), Duration::from_secs(60));
        let delays: Vec<Duration> = (0..200).map(|i| retry_delay(&format!("job-{i}"), 2, base, max)).collect();
        assert!(delays.iter().all(|d| *d < Duration::from_secs(4)), "attempt 2: under 4 s");
        let mean = delays.iter().sum::<Duration>().as_secs_f64() / 200.0;
        assert!((1.6..2.4).contains(&mean), "uniform over [0, 4 s): mean {mean}");
        assert_eq!(retry_delay("a", 3, base, max), retry_delay("a", 3, base, max), "the same job retries the same way");
        assert!(retry_delay("a", 30, base, max) <= max);
    }
}
