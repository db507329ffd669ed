//! A stack of many lanes (`[lanes]`): the quota they share, the scheduler that divides
//! it among them, each lane's place in the run (read from the store yet, what it gave
//! back to the queue), and the books that say which lanes need looking at, so that a
//! decision looks at a few lanes, not all of them. A lane the stack acted on or had
//! news of is `touch`ed; before the next decision, `settle_touched` puts it where it
//! belongs: in the scheduler's line or out of it, among the lanes with an open circuit,
//! a malformed job in front or jobs to bring back, and its deadlines in the heap.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use paceline_shared::breaker::CircuitStatus;
use paceline_shared::config::LanesConfig;
use paceline_shared::pacer::{Decision, PacerState};
use paceline_shared::ports::{PacerSnapshot, QueuedMessage};
use paceline_shared::quota::Quota;
use paceline_shared::time::UnixMillis;

use crate::fairness::FairnessMeter;
use crate::hidden::{most_hidden, HiddenOnQueue, MOST_IN_FLIGHT};
use crate::lane::{LaneMachine, Reach, SharedCalendar};
use crate::report::TierMeter;
use crate::reservations::{Reservation, Reservations};
use crate::schedule::Scheduler;
use crate::stack::RECEIVE_BATCH;
use crate::timers::LaneDeadlines;

/// A stack of many lanes: the quota they share, paced by the same pacer as a lane's,
/// the scheduler that divides it among them by weight, and what each lane is doing.
pub(crate) struct ManyLanes<'a> {
    pub config: &'a LanesConfig,
    /// The shared quota this stack paces under: in a stack of shards whose shares move,
    /// this shard's share of it as last granted.
    pub shared: Quota,
    /// In a stack of shards whose shares move: the shard holds no part of the shared
    /// quota, and no call may go.
    pub no_share: bool,
    pub pacer: PacerState,
    /// The shared day and month units reserved in the store and not yet spent.
    pub reserved: Reservations,
    /// In a stack of shards: the shared day and month tiers whose counter had fewer units
    /// left than asked, each with when to ask again (in that order).
    short_tiers: Vec<(UnixMillis, Reservation)>,
    pub meter: TierMeter,
    pub scheduler: Scheduler,
    /// Per lane: read from the store yet (a lane dispatches nothing before).
    pub hydrated: Vec<bool>,
    /// The lanes to read from the store, first come first.
    pub to_hydrate: VecDeque<usize>,
    /// Per lane: in a stack of shards, it was moved to another shard during this run
    /// (its jobs go there, and nothing of it is saved here any more).
    pub away: Vec<bool>,
    /// Per lane: jobs handed off.
    pub dispatched: Vec<u64>,
    /// The slot of the last call on the shared quota.
    last_slot: Option<UnixMillis>,
    /// Units spent on the shared quota in this run, and the last exact count of what it
    /// takes in the next stretch: (from, units, units spent by then).
    spent: u64,
    capacity_seen: Option<(UnixMillis, usize, u64)>,
    /// Per lane: the messages it gave back to the queue and has not dispatched since,
    /// in the order it first saw them; and how many in every lane.
    hidden: Vec<HiddenJobs>,
    hidden_total: usize,
    /// Per lane: the receipts of what it gave back, by when each batch comes back; a
    /// lane that runs dry sooner (its share grew) brings the first back at once.
    pub returning: Vec<Vec<(UnixMillis, Vec<String>)>>,
    /// How many of the jobs given back are hidden on the queue for later, by when.
    pub hidden_on_queue: HiddenOnQueue,
    /// Per lane: it asked for a batch back and has not received it yet; and when it
    /// last did (a lane brings jobs back at most once a [`RECALL_STRETCH`]).
    pub recalling: Vec<bool>,
    pub recalled_at: Vec<UnixMillis>,
    pub fairness: FairnessMeter,
    /// The lanes' own deadlines (re-reads, reservation holds), by when.
    pub deadlines: LaneDeadlines,
    /// The lanes acted on or heard of since the last decision.
    touched: Vec<usize>,
    is_touched: Vec<bool>,
    /// The lanes whose circuit is open or half-open, by index.
    pub not_closed: BTreeSet<usize>,
    /// The lanes with a job that did not parse at the front.
    pub malformed: BTreeSet<usize>,
    /// The lanes low on jobs with some given back still hidden on the queue.
    pub may_recall: BTreeSet<usize>,
    /// Lanes passed over for a recall because they made one within the last
    /// [`RECALL_STRETCH`], by when it is over: they may recall again then.
    recall_again: BTreeSet<(UnixMillis, usize)>,
    /// Per lane, as of its last settling: jobs in hand.
    in_hand: Vec<usize>,
    /// Jobs in hand in every lane, the summed weights of the lanes holding any, and
    /// the lanes with none in hand while some of theirs are hidden on the queue.
    pub in_hand_total: usize,
    /// The most jobs in hand at once ([`in_hand_most`]).
    pub in_hand_most: usize,
    pub weights_in_hand: f64,
    pub starved: usize,
    is_starved: Vec<bool>,
    /// The lanes with jobs in hand, summed: their own tiers' paces (each as of when it
    /// last came to hold jobs), and that pace per lane.
    pub own_pace_in_hand: f64,
    own_pace_of: Vec<f64>,
    /// The same of the lanes the scheduler may pick now (read, their circuit not open,
    /// jobs in hand), which those are, and how many.
    pub own_pace_ready: f64,
    is_ready: Vec<bool>,
    ready_lanes: usize,
    /// Whether the lanes ready could use twice the shared quota at some point this run
    /// (see `Reach::BesideLanesBeingRead`).
    pub ready_filled_shared: bool,
    /// How far out the last decision let a lane's slot be.
    pub last_reach: Option<Reach>,
    /// Until when the shared quota counts as binding (`SHARED_BINDS_FOR` in `stack.rs`).
    pub binds_until: UnixMillis,
}

