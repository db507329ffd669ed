//! The shared quota's rolling tiers divided among a stack's shards where the work is: a
//! book of parts (one item in the state store) that each shard's run reads and writes
//! back every second, reporting what it could use and taking or giving parts by it.
//!
//! The whole quota is [`ShareBook::parts`] parts (its smallest rolling limit, so a part
//! is at least one unit of every rolling tier); a shard holding `p` parts paces each
//! rolling tier under `limit × p / parts` ([`quota_of_parts`]). Parts move so that no
//! window of any tier holds more than the whole across the shards:
//! - a shard gives parts up only by lowering its own share first, and a part given up is
//!   usable by another shard once the calls it decided before (their slots up to its
//!   dispatch-ahead later) have left every window of the longest rolling tier (plus
//!   [`CLOCK_SKEW`]): a window that starts before the change holds at most the old
//!   shares, one that starts after it at most the new ones;
//! - a shard takes parts only once they are usable, and uses them once its write landed;
//! - a shard uses its parts only until [`ShareTiming::valid_for`] after its last report
//!   that landed; parts of a shard not heard of for that long plus that wait are taken
//!   back ("reclaimed") for the others, as a lease runs out;
//! - a shard whose run ends with nothing left to do leaves the book: its parts are free
//!   after the same wait, and it no longer counts as running.
//!
//!
//! The calendar tiers (day, month) are not in the book: every shard paces under their
//! whole limits and reserves their units a block at a time from one counter for the
//! stack ([`crate::ports::StackDocuments::reserve_shared`]), which never passes a limit.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::quota::{Period, Quota, Spread, Tier};
use crate::time::UnixMillis;

/// What the shards' clocks may differ by, beyond the window a given-up part waits out.
pub const CLOCK_SKEW: Duration = Duration::from_millis(250);

/// How often a shard's run reports to the book (and takes or gives parts).
pub const REPORT_EVERY: Duration = Duration::from_secs(1);

/// The fewest parts a shard gives up at once, as a fraction of the whole: a part that
/// moves is unused for a while (see [`ShareTiming`]), so shares a little off their
/// targets stay as they are.
const LEAST_MOVE_OF_WHOLE: u64 = 200;

/// A running shard's least demand, as a fraction of an even share: a shard whose lanes
/// are idle keeps a sliver, so that a job that comes goes at once (at that pace) while
/// the shard asks for more.
const FLOOR_OF_EVEN_SHARE: u64 = 100;

/// The running shards' weights count as even while the heaviest is at most this many
/// times the lightest: their lanes' paces then differ by a fifth at most (Jain's index
/// among them 0.99 or more).
const WEIGHTS_EVEN_WITHIN: f64 = 1.2;

/// The times the book's rules are measured in, from the quota and the lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShareTiming {
    /// The longest rolling window of the shared quota.
    pub window: Duration,
    /// How far ahead of a decision its call's slot may be (the shards' dispatch-ahead):
    /// calls decided under a share go until this long after it was lowered.
    pub ahead: Duration,
    /// How long after its last report that landed a shard may use its parts (the
    /// lease's own validity: a run that cannot write for that long has lost its lease).
    pub valid_for: Duration,
}

impl ShareTiming {
    /// How long a part given up at `now` waits before another shard may use it: until
    /// the calls decided before have gone and left every window.
    pub fn wait_before_reuse(&self) -> Duration {
        self.ahead + self.window + CLOCK_SKEW
    }
}

/// One shard's line in the book.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holding {
    /// The parts this shard holds.
    pub parts: u64,
    /// What it last said it could use, in parts.
    pub demand: u64,
    /// When its last report landed.
    pub seen: UnixMillis,
    /// The weight of the lanes it holds jobs of, in thousandths of a lane of weight 1
    /// (at least 1): the parts that do not cover every demand go by it. A book written
    /// before weights: each shard one lane's.
    #[serde(default = "unit_weight")]
    pub weight: u64,
}

/// A shard's weight in the book when it says none: one lane of weight 1.
pub const UNIT_WEIGHT: u64 = 1_000;

