//! Independent checkers of quota compliance, for tests, the demo's fake API and
//! simulations. They share no code with the pacer on purpose: an oracle that reused the
//! pacer's arithmetic would agree with its bugs.

use std::collections::VecDeque;
use std::time::Duration;

use crate::time::UnixMillis;

/// The largest number of units found in any window of length `window` (half-open:
/// a call at `t` and one at `t + window` are in different windows), whatever its start.
/// `arrivals` must be sorted by time.
#[must_use]
pub fn peak_in_any_window(arrivals: &[(UnixMillis, u64)], window: Duration) -> u64 {
    let window = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
    let mut first = 0;
    let mut units = 0;
    let mut peak = 0;
    for (t, cost) in arrivals {
        units += cost;
        while arrivals[first].0 .0 + window <= t.0 {
            units -= arrivals[first].1;
            first += 1;
        }
        peak = peak.max(units);
    }
    peak
}

/// A strict sliding-window limiter, as a provider would enforce it: a call that would
/// put more than `limit` units into any window of length `window` is refused.
#[derive(Debug)]
pub struct StrictWindowLimiter {
    limit: u64,
    window_ms: u64,
    arrivals: VecDeque<(u64, u64)>,
    units: u64,
}

impl StrictWindowLimiter {
    /// A limiter of `limit` units per `window`.
    #[must_use]
    pub fn new(limit: u64, window: Duration) -> Self {
        let window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
        Self { limit, window_ms, arrivals: VecDeque::new(), units: 0 }
    }

    /// Whether `cost` more units at `now` fit (forgetting what left the window).
    pub fn fits(&mut self, now: UnixMillis, cost: u64) -> bool {
        while let Some((t, c)) = self.arrivals.front() {
            if t.saturating_add(self.window_ms) > now.0 {
                break;
            }
            self.units -= c;
            self.arrivals.pop_front();
        }
        self.units + cost <= self.limit
    }

    /// Records units at `now`, whether they fit or not (for a provider that counts
    /// refused calls too).
    pub fn record(&mut self, now: UnixMillis, cost: u64) {
        self.units += cost;
        self.arrivals.push_back((now.0, cost));
    }

    /// What a provider's headers would say at `now`: units left in the window ending
    /// then, and when the oldest unit in it leaves (`now` when it is empty).
    pub fn remaining(&mut self, now: UnixMillis) -> (u64, UnixMillis) {
        let _ = self.fits(now, 0);
        let frees = self.arrivals.front().map_or(now, |(t, _)| UnixMillis(t.saturating_add(self.window_ms)));
        (self.limit.saturating_sub(self.units), frees)
    }

    /// Admits and records the call if it fits; refuses (and records nothing) if not.
    pub fn try_admit(&mut self, now: UnixMillis, cost: u64) -> bool {
        let fits = self.fits(now, cost);
        if fits {
            self.record(now, cost);
        }
        fits
    }
}

/// A fixed-window counter, as many providers enforce a rolling tier: windows aligned
/// on the epoch (`[k * window, (k + 1) * window)`), each holding at most `limit` units.
#[derive(Debug)]
pub struct StrictFixedWindowLimiter {
    limit: u64,
    window_ms: u64,
    window_index: u64,
    units: u64,
}

impl StrictFixedWindowLimiter {
    /// A limiter of `limit` units per aligned `window`.
    #[must_use]
    pub fn new(limit: u64, window: Duration) -> Self {
        Self { limit, window_ms: u64::try_from(window.as_millis()).unwrap_or(u64::MAX).max(1), window_index: 0, units: 0 }
    }

    /// Whether `cost` more units at `now` fit in the window holding `now`.
    pub fn fits(&mut self, now: UnixMillis, cost: u64) -> bool {
        let index = now.0 / self.window_ms;
        if index != self.window_index {
            self.window_index = index;
            self.units = 0;
        }
        self.units + cost <= self.limit
    }

    /// Counts `cost` units at `now`.
    pub fn record(&mut self, now: UnixMillis, cost: u64) {
        let _ = self.fits(now, 0);
        self.units += cost;
    }

    /// Units left in the window holding `now`, and when it ends.
    pub fn remaining(&mut self, now: UnixMillis) -> (u64, UnixMillis) {
        let _ = self.fits(now, 0);
        (self.limit.saturating_sub(self.units), UnixMillis((self.window_index + 1).saturating_mul(self.window_ms)))
    }
}