impl<'a> ManyLanes<'a> {
    pub fn new(config: &'a LanesConfig, shared: &Quota) -> Self {
        Self {
            config,
            shared: shared.clone(),
            no_share: false,
            pacer: PacerState::new(shared),
            reserved: Reservations::default(),
            short_tiers: Vec::new(),
            meter: TierMeter::new(shared),
            scheduler: Scheduler::default(),
            hydrated: Vec::new(),
            to_hydrate: VecDeque::new(),
            away: Vec::new(),
            dispatched: Vec::new(),
            last_slot: None,
            spent: 0,
            capacity_seen: None,
            hidden: Vec::new(),
            hidden_total: 0,
            returning: Vec::new(),
            hidden_on_queue: HiddenOnQueue::default(),
            recalling: Vec::new(),
            recalled_at: Vec::new(),
            fairness: FairnessMeter::default(),
            deadlines: LaneDeadlines::default(),
            touched: Vec::new(),
            is_touched: Vec::new(),
            not_closed: BTreeSet::new(),
            malformed: BTreeSet::new(),
            may_recall: BTreeSet::new(),
            recall_again: BTreeSet::new(),
            in_hand: Vec::new(),
            in_hand_total: 0,
            in_hand_most: in_hand_most(shared),
            weights_in_hand: 0.0,
            starved: 0,
            is_starved: Vec::new(),
            own_pace_in_hand: 0.0,
            own_pace_of: Vec::new(),
            own_pace_ready: 0.0,
            is_ready: Vec::new(),
            ready_lanes: 0,
            ready_filled_shared: false,
            last_reach: None,
            binds_until: UnixMillis(0),
        }
    }

    /// A lane of `weight` joined the run: its index, the next one. It is read from the
    /// store before it dispatches.
    pub fn add_lane(&mut self, weight: f64) -> usize {
        let index = self.scheduler.add_lane(weight);
        self.hydrated.push(false);
        self.to_hydrate.push_back(index);
        self.dispatched.push(0);
        self.fairness.add_lane();
        self.hidden.push(HiddenJobs::default());
        self.returning.push(Vec::new());
        self.recalling.push(false);
        self.recalled_at.push(UnixMillis(0));
        self.is_touched.push(false);
        self.in_hand.push(0);
        self.own_pace_of.push(0.0);
        self.is_ready.push(false);
        self.is_starved.push(false);
        self.away.push(false);
        index
    }

    /// Lane `index` was moved to another shard, with the jobs it held: what it gave back
    /// to the queue goes there too when it comes back, so it is no longer counted here.
    pub fn lane_left(&mut self, index: usize) {
        self.away[index] = true;
        self.hidden_total -= self.hidden[index].len();
        self.hidden[index] = HiddenJobs::default();
        self.returning[index].clear();
        self.recalling[index] = false;
        self.may_recall.remove(&index);
        self.recall_again.remove(&(self.recalled_at[index].plus(RECALL_STRETCH), index));
    }

    /// Lane `index` recalled lately: it may again once the stretch of its last recall
    /// is over, whether or not anything else happens to it by then.
    pub fn recall_once_the_stretch_is_over(&mut self, index: usize) {
        self.recall_again.insert((self.recalled_at[index].plus(RECALL_STRETCH), index));
    }

    /// The lanes whose last recall's stretch is over by `now` may recall again.
    pub fn recall_stretches_over(&mut self, now: UnixMillis) {
        while self.recall_again.first().is_some_and(|(at, _)| *at <= now) {
            if let Some((_, index)) = self.recall_again.pop_first() {
                self.may_recall.insert(index);
            }
        }
    }

    /// When the next lane's recall stretch is over.
    pub fn next_recall_stretch_over(&self) -> Option<UnixMillis> {
        self.recall_again.first().map(|(at, _)| *at)
    }

    /// Lane `index` was moved back to this shard: it is read from the store again (the
    /// pace its other shard handed over) before it dispatches.
    pub fn lane_came_back(&mut self, index: usize) {
        self.away[index] = false;
        self.hydrated[index] = false;
        self.to_hydrate.push_back(index);
    }

    /// Lane `index`'s weight is `weight` from its next dispatch on.
    pub fn set_weight(&mut self, index: usize, weight: f64) {
        if self.in_hand[index] > 0 {
            self.weights_in_hand += weight - self.scheduler.weight(index);
        }
        self.scheduler.set_weight(index, weight);
    }

    /// Lane `index` was acted on or heard of: it is settled before the next decision.
    pub fn touch(&mut self, index: usize) {
        if !self.is_touched[index] {
            self.is_touched[index] = true;
            self.touched.push(index);
        }
    }