fn unit_weight() -> u64 {
    UNIT_WEIGHT
}

/// Parts given up, usable by any shard from `usable_at`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Freed {
    pub parts: u64,
    pub usable_at: UnixMillis,
}

/// The division of the shared quota's rolling tiers among a stack's shards.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareBook {
    /// The whole quota in parts.
    pub parts: u64,
    /// Each shard's line, by index.
    pub held: Vec<Holding>,
    /// Parts no shard holds, oldest first.
    pub free: Vec<Freed>,
}

/// What a report gave the shard that made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The parts it held before the report.
    pub before: u64,
    /// The parts it holds once the report is written.
    pub parts: u64,
}

impl Grant {
    /// What the shard may use while the report is being written: the lower of the two
    /// (a share is lowered before the write, raised once it landed).
    #[must_use]
    pub fn while_writing(&self) -> u64 {
        self.before.min(self.parts)
    }
}

impl ShareBook {
    /// The book a stack of `shards` starts with, at `now`: every shard holding an even
    /// share, as each did before shares moved ([`Quota::share`]'s division).
    #[must_use]
    pub fn even(parts: u64, shards: usize, now: UnixMillis) -> Self {
        let count = shards.max(1) as u64;
        let held =
            (0..count).map(|index| Holding { parts: parts / count + u64::from(index < parts % count), demand: 0, seen: now, weight: UNIT_WEIGHT }).collect();
        Self { parts, held, free: Vec::new() }
    }

    /// The book of a stack whose shards changed in number, at `now`: no shard holds a
    /// part and all are usable one window on (runs of the old layout may have used any
    /// of them until a moment ago).
    #[must_use]
    pub fn after_new_layout(parts: u64, shards: usize, now: UnixMillis, timing: &ShareTiming) -> Self {
        let held = (0..shards.max(1)).map(|_| Holding { parts: 0, demand: 0, seen: now, weight: UNIT_WEIGHT }).collect();
        Self { parts, held, free: vec![Freed { parts, usable_at: now.plus(timing.wait_before_reuse()) }] }
    }

    /// Whether this book divides a quota of `parts` among `shards`.
    #[must_use]
    pub fn fits(&self, parts: u64, shards: usize) -> bool {
        self.parts == parts && self.held.len() == shards.max(1)
    }

    /// Shard `shard` reports at `now` that it could use `demand` parts: the book takes
    /// back the parts of shards not heard of, then this shard gives up what others want
    /// and it does not need, or takes what it wants of the usable free parts.
    ///
    /// # Panics
    /// A shard index outside the book.
    pub fn report(&mut self, shard: usize, demand: u64, now: UnixMillis, timing: &ShareTiming) -> Grant {
        self.report_as(shard, demand, false, now, timing)
    }

    /// [`Self::report`] of a shard whose weight still grows (the first jobs of its lanes
    /// coming into hand): it gives up no part it could use. Weighed by the few lanes it
    /// held so far, it would give up parts no shard may use for a window: at 40,000
    /// calls/s over 4 shards by a Zipf law, two shards whose lines start with their
    /// heaviest lanes' jobs gave up 6,017 parts of 40,000 a second in, unused for the
    /// next 3.25 s.
    ///
    /// # Panics
    /// A shard index outside the book.
    pub fn report_while_weighing(&mut self, shard: usize, demand: u64, now: UnixMillis, timing: &ShareTiming) -> Grant {
        self.report_as(shard, demand, true, now, timing)
    }

