//! The end-of-run summary: what was dispatched, how it ended, and how much of each
//! quota tier was used, as a table or as JSON.

use std::time::Duration;

use paceline_orchestrator::StopReason;
use paceline_shared::breaker::{Circuit, CircuitStatus};
use paceline_shared::lane::LaneId;
use paceline_shared::quota::describe_use;
use paceline_shared::table::text_table;
use paceline_shared::time::UnixMillis;
use paceline_worker::WorkerStats;
use serde::Serialize;

use crate::stack::LaneOutcome;

#[derive(Debug, Serialize)]
pub struct TierLine {
    pub tier: String,
    pub units: u64,
    /// The busiest window held `peak_window` of `limit` units.
    pub peak_window: u64,
    pub limit: u64,
    /// Rolling tiers: the achieved rate's share of the tier's while jobs waited for the
    /// pacer (over at least one window). Calendar tiers: the share of the current day or
    /// month used.
    #[serde(serialize_with = "paceline_shared::figures::six_digits")]
    pub utilization: f64,
    /// A day or month tier.
    pub calendar: bool,
}

/// One state of the circuit, and when it began.
#[derive(Debug, Serialize)]
pub struct CircuitMoment {
    /// The lane whose circuit it is (with `[lanes]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lane: Option<String>,
    pub status: CircuitStatus,
    /// RFC 3339.
    pub at: String,
    /// Seconds from the start of the run.
    #[serde(serialize_with = "paceline_shared::figures::six_digits")]
    pub after_seconds: f64,
    pub reason: String,
}

impl CircuitMoment {
    fn new(lane: Option<&LaneId>, circuit: &Circuit, run_started: UnixMillis) -> Self {
        Self {
            lane: lane.map(ToString::to_string),
            status: circuit.status,
            at: circuit.since.to_rfc3339(),
            after_seconds: circuit.since.since(run_started).as_secs_f64(),
            reason: circuit.reason.clone(),
        }
    }
}

/// How long the circuit stayed open in `changes` (each state lasting until the next, the
/// last until `ended`).
fn paused_for(changes: &[Circuit], ended: UnixMillis) -> Duration {
    changes
        .iter()
        .enumerate()
        .filter(|(_, c)| c.status == CircuitStatus::Open)
        .map(|(i, c)| changes.get(i + 1).map_or(ended, |next| next.since).since(c.since))
        .sum()
}

/// Each lane's circuit changes apart, in the order of the lanes' first change.
fn by_lane(changes: &[(LaneId, Circuit)]) -> Vec<(&LaneId, Vec<Circuit>)> {
    let mut lanes: Vec<(&LaneId, Vec<Circuit>)> = Vec::new();
    for (lane, circuit) in changes {
        match lanes.iter_mut().find(|(seen, _)| *seen == lane) {
            Some((_, circuits)) => circuits.push(circuit.clone()),
            None => lanes.push((lane, vec![circuit.clone()])),
        }
    }
    lanes
}

#[derive(Debug, Serialize)]
pub struct Summary {
    pub stop: StopReason,
    pub seconds: f64,
    pub dispatched: u64,
    /// Calls made for jobs (health checks apart): hand-offs whose worker missed its slot
    /// made none.
    pub called: u64,
    pub health_checks: u64,
    pub succeeded: u64,
    pub requeued: u64,
    /// Of the re-queued, jobs whose worker started after its slot's last moment (a busy
    /// machine): they made no call, and go again.
    pub missed_slots: u64,
    pub rate_limited: u64,
    /// Dead-lettered during this run, by the orchestrator (malformed, never fits) and by
    /// workers (4xx, attempts exhausted).
    pub dead_lettered: u64,
    /// Everything in the dead-letter queue now, earlier runs included.
    pub dead_letters_total: u64,
    pub circuit_opened: u64,
    pub circuit_closed: u64,
    /// The circuit's states during the run, oldest first.
    pub circuit_timeline: Vec<CircuitMoment>,
    /// How long the circuit was open (no job dispatched) during the run.
    #[serde(serialize_with = "paceline_shared::figures::six_digits")]
    pub dispatch_paused_seconds: f64,
    /// Calls still running when the run stopped and had waited as long as a call may
    /// take: their jobs go back on the queue at the next start.
    pub interrupted: usize,
    /// The tier that held jobs back longest (none when nothing waited for a tier).
    pub paced_by: Option<String>,
    /// One lane's tiers, or with `[lanes]` the shared ones.
    pub tiers: Vec<TierLine>,
    /// With `[lanes]`: each lane that had jobs, most calls first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub lanes: Vec<LaneLine>,
    /// With `[lanes]`: Jain's index over the lanes contending for the shared quota, by
    /// weight, in 10 s windows (none when no window had two).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fairness: Option<paceline_orchestrator::Fairness>,
}