    /// Settles every lane touched since the last decision (`lanes`: the stack's).
    pub fn settle_touched(&mut self, lanes: &[Box<LaneMachine<'_>>]) {
        for index in std::mem::take(&mut self.touched) {
            self.is_touched[index] = false;
            self.settle(index, &lanes[index]);
        }
    }

    /// Puts lane `index` where its state says it belongs.
    pub fn settle(&mut self, index: usize, lane: &LaneMachine<'_>) {
        self.deadlines.set(index, lane.next_timeout());
        let jobs = lane.jobs_in_hand();
        let had = std::mem::replace(&mut self.in_hand[index], jobs);
        self.in_hand_total = self.in_hand_total + jobs - had;
        match (had > 0, jobs > 0) {
            (false, true) => {
                self.weights_in_hand += self.scheduler.weight(index);
                self.own_pace_of[index] = lane.pace_per_second().min(UNBOUNDED_PACE);
                self.own_pace_in_hand += self.own_pace_of[index];
            }
            (true, false) => {
                self.weights_in_hand -= self.scheduler.weight(index);
                self.own_pace_in_hand -= self.own_pace_of[index];
            }
            _ => {}
        }
        if self.in_hand_total == 0 {
            self.weights_in_hand = 0.0; // no rounding left over
            self.own_pace_in_hand = 0.0;
        }
        let status = lane.circuit().status;
        if status == CircuitStatus::Closed {
            self.not_closed.remove(&index);
        } else {
            self.not_closed.insert(index);
        }
        let flows = self.hydrated[index] && status != CircuitStatus::Open;
        let ready = flows && jobs > 0;
        if ready {
            self.scheduler.ready(index);
        } else {
            self.scheduler.idle(index);
        }
        if ready != std::mem::replace(&mut self.is_ready[index], ready) {
            // Its pace as of when it came to hold jobs, which it has held since.
            if ready {
                self.ready_lanes += 1;
                self.own_pace_ready += self.own_pace_of[index];
            } else {
                self.ready_lanes -= 1;
                self.own_pace_ready -= self.own_pace_of[index];
            }
            if self.ready_lanes == 0 {
                self.own_pace_ready = 0.0; // no rounding left over
            }
        }
        if flows && lane.front_is_malformed() {
            self.malformed.insert(index);
        }
        let starved = jobs == 0 && !self.hidden[index].is_empty();
        if starved != std::mem::replace(&mut self.is_starved[index], starved) {
            if starved {
                self.starved += 1;
            } else {
                self.starved -= 1;
            }
        }
        if jobs < RECEIVE_BATCH && !self.recalling[index] && status != CircuitStatus::Open && !self.returning[index].is_empty() {
            self.may_recall.insert(index);
        } else {
            self.may_recall.remove(&index);
        }
    }

    /// A reservation from the stack's counter of a shared day or month tier (in a stack
    /// of shards) was granted `units` and left the counter at `count`: the pacer counts as
    /// used what every shard reserved less what this one holds, so that it spends what it
    /// holds and then asks again. With the counter at the limit (the other shards hold
    /// the rest), the shard asks again [`ASK_SHORT_TIER_AGAIN`] later, when they may have
    /// given some back ([`ManyLanes::short_tier_due`]).
    pub fn counted_by_the_stack(&mut self, reservation: Reservation, count: u64, units: u64, now: UnixMillis) {
        let used = count.saturating_sub(self.reserved.held(&reservation.key));
        self.pacer.set_calendar_used(&self.shared, reservation.tier, used, reservation.slot);
        let short = units < reservation.units || count >= reservation.limit;
        if !short {
            self.short_tiers.retain(|(_, waiting)| waiting.key != reservation.key);
        } else if !self.short_tiers.iter().any(|(_, waiting)| waiting.key == reservation.key) {
            self.short_tiers.push((now.plus(ASK_SHORT_TIER_AGAIN), reservation));
        }
    }

    /// The reservation to ask again of a shared tier found short whose wait is over, if
    /// any: the block it asked, in the window it asked it in (one that has reset since
    /// starts from a count of its own). It goes to the store as is, so that the lanes do
    /// not take jobs from the queue for it first and give them back; and it is asked
    /// again [`ASK_SHORT_TIER_AGAIN`] later until an answer finds units left (a failed
    /// ask included).
    pub fn short_tier_due(&mut self, now: UnixMillis) -> Option<Reservation> {
        while self.short_tiers.first().is_some_and(|(at, _)| *at <= now) {
            let (_, reservation) = self.short_tiers.remove(0);
            let tier = self.shared.tiers()[reservation.tier];
            if tier.usage_key(self.shared.zone(), now) == reservation.key {
                self.short_tiers.push((now.plus(ASK_SHORT_TIER_AGAIN), reservation.clone()));
                return Some(Reservation { slot: now, ..reservation });
            }
        }
        None
    }

    /// The shared quota as a lane's dispatch sees it.
    pub fn calendar(&self) -> SharedCalendar<'_> {
        SharedCalendar { quota: &self.shared, pacer: &self.pacer, reserved: &self.reserved }
    }

    /// Paces under `share` of the shared quota from now (`None`: no part of it, no call).
    /// The pacer keeps its windows: calls made under a larger share count against the
    /// smaller one until they leave them.
    pub fn set_share(&mut self, share: Option<Quota>) {
        match share {
            Some(quota) => {
                self.shared = quota;
                self.no_share = false;
            }
            None => self.no_share = true,
        }
        self.capacity_seen = None;
    }

    /// About how many unit-cost jobs the shared quota takes from `from` until `until`, at
    /// most `max` (see `Quota::room_estimate`).
    pub fn shared_room(&self, from: UnixMillis, until: UnixMillis, max: usize) -> usize {
        if self.no_share {
            return 0;
        }
        self.shared.room_estimate(&self.pacer, from, until, max)
    }

    /// How many unit-cost jobs the shared quota takes from `from` until `from + stretch`,
    /// at most `max`: counted slot by slot (exact, as a lane's keep must be: a longer
    /// tier spent early holds the quota past the stretch) at most once a second, and in
    /// between that count less what was spent since, which errs low by what the quota
    /// freed meanwhile, never high.
    pub fn shared_capacity(&mut self, from: UnixMillis, stretch: Duration, max: usize) -> usize {
        if self.no_share {
            return 0;
        }
        if let Some((counted_from, units, spent_then)) = self.capacity_seen {
            if from >= counted_from && from < counted_from.plus(Duration::from_secs(1)) {
                return units.saturating_sub(usize::try_from(self.spent - spent_then).unwrap_or(usize::MAX));
            }
        }
        let units = self.shared.capacity_until(&self.pacer, from, from.plus(stretch), max);
        self.capacity_seen = Some((from, units, self.spent));
        units
    }

