//! The pacer: given the quota, its state and `now`, decide whether a job of some cost
//! may be dispatched now or when it may. Pure: no clock, no I/O, no sleeping.
//!
//! Rolling tiers use two rules, both exact in integer milliseconds:
//! - GCRA spreads calls evenly (one unit every `window / limit`). With zero burst
//!   tolerance it satisfies strict leaky-bucket limiters such as nginx's `limit_req`; a
//!   tier's `burst=N` is its tolerance (a bucket of N units);
//! - a sliding-window log guarantees that no window of the tier's length ever holds more
//!   than its limit even when jobs weigh more than one unit (GCRA alone lets a heavy job
//!   overshoot a window by its extra weight).
//!
//! Which rules a tier gets (`Rules`): the shortest rolling tier and `smooth` tiers
//! both (evenly spaced); other rolling tiers the window log alone, so a backlog spends a
//! long tier's allowance at the shortest tier's pace, as a sliding-window provider
//! allows; a `burst` tier GCRA alone with its tolerance (the provider is a bucket).
//!
//! The window used by both is the tier's length plus the quota's safety margin, so that
//! network jitter between our dispatch and the provider's clock cannot push two calls
//! into one provider window. Calendar tiers (day, month) are counters per window.

use std::collections::VecDeque;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::quota::{Period, Quota, Spread, Tier};
use crate::time::UnixMillis;

/// What the pacer says about one job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Dispatch now, then [`PacerState::commit`].
    Allow,
    /// Not before `at`; `by` says what holds it back.
    WaitUntil { at: UnixMillis, by: Hold },
    /// The job's cost exceeds what this tier ever admits at once (its limit, or its
    /// bucket for a `burst` tier): it can never be dispatched.
    Never { tier: Tier },
}

/// What holds a job back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// The tier at this index of the quota's tier list.
    Tier(usize),
    /// A cool-down the provider asked for (429 with Retry-After and the like).
    CoolDown,
}

/// A slot its worker started too late to use: no call was made, so its units go back to
/// the pacer (see [`PacerState::give_back`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MissedSlot {
    /// The slot, as the worker got it.
    pub slot: UnixMillis,
    /// When the pacer counted the call's arrival: the slot and the body's upload time.
    pub arrival: UnixMillis,
    pub cost: u64,
    /// The lane whose slot it was.
    pub lane: crate::lane::LaneId,
}

/// Missed slots on their way from the workers of one process to its orchestrator, which
/// gives them back at once (across processes, as on Lambda, a missed slot is lost: rare
/// with its longer lead).
#[derive(Debug, Default)]
pub struct MissedSlots(std::sync::Mutex<Vec<MissedSlot>>);

impl MissedSlots {
    pub fn push(&self, missed: MissedSlot) {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(missed);
    }

    /// The slots missed since the last call, oldest first.
    #[must_use]
    pub fn take(&self) -> Vec<MissedSlot> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

/// The rules the pacer applies to one rolling tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Rules {
    /// GCRA with this many units of burst tolerance beyond the first (0: evenly spaced).
    gcra_tolerance: Option<u64>,
    /// The sliding-window log.
    window: bool,
}

/// Units admitted per time bucket, oldest first. Buckets are 1 ms (exact) while the
/// limit is small enough that the log stays small anyway, and `window / 1024` for large
/// limits, which bounds memory; a bucket is treated as if all of it arrived at its last
/// millisecond, so bucketing only ever errs safe.
///
/// The log keeps the sum of its entries, so a decision costs the expired entries at its
/// front (usually none) rather than a walk over the whole window.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "LogEntries")]
pub struct SlidingWindowLog {
    window_ms: u64,
    bucket_ms: u64,
    entries: VecDeque<(u64, u64)>,
    /// The sum of `entries`' units (not stored: rebuilt from the entries).
    #[serde(skip)]
    units: u64,
}

/// A log as stored: the running sum is rebuilt from the entries when read back.
#[derive(Deserialize)]
struct LogEntries {
    window_ms: u64,
    bucket_ms: u64,
    entries: VecDeque<(u64, u64)>,
}

impl From<LogEntries> for SlidingWindowLog {
    fn from(stored: LogEntries) -> Self {
        let units = stored.entries.iter().map(|(_, u)| u).sum();
        Self { window_ms: stored.window_ms, bucket_ms: stored.bucket_ms, entries: stored.entries, units }
    }
}

impl SlidingWindowLog {
    /// Limits up to this many units are logged to the millisecond.
    const EXACT_UP_TO: u64 = 4_096;

    /// An empty log for at most `limit` units per `window` (at least 1 ms).
    #[must_use]
    pub fn new(window: Duration, limit: u64) -> Self {
        let window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX).max(1);
        let bucket_ms = if limit <= Self::EXACT_UP_TO { 1 } else { (window_ms / 1024).max(1) };
        Self { window_ms, bucket_ms, entries: VecDeque::new(), units: 0 }
    }

    fn expiry(&self, bucket_start: u64) -> u64 {
        bucket_start + self.bucket_ms - 1 + self.window_ms
    }

    /// The entries still inside the window ending at `now`, oldest first.
    fn live(&self, now: UnixMillis) -> impl Iterator<Item = &(u64, u64)> + Clone {
        self.entries.iter().skip_while(move |(b, _)| self.expiry(*b) <= now.0)
    }

    /// Units inside the window ending at `now`.
    #[must_use]
    pub fn in_window(&self, now: UnixMillis) -> u64 {
        let expired: u64 = self.entries.iter().take_while(|(b, _)| self.expiry(*b) <= now.0).map(|(_, u)| u).sum();
        self.units - expired
    }

    /// When the oldest unit in the window ending at `now` leaves it (`None`: empty).
    #[must_use]
    pub fn next_free_at(&self, now: UnixMillis) -> Option<UnixMillis> {
        self.live(now).next().map(|(bucket, _)| UnixMillis(self.expiry(*bucket)))
    }

    /// The earliest instant at or after `now` when `cost` more units fit under `limit`;
    /// `None` if `cost` exceeds `limit`.
    #[must_use]
    pub fn ready_at(&self, now: UnixMillis, cost: u64, limit: u64) -> Option<UnixMillis> {
        if cost > limit {
            return None;
        }
        let mut excess = (self.in_window(now) + cost).saturating_sub(limit);
        if excess == 0 {
            return Some(now);
        }
        for (bucket, units) in self.live(now) {
            excess = excess.saturating_sub(*units);
            if excess == 0 {
                return Some(UnixMillis(self.expiry(*bucket)));
            }
        }
        None
    }

    /// The last instant a unit was recorded at (the end of its bucket), if any.
    #[must_use]
    pub fn last_at(&self) -> Option<UnixMillis> {
        self.entries.back().map(|(bucket, _)| UnixMillis(bucket + self.bucket_ms - 1))
    }

    /// Takes back `cost` units recorded at `at` (a slot that made no call), as far as the
    /// log still holds them.
    pub fn remove(&mut self, at: UnixMillis, cost: u64) {
        let bucket = at.0 - at.0 % self.bucket_ms;
        if let Some(index) = self.entries.iter().rposition(|(b, _)| *b == bucket) {
            let taken = cost.min(self.entries[index].1);
            self.entries[index].1 -= taken;
            self.units -= taken;
            if self.entries[index].1 == 0 {
                self.entries.remove(index);
            }
        }
    }

    /// Records `cost` units at `now` and forgets what has left the window.
    pub fn record(&mut self, now: UnixMillis, cost: u64) {
        while let Some((_, units)) = self.entries.front().filter(|(b, _)| self.expiry(*b) <= now.0) {
            self.units -= units;
            self.entries.pop_front();
        }
        self.units += cost;
        let bucket = now.0 - now.0 % self.bucket_ms;
        match self.entries.back_mut() {
            Some((last, units)) if *last == bucket => *units += cost,
            _ => self.entries.push_back((bucket, cost)),
        }
    }
}