    fn report_as(&mut self, shard: usize, demand: u64, keeps_what_it_can_use: bool, now: UnixMillis, timing: &ShareTiming) -> Grant {
        let before = self.held[shard].parts;
        self.held[shard].demand = demand.min(self.parts);
        self.held[shard].seen = now;
        self.reclaim_silent(now, timing);
        self.merge_usable(now);
        let targets = self.targets(now, timing);
        let mine = self.held[shard].parts;
        let can_use = self.held[shard].demand;
        let target = if keeps_what_it_can_use { targets[shard].max(can_use.min(mine)) } else { targets[shard] };
        if mine > target {
            let wanted_elsewhere: u64 = (0..self.held.len()).filter(|k| *k != shard).map(|k| targets[k].saturating_sub(self.held[k].parts)).sum();
            let already_free: u64 = self.free.iter().map(|f| f.parts).sum();
            let give = (mine - target).min(wanted_elsewhere.saturating_sub(already_free));
            if give > 0 && give >= (self.parts / LEAST_MOVE_OF_WHOLE).max(1) {
                self.held[shard].parts -= give;
                self.free.push(Freed { parts: give, usable_at: now.plus(timing.wait_before_reuse()) });
            }
        } else if mine < target {
            let take = (target - mine).min(self.usable(now));
            self.take_usable(take, now);
            self.held[shard].parts += take;
        }
        Grant { before, parts: self.held[shard].parts }
    }

    /// Shard `shard`, whose run ended with nothing left to do at `now`, leaves the book:
    /// its parts free once the calls it decided have left every window, and it no longer
    /// counts as running (its floor goes to the others) until it reports again.
    pub fn leave(&mut self, shard: usize, now: UnixMillis, timing: &ShareTiming) {
        let holding = &mut self.held[shard];
        if holding.parts > 0 {
            self.free.push(Freed { parts: holding.parts, usable_at: now.plus(timing.wait_before_reuse()) });
        }
        *holding = Holding { parts: 0, demand: 0, seen: UnixMillis(0), weight: UNIT_WEIGHT };
    }

    /// Free parts usable at `now`.
    #[must_use]
    pub fn usable(&self, now: UnixMillis) -> u64 {
        self.free.iter().filter(|f| f.usable_at <= now).map(|f| f.parts).sum()
    }

    /// Whether shard `shard` was heard of recently enough at `now` to be counted as running.
    fn is_running(&self, shard: usize, now: UnixMillis, timing: &ShareTiming) -> bool {
        now < self.held[shard].seen.plus(timing.valid_for)
    }

    /// The parts of each shard not heard of for [`ShareTiming::valid_for`] and a window
    /// since go back to the free parts, usable at once: the shard stopped using them at
    /// the first, and its last calls' windows ended by the second.
    fn reclaim_silent(&mut self, now: UnixMillis, timing: &ShareTiming) {
        for holding in &mut self.held {
            if holding.parts > 0 && now >= holding.seen.plus(timing.valid_for).plus(timing.wait_before_reuse()) {
                self.free.push(Freed { parts: holding.parts, usable_at: now });
                holding.parts = 0;
                holding.demand = 0;
            }
        }
    }

    /// The free parts usable at `now` in one entry, so the book stays a few entries long.
    fn merge_usable(&mut self, now: UnixMillis) {
        let usable = self.usable(now);
        self.free.retain(|f| f.usable_at > now);
        if usable > 0 {
            self.free.insert(0, Freed { parts: usable, usable_at: now });
        }
    }

    fn take_usable(&mut self, mut parts: u64, now: UnixMillis) {
        for freed in self.free.iter_mut().filter(|f| f.usable_at <= now) {
            let taken = freed.parts.min(parts);
            freed.parts -= taken;
            parts -= taken;
        }
        self.free.retain(|f| f.parts > 0);
    }

