//! What a simulated SQS queue holds: its messages in line, by message group, those in
//! flight or delayed until they are visible again, and its dead letters. A standard
//! queue hands messages out in line; a fair queue (a standard queue whose messages
//! carry a group: Paceline's jobs carry their lane) first hands out the messages of the
//! groups that are not *noisy*, a group being noisy while it holds over 10% of the
//! queue's messages in flight and at least [`NOISY_IN_FLIGHT`] of its own: the rule AWS
//! documents for SQS fair queues (its other trigger, a share of recent processing time,
//! is not modelled: Paceline's receives are what it would measure). A FIFO queue hands
//! out no message of a group while one of it is in flight, up to ten of a group in a
//! receive, each group in the order its messages were sent (a message visible again
//! goes back to its place), and delays no message. No queue lets more than
//! [`MOST_IN_FLIGHT`] messages be in flight: a receive then gets none (AWS's short poll
//! is refused with `OverLimit`, its long poll returns none).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use paceline_shared::lane::LaneId;
use paceline_shared::order::message_group;
use paceline_shared::time::UnixMillis;

/// A group with fewer messages in flight than this is never noisy.
pub const NOISY_IN_FLIGHT: u64 = 30;

/// The most messages a queue lets be in flight: "approximately 120,000" for most
/// standard queues in AWS's quotas (and FIFO queues since 2024).
pub const MOST_IN_FLIGHT: u64 = 120_000;

/// A group's share of the queue's messages in flight above which it is noisy.
const NOISY_SHARE: f64 = 0.1;

/// A message as the queue keeps it.
#[derive(Clone, Debug)]
pub(crate) struct Stored {
    pub id: u64,
    pub body: String,
    pub attempt: u32,
    pub sent_at: UnixMillis,
    /// Its message group (the lane its job names), as an index.
    pub group: usize,
}

/// A hidden message: when it is visible again, and whether it was received (in flight)
/// rather than sent with a delay.
struct Hidden {
    message: Stored,
    until: UnixMillis,
    received: bool,
}

/// The queue's messages.
#[derive(Default)]
pub(crate) struct QueueState {
    /// Hand out the quiet groups' messages first.
    fair: bool,
    /// A FIFO queue: a group's messages in order, none while one is in flight.
    fifo: bool,
    /// Each group's visible messages by place in line (a message made visible again goes
    /// last, one put back at once first).
    groups: Vec<BTreeMap<i64, Stored>>,
    /// Each group's first place in line, with the group.
    heads: BTreeSet<(i64, usize)>,
    /// The next place at the back of the line, and before its front.
    back: i64,
    front: i64,
    visible: usize,
    group_index: HashMap<String, usize>,
    /// Received or delayed messages by receipt, and by when they are visible again.
    hidden: BTreeMap<u64, Hidden>,
    due: BTreeSet<(UnixMillis, u64)>,
    /// Each group's messages in flight (received, neither deleted nor visible again).
    in_flight: Vec<u64>,
    in_flight_total: u64,
    /// The most messages in flight at once so far, and the most the queue lets be.
    pub in_flight_peak: u64,
    most_in_flight: u64,
    next_receipt: u64,
    pub next_id: u64,
    pub dead: Vec<(u64, String)>,
}

impl QueueState {
    /// A fair queue: the quiet groups' messages first.
    pub fn fair() -> Self {
        Self { fair: true, front: -1, most_in_flight: MOST_IN_FLIGHT, ..Self::default() }
    }

    /// A standard queue: messages in line, whatever their group.
    pub fn standard() -> Self {
        Self { front: -1, most_in_flight: MOST_IN_FLIGHT, ..Self::default() }
    }

    /// A FIFO queue: each group in order, none while one of it is in flight.
    pub fn fifo() -> Self {
        Self { fifo: true, front: -1, most_in_flight: MOST_IN_FLIGHT, ..Self::default() }
    }

    /// The group of a message with `body`: the lane its job names, or its retries'
    /// (`ahead`: an ordered lane's retry).
    pub fn group_of(&mut self, body: &str, ahead: bool) -> usize {
        let name = message_group(&LaneId::named_in(body), ahead);
        let next = self.group_index.len();
        let group = *self.group_index.entry(name).or_insert(next);
        if group == self.groups.len() {
            self.groups.push(BTreeMap::new());
            self.in_flight.push(0);
        }
        group
    }

    pub fn is_fair(&self) -> bool {
        self.fair
    }

    pub fn visible_len(&self) -> usize {
        self.visible
    }

    pub fn hidden_len(&self) -> usize {
        self.hidden.len()
    }

    /// Puts `message` last in line (on a FIFO queue: back in its place, the order its
    /// group's messages were sent in).
    pub fn push_back(&mut self, message: Stored) {
        if self.fifo {
            return self.place(sent_place(&message), message);
        }
        let place = self.back;
        self.back += 1;
        self.place(place, message);
    }

    /// Puts `message` first in line (on a FIFO queue: back in its place).
    fn push_front(&mut self, message: Stored) {
        if self.fifo {
            return self.place(sent_place(&message), message);
        }
        let place = self.front;
        self.front -= 1;
        self.place(place, message);
    }

