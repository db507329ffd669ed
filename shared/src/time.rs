//! Wall-clock time in epoch milliseconds and the one `Clock` port every component reads.
//!
//! DynamoDB items and Lambda's deadline are epoch milliseconds, so the domain speaks
//! [`UnixMillis`] everywhere. Three clocks implement [`Clock`]:
//! - [`SystemClock`]: the real wall clock (the only place `SystemTime::now` is read),
//! - [`TokioClock`]: wall time anchored once, then advanced by tokio's clock, so
//!   `#[tokio::test(start_paused = true)]` drives the real loops deterministically,
//! - [`ManualClock`]: set by hand; `sleep_until` jumps straight to the target, which makes
//!   whole simulated runs finish in microseconds.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

/// Milliseconds since the Unix epoch (UTC).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct UnixMillis(pub u64);

impl UnixMillis {
    /// The later of two instants.
    #[must_use]
    pub fn max(self, other: Self) -> Self {
        Ord::max(self, other)
    }

    /// This instant plus a duration, saturating at the far future.
    #[must_use]
    pub fn plus(self, d: Duration) -> Self {
        Self(self.0.saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
    }

    /// This instant minus a duration, saturating at the epoch.
    #[must_use]
    pub fn minus(self, d: Duration) -> Self {
        Self(self.0.saturating_sub(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
    }

    /// Time from `earlier` to `self`, zero if `earlier` is later.
    #[must_use]
    pub fn since(self, earlier: Self) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }

    /// RFC 3339 rendering in UTC, for reports and logs.
    #[must_use]
    pub fn to_rfc3339(self) -> String {
        i64::try_from(self.0)
            .ok()
            .and_then(chrono::DateTime::from_timestamp_millis)
            .map_or_else(|| format!("{}ms", self.0), |t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
    }
}

impl UnixMillis {
    /// Parses an RFC 3339 time (`2026-11-23T20:30:00Z`, `2026-11-23T21:30:00.5+01:00`).
    ///
    /// # Errors
    /// When the text is not one, or lies before 1970.
    pub fn parse_rfc3339(text: &str) -> Result<Self, String> {
        let time = chrono::DateTime::parse_from_rfc3339(text.trim())
            .map_err(|e| format!("`{text}` is not an RFC 3339 time ({e}); write for example 2026-11-23T20:30:00Z"))?;
        u64::try_from(time.timestamp_millis()).map(Self).map_err(|_| format!("`{text}` is before 1970"))
    }
}

/// Serde for a [`UnixMillis`] (or an `Option` of one, with `rfc3339::option`) written as an
/// RFC 3339 string, the form every JSON output uses.
pub mod rfc3339 {
    use super::UnixMillis;
    use serde::{Deserialize, Deserializer, Serializer};

    /// # Errors
    /// As the serializer's.
    pub fn serialize<S: Serializer>(at: &UnixMillis, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&at.to_rfc3339())
    }

    /// # Errors
    /// When the value is not an RFC 3339 string.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<UnixMillis, D::Error> {
        UnixMillis::parse_rfc3339(&String::deserialize(d)?).map_err(serde::de::Error::custom)
    }

    /// The same for an optional time (`null` when absent).
    pub mod option {
        use super::UnixMillis;
        use serde::{Deserialize, Deserializer, Serializer};

        /// # Errors
        /// As the serializer's.
        pub fn serialize<S: Serializer>(at: &Option<UnixMillis>, s: S) -> Result<S::Ok, S::Error> {
            match at {
                Some(at) => s.serialize_str(&at.to_rfc3339()),
                None => s.serialize_none(),
            }
        }

        /// # Errors
        /// When the value is neither null nor an RFC 3339 string.
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<UnixMillis>, D::Error> {
            Option::<String>::deserialize(d)?.map(|text| UnixMillis::parse_rfc3339(&text).map_err(serde::de::Error::custom)).transpose()
        }
    }
}

impl fmt::Display for UnixMillis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_rfc3339())
    }
}