    /// What each shard should hold: the parts not held by silent shards, filled up to
    /// each running shard's demand (at least a sliver of an even share) lowest first,
    /// the demands that do not fit given equal parts of what is left (water-filling).
    /// A silent shard keeps what it holds until it is reclaimed.
    fn targets(&self, now: UnixMillis, timing: &ShareTiming) -> Vec<u64> {
        let count = self.held.len() as u64;
        let floor = (self.parts / count / FLOOR_OF_EVEN_SHARE).max(1);
        let running: Vec<usize> = (0..self.held.len()).filter(|k| self.is_running(*k, now, timing)).collect();
        let mut targets: Vec<u64> = self.held.iter().map(|h| h.parts).collect();
        let silent: u64 = (0..self.held.len()).filter(|k| !running.contains(k)).map(|k| self.held[k].parts).sum();
        let mut pool = self.parts - silent;
        // Water-filling by weight: the shards that want least for their weight are
        // served first, each at most its weight's part of what is left. Weights close
        // to even count as even: moving parts costs the gaining shard a window's wait
        // for them, more than the fairness it buys there.
        let weights = running.iter().map(|k| self.held[*k].weight.max(1));
        let (lightest, heaviest) = (weights.clone().min().unwrap_or(1), weights.max().unwrap_or(1));
        let by_weight = heaviest as f64 > lightest as f64 * WEIGHTS_EVEN_WITHIN;
        let weight = |k: usize| if by_weight { u128::from(self.held[k].weight.max(1)) } else { 1 };
        let mut by_need: Vec<(u64, usize)> = running.iter().map(|k| (self.held[*k].demand.max(floor), *k)).collect();
        by_need.sort_unstable_by(|(a, j), (b, k)| (u128::from(*a) * weight(*k)).cmp(&(u128::from(*b) * weight(*j))).then(j.cmp(k)));
        let mut weight_left: u128 = by_need.iter().map(|(_, k)| weight(*k)).sum();
        for (demand, shard) in by_need {
            let fair = u64::try_from(u128::from(pool) * weight(shard) / weight_left).unwrap_or(pool);
            targets[shard] = demand.min(fair);
            pool -= targets[shard];
            weight_left -= weight(shard);
        }
        targets
    }

    /// Shard `shard` holds jobs of lanes weighing `weight` in all (thousandths of a lane
    /// of weight 1): its next report is weighed by it.
    ///
    /// # Panics
    /// A shard index outside the book.
    pub fn weigh(&mut self, shard: usize, weight: u64) {
        self.held[shard].weight = weight.max(1);
    }
}

/// How many parts a quota is divided into: its smallest rolling limit (or `burst`
/// bucket), so that a part is at least one unit of every rolling tier and bucket; `None`
/// for a quota without rolling tiers (nothing to move).
#[must_use]
pub fn parts_of(whole: &Quota) -> Option<u64> {
    let rolling = whole.tiers().iter().filter(|t| matches!(t.period, Period::Rolling(_)));
    rolling
        .flat_map(|t| match t.spread {
            Spread::Burst(bucket) => vec![t.limit, bucket],
            Spread::Window | Spread::Smooth => vec![t.limit],
        })
        .min()
}

/// The longest rolling window of a quota (zero without one).
#[must_use]
pub fn longest_window(whole: &Quota) -> Duration {
    whole
        .tiers()
        .iter()
        .filter_map(|t| match t.period {
            Period::Rolling(window) => Some(window),
            Period::Day | Period::Month => None,
        })
        .max()
        .unwrap_or_default()
}

/// The quota a shard holding `held` of `parts` paces under: each rolling tier of `whole`
/// (and a `burst` tier's bucket) scaled down, rounded down, and its calendar tiers whole
/// (the shards reserve them from one counter), its spacing kept on average
/// ([`Quota::strict_gaps`]: the shards' calls interleave). `None` when it holds nothing:
/// it may not call at all.
#[must_use]
pub fn quota_of_parts(whole: &Quota, held: u64, parts: u64) -> Option<Quota> {
    if held == 0 || parts == 0 {
        return None;
    }
    let scaled = |units: u64| u64::try_from(u128::from(units) * u128::from(held.min(parts)) / u128::from(parts)).unwrap_or(units);
    let tiers = whole
        .tiers()
        .iter()
        .map(|tier| match tier.period {
            Period::Rolling(_) => {
                let spread = match tier.spread {
                    Spread::Burst(bucket) => Spread::Burst(scaled(bucket)),
                    other => other,
                };
                Tier { limit: scaled(tier.limit), spread, ..*tier }
            }
            Period::Day | Period::Month => *tier,
        })
        .collect();
    Some(whole.with_tiers(tiers).with_gaps_on_average())
}

