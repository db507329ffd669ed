//! A shard's run under the parts of the shared quota the share book gives it
//! (`paceline_shared::shares`), pure: what it could use (its demand), the book it writes
//! back after each read, and the parts it paces under meanwhile: lowered before the
//! write, raised once the write landed, none once no report landed for the lease's
//! validity.

use std::time::Duration;

use paceline_shared::quota::Quota;
use paceline_shared::shares::{parts_of, quota_of_parts, Grant, ShareBook, ShareTiming, REPORT_EVERY, UNIT_WEIGHT};
use paceline_shared::time::UnixMillis;
use tracing::{debug, info};

use crate::settings::Settings;

/// A shard asks for this much more than it used since its last report, so that a shard
/// whose pace grows is not held at its last one.
const HEADROOM: f64 = 1.25;

/// A shard that used this much of its share's pace since its last report could use more
/// (it asks for every part), whatever held its lanes: a shard held by its share at the
/// dispatch-ahead's slack (the shared quota never refused it outright) asks as one
/// refused does.
const SATURATED: f64 = 0.9;

/// A report being written: the grant it asks, when it was made, the shared units spent
/// by then, whether a lane had been held back, and the weight it gave the shard.
#[derive(Debug)]
struct Writing {
    grant: Grant,
    made_at: UnixMillis,
    spent: u64,
    held_back: bool,
    weight: u64,
}

/// The run's share of the shared quota's rolling tiers.
#[derive(Debug)]
pub(crate) struct ShareRun {
    /// The most this shard may pace under (every part): the whole rolling tiers and its
    /// even share of the calendar ones.
    most: Quota,
    parts: u64,
    shard: usize,
    shards: usize,
    timing: ShareTiming,
    /// The parts paced under now.
    held: u64,
    /// Until when they may be: the lease's validity after the last report that landed.
    valid_until: UnixMillis,
    /// The report being written.
    writing: Option<Writing>,
    /// When the last report that landed was made, and the shared units spent by then:
    /// the shard's pace is measured from it.
    last_report: (UnixMillis, u64),
    /// The shared quota held a lane back since the last report: the shard could use more.
    held_back: bool,
    /// The weight of the lanes the shard holds jobs of, in the book's thousandths.
    weight: u64,
    /// The weight the run's last report that landed gave the shard; `None` until one
    /// lands, while the run asks for what the shard's last run said it could use (it has
    /// no pace of its own yet).
    weight_reported: Option<u64>,
    /// Until when a report whose weight grew since the last that landed keeps the parts
    /// the shard can use (see [`Self::still_weighing`]).
    weighs_until: UnixMillis,
}

impl ShareRun {
    /// The run's shares in a stack of shards whose shares move, if `settings` says so
    /// and its quota has rolling tiers; it holds nothing until its first report landed.
    pub fn for_settings(settings: &Settings, lease_valid_for: Duration, started: UnixMillis) -> Option<Self> {
        let most = settings.share_most.as_ref().filter(|_| settings.shard.of > 1)?;
        let parts = parts_of(most)?;
        let window = paceline_shared::shares::longest_window(most);
        let timing = ShareTiming { window, ahead: settings.furthest_ahead(), valid_for: lease_valid_for };
        Some(Self {
            most: most.clone(),
            parts,
            shard: settings.shard.index,
            shards: settings.shard.of,
            weighs_until: started.plus(timing.wait_before_reuse()),
            timing,
            held: 0,
            valid_until: started,
            writing: None,
            last_report: (started, 0),
            held_back: false,
            weight: UNIT_WEIGHT,
            weight_reported: None,
        })
    }

    /// The quota the shard paces under now; `None` while it holds no part.
    pub fn quota(&self) -> Option<Quota> {
        quota_of_parts(&self.most, self.held, self.parts)
    }

    /// The shared quota held a lane back: the shard could use more than it holds.
    pub fn held_back(&mut self) {
        self.held_back = true;
    }

    /// When the next report is due after one made at `now`.
    pub fn next_report(now: UnixMillis) -> UnixMillis {
        now.plus(REPORT_EVERY)
    }

    /// Until when the parts held may be used.
    pub fn valid_until(&self) -> UnixMillis {
        self.valid_until
    }