/// The source of time for every component: read `now`, sleep until an instant.
#[async_trait]
pub trait Clock: Send + Sync {
    /// The current wall-clock time.
    fn now(&self) -> UnixMillis;

    /// Returns once `now() >= deadline` (at once if it already is).
    async fn sleep_until(&self, deadline: UnixMillis);

    /// Like [`Clock::sleep_until`], but may return up to [`COARSE_WAKE_SLACK`] late: for
    /// callers that keep that much slack and need not pay for a precise wake-up.
    async fn sleep_until_coarse(&self, deadline: UnixMillis) {
        self.sleep_until(deadline).await;
    }
}

/// The longest duration any setting takes (a tier's period, a timeout, a cool-down): a
/// year. Past it, instants computed from it would run off the clock's range; a setting
/// longer than that is a typo, refused at parse time.
pub const LONGEST_SETTING: Duration = Duration::from_secs(366 * 86_400);

/// Parses a duration setting (`500ms`, `10s`, `5m`), at most [`LONGEST_SETTING`].
///
/// # Errors
/// The text and what is wrong with it, to be shown with the setting's name.
pub fn parse_setting_duration(text: &str) -> Result<Duration, String> {
    let parsed = humantime::parse_duration(text).map_err(|e| format!("`{text}` is not a duration ({e}); write for example 500ms, 10s, 5m"))?;
    if parsed > LONGEST_SETTING {
        return Err(format!("`{text}` is longer than the longest setting taken, a year (366 days)"));
    }
    Ok(parsed)
}

/// How late [`Clock::sleep_until_coarse`] may return (tokio's timer fires up to a tick,
/// a millisecond, late; twice that covers a busy scheduler).
pub const COARSE_WAKE_SLACK: Duration = Duration::from_millis(2);

/// The real wall clock. Sleeps with tokio's timer, except for the last stretch before
/// the deadline: tokio's timer wheel ticks every millisecond and fires up to a tick late,
/// which would make every paced slot late by most of a millisecond (and cost a slot at
/// 1,000/s). That stretch is slept on a blocking thread with the operating system's
/// high-resolution timer, which wakes within tens of microseconds, without spinning.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

/// The stretch before a deadline that [`SystemClock`] sleeps precisely.
const PRECISE_STRETCH: Duration = Duration::from_millis(2);

/// Reads the operating system's wall clock, to the millisecond.
#[must_use]
pub fn system_now() -> UnixMillis {
    UnixMillis(u64::try_from(system_since_epoch().as_millis()).unwrap_or(u64::MAX))
}

/// The wall clock to the microsecond. The only place in the workspace allowed to read it.
#[expect(clippy::disallowed_methods, reason = "the one place the wall clock is read")]
#[must_use]
pub fn system_since_epoch() -> Duration {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default()
}

#[async_trait]
#[expect(clippy::disallowed_methods, reason = "the real clock: the one place that waits on tokio's timer for wall time")]
impl Clock for SystemClock {
    fn now(&self) -> UnixMillis {
        system_now()
    }

    async fn sleep_until(&self, deadline: UnixMillis) {
        let target = Duration::from_millis(deadline.0);
        loop {
            let left = target.saturating_sub(system_since_epoch());
            if left.is_zero() {
                return;
            }
            if left > PRECISE_STRETCH {
                tokio::time::sleep(left - PRECISE_STRETCH).await;
            } else if tokio::task::spawn_blocking(move || std::thread::sleep(left)).await.is_err() {
                // No blocking pool (runtime shutting down): tokio's timer will do.
                tokio::time::sleep(left).await;
            }
        }
    }

    async fn sleep_until_coarse(&self, deadline: UnixMillis) {
        while self.now() < deadline {
            tokio::time::sleep(deadline.since(self.now())).await;
        }
    }
}

/// Wall time read once at construction, then advanced by tokio's (pausable) clock.
#[derive(Clone, Copy, Debug)]
pub struct TokioClock {
    anchor_wall: UnixMillis,
    anchor_instant: tokio::time::Instant,
}