/// A lane's line in the summary.
#[derive(Debug, Serialize)]
pub struct LaneLine {
    pub lane: String,
    pub weight: f64,
    pub dispatched: u64,
    /// The longest one of its jobs waited from its enqueue to its slot.
    #[serde(serialize_with = "paceline_shared::figures::six_digits")]
    pub longest_wait_seconds: f64,
    /// Its own tiers' busiest windows, `5/5 of 5/s`.
    pub busiest: Vec<String>,
}

/// The summary shows this many lanes; `--json` has them all.
const LANES_SHOWN: usize = 10;

impl Summary {
    #[must_use]
    pub fn new(outcome: &LaneOutcome) -> Self {
        let r = &outcome.report;
        let w = &outcome.worker;
        Self {
            stop: r.stop.clone(),
            seconds: r.ended_at.since(r.started_at).as_secs_f64(),
            dispatched: r.dispatched,
            called: WorkerStats::get(&w.calls),
            health_checks: r.health_checks,
            succeeded: WorkerStats::get(&w.succeeded),
            requeued: WorkerStats::get(&w.requeued),
            missed_slots: WorkerStats::get(&w.missed_slots),
            rate_limited: WorkerStats::get(&w.rate_limited),
            dead_lettered: r.dead_lettered + WorkerStats::get(&w.dead_lettered),
            dead_letters_total: outcome.dead_letters_total,
            circuit_opened: WorkerStats::get(&w.circuit_opened),
            circuit_closed: WorkerStats::get(&w.circuit_closed),
            circuit_timeline: outcome
                .circuit_changes
                .iter()
                .map(|(lane, c)| CircuitMoment::new((!r.lanes.is_empty()).then_some(lane), c, r.started_at))
                .collect(),
            // With lanes, the longest any lane's dispatch was paused.
            dispatch_paused_seconds: by_lane(&outcome.circuit_changes)
                .iter()
                .map(|(_, changes)| paused_for(changes, r.ended_at))
                .max()
                .unwrap_or_default()
                .as_secs_f64(),
            interrupted: outcome.interrupted,
            paced_by: r.paced_by.map(|t| t.to_string()),
            tiers: r
                .tiers
                .iter()
                .map(|t| TierLine {
                    tier: t.tier.to_string(),
                    units: t.units,
                    peak_window: t.peak_window,
                    limit: t.tier.max_in_one_window(),
                    utilization: t.utilization,
                    calendar: t.tier.is_calendar(),
                })
                .collect(),
            lanes: r
                .lanes
                .iter()
                .map(|lane| LaneLine {
                    lane: lane.lane.clone(),
                    weight: lane.weight,
                    dispatched: lane.dispatched,
                    longest_wait_seconds: Duration::from_millis(lane.longest_wait_ms).as_secs_f64(),
                    busiest: lane.tiers.iter().map(|t| format!("{}/{} of {}", t.peak_window, t.tier.max_in_one_window(), t.tier)).collect(),
                })
                .collect(),
            fairness: r.fairness,
        }
    }

    /// The circuit's run in words: "stayed closed", or when it opened (and why), went
    /// half-open and closed, and how long dispatch was paused.
    pub fn circuit_story(&self) -> String {
        if self.circuit_timeline.is_empty() {
            return "stayed closed".into();
        }
        let mut stories: Vec<(Option<&str>, Vec<String>)> = Vec::new();
        for m in &self.circuit_timeline {
            let verb = match m.status {
                CircuitStatus::Open => "opened",
                CircuitStatus::HalfOpen => "half-open",
                CircuitStatus::Closed => "closed",
            };
            let why = if m.status == CircuitStatus::Open && !m.reason.is_empty() { format!(" ({})", m.reason) } else { String::new() };
            let moment = format!("{verb} at {:.1} s{why}", m.after_seconds);
            match stories.iter_mut().find(|(lane, _)| *lane == m.lane.as_deref()) {
                Some((_, moments)) => moments.push(moment),
                None => stories.push((m.lane.as_deref(), vec![moment])),
            }
        }
        let told: Vec<String> = stories
            .into_iter()
            .map(|(lane, moments)| match lane {
                Some(lane) => format!("{lane}'s {}", moments.join(", ")),
                None => moments.join(", "),
            })
            .collect();
        let paused = if self.circuit_timeline.iter().any(|m| m.lane.is_some()) { "a lane's dispatch paused for at most" } else { "dispatch paused for" };
        format!("{}; {paused} {:.1} s", told.join("; "), self.dispatch_paused_seconds)
    }

