//! The decision step alone, for benchmarks: a stack's machine drains a backlog with
//! every port answered at once from memory under virtual time, so what is measured is
//! the decisions (`next_action` and `on_event`), not I/O. `benches/scheduler.rs` prints
//! decisions per second with it; not part of the API.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use paceline_shared::breaker::Circuit;
use paceline_shared::job::{Job, WorkerPayload};
use paceline_shared::ports::{Lease, QueuedMessage};
use paceline_shared::time::UnixMillis;

use crate::report::Progress;
use crate::settings::Settings;
use crate::stack::{Action, Event, LaneStart, SharedState, StackMachine};

/// What a drained backlog took.
#[derive(Clone, Copy, Debug)]
pub struct DecisionFigures {
    /// `next_action` calls.
    pub decisions: u64,
    pub dispatched: u64,
    /// Wall time of the whole drive (one thread, no I/O: its CPU time).
    pub took: Duration,
    /// Virtual time the backlog took to drain.
    pub drained_in: Duration,
}

/// A queue in memory with SQS's visibility: visible messages in order, hidden ones
/// until their time, found by receipt.
#[derive(Default)]
struct MemoryQueue {
    by_time: BTreeMap<(UnixMillis, u64), QueuedMessage>,
    by_receipt: HashMap<String, (UnixMillis, u64)>,
    received: u64,
}

impl MemoryQueue {
    fn receive(&mut self, max: usize, now: UnixMillis, visibility: Duration) -> Vec<QueuedMessage> {
        let due: Vec<(UnixMillis, u64)> = self.by_time.range(..=(now, u64::MAX)).take(max).map(|(key, _)| *key).collect();
        due.into_iter()
            .map(|key| {
                let mut message = self.by_time.remove(&key).expect("a due message");
                self.by_receipt.remove(&message.receipt);
                self.received += 1;
                message.receipt = format!("r{}", self.received);
                let hidden = (now.plus(visibility), key.1);
                self.by_receipt.insert(message.receipt.clone(), hidden);
                self.by_time.insert(hidden, message.clone());
                message
            })
            .collect()
    }

    fn release(&mut self, receipts: &[String], at: UnixMillis) {
        for receipt in receipts {
            if let Some(key) = self.by_receipt.get_mut(receipt) {
                let message = self.by_time.remove(key).expect("a message by its receipt");
                *key = (at, key.1);
                self.by_time.insert(*key, message);
            }
        }
    }

    /// The job of `message` sent again, visible at `at` (after the jobs first sent then);
    /// the received one deleted.
    fn send_again(&mut self, message: &QueuedMessage, at: UnixMillis) {
        self.delete(std::slice::from_ref(&message.receipt));
        self.received += 1;
        let key = (at, (1 << 40) + self.received);
        let sent = QueuedMessage { receipt: format!("s{}", self.received), ..message.clone() };
        self.by_receipt.insert(sent.receipt.clone(), key);
        self.by_time.insert(key, sent);
    }

    fn delete(&mut self, receipts: &[String]) {
        for receipt in receipts {
            if let Some(key) = self.by_receipt.remove(receipt) {
                self.by_time.remove(&key);
            }
        }
    }
}

/// A job on the queue of [`drain`].
#[derive(Clone, Debug)]
pub struct QueuedJob {
    pub lane: String,
    pub cost: u64,
    /// When it is put on the queue, after the run starts.
    pub after: Duration,
}

impl QueuedJob {
    /// A job of cost 1 of `lane`, on the queue from the start.
    #[must_use]
    pub fn of(lane: String) -> Self {
        Self { lane, cost: 1, after: Duration::ZERO }
    }
}

