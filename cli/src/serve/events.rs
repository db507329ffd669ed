//! The live events `serve` streams (`GET /v1/events`, server-sent events): calls, dead
//! letters, circuit changes and the queue's depths, found by one watcher that reads the
//! stack twice a second and hands each event, encoded once, to every open stream.

use std::sync::Arc;
use std::time::Duration;

use paceline_shared::adapters::embedded::{EmbeddedStore, OutcomeQuery};
use paceline_shared::breaker::CircuitStatus;
use paceline_shared::outcome::{Ending, OutcomeRecord};
use paceline_shared::ports::QueueDepth;
use paceline_shared::time::{system_now, Clock as _, SystemClock};
use serde::Serialize;

use super::Served;
use crate::stack::StoredCircuits;

/// How often the watcher reads the stack.
const WATCH_EVERY: Duration = Duration::from_millis(500);
/// Outcome records read per look.
const RECORDS_PER_LOOK: usize = 1_000;

/// A call answered (or that got no answer), as its outcome record says.
#[derive(Clone, Debug, Serialize)]
pub struct CallSeen {
    job_id: String,
    lane: String,
    outcome: String,
    status: Option<u16>,
    attempts: u32,
    at: Option<String>,
}

/// A job that went to the DLQ.
#[derive(Clone, Debug, Serialize)]
pub struct DeadLetterSeen {
    job_id: String,
    lane: String,
    reason: Option<String>,
}

/// What happened, as a stream sends it (`event:` is its `type`). Calls and dead letters
/// come in one event per look at the store (twice a second), however many there were:
/// at 100 calls/s a hundred streams then cost a few writes a second each, not hundreds.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServedEvent {
    Calls {
        calls: Vec<CallSeen>,
    },
    DeadLetters {
        dead_letters: Vec<DeadLetterSeen>,
    },
    /// A lane's circuit changed.
    Circuit {
        lane: String,
        status: CircuitStatus,
        epoch: u64,
        reason: String,
        held: bool,
    },
    /// The queue's depths changed.
    Queue {
        ready: u64,
        in_flight: u64,
        dead: u64,
    },
}

impl ServedEvent {
    /// The SSE `event:` name.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Calls { .. } => "calls",
            Self::DeadLetters { .. } => "dead_letters",
            Self::Circuit { .. } => "circuit",
            Self::Queue { .. } => "queue",
        }
    }
}

/// Sorts a page of outcome records into the calls and the dead letters they tell of.
fn seen_in<'a>(records: impl Iterator<Item = &'a OutcomeRecord>) -> (Vec<CallSeen>, Vec<DeadLetterSeen>) {
    let mut calls = Vec::new();
    let mut dead_letters = Vec::new();
    for record in records {
        let lane = record.lane.to_string();
        if record.times.called.is_some() {
            calls.push(CallSeen {
                job_id: record.job_id.clone(),
                lane: lane.clone(),
                outcome: record.outcome.label().to_owned(),
                status: record.status,
                attempts: record.attempts,
                at: record.times.answered.or(record.times.called).map(|at| at.to_rfc3339()),
            });
        }
        if record.outcome == Ending::DeadLettered {
            dead_letters.push(DeadLetterSeen { job_id: record.job_id.clone(), lane, reason: record.reason.clone() });
        }
    }
    (calls, dead_letters)
}

/// An event as every stream sends it, encoded once.
pub struct Published {
    pub name: &'static str,
    pub json: String,
}

impl From<ServedEvent> for Published {
    fn from(event: ServedEvent) -> Self {
        // Plain data (strings, numbers, an enum of unit variants): it always encodes.
        Self { name: event.name(), json: serde_json::to_string(&event).unwrap_or_default() }
    }
}

/// What the watcher saw last, to tell what is new.
#[derive(Default)]
pub struct Seen {
    after_row: i64,
    circuits: StoredCircuits,
    queue: Option<QueueDepth>,
}

impl Seen {
    /// What is there as `serve` starts: what happened before is in `results`, not news.
    pub fn as_of_now(served: &Served) -> Self {
        let mut seen = Self::default();
        if let Some(store) = &served.stack.embedded {
            seen.after_row = store.newest_outcome_row().unwrap_or(0);
            seen.circuits.changed(store);
        }
        seen
    }
}

/// Reads the stack every [`WATCH_EVERY`] and publishes what changed since `seen`, until
/// `serve` stops. Outcome records (calls, dead letters) and every lane's circuit are read
/// where the embedded store keeps them; the queue's depths on any stack.
pub async fn watch(served: Arc<Served>, mut seen: Seen) {
    let mut stopping = served.stopping.clone();
    loop {
        if let Some(store) = &served.stack.embedded {
            look_at_records(&served, store, &mut seen);
            look_at_circuits(&served, store, &mut seen);
        }
        if let Ok(depth) = served.stack.queues.depth().await {
            if seen.queue != Some(depth) {
                seen.queue = Some(depth);
                served.publish(ServedEvent::Queue { ready: depth.visible, in_flight: depth.not_visible, dead: depth.dead });
            }
        }
        tokio::select! {
            () = SystemClock.sleep_until_coarse(system_now().plus(WATCH_EVERY)) => {}
            _ = stopping.wait_for(|stop| *stop) => return,
        }
    }
}

fn look_at_records(served: &Served, store: &EmbeddedStore, seen: &mut Seen) {
    loop {
        let query = OutcomeQuery { after_row: seen.after_row, limit: RECORDS_PER_LOOK, ..OutcomeQuery::default() };
        let Ok(page) = store.outcomes(&query) else { return };
        if let Some(last) = page.last() {
            seen.after_row = last.row;
        }
        for kept in &page {
            served.metrics.saw(&kept.record);
        }
        let (calls, dead_letters) = seen_in(page.iter().map(|kept| &kept.record));
        if !calls.is_empty() {
            served.publish(ServedEvent::Calls { calls });
        }
        if !dead_letters.is_empty() {
            served.publish(ServedEvent::DeadLetters { dead_letters });
        }
        if page.len() < RECORDS_PER_LOOK {
            return;
        }
    }
}

fn look_at_circuits(served: &Served, store: &EmbeddedStore, seen: &mut Seen) {
    for (lane, circuit) in seen.circuits.changed(store) {
        served.publish(ServedEvent::Circuit {
            lane: lane.to_string(),
            status: circuit.status,
            epoch: circuit.epoch,
            reason: circuit.reason,
            held: circuit.held,
        });
    }
}