    /// What the shard could use, in parts, having spent `spent` shared units in the run
    /// by `now`: every part when the shared quota held a lane back since the last report
    /// or the shard used most of its share's pace, else its pace since then with some
    /// headroom.
    fn demand(&self, spent: u64, now: UnixMillis) -> u64 {
        let (at, spent_then) = self.last_report;
        let seconds = now.since(at).as_secs_f64().max(0.001);
        let pace = spent.saturating_sub(spent_then) as f64 / seconds;
        let whole = self.most.sustained_per_second();
        let held = self.quota().map_or(0.0, |share| share.sustained_per_second());
        if self.held_back || (held > 0.0 && pace >= held * SATURATED) || !whole.is_finite() || whole <= 0.0 {
            return self.parts;
        }
        ((pace * HEADROOM / whole) * self.parts as f64).ceil().min(self.parts as f64) as u64
    }

    /// The shard holds jobs of lanes of `lanes_weight` in all (their `weight`s): its next
    /// reports are weighed by it (one lane's at least), so that the parts no demand
    /// leaves go to the shards by their lanes, not evenly by shard.
    pub fn weigh(&mut self, lanes_weight: f64) {
        let thousandths = (lanes_weight * UNIT_WEIGHT as f64).round();
        self.weight = if thousandths.is_finite() && thousandths >= UNIT_WEIGHT as f64 { thousandths as u64 } else { UNIT_WEIGHT };
    }

    /// The book read at `now` (`None`: none yet; or one of another layout): reports to it
    /// and gives the book to write over the version read. The parts paced under are
    /// lowered to the grant at once, before the write.
    pub fn report(&mut self, read: Option<(ShareBook, u64)>, spent: u64, now: UnixMillis) -> (ShareBook, Option<u64>) {
        let (mut book, version) = match read {
            Some((book, version)) if book.fits(self.parts, self.shards) => (book, Some(version)),
            Some((_, version)) => {
                info!(shards = self.shards, "the share book is of another layout or quota: a new one, every part free one window on");
                (ShareBook::after_new_layout(self.parts, self.shards, now, &self.timing), Some(version))
            }
            None => (ShareBook::even(self.parts, self.shards, now), None),
        };
        let mut demand = self.demand(spent, now);
        if self.weight_reported.is_none() {
            // A run that goes on from the last (a relay, the next kick) keeps its share:
            // asking for its own pace so far (none) would give it up for a window.
            demand = demand.max(book.held.get(self.shard).map_or(0, |holding| holding.demand));
        }
        book.weigh(self.shard, self.weight);
        let grant = if self.still_weighing(now) {
            book.report_while_weighing(self.shard, demand, now, &self.timing)
        } else {
            book.report(self.shard, demand, now, &self.timing)
        };
        self.held = self.held.min(grant.parts);
        self.writing = Some(Writing { grant, made_at: now, spent, held_back: std::mem::take(&mut self.held_back), weight: self.weight });
        (book, version)
    }

    /// Whether the shard's weight may still be growing at `now`: in the run's first
    /// [`ShareTiming::wait_before_reuse`], before its first report landed or while each
    /// weighs it more than the last that landed (a report made again after a lost write
    /// is measured against the one before). A run's first lanes in hand follow its
    /// line's order, not the lanes the line holds; weighed by them, a shard gives up
    /// parts that no shard may use for as long (see `ShareBook::report_while_weighing`).
    fn still_weighing(&self, now: UnixMillis) -> bool {
        now < self.weighs_until && self.weight_reported.is_none_or(|reported| self.weight > reported)
    }

    /// The report's write landed (`true`) or lost to another shard's (`false`): the grant
    /// is the shard's until the lease's validity from when the report was made. `true`
    /// when the parts paced under changed.
    pub fn written(&mut self, landed: bool) -> bool {
        let Some(Writing { grant, made_at, spent, held_back, weight }) = self.writing.take() else { return false };
        if !landed {
            // The next report, soon, measures the pace from the last that landed (over
            // the few milliseconds since this one, it would be anything) and says again
            // that a lane was held back.
            self.held_back |= held_back;
            return false;
        }
        self.last_report = (made_at, spent);
        self.weight_reported = Some(weight);
        self.valid_until = made_at.plus(self.timing.valid_for);
        let before = self.held;
        self.held = grant.parts;
        if before != self.held {
            debug!(parts = self.held, of = self.parts, "the shard's share of the shared quota moved");
        }
        before != self.held
    }