    /// Units spent on the shared quota in this run.
    pub fn spent(&self) -> u64 {
        self.spent
    }

    /// The shared quota's pacer snapshot at `now`.
    pub fn snapshot(&self, at_exit: bool, now: UnixMillis) -> PacerSnapshot {
        PacerSnapshot { state: self.pacer.clone(), at_exit, effective_rate: None, saved_at: Some(now) }
    }

    /// Lane `index` gives `surplus` back to the queue, keeping `timing.kept`: when each
    /// batch comes back (see [`surplus_timed`]), hidden on the queue up to `room` jobs
    /// (see [`Self::room_to_hide`]), the jobs due last sent again past that, each timed
    /// to come back by when its lane could need it at its own pace. Timed at its share
    /// of the shared quota, which grows as other lanes run dry, a job sent again came
    /// back minutes after its lane had run out: at 10,000 calls/s over 1,000 lanes by a
    /// Zipf law on a standard queue, the lowest Jain's index was 0.979 (0.987 timed so).
    pub fn give_back(&mut self, index: usize, surplus: Vec<QueuedMessage>, timing: SurplusTiming, room: usize, now: UnixMillis) -> GivenBack {
        let hidden = &mut self.hidden[index];
        let before = hidden.len();
        let mut timed = surplus_timed(surplus, hidden, timing);
        let sent_again: Vec<(QueuedMessage, Duration)> = if timed.len() <= room {
            Vec::new()
        } else {
            // A job sent again cannot be brought back when its lane runs dry (this run
            // does not hold it any more): timed as if this run ended now.
            let not_brought_back = SurplusTiming { run_left: Duration::ZERO, ..timing };
            timed.split_off(room).into_iter().map(|job| (job.message, comes_back_after(job.position, not_brought_back))).collect()
        };
        for (message, _) in &sent_again {
            hidden.remove(&message.message_id);
        }
        self.hidden_total = self.hidden_total + hidden.len() - before;
        let batches = in_batches(timed);
        for (receipts, after) in &batches {
            self.hidden_on_queue.hide(now.plus(*after), receipts.len());
        }
        GivenBack { hidden: batches, sent_again }
    }

    /// How many more jobs a lane may hide on the queue for later at `now`: SQS counts
    /// them as in flight, with those in hand. Up to what [`MOST_IN_FLIGHT`] leaves, and
    /// no more than leaves room to receive ([`most_hidden`]). Past the room, jobs are
    /// sent again.
    pub fn room_to_hide(&mut self, fair_queue: bool, now: UnixMillis) -> usize {
        self.in_flight_room(now).min(most_hidden(self.in_hand_most, fair_queue).saturating_sub(self.hidden_on_queue.at(now)))
    }

    /// How many more jobs this run may hold in flight at `now`.
    pub fn in_flight_room(&mut self, now: UnixMillis) -> usize {
        MOST_IN_FLIGHT.saturating_sub(self.in_hand_total + self.hidden_on_queue.at(now))
    }

    /// Lane `index` dispatched `message_id`: not hidden on the queue any more.
    pub fn dispatched_from_queue(&mut self, index: usize, message_id: &str) {
        if self.hidden[index].remove(message_id) {
            self.hidden_total -= 1;
        }
    }

    /// Whether SQS sees lane `index`'s group as noisy on a fair queue, as far as this
    /// stack can tell: its messages in flight (in hand and given back for later) are at
    /// least [`NOISY_IN_FLIGHT`] and over a tenth of the stack's. Then the queue hands
    /// out the quiet lanes' messages first, and a receive that brings only noisy lanes'
    /// jobs found no other.
    pub fn looks_noisy(&self, index: usize) -> bool {
        let own = self.in_hand[index] + self.hidden[index].len();
        own >= NOISY_IN_FLIGHT && own * 10 > self.in_hand_total + self.hidden_total
    }

    /// How long from `from` until the shared quota lets a call go (zero when one may).
    pub fn shared_held_for(&self, from: UnixMillis) -> Duration {
        if self.no_share {
            return paceline_shared::shares::REPORT_EVERY;
        }
        self.shared.held_for(&self.pacer, from)
    }

    /// Spends `cost` units of the shared quota at `slot` (counted as arriving up to
    /// `upload` later), with the report's figures: how long since the last call, and
    /// which shared tier, if any, would have held it any earlier.
    pub fn spend(&mut self, cost: u64, slot: UnixMillis, upload: Duration) {
        let held = match self.shared.decide(&self.pacer, cost, slot.minus(Duration::from_millis(1))) {
            Decision::WaitUntil { by, .. } => Some(by),
            _ => None,
        };
        let paced = self.last_slot.map_or(Duration::ZERO, |last| slot.since(last));
        self.pacer.commit(&self.shared, cost, slot.plus(upload));
        self.spent += cost;
        self.reserved.spend(&self.shared, cost, slot);
        self.meter.record(slot, cost, paced, held);
        self.last_slot = Some(slot);
    }
}

/// A message group with fewer messages in flight is never noisy on an SQS fair queue.
const NOISY_IN_FLIGHT: usize = 30;

/// How long a shard whose share of a shared day or month tier ran short (the other
/// shards hold the rest of it) waits before it asks the stack's counter again: the
/// others give back what they did not spend when their runs end.
const ASK_SHORT_TIER_AGAIN: Duration = Duration::from_secs(5);