/// State of one rolling tier.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollingState {
    /// GCRA theoretical arrival time, scaled by the tier's limit to stay exact:
    /// the next unit may go at `ceil(tat_scaled / limit)` ms.
    tat_scaled: u128,
    /// For an evenly spaced tier, scaled like `tat_scaled`: the last call's instant plus
    /// its nominal interval (the tier's own window, no margin). A call that went late
    /// keeps the schedule (`tat_scaled`) but the next one still leaves this gap after
    /// it, so a strict leaky bucket at the provider's rate never sees two calls too close.
    #[serde(default)]
    spaced_until_scaled: u128,
    /// The limit the two instants above are scaled by: the limit they were last kept
    /// under, which is not the tier's own where a shard's share of a shared quota moved
    /// (0 in a snapshot from before: the tier's own).
    #[serde(default)]
    scaled_by: u64,
    log: SlidingWindowLog,
}

impl RollingState {
    /// The limit `tat_scaled` and `spaced_until_scaled` are scaled by, for the state of
    /// `tier`.
    fn scale(&self, tier: &Tier) -> u64 {
        if self.scaled_by == 0 {
            tier.limit
        } else {
            self.scaled_by
        }
    }

    /// `tat_scaled` and `spaced_until_scaled` scaled by `limit` (rounded up: never an
    /// earlier instant), for the state of `tier`: the same instants under whichever
    /// limit a share of the tier moved to.
    fn instants_scaled_by(&self, tier: &Tier, limit: u64) -> (u128, u128) {
        let scale = self.scale(tier);
        if scale == limit || scale == 0 {
            return (self.tat_scaled, self.spaced_until_scaled);
        }
        let rescale = |scaled: u128| (scaled * u128::from(limit)).div_ceil(u128::from(scale));
        (rescale(self.tat_scaled), rescale(self.spaced_until_scaled))
    }

    /// Keeps the instants scaled by `limit` from now on (see [`Self::instants_scaled_by`]).
    fn rescale_to(&mut self, tier: &Tier, limit: u64) {
        (self.tat_scaled, self.spaced_until_scaled) = self.instants_scaled_by(tier, limit);
        self.scaled_by = limit;
    }
}

/// State of one calendar tier: units used in the window starting at `window_start`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CalendarState {
    pub window_start: UnixMillis,
    pub used: u64,
}

/// State of one tier, tagged with the tier it belongs to so a stale snapshot from a
/// different configuration is never applied.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierState {
    pub tier: Tier,
    pub rolling: Option<RollingState>,
    pub calendar: CalendarState,
}

/// Everything the pacer remembers. Serializable, so a run can hand it to the next.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PacerState {
    tiers: Vec<TierState>,
    /// No dispatch before this instant (a provider's cool-down, or this lane's own hold).
    hold_until: UnixMillis,
    /// Added to every rolling window beyond the quota's `safety_margin`: what 429s showed
    /// of the network's jitter (see [`PacerState::learn_jitter`]).
    #[serde(default)]
    learned_margin_ms: u64,
}

/// The most margin 429s can teach the pacer: 100 ms, and never more than a twentieth of
/// the shortest rolling window (a 5% slower pace at worst).
const MAX_LEARNED_MARGIN: Duration = Duration::from_millis(100);
/// A 429 widens the margin by at least this much.
const MIN_MARGIN_STEP: Duration = Duration::from_millis(5);

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Quota {
    fn effective_window_ms(&self, tier: &Tier) -> u64 {
        match tier.period {
            Period::Rolling(d) => millis(d).max(1) + millis(self.safety_margin()),
            Period::Day | Period::Month => 0,
        }
    }

    /// The rules of tier `index` (a rolling tier).
    fn rules(&self, index: usize, tier: &Tier) -> Rules {
        match tier.spread {
            Spread::Burst(units) => Rules { gcra_tolerance: Some(units - 1), window: false },
            Spread::Smooth => Rules { gcra_tolerance: Some(0), window: true },
            Spread::Window if self.spacing_tier() == Some(index) => Rules { gcra_tolerance: Some(0), window: true },
            Spread::Window => Rules { gcra_tolerance: None, window: true },
        }
    }

    /// Whether a job of `cost` units may go at `now`.
    #[must_use]
    pub fn decide(&self, state: &PacerState, cost: u64, now: UnixMillis) -> Decision {
        let mut ready = now;
        let mut by = None;
        if state.hold_until > ready {
            ready = state.hold_until;
            by = Some(Hold::CoolDown);
        }
        if let Some(tier) = self.tier_too_small_for(cost) {
            return Decision::Never { tier: *tier };
        }
        for (index, (tier, tier_state)) in self.tiers().iter().zip(&state.tiers).enumerate() {
            let tier_ready = match &tier_state.rolling {
                Some(rolling) => {
                    let rules = self.rules(index, tier);
                    let (tat_scaled, spaced_until_scaled) = rolling.instants_scaled_by(&tier_state.tier, tier.limit);
                    let gcra = rules.gcra_tolerance.map_or(now, |tolerance| {
                        // A bucket of `tolerance + 1` units: a job may start while the
                        // bucket has room for it (for a heavy job, room for all of it
                        // up to the bucket's size).
                        let room = u128::from(tolerance + 1 - cost.min(tolerance + 1));
                        let ready_scaled = tat_scaled.saturating_sub(room * u128::from(state.window_ms(self, tier)));
                        let ready_scaled = if tolerance == 0 && self.strict_gaps() { ready_scaled.max(spaced_until_scaled) } else { ready_scaled };
                        UnixMillis(u64::try_from(ready_scaled.div_ceil(u128::from(tier.limit))).unwrap_or(u64::MAX))
                    });
                    let window = if rules.window { rolling.log.ready_at(now, cost, tier.limit).unwrap_or(UnixMillis(u64::MAX)) } else { now };
                    gcra.max(window)
                }
                None => {
                    let (start, end) = tier.window_at(self.zone(), now);
                    let used = if tier_state.calendar.window_start >= start { tier_state.calendar.used } else { 0 };
                    if used + cost <= tier.limit {
                        now
                    } else {
                        end
                    }
                }
            };
            // Tiers ready at the same moment both hold the job; it is named for the
            // slower one (a long window's log replays the short tier's spacing, but it
            // is the long window whose budget ran out).
            let slower_than_holder = matches!(by, Some(Hold::Tier(held)) if tier.rate_per_second() < self.tiers()[held].rate_per_second());
            if tier_ready > ready || (tier_ready == ready && tier_ready > now && slower_than_holder) {
                ready = tier_ready;
                by = Some(Hold::Tier(index));
            }
        }
        match by {
            Some(by) if ready > now => Decision::WaitUntil { at: ready, by },
            _ => Decision::Allow,
        }
    }

    /// How many unit-cost jobs could be dispatched from `now` until `horizon` (capped at
    /// `max`): the orchestrator receives no more than it can hand off in time.
    #[must_use]
    pub fn capacity_until(&self, state: &PacerState, now: UnixMillis, horizon: UnixMillis, max: usize) -> usize {
        let mut state = state.clone();
        let mut t = now;
        for admitted in 0..max {
            match self.decide(&state, 1, t) {
                Decision::Allow => state.commit(self, 1, t),
                Decision::WaitUntil { at, .. } if at < horizon => {
                    t = at;
                    state.commit(self, 1, t);
                }
                _ => return admitted,
            }
        }
        max
    }

    /// How long from `from` until a unit-cost job may go: zero when one may go then (or
    /// none ever could).
    #[must_use]
    pub fn held_for(&self, state: &PacerState, from: UnixMillis) -> Duration {
        match self.decide(state, 1, from) {
            Decision::WaitUntil { at, .. } => at.since(from),
            Decision::Allow | Decision::Never { .. } => Duration::ZERO,
        }
    }

    /// About how many unit-cost jobs could be dispatched from `from` until `until` (at
    /// most `max`): from the first free slot on, at the long-run rate. O(tiers), where
    /// [`Self::capacity_until`] is exact but walks every slot: for sizing what many
    /// lanes keep in hand and receive on every decision, with thousands of jobs in hand.
    #[must_use]
    pub fn room_estimate(&self, state: &PacerState, from: UnixMillis, until: UnixMillis, max: usize) -> usize {
        let first = match self.decide(state, 1, from) {
            Decision::Allow => from,
            Decision::WaitUntil { at, .. } => at,
            Decision::Never { .. } => return 0,
        };
        if first >= until {
            return 0;
        }
        let after_first = until.since(first).as_secs_f64() * self.sustained_per_second();
        if after_first >= max as f64 {
            max
        } else {
            (after_first as usize + 1).min(max)
        }
    }
}