    /// The book `read` at `now` with this shard gone from it, its run over with nothing
    /// left to do (see `ShareBook::leave`): the book to write over the version read;
    /// `None` when there is no book of this layout to leave.
    pub fn leave(&self, read: Option<(ShareBook, u64)>, now: UnixMillis) -> Option<(ShareBook, u64)> {
        let (mut book, version) = read.filter(|(book, _)| book.fits(self.parts, self.shards))?;
        book.leave(self.shard, now, &self.timing);
        Some((book, version))
    }

    /// The write failed: the report is over, the parts stay as lowered.
    pub fn write_failed(&mut self) {
        if let Some(Writing { held_back, .. }) = self.writing.take() {
            self.held_back |= held_back;
        }
    }

    /// No report landed for the lease's validity: the shard holds nothing from `now`.
    /// `true` when it held any.
    pub fn expire(&mut self, now: UnixMillis) -> bool {
        if now < self.valid_until || self.held == 0 {
            return false;
        }
        self.held = 0;
        true
    }
}

#[cfg(test)]
mod tests {
    use paceline_shared::config::WorkerHost;
    use paceline_shared::keys::Shard;
    use paceline_shared::quota::{chrono_tz, Tier};

    use super::*;

    fn settings(shard: usize) -> Settings {
        let quota = Quota::new(vec!["100/s".parse::<Tier>().unwrap()], chrono_tz::UTC, Duration::ZERO).unwrap();
        let mut settings = Settings::defaults_for(quota.share(shard, 2).unwrap(), WorkerHost::Lambda);
        settings.shard = Shard { index: shard, of: 2 };
        settings.share_most = Some(quota);
        settings
    }

    /// The shared 100/s as the run paces it now (`None`: no call may go).
    fn pace(run: &ShareRun) -> Option<u64> {
        run.quota().map(|quota| quota.tiers()[0].limit)
    }

    /// A run's reports keep the parts the shard can use while its weight grows in the
    /// run's first wait before a part given up may be used again (its lanes' first jobs
    /// coming into hand), and divide by weight as the book says once it stops growing or
    /// that time is over. A report made again after a lost write is measured against the
    /// last that landed.
    #[test]
    fn a_run_keeps_its_parts_while_its_weight_grows_in_its_first_seconds() {
        let valid_for = Duration::from_secs(24);
        let mut book = ShareBook::even(100, 2, UnixMillis(0));
        book.weigh(1, 3 * UNIT_WEIGHT);
        book.report(1, 100, UnixMillis(0), &ShareTiming { window: Duration::from_secs(1), ahead: Duration::ZERO, valid_for });
        // Shard 0, busy (a unit every 10 ms), holds one lane's jobs, then two's; then
        // three's in a report whose write is lost, and 2.2's in the one made again, then
        // still; then more, once its first seconds are over, as shard 1 does.
        let mut run = ShareRun::for_settings(&settings(0), valid_for, UnixMillis(0)).unwrap();
        let weighs_until = run.weighs_until.0;
        let mut held_at = |weight: f64, others: u64, now: u64, landed: bool| {
            run.weigh(weight);
            book.weigh(1, others * UNIT_WEIGHT);
            let (written, _) = run.report(Some((book.clone(), 1)), now / 10, UnixMillis(now));
            run.written(landed);
            if landed {
                book = written;
            }
            book.held[0].parts
        };
        assert_eq!(held_at(1.0, 3, 100, true), 50, "its first report keeps its half");
        assert_eq!(held_at(2.0, 3, 200, true), 50, "its weight grew: it keeps it");
        held_at(3.0, 3, 300, false);
        assert_eq!(held_at(2.2, 3, 320, true), 50, "more than the last report that landed: it keeps it");
        assert_eq!(held_at(2.2, 3, 400, true), 43, "2.2 lanes against three");
        let past = held_at(3.0, 6, weighs_until, true);
        assert!(past < 43, "past its first seconds, a weight that grew keeps nothing: {past}");
    }