/// A strict bucket limiter, as a provider with a token or leaky bucket enforces it: the
/// bucket holds `capacity` units and drains `limit` units per `window`; a call is
/// refused unless the bucket has room for at least one more unit (a heavy call then
/// fills it past the brim, as nginx counts a request once whatever it weighs). Kept as
/// a water level, not as GCRA's arrival times, so that it shares no arithmetic with the
/// pacer.
#[derive(Debug)]
pub struct StrictBucketLimiter {
    capacity: u64,
    limit: u64,
    window_ms: u64,
    /// Water in the bucket, in units of `1 / window_ms` unit.
    level: u128,
    last: u64,
}

impl StrictBucketLimiter {
    /// A bucket of `capacity` units draining `limit` units per `window`.
    #[must_use]
    pub fn new(capacity: u64, limit: u64, window: Duration) -> Self {
        let window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX).max(1);
        Self { capacity, limit, window_ms, level: 0, last: 0 }
    }

    fn drain(&mut self, now: UnixMillis) {
        let drained = u128::from(now.0.saturating_sub(self.last)) * u128::from(self.limit);
        self.level = self.level.saturating_sub(drained);
        self.last = self.last.max(now.0);
    }

    /// Whether a call at `now` fits; calls must come in time order.
    pub fn fits(&mut self, now: UnixMillis) -> bool {
        self.drain(now);
        self.level + u128::from(self.window_ms) <= u128::from(self.capacity) * u128::from(self.window_ms)
    }

    /// Pours `cost` units in at `now`.
    pub fn record(&mut self, now: UnixMillis, cost: u64) {
        self.drain(now);
        self.level += u128::from(cost) * u128::from(self.window_ms);
    }

    /// Whole units the bucket has room for at `now`, and when it is empty.
    pub fn remaining(&mut self, now: UnixMillis) -> (u64, UnixMillis) {
        self.drain(now);
        let room = (u128::from(self.capacity) * u128::from(self.window_ms)).saturating_sub(self.level) / u128::from(self.window_ms);
        let empty_in_ms = self.level.div_ceil(u128::from(self.limit.max(1)));
        (u64::try_from(room).unwrap_or(u64::MAX), now.plus(Duration::from_millis(u64::try_from(empty_in_ms).unwrap_or(u64::MAX))))
    }

    /// Admits and records the call if it fits; refuses (and records nothing) if not.
    pub fn try_admit(&mut self, now: UnixMillis, cost: u64) -> bool {
        let fits = self.fits(now);
        if fits {
            self.record(now, cost);
        }
        fits
    }
}

/// Tracks, online, the most units seen in any window of one length: bounded memory
/// (only the arrivals of the current window), for run reports.
#[derive(Debug)]
pub struct WindowPeak {
    window_ms: u64,
    arrivals: VecDeque<(u64, u64)>,
    units: u64,
    peak: u64,
    peak_end: u64,
}

impl WindowPeak {
    #[must_use]
    pub fn new(window: Duration) -> Self {
        Self { window_ms: u64::try_from(window.as_millis()).unwrap_or(u64::MAX), arrivals: VecDeque::new(), units: 0, peak: 0, peak_end: 0 }
    }

    /// Adds an arrival; arrivals must come in time order.
    pub fn push(&mut self, at: UnixMillis, cost: u64) {
        while let Some((t, c)) = self.arrivals.front() {
            if t.saturating_add(self.window_ms) > at.0 {
                break;
            }
            self.units -= c;
            self.arrivals.pop_front();
        }
        self.units += cost;
        self.arrivals.push_back((at.0, cost));
        if self.units > self.peak {
            self.peak = self.units;
            self.peak_end = at.0;
        }
    }

    /// Takes back `cost` units that arrived at `at` (a slot that made no call), if they
    /// are still in the window: later windows count without them.
    pub fn remove(&mut self, at: UnixMillis, cost: u64) {
        if let Some((_, units)) = self.arrivals.iter_mut().rev().find(|(t, _)| *t == at.0) {
            let taken = cost.min(*units);
            *units -= taken;
            self.units -= taken;
        }
    }

    /// Where the busiest window first occurred: it starts at this instant (and ends
    /// before `start + window`). Any window of the length is some fixed-window
    /// alignment's window, so this also names the worst alignment: `start % window`.
    #[must_use]
    pub fn peak_window_start(&self) -> UnixMillis {
        UnixMillis((self.peak_end + 1).saturating_sub(self.window_ms))
    }