/// The fewest jobs a stack of many lanes may hold in hand at once (see [`in_hand_most`]).
const MANY_LANES_IN_HAND: usize = 5_000;

/// The most, whatever the pace: well inside the 120,000 messages a standard SQS queue
/// lets be in flight.
const MOST_IN_HAND_EVER: usize = 60_000;

/// The pace a lane without tiers of its own counts for among the lanes in hand: more
/// than any shared quota, and small enough that their sum comes back to zero exactly.
const UNBOUNDED_PACE: f64 = 1e9;

/// How many seconds of the shared quota's pace a stack of many lanes holds in hand.
/// What it holds in hand is in flight on SQS, beside what it hides for later, and on a
/// fair queue its receives stop where the two reach SQS's limit. At 10,000 calls/s over
/// 1,000 lanes by a Zipf law, five seconds (50,000 jobs) reached that limit 6 s in and
/// read the line on at the pace the jobs went: the light lanes' last jobs came late, and
/// the first 10 s window's Jain's index was 0.986 to 0.990. Four give 0.990 to 0.992
/// for 0.011 SQS requests a job more; three, 0.992 for 0.038 more, with 118,744
/// messages in flight at the most, next to the limit.
const SECONDS_IN_HAND: f64 = 4.0;

/// The most jobs a stack of many lanes holds in hand at once: what the shared quota lets
/// go in [`SECONDS_IN_HAND`], from [`MANY_LANES_IN_HAND`] to [`MOST_IN_HAND_EVER`]. A
/// held lane's jobs past what it can use before their visibility timeout go back to the
/// queue. At 10,000 calls/s over 1,000 lanes, 5,000 jobs in hand left each lane 5, and
/// its next ones scattered on the queue: the shared tier was a third used.
pub(crate) fn in_hand_most(shared: &Quota) -> usize {
    let pace = shared.sustained_per_second();
    if !pace.is_finite() {
        return MANY_LANES_IN_HAND;
    }
    ((pace * SECONDS_IN_HAND) as usize).clamp(MANY_LANES_IN_HAND, MOST_IN_HAND_EVER)
}

/// How far ahead a lane's share of the shared quota is counted when it holds jobs: past
/// it, its jobs go back on the queue for later, making room for other lanes' jobs.
pub(crate) const FAIR_SHARE_STRETCH: Duration = Duration::from_secs(20);

/// The longest a lane's surplus is hidden on the queue before it is looked at again.
pub(crate) const MAX_RELEASE_DELAY: Duration = Duration::from_secs(15 * 60);

/// The messages a lane gave back to the queue and has not dispatched since, each with
/// the order in which the lane first saw it: a job seen again keeps its place behind
/// those it came after, however often it comes back.
#[derive(Default)]
pub(crate) struct HiddenJobs {
    order_of: HashMap<String, u64>,
    in_order: BTreeSet<u64>,
    next: u64,
}

impl HiddenJobs {
    pub fn is_empty(&self) -> bool {
        self.order_of.is_empty()
    }

    pub fn len(&self) -> usize {
        self.order_of.len()
    }

    /// How many of the lane's hidden jobs are ahead of `message_id` (zero-based): its
    /// place among them, a new one's behind them all (then hidden too).
    fn place_of(&mut self, message_id: &str) -> usize {
        if let Some(order) = self.order_of.get(message_id) {
            // Counted from the first still hidden: those before it mostly went already.
            let first = self.in_order.first().copied().unwrap_or(*order);
            return usize::try_from(order - first).unwrap_or(usize::MAX).min(self.len() - 1);
        }
        let place = self.len();
        self.order_of.insert(message_id.to_owned(), self.next);
        self.in_order.insert(self.next);
        self.next += 1;
        place
    }

    /// The lane dispatched `message_id`: no longer hidden. Whether it was.
    pub fn remove(&mut self, message_id: &str) -> bool {
        let Some(order) = self.order_of.remove(message_id) else { return false };
        self.in_order.remove(&order);
        if self.order_of.is_empty() {
            *self = Self::default(); // its memory too: the lane may stay idle
        }
        true
    }
}

/// How fast a lane giving jobs back goes: its jobs a second, and whether that is its own
/// tiers' pace, which it cannot pass, or its share of the shared quota, which grows as
/// other lanes run dry (or the queue may hand the job out late: see `route_received`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct LanePace {
    pub per_second: f64,
    pub own: bool,
    /// Its own tiers' pace, however large its share may grow.
    pub own_per_second: f64,
}

/// When each batch of a lane's surplus comes back on the queue: [`surplus_timed`] in
/// batches of jobs due within the same second, ten at most (a batch comes back with its
/// first).
#[cfg(test)]
pub(crate) fn surplus_returns(
    surplus: Vec<QueuedMessage>,
    hidden: &mut HiddenJobs,
    kept: usize,
    pace: LanePace,
    visibility: Duration,
    held_for: Duration,
) -> Vec<(Vec<String>, Duration)> {
    in_batches(surplus_timed(surplus, hidden, SurplusTiming { kept, pace, visibility, held_for, run_left: Duration::MAX }))
}