/// Drains `jobs` (in queue order) through a stack under `settings` (one lane, or many
/// with `[lanes]`), every port answering at once, for at most `for_at_most` of virtual
/// time (the run's deadline). `on_call` sees each job handed off with its slot (where
/// its worker calls, with `dispatch_ahead` 0). `at_end` is called once drained, while
/// the machine still holds its lanes (to measure its memory), with the queue dropped.
///
/// # Panics
/// If the run takes far more decisions than it should (a loop).
#[expect(clippy::disallowed_methods, reason = "a benchmark: times the decisions on this machine's clock")]
pub fn drain(
    settings: &Settings,
    jobs: &[QueuedJob],
    for_at_most: Duration,
    mut on_call: impl FnMut(UnixMillis, &Job),
    at_end: impl FnOnce(),
) -> DecisionFigures {
    let started = UnixMillis(1_800_000_000_000);
    let mut queue = MemoryQueue::default();
    for (seq, job) in jobs.iter().enumerate() {
        let QueuedJob { lane, cost, after } = job;
        let body = format!(r#"{{"id":"j{seq}","lane":"{lane}","cost":{cost},"request":{{"method":"GET","path":"/items/{seq}"}}}}"#);
        let at = started.plus(*after);
        let message = QueuedMessage { message_id: format!("m{seq}"), receipt: format!("q{seq}"), body, attempt: 0, enqueued_at: at, group: None };
        queue.by_receipt.insert(message.receipt.clone(), (at, seq as u64));
        queue.by_time.insert((at, seq as u64), message);
    }
    let progress = Progress::default();
    let lease = |at: UnixMillis| Lease { holder: "bench".into(), epoch: 1, expires_at: at.plus(Duration::from_secs(60)) };
    let deadline = started.plus(for_at_most);
    let mut machine = StackMachine::new(settings, &progress, lease(started), started, deadline, true);
    let visibility = settings.orchestrator.visibility_timeout;
    let shared = || SharedState { circuit: Circuit::default(), cool_down: UnixMillis(0), provider_reading: None, call_slots: None, retune: None };
    let (mut now, mut decisions, mut dispatched) = (started, 0u64, 0u64);
    let clock = Instant::now();
    // A loop that stops advancing is a failure, not a hang: far more decisions than any
    // drain of these jobs takes.
    let most_decisions = 100_000 + 1_000 * jobs.len() as u64;
    loop {
        decisions += 1;
        assert!(decisions <= most_decisions, "no end after {decisions} decisions, at {} ms", now.since(started).as_millis());
        let event = match machine.next_action(now) {
            Action::Stop => break,
            Action::Sleep { until, .. } => {
                now = until.max(now.plus(Duration::from_millis(1)));
                continue;
            }
            Action::Renew(_) => Event::Renewed(Ok(lease(now))),
            Action::Refresh(lane) => Event::Refreshed(lane, Ok(shared())),
            // Benchmarked lanes are not ordered: nothing was ever handed off in order.
            Action::ReadOrder(lane) => Event::OrderRead(lane, Ok(None)),
            Action::RefreshLanes(lanes) => Event::LanesRefreshed(lanes.into_iter().map(|lane| (lane, Ok((shared(), None)))).collect()),
            Action::SwapCircuit { lane, next, .. } => Event::CircuitSwapped(lane, next, Ok(())),
            Action::Flush(..) => Event::Flushed(Ok(())),
            Action::StartRelay(_) => Event::RelayStarted(Ok(())),
            Action::Reserve(lane, needed) => Event::Reserved(lane, needed, Ok(())),
            Action::ReserveShared(needed) => {
                let granted = needed.iter().map(|reservation| crate::reservations::Granted { units: reservation.units, shared_count: None }).collect();
                Event::SharedReserved(needed, Ok(granted))
            }
            Action::HydrateLanes(lanes) => {
                // A fresh store: nothing used in any tier.
                let start = |lane: usize| {
                    let calendar_used = vec![0; machine.lane_scope(lane).1.tiers().len()];
                    LaneStart { last_run: crate::handover::LastRun::None, calendar_used, shared: shared() }
                };
                Event::LanesHydrated(lanes.into_iter().map(|lane| (lane, Ok(start(lane)))).collect())
            }
            Action::Forward(..) | Action::ReadShares | Action::WriteShares(..) | Action::ReadHomes | Action::HandOver(..) => {
                unreachable!("the benchmarked stack is one shard")
            }
            Action::DeadLetter(message, ..) => {
                queue.delete(std::slice::from_ref(&message.receipt));
                Event::DeadLettered(message, Ok(()))
            }
            Action::Release(messages) => {
                for message in &messages {
                    queue.release(std::slice::from_ref(&message.receipt), now.plus(message.after));
                }
                Event::released(&messages, Ok(()))
            }
            Action::SendAgain(jobs) => {
                for (message, delay) in &jobs {
                    queue.send_again(message, now.plus(*delay));
                }
                Event::SentAgain(jobs.into_iter().map(|(message, _)| message).collect(), Ok(()))
            }
            Action::ExtendHidden(receipts) => {
                queue.release(&receipts, now.plus(settings.orchestrator.visibility_timeout));
                Event::ExtendedHidden(receipts.len(), Ok(()))
            }
            Action::Receive { max, wait, long_poll } => {
                let received = queue.receive(max, now, visibility);
                if received.is_empty() && long_poll {
                    // A long poll waits for the first message to be visible, or `wait`.
                    let visible = queue.by_time.keys().next().map_or(UnixMillis(u64::MAX), |(at, _)| *at);
                    now = now.plus(wait).min(visible).max(now.plus(Duration::from_millis(1)));
                }
                Event::Received { result: Ok(received), took: Duration::ZERO, long_poll }
            }
            Action::Delete(receipts) => {
                queue.delete(&receipts);
                Event::Deleted(receipts, Ok(()))
            }
            Action::Dispatch(hand_off, payload) => {
                dispatched += 1;
                if let WorkerPayload::Job { job, .. } = &payload {
                    on_call(hand_off.slot, job);
                }
                Event::HandedOff(hand_off, Box::new(payload), Ok(()))
            }
            Action::HealthCheck(lane, _) => Event::HealthChecked(lane, Ok(())),
            Action::CheckDrained => Event::DrainChecked(Ok(queue.by_time.is_empty())),
        };
        machine.on_event(event, now).expect("every port answers");
    }
    let took = clock.elapsed();
    drop(queue);
    at_end();
    drop(machine);
    DecisionFigures { decisions, dispatched, took, drained_in: now.since(started) }
}
