//! `/metrics`: the stack in Prometheus's text format, encoded by `prometheus-client`.
//! Counters (calls, the dispatch-to-call delay) grow as `serve` sees outcome records;
//! gauges (tiers, queue, circuits, dead letters) are read from the stack at each scrape.

use std::sync::Mutex;

use paceline_shared::breaker::CircuitStatus;
use paceline_shared::dlq::CauseGroup;
use paceline_shared::outcome::OutcomeRecord;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::commands::status::Status;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    lane: String,
    /// `2xx`, `4xx`, `5xx`, or `none` (no answer: a timeout, a dead connection).
    status: String,
    /// `succeeded`, `dead_lettered` or `retrying`.
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabels {
    /// The lane whose tier it is (`shared` for the tiers every lane shares).
    lane: String,
    tier: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    /// `ready`, `in_flight` (or delayed) or `dead`.
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CircuitLabels {
    lane: String,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeadLabels {
    dlq: String,
    cause: String,
}

/// Every metric `serve` exposes.
pub struct Metrics {
    registry: Registry,
    calls: Family<CallLabels, Counter>,
    dispatch_to_call: Histogram,
    tier_used: Family<TierLabels, Gauge>,
    tier_limit: Family<TierLabels, Gauge>,
    queue: Family<QueueLabels, Gauge>,
    oldest_job_age: Gauge,
    circuit: Family<CircuitLabels, Gauge>,
    dead_letters: Family<DeadLabels, Gauge>,
    /// One scrape at a time refills the gauges.
    scrape: Mutex<()>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("paceline");
        let calls = Family::<CallLabels, Counter>::default();
        registry.register("calls", "Calls made to the API, by lane, status class and outcome", calls.clone());
        // 1 ms to about 16 s: pacing keeps this near the dispatch lead; a backlog of
        // workers waiting for call slots shows in the upper buckets.
        let dispatch_to_call = Histogram::new([0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]);
        registry.register("dispatch_to_call_delay_seconds", "From a job's hand-off to a worker to its call", dispatch_to_call.clone());
        let tier_used = Family::<TierLabels, Gauge>::default();
        registry.register("tier_used", "Units used in each quota tier's current window", tier_used.clone());
        let tier_limit = Family::<TierLabels, Gauge>::default();
        registry.register("tier_limit", "Each quota tier's limit", tier_limit.clone());
        let queue = Family::<QueueLabels, Gauge>::default();
        registry.register("queue_jobs", "Jobs on the queue: ready, in flight or delayed, and dead-lettered", queue.clone());
        let oldest_job_age = Gauge::default();
        registry.register("oldest_job_age_seconds", "Age of the oldest job on the queue (the embedded store)", oldest_job_age.clone());
        let circuit = Family::<CircuitLabels, Gauge>::default();
        registry.register("circuit_state", "1 for each lane's circuit state (closed, half_open, open), 0 for the others", circuit.clone());
        let dead_letters = Family::<DeadLabels, Gauge>::default();
        registry.register("dead_letters", "Dead letters by DLQ and cause", dead_letters.clone());
        Self { registry, calls, dispatch_to_call, tier_used, tier_limit, queue, oldest_job_age, circuit, dead_letters, scrape: Mutex::new(()) }
    }
}

/// A circuit's state as the metric labels it.
fn state_label(status: CircuitStatus) -> &'static str {
    match status {
        CircuitStatus::Closed => "closed",
        CircuitStatus::HalfOpen => "half_open",
        CircuitStatus::Open => "open",
    }
}

fn as_gauge(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// What a scrape reads from the stack besides its status.
pub struct Scraped<'a> {
    pub status: &'a Status,
    /// Dead letters by DLQ and cause, where they can be counted without disturbing the
    /// DLQ (the embedded store).
    pub dead_by_cause: Option<&'a [CauseGroup]>,
    pub oldest_job_age_seconds: Option<u64>,
}

impl Metrics {
    /// Counts a call that `record` says was made.
    pub fn saw(&self, record: &OutcomeRecord) {
        let Some(called) = record.times.called else { return };
        let status = record.status.map_or_else(|| "none".to_owned(), |status| format!("{}xx", status / 100));
        let labels = CallLabels { lane: record.lane.to_string(), status, outcome: record.outcome.label().to_owned() };
        self.calls.get_or_create(&labels).inc();
        if let Some(dispatched) = record.times.dispatched {
            self.dispatch_to_call.observe(called.since(dispatched).as_secs_f64());
        }
    }

    /// The text a scrape gets, the gauges filled from `scraped`.
    pub fn render(&self, scraped: &Scraped<'_>) -> String {
        let _one_at_a_time = self.scrape.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let status = scraped.status;
        for family in [&self.tier_used, &self.tier_limit] {
            family.clear();
        }
        let shared_or_default = if status.lanes.is_some() { "shared" } else { "default" };
        for tier in &status.tiers {
            let labels = TierLabels { lane: shared_or_default.to_owned(), tier: tier.tier.clone() };
            self.tier_limit.get_or_create(&labels).set(as_gauge(tier.limit));
            self.tier_used.get_or_create(&labels).set(as_gauge(tier.used.unwrap_or(0)));
        }
        let queue = status.queue;
        for (state, count) in [("ready", queue.visible), ("in_flight", queue.not_visible), ("dead", queue.dead)] {
            self.queue.get_or_create(&QueueLabels { state: state.to_owned() }).set(as_gauge(count));
        }
        self.oldest_job_age.set(as_gauge(scraped.oldest_job_age_seconds.unwrap_or(0)));
        self.circuit.clear();
        let circuits: Vec<(String, CircuitStatus)> = match (&status.lanes, &status.circuit) {
            (Some(lanes), _) => lanes.iter().map(|lane| (lane.lane.clone(), lane.circuit)).collect(),
            (None, Some(circuit)) => vec![(status.lane.clone().unwrap_or_else(|| "default".to_owned()), circuit.status)],
            (None, None) => Vec::new(),
        };
        for (lane, current) in circuits {
            for state in [CircuitStatus::Closed, CircuitStatus::HalfOpen, CircuitStatus::Open] {
                let labels = CircuitLabels { lane: lane.clone(), state: state_label(state).to_owned() };
                self.circuit.get_or_create(&labels).set(i64::from(state == current));
            }
        }
        self.dead_letters.clear();
        for group in scraped.dead_by_cause.unwrap_or_default() {
            let labels = DeadLabels { dlq: group.source.to_string(), cause: group.cause.clone() };
            self.dead_letters.get_or_create(&labels).set(as_gauge(group.count));
        }
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}