/// When each job of a lane's surplus comes back on the queue, soonest first. The lane
/// keeps `timing.kept` jobs and goes at `timing.pace`; each job comes behind what the
/// lane keeps and the jobs it gave back before this one and still hides (`hidden`, in
/// the order the lane first saw them), and is due at `position / pace`. At the lane's
/// own pace it comes back half a visibility timeout before it is due, when the lane has
/// less before it than it keeps: once, not given back again. At a share of the shared
/// quota it comes back halfway to when it is due, the lane may go faster by then. At
/// least a second and at most [`MAX_RELEASE_DELAY`] later (or `visibility` when the
/// pace is unknown), and not before the lane may call again (`held_for`: its day spent,
/// a cool-down). A job is so looked at a few times at most before it goes, not once a
/// second, and the lane's order holds.
///
/// A job timed at a share to come back past the run's end (`timing.run_left`) comes
/// back when it would at the lane's own pace instead, if that is sooner, but not before
/// the run's end: until then this run brings a job back when its lane runs dry, the
/// next run cannot (it does not hold the receipt). With many jobs given back while
/// 1,000 lanes shared the quota, a heavy lane went without jobs for 8 s after a
/// hand-over, its next ones timed for its thousandth of the shared quota and hidden on
/// the queue for minutes.
fn surplus_timed(surplus: Vec<QueuedMessage>, hidden: &mut HiddenJobs, timing: SurplusTiming) -> Vec<TimedJob> {
    let mut timed: Vec<TimedJob> = surplus
        .into_iter()
        .map(|message| {
            let position = timing.kept + hidden.place_of(&message.message_id) + 1;
            TimedJob { after: comes_back_after(position, timing), position, message }
        })
        .collect();
    timed.sort_by_key(|job| job.after);
    timed
}

/// When the job `position`th in its lane's line comes back (see [`surplus_timed`]).
fn comes_back_after(position: usize, timing: SurplusTiming) -> Duration {
    let SurplusTiming { pace, visibility, held_for, run_left, .. } = timing;
    let per_second = pace.per_second;
    let due_at = |per_second: f64| Duration::from_secs_f64((position as f64 / per_second).min(MAX_RELEASE_DELAY.as_secs_f64()));
    let after = if !per_second.is_finite() || per_second <= 0.0 {
        visibility
    } else {
        let due = due_at(per_second);
        if pace.own {
            due.saturating_sub(visibility / 2)
        } else {
            let at_share = due.mul_f64(RETURN_EARLY);
            if at_share > run_left {
                at_share.min(due_at(pace.own_per_second).saturating_sub(visibility / 2).max(run_left))
            } else {
                at_share
            }
        }
    };
    after.max(held_for).clamp(Duration::from_secs(1), MAX_RELEASE_DELAY)
}

/// A job of a lane's surplus: when it comes back, and its place in the lane's line.
struct TimedJob {
    after: Duration,
    position: usize,
    message: QueuedMessage,
}

/// Jobs timed soonest first, in batches of those due within the same second, ten at most.
fn in_batches(timed: Vec<TimedJob>) -> Vec<(Vec<String>, Duration)> {
    let mut returns: Vec<(Vec<String>, Duration)> = Vec::new();
    for TimedJob { after, message, .. } in timed {
        match returns.last_mut() {
            Some((receipts, first)) if receipts.len() < RECEIVE_BATCH && after.as_secs() == first.as_secs() => receipts.push(message.receipt),
            _ => returns.push((vec![message.receipt], after)),
        }
    }
    returns
}

/// When a lane's surplus comes back (see [`surplus_timed`]): the jobs it keeps, its
/// pace, the visibility timeout, how long it may not call, and how long until the run
/// ends (`Duration::MAX` for a run without an end).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SurplusTiming {
    pub kept: usize,
    pub pace: LanePace,
    pub visibility: Duration,
    pub held_for: Duration,
    pub run_left: Duration,
}

/// What a lane gives back: batches of receipts hidden on the queue, each until that much
/// later, and the jobs sent again with that delay (there was no room to hide them).
#[derive(Default)]
pub(crate) struct GivenBack {
    pub hidden: Vec<(Vec<String>, Duration)>,
    pub sent_again: Vec<(QueuedMessage, Duration)>,
}

/// What a lane that runs dry brings back of what it gave back: this long at its own pace.
pub(crate) const RECALL_STRETCH: Duration = Duration::from_secs(2);

/// The share of the time until a job given back is due at which it comes back, while
/// its lane goes at a share of the shared quota.
pub(crate) const RETURN_EARLY: f64 = 0.5;

#[cfg(test)]
mod tests {
    use super::*;
    use paceline_shared::quota::chrono_tz;

    fn at_share(per_second: f64) -> LanePace {
        LanePace { per_second, own: false, own_per_second: f64::INFINITY }
    }

    fn queued(id: &str) -> QueuedMessage {
        QueuedMessage { message_id: id.into(), receipt: format!("r-{id}"), body: String::new(), attempt: 0, enqueued_at: UnixMillis(0), group: None }
    }

    /// `n` jobs `{prefix}0`.. the lane gave back, in that order.
    fn hidden_jobs(prefix: &str, n: usize) -> HiddenJobs {
        let mut hidden = HiddenJobs::default();
        let surplus = (0..n).map(|i| queued(&format!("{prefix}{i}"))).collect();
        surplus_returns(surplus, &mut hidden, 0, at_share(10.0), Duration::from_secs(30), Duration::ZERO);
        hidden
    }