    /// A report whose write another shard's beat is made again soon after: it measures
    /// the shard's pace from the last report that landed, not over the few milliseconds
    /// since the lost one, and says again that a lane was held back.
    #[test]
    fn a_report_made_again_after_a_lost_write_measures_from_the_last_that_landed() {
        let valid_for = Duration::from_secs(24);
        let mut run = ShareRun::for_settings(&settings(0), valid_for, UnixMillis(0)).unwrap();
        let (book, _) = run.report(None, 0, UnixMillis(0));
        run.written(true);
        // A second at its whole half (50 units): it asks for every part.
        let (_, _) = run.report(Some((book.clone(), 1)), 50, UnixMillis(1_000));
        run.written(false);
        let (again, _) = run.report(Some((book.clone(), 1)), 50, UnixMillis(1_020));
        assert_eq!(again.held[0].demand, 100, "its pace over the second, not over 20 ms: {again:?}");
        // Held back, and the write lost: the next report still asks for every part.
        run.written(true);
        run.held_back();
        let _ = run.report(Some((book.clone(), 2)), 50, UnixMillis(2_000));
        run.written(false);
        let (after_loss, _) = run.report(Some((book, 2)), 50, UnixMillis(2_020));
        assert_eq!(after_loss.held[0].demand, 100, "{after_loss:?}");
    }

    #[test]
    fn a_run_holds_nothing_until_its_report_lands_and_lowers_itself_before_its_write() {
        let valid_for = Duration::from_secs(24);
        let mut run = ShareRun::for_settings(&settings(0), valid_for, UnixMillis(0)).unwrap();
        assert_eq!(pace(&run), None);
        // The first report: an even book; the shard spent nothing yet and keeps its half.
        let (book, version) = run.report(None, 0, UnixMillis(10));
        assert_eq!((version, pace(&run)), (None, None));
        assert!(run.written(true));
        assert_eq!(pace(&run), Some(50));
        // The other shard is held back and asks for every part; this one used 10 a second.
        let mut other = ShareRun::for_settings(&settings(1), valid_for, UnixMillis(0)).unwrap();
        other.held_back();
        let (book, _) = other.report(Some((book, 1)), 0, UnixMillis(20));
        let (_, version) = run.report(Some((book, 2)), 10, UnixMillis(1_010));
        assert_eq!((version, pace(&run)), (Some(2), Some(13)), "10 a second, and a quarter more, lowered before the write");
        // The write lost to another shard's: the share stays lowered, and the next report
        // reads again.
        assert!(!run.written(false));
        assert_eq!(pace(&run), Some(13));
        // Nothing landed for the lease's validity after the first report: nothing held.
        assert!(!run.expire(UnixMillis(24_009)));
        assert!(run.expire(UnixMillis(24_010)));
        assert_eq!(pace(&run), None);
    }

    /// A shard that used nearly all of its share (45 and 50 a second of 50) asks for
    /// every part, whatever held its lanes, and two such shards keep their halves.
    #[test]
    fn a_shard_that_used_nearly_all_its_share_asks_for_every_part() {
        let valid_for = Duration::from_secs(24);
        let (mut first, mut second) =
            (ShareRun::for_settings(&settings(0), valid_for, UnixMillis(0)).unwrap(), ShareRun::for_settings(&settings(1), valid_for, UnixMillis(0)).unwrap());
        let (book, _) = first.report(None, 0, UnixMillis(0));
        first.written(true);
        let (book, _) = second.report(Some((book, 1)), 0, UnixMillis(5));
        second.written(true);
        let (book, _) = first.report(Some((book, 2)), 45, UnixMillis(1_000));
        first.written(true);
        let (book, _) = second.report(Some((book, 3)), 50, UnixMillis(1_005));
        second.written(true);
        assert_eq!(book.held.iter().map(|h| (h.parts, h.demand)).collect::<Vec<_>>(), vec![(50, 100), (50, 100)], "{book:?}");
        assert_eq!((pace(&first), pace(&second)), (Some(50), Some(50)));
    }

    #[test]
    fn a_stack_whose_shares_are_fixed_or_of_one_shard_has_no_share_run() {
        let mut fixed = settings(0);
        fixed.share_most = None;
        assert!(ShareRun::for_settings(&fixed, Duration::from_secs(24), UnixMillis(0)).is_none());
        let mut whole = settings(0);
        whole.shard = Shard::WHOLE;
        assert!(ShareRun::for_settings(&whole, Duration::from_secs(24), UnixMillis(0)).is_none());
    }
}