    /// The most units in any window so far.
    #[must_use]
    pub fn peak(&self) -> u64 {
        self.peak
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_counts_half_open_windows() {
        let at = |ms: &[u64]| ms.iter().map(|t| (UnixMillis(*t), 1)).collect::<Vec<_>>();
        assert_eq!(peak_in_any_window(&at(&[0, 1000, 2000]), Duration::from_secs(1)), 1);
        assert_eq!(peak_in_any_window(&at(&[0, 999, 1000]), Duration::from_secs(1)), 2);
        assert_eq!(peak_in_any_window(&[(UnixMillis(5), 3), (UnixMillis(6), 4)], Duration::from_secs(1)), 7);
    }

    #[test]
    fn online_peak_agrees_with_the_batch_checker() {
        let arrivals: Vec<(UnixMillis, u64)> = (0..200u64).map(|i| (UnixMillis(i * i % 997 + i * 13), 1 + i % 3)).collect();
        let mut sorted = arrivals.clone();
        sorted.sort();
        let mut online = WindowPeak::new(Duration::from_millis(250));
        for (t, c) in &sorted {
            online.push(*t, *c);
        }
        assert_eq!(online.peak(), peak_in_any_window(&sorted, Duration::from_millis(250)));
    }

    #[test]
    fn the_busiest_sliding_window_is_the_worst_fixed_window_alignment() {
        let arrivals: Vec<u64> = (0..300u64).map(|i| (i * i * 7 + i * 31) % 5_000).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        let window = 250;
        let mut online = WindowPeak::new(Duration::from_millis(window));
        for t in &arrivals {
            online.push(UnixMillis(*t), 1);
        }
        // Brute force: every alignment, every fixed window of it.
        let mut worst = (0, 0);
        for offset in 0..window {
            let mut counts = std::collections::BTreeMap::new();
            for t in &arrivals {
                *counts.entry((t + window - offset) / window).or_insert(0u64) += 1;
            }
            let peak = counts.values().copied().max().unwrap_or(0);
            if peak > worst.0 {
                worst = (peak, offset);
            }
        }
        assert_eq!(online.peak(), worst.0);
        let start = online.peak_window_start().0;
        let in_it = arrivals.iter().filter(|t| (start..start + window).contains(t)).count() as u64;
        assert_eq!(in_it, online.peak(), "the named window holds the peak");
    }

    #[test]
    fn fixed_window_limiter_resets_on_the_aligned_boundary() {
        let mut fixed = StrictFixedWindowLimiter::new(2, Duration::from_secs(1));
        let mut admit = |t: u64| {
            let fits = fixed.fits(UnixMillis(t), 1);
            if fits {
                fixed.record(UnixMillis(t), 1);
            }
            fits
        };
        assert!(admit(998) && admit(999));
        assert!(!admit(999), "the window [0, 1000) is full");
        assert!(admit(1_000) && admit(1_001), "a fixed window admits 4 within 3 ms across its boundary");
        assert!(!admit(1_999));
    }

    #[test]
    fn bucket_limiter_takes_its_capacity_at_once_then_its_rate() {
        let mut bucket = StrictBucketLimiter::new(3, 2, Duration::from_secs(1));
        assert!((0..3).all(|_| bucket.try_admit(UnixMillis(0), 1)));
        assert!(!bucket.try_admit(UnixMillis(499), 1));
        assert!(bucket.try_admit(UnixMillis(500), 1));
        assert!(!bucket.try_admit(UnixMillis(999), 1));
        assert!(bucket.try_admit(UnixMillis(1_000), 1));
        let mut strict = StrictBucketLimiter::new(1, 10, Duration::from_secs(1));
        assert!(strict.try_admit(UnixMillis(0), 3), "a heavy call goes into an empty bucket");
        assert!(!strict.try_admit(UnixMillis(200), 1), "and keeps it full for its weight");
        assert!(strict.try_admit(UnixMillis(300), 1));
    }

    #[test]
    fn strict_limiter_refuses_the_call_that_would_overfill_a_window() {
        let mut limiter = StrictWindowLimiter::new(2, Duration::from_secs(1));
        assert!(limiter.try_admit(UnixMillis(0), 1));
        assert!(limiter.try_admit(UnixMillis(500), 1));
        assert!(!limiter.try_admit(UnixMillis(999), 1));
        assert!(limiter.try_admit(UnixMillis(1_000), 1));
        assert!(!limiter.try_admit(UnixMillis(1_200), 1));
        assert!(limiter.try_admit(UnixMillis(1_500), 1));
    }
}