/// Shard `index` of `count`'s even share of `whole` ([`Quota::share`]), and, where its
/// share moves (a stack of shards, a quota with rolling tiers), the most it may pace
/// under: the whole quota (the share book says how much of its rolling tiers it holds).
///
/// # Errors
/// A rolling tier too small for every shard to have a unit of it, named.
pub fn shard_quota(whole: &Quota, index: usize, count: usize) -> Result<(Quota, Option<Quota>), String> {
    let even = whole.share(index, count)?;
    let most = parts_of(whole).filter(|_| count > 1).and_then(|parts| quota_of_parts(whole, parts, parts));
    Ok((even, most))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const TIMING: ShareTiming = ShareTiming { window: Duration::from_secs(1), ahead: Duration::from_millis(900), valid_for: Duration::from_secs(24) };

    fn at(ms: u64) -> UnixMillis {
        UnixMillis(ms)
    }

    fn held(book: &ShareBook) -> Vec<u64> {
        book.held.iter().map(|h| h.parts).collect()
    }

    /// The parts are never more nor fewer than the whole: held and free add up to it.
    fn assert_whole(book: &ShareBook) {
        assert_eq!(book.held.iter().map(|h| h.parts).sum::<u64>() + book.free.iter().map(|f| f.parts).sum::<u64>(), book.parts, "{book:?}");
    }

    #[test]
    fn a_busy_shard_takes_what_an_idle_one_gives_up_once_its_calls_left_every_window() {
        let mut book = ShareBook::even(1_000, 2, at(0));
        // Shard 0 is busy (it could use the whole), shard 1 idle (it used nothing).
        assert_eq!(book.report(0, 1_000, at(1_000), &TIMING), Grant { before: 500, parts: 500 }, "nothing free yet");
        let given = book.report(1, 0, at(1_100), &TIMING);
        assert_eq!(given, Grant { before: 500, parts: 5 }, "the idle shard keeps a hundredth of an even share");
        assert_eq!(given.while_writing(), 5, "and lowers itself before its write");
        // Its calls decided until now go up to 900 ms later, and leave the window a second
        // after that; and the clocks may differ by 250 ms.
        assert_eq!(book.free, vec![Freed { parts: 495, usable_at: at(1_100 + 900 + 1_000 + 250) }]);
        assert_eq!(book.report(0, 1_000, at(3_249), &TIMING).parts, 500, "not usable a millisecond early");
        let taken = book.report(0, 1_000, at(3_250), &TIMING);
        assert_eq!(taken, Grant { before: 500, parts: 995 });
        assert_eq!(taken.while_writing(), 500, "raised only once its write landed");
        assert_whole(&book);
    }

    /// A shard whose weight still grows gives up no part it could use: weighed by the
    /// few lanes it held so far, it would give parts that no shard may use for a window.
    /// What it cannot use it gives up as any shard does.
    #[test]
    fn a_shard_still_weighing_its_lanes_gives_up_only_the_parts_it_cannot_use() {
        let mut book = ShareBook::even(1_000, 2, at(0));
        book.weigh(0, 3 * UNIT_WEIGHT);
        book.report(0, 1_000, at(1_000), &TIMING);
        book.weigh(1, UNIT_WEIGHT);
        let weighed = |report: fn(&mut ShareBook, usize, u64, UnixMillis, &ShareTiming) -> Grant, demand: u64| {
            let mut book = book.clone();
            let grant = report(&mut book, 1, demand, at(1_010), &TIMING);
            assert_whole(&book);
            grant.parts
        };
        assert_eq!(weighed(ShareBook::report, 1_000), 250, "weighed a lane against three: a quarter");
        assert_eq!(weighed(ShareBook::report_while_weighing, 1_000), 500, "still weighing, it keeps what it can use");
        assert_eq!(weighed(ShareBook::report_while_weighing, 400), 400, "and gives up what it cannot");
        assert_eq!(weighed(ShareBook::report_while_weighing, 100), weighed(ShareBook::report, 100), "below its weight's part, as any shard");
    }

    #[test]
    fn two_busy_shards_end_with_even_shares_and_a_shard_that_needs_less_keeps_what_it_needs() {
        let mut book = ShareBook::even(900, 3, at(0));
        for second in 1..10 {
            book.report(0, 900, at(second * 1_000), &TIMING);
            book.report(1, 900, at(second * 1_000 + 10), &TIMING);
            book.report(2, 100, at(second * 1_000 + 20), &TIMING);
        }
        assert_eq!(held(&book), vec![400, 400, 100]);
        assert_whole(&book);
    }

    /// Four busy shards holding jobs of 4, 3, 3 and 2 lanes end with the parts by their
    /// lanes (a lane on the shard of two went twice as fast as one on the shard of four
    /// when they were divided evenly: Jain's index 0.96 among the twelve); 26, 24, 25
    /// and 25 lanes (within a fifth of each other) keep even shares, which costs no wait
    /// for parts moving.
    #[test]
    fn busy_shards_divide_the_parts_by_the_weight_of_their_lanes_unless_it_is_close_to_even() {
        let settle = |weights: [u64; 4]| {
            let mut book = ShareBook::even(1_200, 4, at(0));
            for second in 1..10 {
                for (shard, weight) in weights.iter().enumerate() {
                    book.weigh(shard, weight * UNIT_WEIGHT);
                    book.report(shard, 1_200, at(second * 1_000 + shard as u64 * 10), &TIMING);
                }
            }
            assert_whole(&book);
            held(&book)
        };
        assert_eq!(settle([4, 3, 3, 2]), vec![400, 300, 300, 200]);
        assert_eq!(settle([26, 24, 25, 25]), vec![300, 300, 300, 300]);
    }

    #[test]
    fn nothing_moves_while_every_shard_has_what_it_could_use() {
        let mut book = ShareBook::even(1_000, 2, at(0));
        book.report(0, 100, at(1_000), &TIMING);
        book.report(1, 200, at(1_010), &TIMING);
        assert_eq!((held(&book), book.free.clone()), (vec![500, 500], Vec::new()), "no one wants more: nothing is given up");
    }

    #[test]
    fn a_silent_shard_keeps_its_parts_until_its_reports_could_no_longer_be_valid_and_a_window_passed() {
        let mut book = ShareBook::even(1_000, 2, at(0));
        book.report(1, 1_000, at(0), &TIMING);
        // Shard 1 is never heard of again (its run crashed at 0).
        let reclaim_at = 24_000 + 900 + 1_000 + 250;
        assert_eq!(book.report(0, 1_000, at(reclaim_at - 1), &TIMING).parts, 500);
        assert_eq!(book.report(0, 1_000, at(reclaim_at), &TIMING).parts, 1_000, "its parts came back, usable at once");
        assert_eq!(held(&book), vec![1_000, 0]);
        // Its next run starts with nothing, keeps the floor's demand and asks: shard 0
        // gives up half, usable a window later.
        assert_eq!(book.report(1, 1_000, at(30_000), &TIMING).parts, 0);
        book.report(0, 1_000, at(30_500), &TIMING);
        assert_eq!(book.report(1, 1_000, at(30_500 + 2_150), &TIMING).parts, 500);
        assert_whole(&book);
    }

    #[test]
    fn a_new_layout_starts_with_every_part_free_one_window_on() {
        let mut book = ShareBook::after_new_layout(300, 3, at(5_000), &TIMING);
        assert!(book.fits(300, 3) && !book.fits(300, 2) && !book.fits(301, 3));
        assert_eq!(book.report(0, 300, at(5_000), &TIMING).parts, 0);
        assert_eq!(book.report(0, 300, at(7_150), &TIMING).parts, 298, "all but the floor of the two others, idle");
        assert_whole(&book);
    }

    #[test]
    fn a_shard_s_quota_scales_each_rolling_tier_and_keeps_the_calendar_tiers_whole() {
        let tier = |text: &str| text.parse::<Tier>().unwrap();
        let whole = Quota::new(vec![tier("100/s"), tier("3000/min"), tier("100000/day")], chrono_tz::UTC, Duration::ZERO).unwrap();
        assert_eq!(parts_of(&whole), Some(100));
        assert_eq!(longest_window(&whole), Duration::from_secs(60));
        let quarter = quota_of_parts(&whole, 25, 100).unwrap();
        let limits: Vec<u64> = quarter.tiers().iter().map(|t| t.limit).collect();
        assert_eq!(limits, vec![25, 750, 100_000]);
        let sliver: Vec<u64> = quota_of_parts(&whole, 1, 100).unwrap().tiers().iter().map(|t| t.limit).collect();
        assert_eq!(sliver, vec![1, 30, 100_000]);
        assert_eq!(quota_of_parts(&whole, 0, 100), None, "no parts, no calls");
        let calendar_only = Quota::new(vec![tier("1000/day")], chrono_tz::UTC, Duration::ZERO).unwrap();
        assert_eq!(parts_of(&calendar_only), None);
    }

    /// One shard's use of its parts over time, as its run sees it: lowered to what it
    /// holds while its report is written, raised once it landed, none once its last
    /// landed report is too old.
    #[derive(Default)]
    struct Usage {
        /// (from, parts), in time order.
        steps: Vec<(u64, u64)>,
    }

    impl Usage {
        fn set(&mut self, from: u64, parts: u64) {
            self.steps.push((from, parts));
        }

        /// The most parts in use at any instant of [from, to].
        fn most_within(&self, from: u64, to: u64) -> u64 {
            let mut most = 0;
            let mut current = 0;
            for &(at, parts) in &self.steps {
                if at <= from {
                    current = parts;
                } else if at <= to {
                    most = most.max(current);
                    current = parts;
                }
            }
            most.max(current)
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Shards report at random moments with random demands, and some leave the book
        /// (their run ended); some writes are lost (the book is not written, the shard
        /// lowered itself, or stopped, anyway) and some shards go silent. No window of
        /// the tier ever holds more than the whole across the shards: a call at `t` was
        /// decided under the share its shard held at some instant of `[t - ahead, t]`, so
        /// a window's calls under a shard's share are at most its largest share from
        /// `ahead` before the window to its end.
        #[test]
        fn no_window_ever_holds_more_than_the_whole_across_the_shards(
            shards in 2usize..5,
            reports in proptest::collection::vec(
                (0usize..4, 0u64..1_200, prop_oneof![1u64..700, 1u64..30_000], any::<bool>(), proptest::bool::weighted(0.1)),
                1..120,
            ),
        ) {
            let parts = 1_000;
            let mut book = ShareBook::even(parts, shards, UnixMillis(0));
            let mut usage: Vec<Usage> = (0..shards).map(|_| Usage::default()).collect();
            for (u, holding) in usage.iter_mut().zip(&book.held) {
                u.set(0, holding.parts);
            }
            let mut landed_at = vec![0u64; shards];
            let mut now = 0;
            for (shard, demand, gap, lost, leaves) in reports {
                let shard = shard % shards;
                now += gap;
                // A shard whose last landed report is too old stopped using its parts.
                for k in 0..shards {
                    let expiry = landed_at[k] + TIMING.valid_for.as_millis() as u64;
                    if expiry <= now && usage[k].steps.last().is_some_and(|s| s.1 > 0 && s.0 < expiry) {
                        usage[k].set(expiry, 0);
                    }
                }
                let mut written = book.clone();
                if leaves {
                    written.leave(shard, UnixMillis(now), &TIMING);
                    usage[shard].set(now, 0);
                    if !lost {
                        book = written;
                    }
                    assert_whole(&book);
                    continue;
                }
                let grant = written.report(shard, demand, UnixMillis(now), &TIMING);
                // Lowered before the write (to the grant, or less if a write was lost).
                let in_use_before = usage[shard].steps.last().map_or(0, |s| s.1);
                usage[shard].set(now, in_use_before.min(grant.parts));
                if !lost {
                    book = written;
                    landed_at[shard] = now;
                    usage[shard].set(now + 1, grant.parts);
                }
                assert_whole(&book);
            }
            let (window, ahead) = (TIMING.window.as_millis() as u64, TIMING.ahead.as_millis() as u64);
            for start in (0..now + window).step_by(50) {
                let in_window: u64 = usage.iter().map(|u| u.most_within(start.saturating_sub(ahead), start + window)).sum();
                prop_assert!(in_window <= parts, "window from {start} ms holds {in_window} parts of {parts}");
            }
        }
    }
}