    /// The human-readable form.
    #[must_use]
    pub fn render(&self) -> String {
        let why = match self.stop {
            StopReason::Drained => "the queue is drained",
            StopReason::Deadline => "its time was up",
            StopReason::Stopped => "it was asked to stop",
            StopReason::LeaseLost => "another run took the lease",
        };
        let mut out = format!("run ended after {:.1} s: {why}\n", self.seconds);
        out += &format!("  dispatched     {:>7}   (+ {} health checks)\n", self.dispatched, self.health_checks);
        out += &format!("  called         {:>7}\n", self.called);
        out += &format!("  succeeded      {:>7}\n", self.succeeded);
        out += &format!("  re-queued      {:>7}\n", self.requeued);
        if self.missed_slots > 0 {
            out += &format!("    {} of them started after their slot (a busy machine) and made no call; the slots went back to the pacer\n", self.missed_slots);
        }
        out += &format!("  answered 429   {:>7}   (each one means the configured quota is above the API's)\n", self.rate_limited);
        out += &format!("  dead-lettered  {:>7}   ({} in the DLQ in all)\n", self.dead_lettered, self.dead_letters_total);
        out += &format!("  circuit        {}\n", self.circuit_story());
        if self.interrupted > 0 {
            out +=
                &format!("  interrupted    {:>7}   (calls still running at the stop; their jobs go back on the queue at the next start)\n", self.interrupted);
        }
        let mut tiers = text_table(&["tier", "units", "busiest window", "use"], &[1, 2]);
        for t in &self.tiers {
            let used = describe_use(&t.tier, t.calendar, t.utilization);
            let pace = if self.paced_by.as_deref() == Some(t.tier.as_str()) { " (set the pace)" } else { "" };
            tiers.add_row(vec![t.tier.clone(), t.units.to_string(), format!("{}/{}", t.peak_window, t.limit), format!("{used}{pace}")]);
        }
        // Lanes that share no quota ([quota] left out) have no shared tier to show.
        if !self.tiers.is_empty() {
            out += &format!("{tiers}\n");
        }
        if !self.lanes.is_empty() {
            let heading =
                if self.lanes.len() > LANES_SHOWN { format!("lanes (the {LANES_SHOWN} with most calls of {})", self.lanes.len()) } else { "lanes".to_owned() };
            let mut lanes = text_table(&[heading.as_str(), "weight", "calls", "longest wait", "its busiest windows"], &[1, 2, 3]);
            // A lane with no call (its jobs dead-lettered or still waiting) has no line.
            for lane in self.lanes.iter().filter(|lane| lane.dispatched > 0).take(LANES_SHOWN) {
                lanes.add_row(vec![
                    lane.lane.clone(),
                    lane.weight.to_string(),
                    lane.dispatched.to_string(),
                    format!("{:.1} s", lane.longest_wait_seconds),
                    lane.busiest.join(", "),
                ]);
            }
            out += &format!("{lanes}\n");
            if let Some(f) = &self.fairness {
                let seconds = paceline_orchestrator::FAIRNESS_WINDOW.as_secs();
                out += &format!(
                    "fairness: Jain's index {:.3} among the lanes contending for the shared quota, by weight (mean of {} window(s) of {seconds} s; 1 is even)\n",
                    f.jain_index, f.windows
                );
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn circuit(status: CircuitStatus, since: u64) -> Circuit {
        Circuit { status, epoch: since, since: UnixMillis(since), reason: "HTTP 503".into(), reopened: 0, held: false }
    }

    #[test]
    fn dispatch_is_paused_while_the_circuit_is_open_and_until_the_run_ends_if_it_stays_open() {
        let changes = [circuit(CircuitStatus::Open, 10_000), circuit(CircuitStatus::HalfOpen, 16_500), circuit(CircuitStatus::Closed, 20_000)];
        assert_eq!(paused_for(&changes, UnixMillis(30_000)), Duration::from_millis(6_500));
        let reopened = [circuit(CircuitStatus::Open, 10_000), circuit(CircuitStatus::HalfOpen, 12_000), circuit(CircuitStatus::Open, 13_000)];
        assert_eq!(paused_for(&reopened, UnixMillis(20_000)), Duration::from_millis(2_000 + 7_000));
        assert_eq!(paused_for(&[], UnixMillis(20_000)), Duration::ZERO);
    }

    #[test]
    fn the_circuit_story_names_each_state_from_the_start_of_the_run() {
        let started = UnixMillis(1_000);
        let changes = [circuit(CircuitStatus::Open, 13_800), circuit(CircuitStatus::HalfOpen, 20_100), circuit(CircuitStatus::Closed, 28_100)];
        let summary = Summary {
            stop: StopReason::Drained,
            seconds: 45.0,
            dispatched: 0,
            health_checks: 0,
            succeeded: 0,
            requeued: 0,
            missed_slots: 0,
            called: 0,
            rate_limited: 0,
            dead_lettered: 0,
            dead_letters_total: 0,
            circuit_opened: 1,
            circuit_closed: 1,
            circuit_timeline: changes.iter().map(|c| CircuitMoment::new(None, c, started)).collect(),
            dispatch_paused_seconds: paused_for(&changes, UnixMillis(46_000)).as_secs_f64(),
            interrupted: 0,
            paced_by: None,
            tiers: Vec::new(),
            lanes: Vec::new(),
            fairness: None,
        };
        assert_eq!(summary.circuit_story(), "opened at 12.8 s (HTTP 503), half-open at 19.1 s, closed at 27.1 s; dispatch paused for 6.3 s");
        let calm = Summary { circuit_timeline: Vec::new(), ..summary };
        assert_eq!(calm.circuit_story(), "stayed closed");
    }
}