    fn place(&mut self, place: i64, message: Stored) {
        let group = message.group;
        if let Some(head) = self.groups[group].keys().next().copied() {
            if place < head {
                self.heads.remove(&(head, group));
                self.heads.insert((place, group));
            }
        } else {
            self.heads.insert((place, group));
        }
        self.groups[group].insert(place, message);
        self.visible += 1;
    }

    /// Whether `group` is noisy now.
    fn noisy(&self, group: usize) -> bool {
        let own = self.in_flight[group];
        own >= NOISY_IN_FLIGHT && own as f64 > NOISY_SHARE * self.in_flight_total as f64
    }

    /// The next message to hand out: the first in line, a fair queue passing over the
    /// noisy groups' while a quiet group has one, a FIFO queue over the groups with a
    /// message in flight (but `receiving`, whose messages this receive is handing out).
    fn pop(&mut self, receiving: Option<usize>) -> Option<Stored> {
        let (place, group) = if self.fifo {
            self.heads.iter().find(|(_, group)| self.in_flight[*group] == 0 || receiving == Some(*group)).copied()?
        } else {
            let quiet = if self.fair { self.heads.iter().find(|(_, group)| !self.noisy(*group)).copied() } else { None };
            quiet.or_else(|| self.heads.first().copied())?
        };
        self.heads.remove(&(place, group));
        let message = self.groups[group].remove(&place).expect("a head is in its group");
        if let Some(next) = self.groups[group].keys().next() {
            self.heads.insert((*next, group));
        }
        self.visible -= 1;
        Some(message)
    }

    /// Whether as many messages are in flight as the queue lets be: a receive gets none.
    pub fn in_flight_at_most(&self) -> bool {
        self.in_flight_total >= self.most_in_flight
    }

    /// Hands out up to `max` messages, each hidden until `until` under a new receipt,
    /// none past the most the queue lets be in flight.
    pub fn receive(&mut self, max: usize, until: UnixMillis) -> Vec<(u64, Stored)> {
        let mut received: Vec<(u64, Stored)> = Vec::new();
        while received.len() < max && !self.in_flight_at_most() {
            let receiving = received.last().map(|(_, message)| message.group);
            let Some(message) = self.pop(receiving) else { break };
            let receipt = self.next_receipt;
            self.next_receipt += 1;
            self.in_flight[message.group] += 1;
            self.in_flight_total += 1;
            self.in_flight_peak = self.in_flight_peak.max(self.in_flight_total);
            received.push((receipt, message.clone()));
            self.hide(receipt, Hidden { message, until, received: true });
        }
        received
    }

    /// Holds `message` (sent with a delay) until `until` (a FIFO queue delays none: it
    /// goes in line at once).
    pub fn delay(&mut self, message: Stored, until: UnixMillis) {
        if self.fifo {
            return self.push_back(message);
        }
        let receipt = self.next_receipt;
        self.next_receipt += 1;
        self.hide(receipt, Hidden { message, until, received: false });
    }

    fn hide(&mut self, receipt: u64, hidden: Hidden) {
        self.due.insert((hidden.until, receipt));
        self.hidden.insert(receipt, hidden);
    }

    /// Takes the message of `receipt` out of the hidden ones (no longer in flight).
    fn unhide(&mut self, receipt: u64) -> Option<Stored> {
        let hidden = self.hidden.remove(&receipt)?;
        self.due.remove(&(hidden.until, receipt));
        if hidden.received {
            self.in_flight[hidden.message.group] -= 1;
            self.in_flight_total -= 1;
        }
        Some(hidden.message)
    }

    /// Deletes the message of `receipt`.
    pub fn delete(&mut self, receipt: u64) {
        self.unhide(receipt);
    }

    /// The message of `receipt` visible again: at once (first in line), or after
    /// `until` (still in flight until then).
    pub fn release(&mut self, receipt: u64, until: Option<UnixMillis>) {
        match until {
            None => {
                if let Some(message) = self.unhide(receipt) {
                    self.push_front(message);
                }
            }
            Some(until) => {
                if let Some(mut hidden) = self.hidden.remove(&receipt) {
                    self.due.remove(&(hidden.until, receipt));
                    hidden.until = until;
                    self.hide(receipt, hidden);
                }
            }
        }
    }

    /// Makes visible again, last in line by receipt, every hidden message due by `now`.
    pub fn reveal_due(&mut self, now: UnixMillis) {
        let mut due: Vec<u64> = self.due.iter().take_while(|(until, _)| *until <= now).map(|(_, receipt)| *receipt).collect();
        due.sort_unstable();
        for receipt in due {
            if let Some(message) = self.unhide(receipt) {
                self.push_back(message);
            }
        }
    }

    pub fn next_wake(&self) -> Option<UnixMillis> {
        self.due.first().map(|(until, _)| *until)
    }
}