    /// A run at 10,000 calls/s may hold 40,000 jobs in hand. With 30,000 in hand, a fair
    /// queue lets it hide 80,000 for later, what SQS's limit leaves, and 85,000 at most:
    /// the busy lanes' jobs left on the queue are passed over for the quiet lanes', and
    /// receives need room for five eighths of what it may hold. A standard queue hands
    /// them out in line, and its receives need room to reach the jobs behind them:
    /// 70,000, what holding all 40,000 in hand leaves. Hidden jobs count until they are
    /// due.
    #[test]
    fn a_run_hides_up_to_what_sqs_lets_be_in_flight_and_leaves_room_to_receive_more_on_a_standard_queue() {
        let quota = Quota::new(vec!["10000/s".parse().unwrap()], chrono_tz::UTC, Duration::ZERO).unwrap();
        let config = LanesConfig::parse_text("tiers = [\"100/s\"]", &quota).unwrap();
        let mut many = ManyLanes::new(&config, &quota);
        let t0 = UnixMillis(1_795_824_000_000);
        assert_eq!(many.in_hand_most, 40_000);
        many.in_hand_total = 30_000;
        assert_eq!((many.room_to_hide(true, t0), many.room_to_hide(false, t0)), (80_000, 70_000));
        many.hidden_on_queue.hide(t0.plus(Duration::from_secs(30)), 55_000);
        assert_eq!((many.room_to_hide(true, t0), many.room_to_hide(false, t0)), (25_000, 15_000));
        assert_eq!(many.in_flight_room(t0), 25_000, "what receives may bring");
        many.in_hand_total = 10_000;
        assert_eq!((many.room_to_hide(true, t0), many.room_to_hide(false, t0)), (30_000, 15_000), "room kept for five eighths of 40,000 / all of it");
        let due = t0.plus(Duration::from_secs(30));
        assert_eq!((many.room_to_hide(true, due), many.room_to_hide(false, due)), (85_000, 70_000), "visible again: no longer in flight");
    }

    /// A lane going at its share of the shared quota, 10/s, under its own 100/s, gives
    /// back a job 4,801st in its line with room to hide none: it is sent again, and no
    /// later than it could be due at the lane's own pace (48.01 s, half the visibility
    /// timeout before: 33.01 s), not halfway to when it is due at its share (240.05 s).
    /// A job sent again cannot be brought back when the lane runs dry, and its share
    /// grows as other lanes run dry: at 10,000 calls/s over 1,000 lanes by a Zipf law on
    /// a standard queue, the heavy lanes went minutes without jobs, their jobs on their
    /// way back, and the lowest Jain's index was 0.979. One hidden is timed at its share.
    #[test]
    fn a_job_sent_again_comes_back_by_when_its_lane_could_need_it_at_its_own_pace() {
        let quota = Quota::new(vec!["10000/s".parse().unwrap()], chrono_tz::UTC, Duration::ZERO).unwrap();
        let config = LanesConfig::parse_text("tiers = [\"100/s\"]", &quota).unwrap();
        let mut many = ManyLanes::new(&config, &quota);
        let pace = LanePace { per_second: 10.0, own: false, own_per_second: 100.0 };
        let timing = SurplusTiming { kept: 4_800, pace, visibility: Duration::from_secs(30), held_for: Duration::ZERO, run_left: Duration::MAX };
        let t0 = UnixMillis(1_795_824_000_000);
        let (a, b) = (many.add_lane(1.0), many.add_lane(1.0));
        let given = many.give_back(a, vec![queued("a")], timing, 0, t0);
        assert!(given.hidden.is_empty());
        assert_eq!(given.sent_again[0].1, Duration::from_millis(33_010));
        let given = many.give_back(b, vec![queued("b")], timing, 1, t0);
        assert_eq!(given.hidden, [(vec!["r-b".to_owned()], Duration::from_millis(240_050))], "hidden: brought back when the lane runs dry");
    }

    /// A shard whose reservation of the shared day tier came back short spends what it
    /// holds (its pacer counts the rest used), asks again 5 s later by itself, and again
    /// 5 s after each ask (a failed one too) until an answer finds units left; an ask in
    /// a window that has reset since is dropped.
    #[test]
    fn a_shard_short_of_a_shared_day_tier_asks_again_every_5_s_until_units_are_left() {
        let tier = |text: &str| text.parse::<paceline_shared::quota::Tier>().unwrap();
        let quota = Quota::new(vec![tier("100/s"), tier("600/day")], chrono_tz::UTC, Duration::ZERO).unwrap();
        let config = LanesConfig::parse_text("tiers = [\"100/s\"]", &quota).unwrap();
        let mut many = ManyLanes::new(&config, &quota);
        let t0 = UnixMillis(1_795_824_000_000); // midnight UTC
        let at = |ms: u64| t0.plus(Duration::from_millis(ms));
        let key = quota.tiers()[1].usage_key(chrono_tz::UTC, t0);
        let asked = Reservation { key: key.clone(), units: 200, tier: 1, limit: 600, slot: at(0) };
        many.reserved.add(key.clone(), 30);
        many.counted_by_the_stack(asked.clone(), 600, 30, at(0));
        assert_eq!(many.pacer.usage(&quota, at(0))[1], 570, "the 30 held are all it may spend");
        assert_eq!(many.short_tier_due(at(4_999)), None);
        let again = many.short_tier_due(at(5_000)).expect("asked again");
        assert_eq!((again.units, again.slot), (200, at(5_000)));
        assert_eq!(many.short_tier_due(at(9_999)), None, "one ask at a time");
        assert!(many.short_tier_due(at(10_000)).is_some(), "that ask's answer never came (it failed): asked again");
        many.counted_by_the_stack(Reservation { slot: at(10_000), ..asked.clone() }, 600, 0, at(10_000));
        assert!(many.short_tier_due(at(15_000)).is_some(), "still short");
        // Another shard's run ended and gave 300 back: the 200 asked are granted.
        many.reserved.add(key.clone(), 200);
        many.counted_by_the_stack(Reservation { slot: at(15_000), ..asked.clone() }, 500, 200, at(15_000));
        assert_eq!(many.pacer.usage(&quota, at(15_000))[1], 270, "500 counted, 230 of them held here");
        assert_eq!(many.short_tier_due(at(60_000)), None, "units were left: no more asks");
        many.counted_by_the_stack(asked, 600, 0, at(0));
        assert_eq!(many.short_tier_due(at(86_400_000 + 5_000)), None, "the day reset: its count starts afresh");
    }

