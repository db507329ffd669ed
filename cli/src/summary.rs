//! The end-of-run summary: what was dispatched, how it ended, and how much of each
//! quota tier was used, as a table or as JSON.

use paceline_orchestrator::StopReason;
use paceline_shared::quota::describe_use;
use paceline_worker::WorkerStats;
use serde::Serialize;

use crate::lane::LaneOutcome;

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

#[derive(Debug, Serialize)]
pub struct Summary {
    pub stop: StopReason,
    pub seconds: f64,
    pub dispatched: u64,
    pub health_checks: u64,
    pub succeeded: u64,
    pub requeued: u64,
    pub rate_limited: u64,
    /// Dead-lettered during this run, by the orchestrator (malformed, never fits) and by
    /// workers (4xx, attempts exhausted).
    pub dead_lettered: u64,
    /// Everything in the dead-letter queue now, earlier runs included.
    pub dead_letters_total: u64,
    pub circuit_opened: u64,
    pub circuit_closed: u64,
    /// Calls still running when the run stopped and had waited as long as a call may
    /// take: their jobs go back on the queue at the next start.
    pub interrupted: usize,
    /// The tier that held jobs back longest (none when nothing waited for a tier).
    pub paced_by: Option<String>,
    pub tiers: Vec<TierLine>,
}

impl Summary {
    #[must_use]
    pub fn new(outcome: &LaneOutcome) -> Self {
        let r = &outcome.report;
        let w = &outcome.worker;
        Self {
            stop: r.stop.clone(),
            seconds: r.ended_at.since(r.started_at).as_secs_f64(),
            dispatched: r.dispatched,
            health_checks: r.health_checks,
            succeeded: WorkerStats::get(&w.succeeded),
            requeued: WorkerStats::get(&w.requeued),
            rate_limited: WorkerStats::get(&w.rate_limited),
            dead_lettered: r.dead_lettered + WorkerStats::get(&w.dead_lettered),
            dead_letters_total: outcome.dead_letters_total,
            circuit_opened: WorkerStats::get(&w.circuit_opened),
            circuit_closed: WorkerStats::get(&w.circuit_closed),
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
        }
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
        out += &format!("  succeeded      {:>7}\n", self.succeeded);
        out += &format!("  re-queued      {:>7}\n", self.requeued);
        out += &format!("  answered 429   {:>7}   (each one means the configured quota is above the API's)\n", self.rate_limited);
        out += &format!("  dead-lettered  {:>7}   ({} in the DLQ in all)\n", self.dead_lettered, self.dead_letters_total);
        out += &format!("  circuit        opened {}, closed {}\n", self.circuit_opened, self.circuit_closed);
        if self.interrupted > 0 {
            out +=
                &format!("  interrupted    {:>7}   (calls still running at the stop; their jobs go back on the queue at the next start)\n", self.interrupted);
        }
        out += &format!("  {:<18} {:>7}   {:>14}   use\n", "tier", "units", "busiest window");
        for t in &self.tiers {
            let busiest = format!("{}/{}", t.peak_window, t.limit);
            let used = describe_use(&t.tier, t.calendar, t.utilization);
            let pace = if self.paced_by.as_deref() == Some(t.tier.as_str()) { "  <- set the pace" } else { "" };
            out += &format!("  {:<18} {:>7}   {busiest:>14}   {used}{pace}\n", t.tier, t.units);
        }
        out
    }
}