impl PacerState {
    /// No dispatch before this instant.
    #[must_use]
    pub fn hold_until(&self) -> UnixMillis {
        self.hold_until
    }

    /// Holds dispatch until `at` (a provider's cool-down, a lane's own hold).
    pub fn set_hold_until(&mut self, at: UnixMillis) {
        self.hold_until = at;
    }

    /// A fresh state: nothing used anywhere.
    #[must_use]
    pub fn new(quota: &Quota) -> Self {
        let tiers = quota
            .tiers()
            .iter()
            .map(|tier| TierState {
                tier: *tier,
                rolling: match tier.period {
                    Period::Rolling(_) => Some(RollingState {
                        tat_scaled: 0,
                        spaced_until_scaled: 0,
                        scaled_by: tier.limit,
                        log: SlidingWindowLog::new(Duration::from_millis(quota.effective_window_ms(tier)), tier.limit),
                    }),
                    Period::Day | Period::Month => None,
                },
                calendar: CalendarState::default(),
            })
            .collect();
        Self { tiers, hold_until: UnixMillis(0), learned_margin_ms: 0 }
    }

    /// Takes the rolling-tier state and cool-down from a snapshot of an earlier run,
    /// for the tiers that still have the same limit and window (margin included).
    #[must_use]
    pub fn restored(quota: &Quota, snapshot: &PacerState) -> Self {
        let mut state = Self::new(quota);
        // The margin the last run learned carries over, and with it the windows' lengths.
        state.set_learned_margin(quota, snapshot.learned_margin_ms);
        for tier_state in &mut state.tiers {
            if let Some(old) = snapshot.same_rolling_tier(tier_state) {
                tier_state.rolling = Some(old.clone());
            }
        }
        state.hold_until = snapshot.hold_until;
        state
    }

    /// Whether this snapshot holds the past calls of every rolling tier of `quota` (one
    /// of another config's tiers leaves some tier of this one without them).
    #[must_use]
    pub fn covers_rolling_tiers(&self, quota: &Quota) -> bool {
        let mut wanted = Self::new(quota);
        wanted.set_learned_margin(quota, self.learned_margin_ms);
        wanted.tiers.iter().all(|tier_state| tier_state.rolling.is_none() || self.same_rolling_tier(tier_state).is_some())
    }

    /// The rolling state this snapshot keeps for the tier of `tier_state`: the same
    /// limit, period and window. A tier whose spread changed keeps its state: the
    /// spacing and the window log mean the same whatever the rules applied to them.
    fn same_rolling_tier(&self, tier_state: &TierState) -> Option<&RollingState> {
        let same_tier = |old: &&TierState| old.tier.limit == tier_state.tier.limit && old.tier.period == tier_state.tier.period;
        let old = self.tiers.iter().find(same_tier)?;
        match (&old.rolling, &tier_state.rolling) {
            (Some(a), Some(b)) if a.log.window_ms == b.log.window_ms && a.log.bucket_ms == b.log.bucket_ms => Some(a),
            _ => None,
        }
    }

    /// After a run that stopped without saving its final state (a crash), its last
    /// dispatches are unknown: hold every dispatch for one full window of the longest
    /// rolling tier, after which nothing it did can share a window with what we do.
    pub fn hold_after_unclean_stop(&mut self, quota: &Quota, now: UnixMillis) {
        self.hold_until = self.hold_until.max(now.plus(self.longest_window(quota)));
    }

    /// One window of the longest rolling tier, with the margin as configured and learned
    /// (zero without rolling tiers): after it, nothing dispatched before can share a
    /// window with what is dispatched next.
    #[must_use]
    pub fn longest_window(&self, quota: &Quota) -> Duration {
        Duration::from_millis(quota.tiers().iter().map(|t| self.window_ms(quota, t)).max().unwrap_or(0))
    }

    /// The length the pacer gives `tier`'s window: its own, the configured margin and what
    /// 429s taught (zero for a calendar tier).
    fn window_ms(&self, quota: &Quota, tier: &Tier) -> u64 {
        match tier.period {
            Period::Rolling(_) => quota.effective_window_ms(tier) + self.learned_margin_ms,
            Period::Day | Period::Month => 0,
        }
    }

    /// The margin added to rolling windows now: the configured one and what 429s taught.
    #[must_use]
    pub fn safety_margin(&self, quota: &Quota) -> Duration {
        quota.safety_margin() + Duration::from_millis(self.learned_margin_ms)
    }