    /// A lane at 10/s keeping 20 jobs: a job it had not seen goes behind the 50 still
    /// hidden, one it gave back before behind the 20 it keeps and the jobs it hid before
    /// that one; each comes back halfway to when it is due, with those due within the
    /// same second, at least a second later.
    #[test]
    fn a_lane_s_surplus_comes_back_a_little_before_it_is_due_and_in_the_lane_s_order() {
        let mut hidden = hidden_jobs("h", 50);
        let surplus: Vec<QueuedMessage> = (0..12).map(|i| queued(&format!("n{i}"))).chain([queued("h3")]).collect();
        let returns = surplus_returns(surplus, &mut hidden, 20, at_share(10.0), Duration::from_secs(30), Duration::ZERO);
        let shown: Vec<(usize, Duration)> = returns.iter().map(|(receipts, after)| (receipts.len(), *after)).collect();
        // h3 at position 24 (2.4 s, half of it); n0 to n11 at 71 to 82 (3.55 to 4.1 s).
        assert_eq!(shown, [(1, Duration::from_millis(1_200)), (9, Duration::from_millis(3_550)), (3, Duration::from_millis(4_000))]);
        assert_eq!(returns[0].0[0], "r-h3", "the job given back before comes first");
        assert_eq!(hidden.len(), 62, "the new ones are hidden too");
        let slow = surplus_returns(vec![queued("x")], &mut HiddenJobs::default(), 0, at_share(1e9), Duration::from_secs(30), Duration::ZERO);
        assert_eq!(slow[0].1, Duration::from_secs(1), "at least a second");
        let far = surplus_returns(vec![queued("y")], &mut hidden, 1_000_000, at_share(1.0), Duration::from_secs(30), Duration::ZERO);
        assert_eq!(far[0].1, MAX_RELEASE_DELAY.mul_f64(RETURN_EARLY));
    }

    /// A lane going at its own 100/s (its tiers, not a share of the shared quota) and
    /// keeping 4,800 jobs gives its 5,201st job back: it comes back half the visibility
    /// timeout (30 s) before it is due, 100.01 - 15 = 85.01 s, and is kept then. Halfway
    /// to when it is due (50 s), it found 5,000 jobs still before it and went back again;
    /// at 10,000 calls/s over 1,000 lanes by a Zipf law, the heavy lanes' jobs went to
    /// and fro 0.08 requests a job. At a share of the shared quota, which grows as other
    /// lanes run dry, it still comes back halfway.
    #[test]
    fn a_job_of_a_lane_at_its_own_pace_comes_back_half_a_visibility_timeout_before_it_is_due() {
        let mut hidden = hidden_jobs("h", 5_200);
        let own = LanePace { per_second: 100.0, own: true, own_per_second: 100.0 };
        let returns = surplus_returns(vec![queued("n")], &mut hidden, 4_800, own, Duration::from_secs(30), Duration::ZERO);
        assert_eq!(returns[0].1, Duration::from_millis(85_010));
        let mut hidden = hidden_jobs("h", 5_200);
        let shared = surplus_returns(vec![queued("n")], &mut hidden, 4_800, at_share(100.0), Duration::from_secs(30), Duration::ZERO);
        assert_eq!(shared[0].1, Duration::from_millis(50_005));
    }

    /// A heavy lane at 5/s keeping 25, a thousand of its jobs hidden: its 901st, seen
    /// again, comes back when the 900 before it are nearly gone (92.6 s), not a few
    /// seconds later to be given back again, and again (it came 2.6 s later, right
    /// behind what the lane keeps: a heavy lane's backlog went to and fro). Once 500 of
    /// those ahead of it went, it is 500 places nearer.
    #[test]
    fn a_job_given_back_again_keeps_its_place_behind_the_jobs_hidden_before_it() {
        let mut hidden = hidden_jobs("h", 1_000);
        let again = surplus_returns(vec![queued("h900")], &mut hidden, 25, at_share(5.0), Duration::from_secs(30), Duration::ZERO);
        assert_eq!(again[0].1, Duration::from_millis(92_600));
        for i in 0..500 {
            assert!(hidden.remove(&format!("h{i}")));
        }
        let nearer = surplus_returns(vec![queued("h900")], &mut hidden, 25, at_share(5.0), Duration::from_secs(30), Duration::ZERO);
        assert_eq!(nearer[0].1, Duration::from_millis(42_600));
        assert_eq!(hidden.len(), 500, "a job seen again is hidden once");
    }

    /// Four seconds of the shared quota's pace in hand, from 5,000 to 60,000: a stack at
    /// 10,000 calls/s over 1,000 lanes holds 40,000, four seconds' worth for each lane at
    /// its share (with 5,000, five jobs each: the shared tier was a third used on SQS).
    #[test]
    fn a_stack_of_many_lanes_holds_four_seconds_of_the_shared_pace_in_hand() {
        let shared = |tiers: &[&str]| Quota::new(tiers.iter().map(|t| t.parse().unwrap()).collect(), chrono_tz::UTC, Duration::ZERO).unwrap();
        assert_eq!(in_hand_most(&shared(&["200/s"])), 5_000);
        assert_eq!(in_hand_most(&shared(&["10000/s"])), 40_000);
        assert_eq!(in_hand_most(&shared(&["100000/s"])), 60_000, "well inside SQS's 120,000 in flight");
        assert_eq!(in_hand_most(&shared(&["600000/min", "20000/s"])), 40_000, "the sustained pace: 10,000/s");
        assert_eq!(in_hand_most(&Quota::unlimited(chrono_tz::UTC, Duration::ZERO)), 5_000, "no shared quota");
    }
}