impl TokioClock {
    /// Anchors at the system wall clock now.
    #[must_use]
    pub fn new() -> Self {
        Self::anchored_at(system_now())
    }

    /// Anchors at a chosen wall time: tests get literal, repeatable instants.
    #[must_use]
    #[expect(clippy::disallowed_methods, reason = "tokio's (pausable) clock is this Clock's source")]
    pub fn anchored_at(wall: UnixMillis) -> Self {
        Self { anchor_wall: wall, anchor_instant: tokio::time::Instant::now() }
    }

    fn instant_of(&self, t: UnixMillis) -> tokio::time::Instant {
        self.anchor_instant + Duration::from_millis(t.0.saturating_sub(self.anchor_wall.0))
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
#[expect(clippy::disallowed_methods, reason = "tokio's (pausable) clock is this Clock's source")]
impl Clock for TokioClock {
    fn now(&self) -> UnixMillis {
        self.anchor_wall.plus(self.anchor_instant.elapsed())
    }

    async fn sleep_until(&self, deadline: UnixMillis) {
        tokio::time::sleep_until(self.instant_of(deadline)).await;
    }
}

/// A clock moved only by hand (or by `sleep_until`, which jumps to its target).
#[derive(Debug, Default)]
pub struct ManualClock {
    now: AtomicU64,
}

impl ManualClock {
    /// A clock reading `start`.
    #[must_use]
    pub fn new(start: UnixMillis) -> Self {
        Self { now: AtomicU64::new(start.0) }
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.now.fetch_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    /// Sets the clock, never backwards.
    pub fn set(&self, t: UnixMillis) {
        self.now.fetch_max(t.0, Ordering::SeqCst);
    }
}

#[async_trait]
impl Clock for ManualClock {
    fn now(&self) -> UnixMillis {
        UnixMillis(self.now.load(Ordering::SeqCst))
    }

    async fn sleep_until(&self, deadline: UnixMillis) {
        self.set(deadline);
        tokio::task::yield_now().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn tokio_clock_follows_paused_time_to_the_millisecond() {
        let clock = TokioClock::anchored_at(UnixMillis(1_000));
        clock.sleep_until(UnixMillis(1_250)).await;
        assert_eq!(clock.now(), UnixMillis(1_250));
        tokio::time::advance(Duration::from_millis(5)).await;
        assert_eq!(clock.now(), UnixMillis(1_255));
    }

    #[tokio::test]
    async fn manual_clock_jumps_on_sleep_and_never_goes_back() {
        let clock = ManualClock::new(UnixMillis(10));
        clock.sleep_until(UnixMillis(500)).await;
        assert_eq!(clock.now(), UnixMillis(500));
        clock.set(UnixMillis(100));
        assert_eq!(clock.now(), UnixMillis(500));
        clock.advance(Duration::from_millis(7));
        assert_eq!(clock.now(), UnixMillis(507));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn system_clock_never_wakes_before_a_deadline() {
        // Only "never early" is asserted: how late depends on the machine (the benchmark
        // measures it).
        let clock = SystemClock;
        for step in [0, 1, 3, 7] {
            let deadline = clock.now().plus(Duration::from_millis(step));
            clock.sleep_until(deadline).await;
            assert!(system_since_epoch() >= Duration::from_millis(deadline.0), "precise sleep woke early");
            let deadline = clock.now().plus(Duration::from_millis(step));
            clock.sleep_until_coarse(deadline).await;
            assert!(clock.now() >= deadline, "coarse sleep woke early");
        }
    }

    #[test]
    fn renders_rfc3339() {
        assert_eq!(UnixMillis(1_700_000_000_123).to_rfc3339(), "2023-11-14T22:13:20.123Z");
        assert_eq!(UnixMillis::parse_rfc3339("2023-11-14T23:13:20.123+01:00"), Ok(UnixMillis(1_700_000_000_123)));
        assert!(UnixMillis::parse_rfc3339("yesterday").unwrap_err().contains("RFC 3339"));
    }
}