    /// The provider refused a call although no window of ours was over: it saw our calls
    /// closer together than we sent them (network jitter at a window's edge, larger than
    /// the margin). Widens the margin every rolling window gets, doubling it (by at least
    /// 5 ms) up to 100 ms or a twentieth of the shortest rolling window, whichever is
    /// less. Returns the new margin if it grew.
    pub fn learn_jitter(&mut self, quota: &Quota) -> Option<Duration> {
        let shortest = quota.tiers().iter().filter_map(|t| match t.period {
            Period::Rolling(d) => Some(d),
            Period::Day | Period::Month => None,
        });
        let configured = millis(quota.safety_margin());
        let cap = millis(shortest.min()? / 20).min(millis(MAX_LEARNED_MARGIN)).max(configured);
        let margin = configured + self.learned_margin_ms;
        let grown = (margin * 2).max(margin + millis(MIN_MARGIN_STEP)).min(cap);
        (grown > margin).then(|| {
            self.set_learned_margin(quota, grown - configured);
            Duration::from_millis(grown)
        })
    }

    /// Goes back to the configured margin (an operator's `paceline rate reset`).
    pub fn forget_jitter(&mut self, quota: &Quota) {
        self.set_learned_margin(quota, 0);
    }

    fn set_learned_margin(&mut self, quota: &Quota, learned_ms: u64) {
        self.learned_margin_ms = learned_ms;
        for (tier, tier_state) in quota.tiers().iter().zip(&mut self.tiers) {
            if let Some(rolling) = &mut tier_state.rolling {
                rolling.log.window_ms = quota.effective_window_ms(tier) + learned_ms;
            }
        }
    }

    /// Records a dispatch of `cost` units at `now`. Call only after [`Decision::Allow`].
    pub fn commit(&mut self, quota: &Quota, cost: u64, now: UnixMillis) {
        let learned_margin_ms = self.learned_margin_ms;
        for (index, (tier, tier_state)) in quota.tiers().iter().zip(&mut self.tiers).enumerate() {
            match &mut tier_state.rolling {
                Some(rolling) => {
                    rolling.rescale_to(&tier_state.tier, tier.limit);
                    let limit = u128::from(tier.limit);
                    let step = u128::from(quota.effective_window_ms(tier) + learned_margin_ms) * u128::from(cost);
                    let now_scaled = u128::from(now.0) * limit;
                    let base = if quota.rules(index, tier).gcra_tolerance == Some(0) {
                        // A dispatch a little after its slot (rounding to the millisecond,
                        // a timer waking late) keeps the schedule, so lateness does not
                        // push every later slot back. "A little" is the safety margin (at
                        // least 1 ms); the window log still guarantees no window overfills
                        // and the nominal gap after this call keeps strict buckets happy.
                        // A gap under a millisecond cannot be kept on a millisecond clock
                        // (nor does a provider's): tiers faster than that go by the rest.
                        let nominal_ms = u128::from(millis(tier.nominal_window()).max(1));
                        if nominal_ms >= limit {
                            rolling.spaced_until_scaled = now_scaled + nominal_ms * u128::from(cost);
                        }
                        let tolerance = u128::from(millis(quota.safety_margin()).max(1)) * limit;
                        if now_scaled < rolling.tat_scaled + tolerance {
                            rolling.tat_scaled
                        } else {
                            now_scaled
                        }
                    } else {
                        rolling.tat_scaled.max(now_scaled)
                    };
                    rolling.tat_scaled = base + step;
                    rolling.log.record(now, cost);
                }
                None => {
                    let (start, _) = tier.window_at(quota.zone(), now);
                    if tier_state.calendar.window_start < start {
                        tier_state.calendar = CalendarState { window_start: start, used: 0 };
                    }
                    tier_state.calendar.used += cost;
                }
            }
        }
    }

    /// Gives back a slot no call was made at (its worker started too late): the units
    /// committed at `at` leave every tier's count, and the schedule of an evenly spaced
    /// tier moves back by them, so the pace takes them up again within a window. The
    /// nominal gap after the last call stays: a strict leaky bucket never sees two calls
    /// too close.
    pub fn give_back(&mut self, quota: &Quota, at: UnixMillis, cost: u64) {
        let learned_margin_ms = self.learned_margin_ms;
        for (tier, tier_state) in quota.tiers().iter().zip(&mut self.tiers) {
            match &mut tier_state.rolling {
                Some(rolling) => {
                    // A slot kept under a larger share moves the schedule back by the
                    // smaller one's interval: no further than the window log allows.
                    rolling.rescale_to(&tier_state.tier, tier.limit);
                    let step = u128::from(quota.effective_window_ms(tier) + learned_margin_ms) * u128::from(cost);
                    rolling.tat_scaled = rolling.tat_scaled.saturating_sub(step);
                    rolling.log.remove(at, cost);
                }
                None => {
                    let (start, _) = tier.window_at(quota.zone(), at);
                    if tier_state.calendar.window_start == start {
                        tier_state.calendar.used = tier_state.calendar.used.saturating_sub(cost);
                    }
                }
            }
        }
    }

    /// Sets the units already used in the calendar window of tier `index` that holds
    /// `now` (as loaded from the state store).
    pub fn set_calendar_used(&mut self, quota: &Quota, index: usize, used: u64, now: UnixMillis) {
        if let (Some(tier), Some(tier_state)) = (quota.tiers().get(index), self.tiers.get_mut(index)) {
            let (start, _) = tier.window_at(quota.zone(), now);
            tier_state.calendar = CalendarState { window_start: start, used };
        }
    }

    /// When the oldest unit in rolling tier `index`'s window at `now` leaves it (safety
    /// margin included); `None` for an empty window or a calendar tier.
    #[must_use]
    pub fn frees_at(&self, index: usize, now: UnixMillis) -> Option<UnixMillis> {
        self.tiers.get(index)?.rolling.as_ref()?.log.next_free_at(now)
    }

    /// The last slot the rolling tiers' logs hold (a snapshot's: the last call its run
    /// decided, which may go after the next run has started).
    #[must_use]
    pub fn last_slot(&self) -> Option<UnixMillis> {
        self.tiers.iter().filter_map(|s| s.rolling.as_ref()?.log.last_at()).max()
    }