/// Where a message sent `id`-th goes in its FIFO group: the order of sending.
fn sent_place(message: &Stored) -> i64 {
    i64::try_from(message.id).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(state: &mut QueueState, id: u64, lane: &str) -> Stored {
        let body = format!(r#"{{"id":"{id}","lane":"{lane}"}}"#);
        let group = state.group_of(&body, false);
        Stored { id, body, attempt: 0, sent_at: UnixMillis(0), group }
    }

    fn ids(received: &[(u64, Stored)]) -> Vec<u64> {
        received.iter().map(|(_, m)| m.id).collect()
    }

    /// 100 messages of a heavy lane, then one each of three light lanes.
    fn backlog(state: &mut QueueState) {
        for id in 0..100 {
            let message = stored(state, id, "heavy");
            state.push_back(message);
        }
        for (id, lane) in [(100, "a"), (101, "b"), (102, "c")] {
            let message = stored(state, id, lane);
            state.push_back(message);
        }
    }

    #[test]
    fn a_standard_queue_hands_out_in_line_and_a_message_put_back_comes_first() {
        let mut state = QueueState::standard();
        backlog(&mut state);
        let first = state.receive(40, UnixMillis(1_000));
        assert_eq!(ids(&first), (0..40).collect::<Vec<_>>());
        state.release(first[5].0, None);
        assert_eq!(ids(&state.receive(2, UnixMillis(1_000))), [5, 40]);
        // Due again: last in line.
        state.reveal_due(UnixMillis(1_000));
        let rest = state.receive(200, UnixMillis(2_000));
        assert_eq!(rest.len(), 103, "every message once more");
        assert_eq!(ids(&rest)[..3], [41, 42, 43]);
    }

    #[test]
    fn a_fair_queue_hands_out_the_quiet_groups_messages_once_one_group_is_noisy() {
        let mut state = QueueState::fair();
        backlog(&mut state);
        // 30 of heavy's in flight, all of the queue's: heavy is noisy from then on.
        assert_eq!(ids(&state.receive(30, UnixMillis(1_000))), (0..30).collect::<Vec<_>>());
        assert_eq!(ids(&state.receive(4, UnixMillis(1_000))), [100, 101, 102, 30], "the light lanes' first, then heavy's again");
        let mut standard = QueueState::standard();
        backlog(&mut standard);
        assert_eq!(ids(&standard.receive(33, UnixMillis(1_000)))[30..], [30, 31, 32], "a standard queue keeps the line");
    }

    #[test]
    fn a_message_in_flight_stays_counted_until_deleted_or_visible_again() {
        let mut state = QueueState::fair();
        backlog(&mut state);
        let received = state.receive(30, UnixMillis(1_000));
        // Put back for later: still in flight, heavy still noisy.
        state.release(received[0].0, Some(UnixMillis(5_000)));
        assert_eq!(ids(&state.receive(1, UnixMillis(1_000))), [100]);
        for (receipt, _) in &received[1..] {
            state.delete(*receipt);
        }
        assert_eq!(ids(&state.receive(1, UnixMillis(1_000))), [30], "one in flight of heavy's: quiet");
        state.reveal_due(UnixMillis(5_000));
        assert_eq!((state.visible_len(), state.hidden_len()), (103 - 29, 0), "all but the 29 deleted");
    }

    #[test]
    fn a_queue_hands_out_no_message_past_the_most_it_lets_be_in_flight() {
        let mut state = QueueState::fair();
        state.most_in_flight = 5;
        backlog(&mut state);
        let received = state.receive(10, UnixMillis(1_000));
        assert_eq!(received.len(), 5);
        assert!(state.in_flight_at_most() && state.receive(10, UnixMillis(1_000)).is_empty());
        state.release(received[0].0, Some(UnixMillis(5_000)));
        assert!(state.receive(10, UnixMillis(1_000)).is_empty(), "hidden for later: still in flight");
        state.delete(received[1].0);
        state.release(received[2].0, None);
        assert_eq!(state.receive(10, UnixMillis(1_000)).len(), 2, "one deleted, one visible again");
        assert_eq!(state.in_flight_peak, 5);
    }

    #[test]
    fn a_fifo_queue_gives_none_of_a_group_in_flight_and_gives_a_group_back_in_the_order_it_was_sent() {
        let mut state = QueueState::fifo();
        backlog(&mut state);
        let first = state.receive(10, UnixMillis(1_000));
        assert_eq!(ids(&first), (0..10).collect::<Vec<_>>(), "ten of heavy's, in order");
        assert_eq!(ids(&state.receive(10, UnixMillis(1_000))), [100, 101, 102], "heavy is in flight: the others' only");
        state.release(first[9].0, None);
        assert!(state.receive(10, UnixMillis(1_000)).is_empty(), "nine of heavy's still in flight");
        for (receipt, _) in &first[..9] {
            state.delete(*receipt);
        }
        let next = state.receive(3, UnixMillis(2_000));
        assert_eq!(ids(&next), [9, 10, 11], "the one given back first, in its place");
        state.reveal_due(UnixMillis(2_000));
        assert_eq!(ids(&state.receive(3, UnixMillis(3_000))), [9, 10, 11], "visible again: back in place, not last in line");
    }
}