    /// Units used in each tier's current window at `now`, in tier order.
    #[must_use]
    pub fn usage(&self, quota: &Quota, now: UnixMillis) -> Vec<u64> {
        quota
            .tiers()
            .iter()
            .zip(&self.tiers)
            .map(|(tier, s)| match &s.rolling {
                Some(rolling) => rolling.log.in_window(now),
                None => {
                    let (start, _) = tier.window_at(quota.zone(), now);
                    if s.calendar.window_start >= start {
                        s.calendar.used
                    } else {
                        0
                    }
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::{peak_in_any_window, StrictBucketLimiter};
    use proptest::prelude::*;

    fn quota(tiers: &[&str], margin_ms: u64) -> Quota {
        Quota::new(tiers.iter().map(|t| t.parse().unwrap()).collect(), chrono_tz::UTC, Duration::from_millis(margin_ms)).unwrap()
    }

    /// Dispatches a saturating backlog of `cost`-unit jobs from `start` for `span`,
    /// always at the first instant the pacer allows. Returns the dispatch times.
    fn saturate(q: &Quota, costs: &[u64], start: u64, span: u64) -> Vec<(UnixMillis, u64)> {
        let mut state = PacerState::new(q);
        let mut now = UnixMillis(start);
        let mut sent = Vec::new();
        for cost in costs.iter().cycle() {
            match q.decide(&state, *cost, now) {
                Decision::Allow => {
                    state.commit(q, *cost, now);
                    sent.push((now, *cost));
                }
                Decision::WaitUntil { at, .. } => now = at,
                Decision::Never { .. } => panic!("cost {cost} never fits"),
            }
            if now.0 >= start + span {
                break;
            }
        }
        sent
    }

    #[test]
    fn one_per_second_goes_exactly_every_second() {
        let q = quota(&["1/s"], 0);
        let sent = saturate(&q, &[1], 1_000_000, 5_000);
        let times: Vec<u64> = sent.iter().map(|(t, _)| t.0).collect();
        assert_eq!(times, vec![1_000_000, 1_001_000, 1_002_000, 1_003_000, 1_004_000]);
    }

    #[test]
    fn ten_per_second_is_evenly_spaced_with_the_margin_spread_over_calls() {
        let q = quota(&["10/s"], 10);
        let sent = saturate(&q, &[1], 0, 1_000);
        let times: Vec<u64> = sent.iter().map(|(t, _)| t.0).collect();
        assert_eq!(times, vec![0, 101, 202, 303, 404, 505, 606, 707, 808, 909]);
    }

    #[test]
    fn fractional_intervals_stay_exact_over_a_long_run() {
        // 7 per 1.002 s: intervals of 143.142... ms must not drift.
        let q = quota(&["7/s"], 2);
        let sent = saturate(&q, &[1], 0, 100_100);
        assert_eq!(sent.len(), 700);
        assert_eq!(sent[7].0, UnixMillis(1_002));
        assert_eq!(sent[699].0, UnixMillis(100_057)); // ceil(699 * 1002 / 7)
    }

    #[test]
    fn rounding_to_the_millisecond_never_brings_two_calls_closer_than_the_tiers_interval() {
        // Without a margin, slots at ceil(k * 142.857) would put 858 and 1000 142 ms
        // apart: a strict bucket at 7/s (nginx's limit_req) refuses the second.
        let q = quota(&["7/s"], 0);
        let sent = saturate(&q, &[1], 0, 100_000);
        for pair in sent.windows(2) {
            assert!((pair[1].0 .0 - pair[0].0 .0) * 7 >= 1_000, "{pair:?}");
        }
        assert!(sent.len() >= 690, "{} calls in 100 s", sent.len());
    }

    /// A lane's tier rounds each gap up to the millisecond (a strict bucket at 990/s on a
    /// millisecond clock takes no more: 1.01 ms is 2 ms), which costs a 990/s tier half
    /// its rate; a shard's share, whose calls interleave with other shards', keeps the
    /// spacing's schedule on average: gaps of 1 and 2 ms, and still no window over 990.
    #[test]
    fn a_share_keeps_its_spacing_on_average_where_a_lane_rounds_each_gap_up() {
        let lane = quota(&["990/s"], 0);
        assert_eq!(saturate(&lane, &[1], 0, 10_000).len(), 5_000);
        let share = quota(&["990/s"], 0).with_gaps_on_average();
        let sent = saturate(&share, &[1], 0, 10_000);
        assert!(sent.len() >= 9_890, "{} calls in 10 s", sent.len());
        assert!(peak_in_any_window(&sent, Duration::from_secs(1)) <= 990);
        let odd = quota(&["99/s", "5000/min"], 0).with_gaps_on_average();
        let sent = saturate(&odd, &[1], 0, 10_000);
        assert!(sent.len() >= 985 && peak_in_any_window(&sent, Duration::from_secs(1)) <= 99, "{} calls in 10 s", sent.len());
    }

    #[test]
    fn a_tier_faster_than_a_call_a_millisecond_still_gets_its_rate() {
        // 5000/s: five calls a millisecond. The gap after a late call cannot be kept at
        // a fifth of a millisecond on a millisecond clock, so it is not kept at all.
        let q = quota(&["5000/s"], 0);
        let sent = saturate(&q, &[1], 0, 1_000);
        assert!(sent.len() >= 4_990, "{} calls in a second", sent.len());
        assert!(peak_in_any_window(&sent, Duration::from_secs(1)) <= 5_000);
    }

    /// Dispatches a backlog of unit jobs, each timer firing `late_ms` after the instant
    /// the pacer asked for.
    fn saturate_waking_late(q: &Quota, late_ms: u64, calls: usize) -> Vec<(UnixMillis, u64)> {
        let mut state = PacerState::new(q);
        let mut sent = Vec::new();
        let mut now = UnixMillis(0);
        while sent.len() < calls {
            match q.decide(&state, 1, now) {
                Decision::Allow => {
                    state.commit(q, 1, now);
                    sent.push((now, 1));
                }
                Decision::WaitUntil { at, .. } => now = at.plus(Duration::from_millis(late_ms)),
                Decision::Never { .. } => unreachable!(),
            }
        }
        sent
    }

    #[test]
    fn late_wake_ups_within_the_per_call_margin_do_not_drift_the_schedule() {
        // 5 per 1.01 s: slots 202 ms apart, 2 ms more than the provider's interval.
        // Timers 2 ms late keep the schedule: the 200th call at ceil(199 * 202) + 2 ms,
        // where without catching up it would be at 199 * 204 = 40 596 ms. The window log
        // (exact on actual times) may still add the lateness once per window: 40 * 2 ms.
        let sent = saturate_waking_late(&quota(&["5/s"], 10), 2, 200);
        let last = sent.last().unwrap().0 .0;
        assert!((40_200..=40_300).contains(&last), "200th dispatch at {last} ms");
        assert!(peak_in_any_window(&sent, Duration::from_secs(1)) <= 5);
    }

    #[test]
    fn late_wake_ups_beyond_the_per_call_margin_still_leave_the_tiers_interval() {
        // Slots every 50.5 ms, timers 3 ms late: a call that went late is followed by
        // one at least the provider's 50 ms later, never sooner.
        let sent = saturate_waking_late(&quota(&["20/s"], 10), 3, 200);
        for pair in sent.windows(2) {
            assert!(pair[1].0 .0 - pair[0].0 .0 >= 50, "{pair:?}");
        }
        assert!(peak_in_any_window(&sent, Duration::from_secs(1)) <= 20);
    }

    #[test]
    fn a_backlog_fills_a_long_tier_at_the_shortest_tiers_pace() {
        // The hour tier is a sliding window: its 1,000 calls go at 10/s (101 ms apart
        // with the margin), then nothing until the first of them leaves the hour.
        let q = quota(&["10/s", "1000/h"], 10);
        let sent = saturate(&q, &[1], 0, 2 * 3_600_000);
        assert_eq!(sent[499].0, UnixMillis(50_399)); // ceil(499 * 101)
        assert_eq!(sent[999].0, UnixMillis(100_899));
        assert_eq!(sent[1_000].0, UnixMillis(3_600_010)); // the first call leaves the hour (and margin)
        assert!(peak_in_any_window(&sent, Duration::from_secs(3_600)) <= 1_000);
    }

    #[test]
    fn a_smooth_long_tier_spreads_its_allowance_evenly() {
        let q = quota(&["10/s", "1000/h smooth"], 10);
        let times: Vec<u64> = saturate(&q, &[1], 0, 10_000).iter().map(|(t, _)| t.0).collect();
        assert_eq!(times, vec![0, 3_601, 7_201]); // (3 600 000 + 10) / 1000 ms apart
    }

    #[test]
    fn a_burst_tier_lets_its_bucket_go_at_once_then_refills_at_its_rate() {
        // A bucket of 40 leaking 2/s (505 ms a unit with the margin).
        let q = quota(&["2/s burst=40"], 10);
        let times: Vec<u64> = saturate(&q, &[1], 0, 2_000).iter().map(|(t, _)| t.0).collect();
        assert_eq!(times[..40], [0; 40]);
        assert_eq!(times[40..], [505, 1_010, 1_515]);
    }

    #[test]
    fn heavy_job_waits_for_the_window_not_just_the_spacing() {
        let q = quota(&["10/s"], 0);
        let mut state = PacerState::new(&q);
        state.commit(&q, 1, UnixMillis(0));
        // GCRA alone would allow a 10-unit job at 100 ms; the window still holds 1 unit.
        assert_eq!(q.decide(&state, 10, UnixMillis(100)), Decision::WaitUntil { at: UnixMillis(1_000), by: Hold::Tier(0) });
        assert_eq!(q.decide(&state, 11, UnixMillis(100)), Decision::Never { tier: "10/s".parse().unwrap() });
    }

    #[test]
    fn calendar_tier_waits_for_midnight_when_exhausted() {
        let q = quota(&["100/s", "3/day"], 0);
        let mut state = PacerState::new(&q);
        let day_start = 1_795_824_000_000; // 2026-11-28T00:00:00Z
        state.set_calendar_used(&q, 1, 2, UnixMillis(day_start + 5_000));
        assert_eq!(q.decide(&state, 1, UnixMillis(day_start + 5_000)), Decision::Allow);
        state.commit(&q, 1, UnixMillis(day_start + 5_000));
        assert_eq!(q.decide(&state, 1, UnixMillis(day_start + 6_000)), Decision::WaitUntil { at: UnixMillis(day_start + 86_400_000), by: Hold::Tier(1) });
        assert_eq!(q.decide(&state, 1, UnixMillis(day_start + 86_400_000)), Decision::Allow);
        assert_eq!(state.usage(&q, UnixMillis(day_start + 5_500)), vec![1, 3]);
    }

    #[test]
    fn a_rolling_tier_tells_when_its_oldest_unit_frees_up() {
        let q = quota(&["3/min", "10/day"], 10);
        let mut state = PacerState::new(&q);
        assert_eq!(state.frees_at(0, UnixMillis(0)), None);
        state.commit(&q, 1, UnixMillis(1_000));
        state.commit(&q, 1, UnixMillis(21_000));
        assert_eq!(state.usage(&q, UnixMillis(30_000)), vec![2, 2]);
        assert_eq!(state.frees_at(0, UnixMillis(30_000)), Some(UnixMillis(61_010)));
        assert_eq!(state.frees_at(0, UnixMillis(61_010)), Some(UnixMillis(81_010)));
        assert_eq!(state.usage(&q, UnixMillis(61_010))[0], 1);
        assert_eq!(state.frees_at(1, UnixMillis(30_000)), None, "a calendar tier resets instead");
    }

    #[test]
    fn cool_down_holds_every_dispatch() {
        let q = quota(&["10/s"], 0);
        let mut state = PacerState::new(&q);
        state.hold_until = UnixMillis(5_000);
        assert_eq!(q.decide(&state, 1, UnixMillis(1_000)), Decision::WaitUntil { at: UnixMillis(5_000), by: Hold::CoolDown });
        assert_eq!(q.decide(&state, 1, UnixMillis(5_000)), Decision::Allow);
    }

    /// Calls at the first instant `q` allows, from `from` until `until`, committed to
    /// `state`; their instants.
    fn greedy(q: &Quota, state: &mut PacerState, from: UnixMillis, until: UnixMillis) -> Vec<UnixMillis> {
        let (mut now, mut calls) = (from, Vec::new());
        while now < until {
            match q.decide(state, 1, now) {
                Decision::Allow => {
                    state.commit(q, 1, now);
                    calls.push(now);
                }
                Decision::WaitUntil { at, .. } => now = at,
                Decision::Never { .. } => break,
            }
        }
        calls
    }

    /// A shard paces under its share of a shared quota, which moves: the same state is
    /// committed under one limit and asked under another. Its schedule was kept in units
    /// of the limit it was committed under and read in units of the one asked, so under
    /// half the limit the next slot lay twice as far from 1970: the shard never called
    /// again. Under twice the limit, it may go at once (the window log still holds it).
    #[test]
    fn a_schedule_kept_under_one_share_of_a_tier_is_read_at_the_same_instants_under_another() {
        let (whole, half) = (quota(&["100/s"], 0), quota(&["50/s"], 0));
        let start = UnixMillis(1_800_000_000_000);
        let mut state = PacerState::new(&whole);
        let busy = greedy(&whole, &mut state, start, start.plus(Duration::from_secs(5)));
        assert!(busy.len() >= 500, "{} calls in 5 s at 100/s", busy.len());
        let after = start.plus(Duration::from_secs(5));
        let at_half = greedy(&half, &mut state, after, after.plus(Duration::from_secs(3)));
        assert!(at_half.first().is_some_and(|first| *first < after.plus(Duration::from_secs(1))), "the first call under half the limit: {:?}", at_half.first());
        let last_second = at_half.iter().filter(|t| **t >= after.plus(Duration::from_secs(2))).count();
        assert!((49..=51).contains(&last_second), "{last_second} calls in a second at 50/s");
        let back = after.plus(Duration::from_secs(3));
        let at_whole = greedy(&whole, &mut state, back, back.plus(Duration::from_secs(2)));
        let last_second = at_whole.iter().filter(|t| **t >= back.plus(Duration::from_secs(1))).count();
        assert!((99..=101).contains(&last_second), "{last_second} calls in a second at 100/s again");
    }

    #[test]
    fn capacity_until_counts_what_fits_before_the_horizon() {
        let q = quota(&["1/s"], 0);
        let state = PacerState::new(&q);
        assert_eq!(q.capacity_until(&state, UnixMillis(0), UnixMillis(3_500), 10), 4);
        assert_eq!(q.capacity_until(&state, UnixMillis(0), UnixMillis(60_000), 10), 10);
    }

    #[test]
    fn the_room_estimate_is_within_a_job_of_the_exact_count_at_a_backlog_s_pace() {
        for (tiers, until_ms) in [(&["1/s"][..], 3_500), (&["10/s"][..], 24_000), (&["10/s", "500/min"][..], 300_000)] {
            let q = quota(tiers, 0);
            let mut state = PacerState::new(&q);
            state.commit(&q, 1, UnixMillis(0));
            let exact = q.capacity_until(&state, UnixMillis(0), UnixMillis(until_ms), 100_000);
            let estimate = q.room_estimate(&state, UnixMillis(0), UnixMillis(until_ms), 100_000);
            assert!(exact.abs_diff(estimate) <= 1, "{tiers:?} until {until_ms} ms: {estimate} for {exact}");
        }
        let q = quota(&["1/s"], 0);
        let mut held = PacerState::new(&q);
        held.hold_until = UnixMillis(10_000);
        assert_eq!(q.room_estimate(&held, UnixMillis(0), UnixMillis(10_000), 10), 0, "held until the horizon: none");
        assert_eq!(q.room_estimate(&held, UnixMillis(0), UnixMillis(60_000), 10), 10, "at most max");
    }

    #[test]
    fn restored_state_keeps_spacing_across_runs_and_ignores_changed_tiers() {
        let q = quota(&["1/s"], 0);
        let mut state = PacerState::new(&q);
        state.commit(&q, 1, UnixMillis(10_000));
        let snapshot: PacerState = serde_json::from_str(&serde_json::to_string(&state).unwrap()).unwrap();
        let next_run = PacerState::restored(&q, &snapshot);
        assert_eq!(q.decide(&next_run, 1, UnixMillis(10_400)), Decision::WaitUntil { at: UnixMillis(11_000), by: Hold::Tier(0) });
        let changed = quota(&["2/s"], 0);
        let other = PacerState::restored(&changed, &snapshot);
        assert_eq!(changed.decide(&other, 1, UnixMillis(10_400)), Decision::Allow);
    }

    #[test]
    fn a_snapshot_covers_a_quota_only_with_every_rolling_tier_s_past_calls() {
        let q = quota(&["1/s", "50/min", "1000/day"], 0);
        let mut state = PacerState::new(&q);
        state.commit(&q, 1, UnixMillis(10_000));
        assert!(state.covers_rolling_tiers(&q));
        assert!(state.covers_rolling_tiers(&quota(&["1/s", "1000/day"], 0)), "a tier dropped leaves none without its calls");
        assert!(state.covers_rolling_tiers(&quota(&["1/s", "50/min", "9/day"], 0)), "calendar tiers start from the store's count");
        assert!(!state.covers_rolling_tiers(&quota(&["2/s", "50/min"], 0)), "a new limit");
        assert!(!state.covers_rolling_tiers(&quota(&["1/s", "50/min", "500/h"], 0)), "a new tier");
        assert!(!state.covers_rolling_tiers(&quota(&["1/s", "50/min"], 20)), "another margin: other windows");
        state.learn_jitter(&q);
        let learned = state.safety_margin(&q);
        assert!(state.covers_rolling_tiers(&q), "the margin it learned goes with it ({learned:?})");
    }

    /// Under `10/s + 50/10s` a call made on its slot reached a strict sliding-window API
    /// 11 ms late, past the 10 ms margin, and was refused: a 429 says the jitter is
    /// larger than the margin, so every rolling window grows by what it taught, the
    /// next run keeps it and an operator's reset forgets it.
    #[test]
    fn a_429_widens_every_rolling_window_up_to_a_twentieth_of_the_shortest() {
        let q = quota(&["10/s", "50/10s", "1000/day"], 10);
        let mut state = PacerState::new(&q);
        let grown: Vec<_> = std::iter::from_fn(|| state.learn_jitter(&q)).map(|m| m.as_millis()).collect();
        assert_eq!(grown, vec![20, 40, 50], "doubling up to 1 s / 20");
        assert_eq!(state.longest_window(&q), Duration::from_millis(10_050));
        state.commit(&q, 1, UnixMillis(0));
        assert_eq!(q.decide(&state, 1, UnixMillis(0)), Decision::WaitUntil { at: UnixMillis(105), by: Hold::Tier(0) });
        assert_eq!(state.frees_at(1, UnixMillis(0)), Some(UnixMillis(10_050)), "the long window's log is wider too");
        let next_run = PacerState::restored(&q, &serde_json::from_str(&serde_json::to_string(&state).unwrap()).unwrap());
        assert_eq!(next_run.safety_margin(&q), Duration::from_millis(50));
        assert_eq!(q.decide(&next_run, 1, UnixMillis(0)), Decision::WaitUntil { at: UnixMillis(105), by: Hold::Tier(0) });
        state.forget_jitter(&q);
        assert_eq!(state.safety_margin(&q), Duration::from_millis(10));
        state.commit(&q, 1, UnixMillis(105));
        assert_eq!(q.decide(&state, 1, UnixMillis(105)), Decision::WaitUntil { at: UnixMillis(206), by: Hold::Tier(0) }, "101 ms apart again");
        let tiny = quota(&["1/10ms"], 0);
        assert_eq!(PacerState::new(&tiny).learn_jitter(&tiny), None, "a 10 ms window cannot take a 5 ms step");
    }

    #[test]
    fn an_unclean_stop_holds_for_the_longest_rolling_window() {
        let q = quota(&["10/s", "100/min", "1000/day"], 10);
        let mut state = PacerState::new(&q);
        state.hold_after_unclean_stop(&q, UnixMillis(5_000));
        assert_eq!(q.decide(&state, 1, UnixMillis(5_000)), Decision::WaitUntil { at: UnixMillis(65_010), by: Hold::CoolDown });
    }

    #[test]
    fn binding_tier_is_used_at_least_99_percent_over_a_long_run() {
        for (tiers, margin) in [(&["10/s", "500/min", "1000000/day"][..], 10), (&["3/s", "1000/h"][..], 10), (&["50/s"][..], 5)] {
            let q = quota(tiers, margin);
            let span = 3_600_000;
            let sent = saturate(&q, &[1], 1_795_824_000_000, span);
            let achieved = sent.len() as f64 / (span as f64 / 1000.0);
            let utilization = achieved / q.binding_tier().rate_per_second();
            assert!(utilization >= 0.99, "{tiers:?}: utilization {utilization:.4}");
            assert!(utilization <= 1.0, "{tiers:?}: over quota {utilization:.4}");
        }
    }

    fn tier_strategy() -> impl Strategy<Value = String> {
        let rolling = prop_oneof![
            (1u64..20, 1u64..3).prop_map(|(l, s)| format!("{l}/{s}s")),
            (1u64..40, 100u64..900).prop_map(|(l, ms)| format!("{l}/{ms}ms")),
            (20u64..200).prop_map(|l| format!("{l}/min")),
        ];
        let spread = prop_oneof![4 => Just(String::new()), 1 => Just(" smooth".to_owned()), 2 => (1u64..30).prop_map(|b| format!(" burst={b}"))];
        prop_oneof![3 => (rolling, spread).prop_map(|(rate, spread)| rate + &spread), 1 => (50u64..400).prop_map(|l| format!("{l}/day"))]
    }

    /// A quota of the given tiers, one per period (later duplicates dropped).
    fn quota_of(tiers: &[String], margin: u64) -> Option<Quota> {
        let mut tiers: Vec<Tier> = tiers.iter().map(|t| t.parse().unwrap()).collect();
        let mut periods = Vec::new();
        tiers.retain(|t| {
            if periods.contains(&t.period) {
                false
            } else {
                periods.push(t.period);
                true
            }
        });
        Quota::new(tiers, chrono_tz::UTC, Duration::from_millis(margin)).ok()
    }

    /// Jobs of `costs` (in turn) offered at `start` and every `gap` after (in turn); a job
    /// told to wait is offered again at the next moment, or, with `backlog`, at the
    /// instant the pacer named plus `late_ms`. Returns what was dispatched.
    fn drive(q: &Quota, costs: &[u64], gaps: &[u64], start: u64, backlog: bool, late_ms: u64) -> Result<Vec<(UnixMillis, u64)>, TestCaseError> {
        let mut state = PacerState::new(q);
        let mut now = UnixMillis(start);
        let mut sent = Vec::new();
        for (i, gap) in gaps.iter().cycle().take(600).enumerate() {
            let cost = costs[i % costs.len()];
            match q.decide(&state, cost, now) {
                Decision::Allow => {
                    state.commit(q, cost, now);
                    sent.push((now, cost));
                    now = now.plus(Duration::from_millis(*gap));
                }
                Decision::WaitUntil { at, .. } => {
                    prop_assert!(at > now);
                    now = if backlog { at.plus(Duration::from_millis(late_ms)) } else { now.plus(Duration::from_millis(*gap)) };
                }
                Decision::Never { tier } => prop_assert!(cost > tier.max_cost()),
            }
        }
        Ok(sent)
    }

    /// As [`drive`] with a backlog, but the worker of every `miss_every`th dispatch starts
    /// too late and makes no call; its slot is given back once the pacer next decides.
    /// Returns the calls made.
    fn drive_missing(q: &Quota, costs: &[u64], gaps: &[u64], start: u64, miss_every: usize) -> Result<Vec<(UnixMillis, u64)>, TestCaseError> {
        let mut state = PacerState::new(q);
        let mut now = UnixMillis(start);
        let (mut calls, mut missed) = (Vec::new(), Vec::new());
        for (i, gap) in gaps.iter().cycle().take(600).enumerate() {
            for (at, cost) in missed.drain(..) {
                state.give_back(q, at, cost);
            }
            let cost = costs[i % costs.len()];
            match q.decide(&state, cost, now) {
                Decision::Allow => {
                    state.commit(q, cost, now);
                    if i % miss_every == 0 {
                        missed.push((now, cost));
                    } else {
                        calls.push((now, cost));
                    }
                    now = now.plus(Duration::from_millis(*gap));
                }
                Decision::WaitUntil { at, .. } => now = at,
                Decision::Never { tier } => prop_assert!(cost > tier.max_cost()),
            }
        }
        Ok(calls)
    }

    /// Checks every tier as its provider would count it: a `burst` tier as a bucket, any
    /// other rolling tier as a sliding window, a calendar tier per day.
    fn check_every_tier(q: &Quota, sent: &[(UnixMillis, u64)]) -> Result<(), TestCaseError> {
        for tier in q.tiers() {
            match (tier.period, tier.spread) {
                (Period::Rolling(window), Spread::Burst(units)) => {
                    let mut bucket = StrictBucketLimiter::new(units, tier.limit, window);
                    let refused = sent.iter().find(|(t, c)| !bucket.try_admit(*t, *c));
                    prop_assert!(refused.is_none(), "{tier}: bucket refused {refused:?}");
                }
                (Period::Rolling(window), _) => {
                    let peak = peak_in_any_window(sent, window);
                    prop_assert!(peak <= tier.limit, "{tier}: {peak} in one window");
                }
                _ => {
                    let mut per_day = std::collections::BTreeMap::<UnixMillis, u64>::new();
                    for (t, c) in sent {
                        *per_day.entry(tier.window_at(q.zone(), *t).0).or_default() += c;
                    }
                    prop_assert!(per_day.values().all(|u| *u <= tier.limit), "{tier}: {per_day:?}");
                }
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// No window of any tier, wherever it starts, ever holds more than the limit (no
        /// `burst` tier's bucket ever overflows), whatever the mix of tiers, costs,
        /// margin and the moments jobs show up: irregularly, or as a backlog whose
        /// timers fire late.
        #[test]
        fn no_window_of_any_tier_ever_admits_more_than_its_limit(
            tiers in proptest::collection::vec(tier_strategy(), 1..4),
            costs in proptest::collection::vec(1u64..4, 1..20),
            gaps in proptest::collection::vec(0u64..700, 1..50),
            margin in 0u64..20,
            start in 1_795_800_000_000u64..1_795_900_000_000,
            backlog in any::<bool>(),
            late_ms in 0u64..4,
        ) {
            let Some(q) = quota_of(&tiers, margin) else { return Ok(()) };
            let sent = drive(&q, &costs, &gaps, start, backlog, late_ms)?;
            check_every_tier(&q, &sent)?;
        }

        /// Slots given back because their worker made no call never let the calls made
        /// overfill a window of any tier, nor come closer than a strict leaky bucket at
        /// the shortest tier's rate allows.
        #[test]
        fn slots_given_back_never_let_a_window_hold_more_calls_than_its_limit(
            tiers in proptest::collection::vec(tier_strategy(), 1..4),
            costs in proptest::collection::vec(1u64..4, 1..20),
            gaps in proptest::collection::vec(0u64..700, 1..50),
            margin in 0u64..20,
            miss_every in 2usize..8,
        ) {
            let Some(q) = quota_of(&tiers, margin) else { return Ok(()) };
            let calls = drive_missing(&q, &costs, &gaps, 1_795_800_000_000, miss_every)?;
            check_every_tier(&q, &calls)?;
            let Some(spacing) = q.spacing_tier().map(|i| q.tiers()[i]) else { return Ok(()) };
            let (Period::Rolling(window), Spread::Window | Spread::Smooth) = (spacing.period, spacing.spread) else { return Ok(()) };
            let mut bucket = StrictBucketLimiter::new(1, spacing.limit, window);
            let refused = calls.iter().find(|(t, c)| !bucket.try_admit(*t, *c));
            prop_assert!(refused.is_none(), "{spacing}: refused {refused:?}");
        }

        /// Unless it has a `burst`, the shortest rolling tier spaces calls so that a
        /// strict leaky bucket at its rate (room for one call) never refuses one.
        #[test]
        fn a_strict_leaky_bucket_at_the_shortest_tiers_rate_never_refuses(
            tiers in proptest::collection::vec(tier_strategy(), 1..4),
            costs in proptest::collection::vec(1u64..4, 1..20),
            gaps in proptest::collection::vec(0u64..700, 1..50),
            margin in 0u64..20,
            backlog in any::<bool>(),
            late_ms in 0u64..4,
        ) {
            let Some(q) = quota_of(&tiers, margin) else { return Ok(()) };
            let Some(spacing) = q.spacing_tier().map(|i| q.tiers()[i]) else { return Ok(()) };
            let (Period::Rolling(window), Spread::Window | Spread::Smooth) = (spacing.period, spacing.spread) else { return Ok(()) };
            let sent = drive(&q, &costs, &gaps, 1_795_800_000_000, backlog, late_ms)?;
            let mut bucket = StrictBucketLimiter::new(1, spacing.limit, window);
            let refused = sent.iter().find(|(t, c)| !bucket.try_admit(*t, *c));
            prop_assert!(refused.is_none(), "{spacing}: refused {refused:?}");
        }
    }
}
