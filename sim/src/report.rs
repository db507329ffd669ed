//! What a simulation found, as a serializable report and as text: the provider's
//! per-tier check, outcomes, the dispatch-to-call delay distribution, time to drain,
//! AWS requests and the cost estimate; and a side-by-side table of dispatchers.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::time::Duration;

use comfy_table::{presets, ContentArrangement};
use paceline_shared::quota::describe_use;
use paceline_shared::table::text_table;
use paceline_worker::WorkerStats;
use serde::Serialize;

use crate::pricing::{estimate, CostEstimate};
use crate::provider::{Answers, TierFigures};
use crate::{Lane, Plan};

/// Percentiles of a distribution, in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub count: u64,
    pub p50: u32,
    pub p90: u32,
    pub p99: u32,
    pub p999: u32,
    pub max: u32,
}

impl Percentiles {
    /// Nearest-rank percentiles of `values` (sorted here).
    #[must_use]
    pub fn of(mut values: Vec<u32>) -> Self {
        values.sort_unstable();
        let at = |q: f64| values.get(((values.len() as f64 * q).ceil() as usize).saturating_sub(1)).copied().unwrap_or(0);
        Self { count: values.len() as u64, p50: at(0.5), p90: at(0.9), p99: at(0.99), p999: at(0.999), max: values.last().copied().unwrap_or(0) }
    }
}

/// What became of the jobs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Outcomes {
    pub succeeded: u64,
    /// Jobs dead-lettered, all causes.
    pub dead_lettered: u64,
    /// Dead letters by cause.
    pub dead_letter_causes: BTreeMap<String, u64>,
    /// Jobs put back on the queue by a worker (after a failure or a missed slot).
    pub requeued: u64,
    /// Dispatch-ahead slots a worker started too late for (no call made).
    pub missed_slots: u64,
    pub circuit_opened: u64,
    pub worker_errors: u64,
    /// The orchestrator's executions, by kick or relay (none for baselines).
    pub orchestrator_runs: crate::runs::RunCounts,
}

/// The worker function as Lambda ran it: invocations, the most executions at once
/// against the account's limit, and throttling.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LambdaFigures {
    /// Worker invocations (hand-offs of one job, of a batch, and health checks).
    pub invocations: u64,
    #[serde(serialize_with = "paceline_shared::figures::six_digits")]
    pub invocations_per_job: f64,
    /// The account's concurrent executions (`--lambda-concurrency`).
    pub concurrency_limit: u64,
    pub peak_concurrent: u64,
    /// Times an event found every execution busy and was put off.
    pub throttled: u64,
    /// Jobs whose events aged out before they could run (to the worker DLQ, unrun).
    pub aged_out_jobs: u64,
    /// Executions killed part-way (`--rate-worker-crash`).
    pub killed: u64,
    /// DynamoDB requests per job, all callers.
    #[serde(serialize_with = "paceline_shared::figures::six_digits")]
    pub dynamodb_requests_per_job: f64,
    /// The workers' part of them: call and batch records.
    #[serde(serialize_with = "paceline_shared::figures::six_digits")]
    pub call_record_requests_per_job: f64,
}

/// One simulation's findings.
#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    pub dispatcher: String,
    pub jobs: u64,
    pub seed: u64,
    pub quota: Vec<String>,
    pub safety_margin_ms: u64,
    pub dispatch_ahead_ms: u64,
    /// How the simulated provider counted rolling tiers.
    pub provider: crate::provider::ProviderModel,
    /// The tier whose share was highest: the one that set the pace.
    pub paced_by: Option<String>,
    pub profile: crate::profile::LatencyProfile,
    pub failures: crate::profile::Failures,
    pub drained: bool,
    /// Simulated time from the start until the last job settled (or the time limit).
    pub time_to_drain_s: f64,
    pub outcomes: Outcomes,
    /// Per tier, as the provider checked it. `violations` must be 0.
    pub tiers: Vec<TierFigures>,
    pub answers: Answers,
    pub health_checks: u64,
    /// From the hand-off (the orchestrator's invoke) to the call reaching the provider.
    pub dispatch_to_call_ms: Percentiles,
    /// The worker function as Lambda ran it.
    pub lambda: LambdaFigures,
    /// The emptiest second of the steady flow, against the tightest rolling tier (one of
    /// at least 10 calls a second).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lowest_second: Option<LowestSecond>,
    /// AWS requests by operation.
    pub aws_requests: BTreeMap<String, u64>,
    pub cost: CostEstimate,
    /// Wall-clock seconds the simulation took (varies run to run; not part of equality).
    #[serde(serialize_with = "paceline_shared::figures::six_digits")]
    pub wall_seconds: f64,
    /// Calls admitted, offered and refused as over quota per simulated second, for plots.
    #[serde(skip)]
    pub admitted_per_second: Vec<u32>,
    #[serde(skip)]
    pub offered_per_second: Vec<u32>,
    #[serde(skip)]
    pub refused_per_second: Vec<u32>,
}

impl SimReport {
    /// Violations over every tier.
    #[must_use]
    pub fn violations(&self) -> u64 {
        self.tiers.iter().map(|t| t.violations).sum()
    }

    /// The report without its wall-clock time, for comparing runs.
    #[must_use]
    pub fn repeatable_json(&self) -> String {
        let mut value = serde_json::to_value(self).unwrap_or_default();
        if let Some(map) = value.as_object_mut() {
            map.remove("wall_seconds");
        }
        value.to_string()
    }
}

/// The second with the fewest calls while the backlog flowed: from the first second at
/// [`STEADY_SHARE`] of the tier's rate to the last, outside outages (an outage and the
/// seconds after it until the rate is back at that share).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LowestSecond {
    /// The tier's rate, per second.
    pub tier_per_second: f64,
    /// Calls admitted in that second.
    pub calls: u32,
    /// Its share of the tier's rate.
    #[serde(serialize_with = "paceline_shared::figures::six_digits")]
    pub share: f64,
    /// The second, from the start.
    pub at_s: u64,
}

/// The share of the tier's rate from which a second counts as the steady flow.
pub const STEADY_SHARE: f64 = 0.98;

/// The emptiest steady second in `per_second` under `plan`'s tightest rolling tier, if it
/// allows at least 10 calls a second.
fn lowest_second(plan: &Plan, per_second: &[u32]) -> Option<LowestSecond> {
    let (limit, window_ms) = crate::baselines::tightest_rolling(&plan.settings.quota)?;
    let rate = limit as f64 * 1_000.0 / window_ms as f64;
    if rate < 10.0 {
        return None;
    }
    let steady = |calls: u32| f64::from(calls) >= STEADY_SHARE * rate;
    let first = per_second.iter().position(|c| steady(*c))?;
    let last = per_second.iter().rposition(|c| steady(*c))?;
    let mut lowest: Option<LowestSecond> = None;
    let mut recovering = false;
    for (at_s, calls) in per_second.iter().enumerate().take(last + 1).skip(first) {
        let second = Duration::from_secs(at_s as u64);
        if plan.failures.in_outage(second) || plan.failures.in_outage(second + Duration::from_millis(999)) {
            recovering = true;
            continue;
        }
        recovering = recovering && !steady(*calls);
        if !recovering && lowest.as_ref().is_none_or(|l| *calls < l.calls) {
            lowest = Some(LowestSecond { tier_per_second: rate, calls: *calls, share: f64::from(*calls) / rate, at_s: at_s as u64 });
        }
    }
    lowest
}

pub(crate) fn build(plan: &Plan, dispatcher: String, lane: &Lane, drained: bool, runs: crate::runs::RunCounts, elapsed: Duration, wall: Duration) -> SimReport {
    let seen = lane.provider.figures();
    let stats = &lane.stats;
    let outcomes = Outcomes {
        succeeded: WorkerStats::get(&stats.succeeded),
        dead_lettered: lane.queue.dead_letter_causes().values().sum(),
        dead_letter_causes: lane.queue.dead_letter_causes(),
        requeued: WorkerStats::get(&stats.requeued),
        missed_slots: WorkerStats::get(&stats.missed_slots),
        circuit_opened: WorkerStats::get(&stats.circuit_opened),
        worker_errors: lane.lambda.executions().worker_errors.load(Ordering::Relaxed),
        orchestrator_runs: runs,
    };
    let quota = &plan.settings.quota;
    let paced_by = seen.tiers.iter().rev().max_by(|a, b| a.utilization.total_cmp(&b.utilization)).filter(|t| t.admitted > 0).map(|t| t.tier.clone());
    SimReport {
        dispatcher,
        jobs: plan.jobs as u64,
        seed: plan.seed,
        quota: quota.tiers().iter().map(ToString::to_string).collect(),
        safety_margin_ms: quota.safety_margin().as_millis() as u64,
        dispatch_ahead_ms: plan.settings.dispatch_ahead().as_millis() as u64,
        provider: plan.provider,
        paced_by,
        profile: plan.profile.clone(),
        failures: plan.failures.clone(),
        drained,
        time_to_drain_s: elapsed.as_secs_f64(),
        outcomes,
        tiers: seen.tiers,
        answers: seen.answers,
        health_checks: seen.health_checks,
        dispatch_to_call_ms: Percentiles::of(seen.delays_ms),
        lambda: lambda_figures(plan, lane),
        lowest_second: lowest_second(plan, &seen.admitted_per_second),
        aws_requests: lane.world.ledger.requests().into_iter().map(|(op, n)| (op.to_owned(), n)).collect(),
        cost: estimate(&lane.world.ledger, plan.memory, plan.table, plan.jobs as u64),
        wall_seconds: wall.as_secs_f64(),
        admitted_per_second: seen.admitted_per_second,
        offered_per_second: seen.offered_per_second,
        refused_per_second: seen.refused_per_second,
    }
}

fn lambda_figures(plan: &Plan, lane: &Lane) -> LambdaFigures {
    let requests = lane.world.ledger.requests();
    let jobs = plan.jobs.max(1) as f64;
    let invocations = requests.get("lambda:Invoke").copied().unwrap_or(0);
    let dynamodb: u64 = requests.iter().filter(|(op, _)| op.starts_with("dynamodb:")).map(|(_, n)| n).sum();
    let l = lane.lambda.executions();
    LambdaFigures {
        invocations,
        invocations_per_job: invocations as f64 / jobs,
        concurrency_limit: plan.lambda_concurrency,
        peak_concurrent: l.peak_executing.load(Ordering::Relaxed),
        throttled: l.throttles.load(Ordering::Relaxed),
        aged_out_jobs: l.aged_out_jobs.load(Ordering::Relaxed),
        killed: l.crashes.load(Ordering::Relaxed),
        dynamodb_requests_per_job: dynamodb as f64 / jobs,
        call_record_requests_per_job: lane.world.ledger.call_record_requests.load(Ordering::Relaxed) as f64 / jobs,
    }
}

fn human(seconds: f64) -> String {
    humantime::format_duration(Duration::from_secs(seconds.round() as u64)).to_string()
}

/// The report as text for a terminal.
#[must_use]
pub fn render(r: &SimReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Simulated {} jobs with {} (seed {}), quota {} (safety margin {} ms)",
        r.jobs,
        r.dispatcher,
        r.seed,
        r.quota.join(", "),
        r.safety_margin_ms
    );
    let drained = if r.drained { "drained in" } else { "NOT drained after" };
    let _ = writeln!(out, "  {drained} {} of simulated time ({:.1} s of wall time)", human(r.time_to_drain_s), r.wall_seconds);
    let o = &r.outcomes;
    let dead = o.dead_lettered;
    let _ = writeln!(
        out,
        "  succeeded {}, dead-lettered {dead}, re-queued {}, missed slots {}, circuit opened {}x",
        o.succeeded, o.requeued, o.missed_slots, o.circuit_opened
    );
    for (cause, n) in &o.dead_letter_causes {
        let _ = writeln!(out, "    DLQ {cause}: {n}");
    }
    let runs = &o.orchestrator_runs;
    if runs.executions > 0 {
        let _ = writeln!(out, "  orchestrator: {} executions, {} took the lease as a relay, {} killed", runs.executions, runs.relayed, runs.killed);
    }
    let model = serde_json::to_value(r.provider).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
    let _ = writeln!(out, "\nAt the provider ({model}, strict per tier; a violation is a call refused with 429):");
    let mut tiers = text_table(&["tier", "admitted", "violations", "busiest window", "worst alignment", "use"], &[1, 2, 3, 4]);
    for t in &r.tiers {
        let busiest = t.peak_offered_in_any_window.map_or_else(|| "-".into(), |p| format!("{p}/{}", t.limit));
        let offset = t.worst_alignment_offset_ms.map_or_else(|| "calendar".into(), |o| format!("+{o} ms"));
        let used = describe_use(&t.tier, t.calendar, t.utilization);
        let pace = if r.paced_by.as_deref() == Some(t.tier.as_str()) { " (set the pace)" } else { "" };
        tiers.add_row(vec![t.tier.clone(), t.admitted.to_string(), t.violations.to_string(), busiest, offset, format!("{used}{pace}")]);
    }
    let _ = writeln!(out, "{tiers}");
    if let Some(l) = &r.lowest_second {
        let at = human(l.at_s as f64);
        let _ = writeln!(out, "  emptiest second of the flow: {} calls, {:.1}% of {}/s (at {at})", l.calls, l.share * 100.0, l.tier_per_second);
    }
    let a = &r.answers;
    let _ = writeln!(
        out,
        "  answers: {} ok, {} over quota (429), {} injected 429, {} injected 5xx, {} outage 503; {} health checks; at most {} calls in flight",
        a.ok, a.over_quota_429, a.injected_429, a.injected_5xx, a.outage_503, r.health_checks, a.peak_in_flight
    );
    let d = &r.dispatch_to_call_ms;
    let _ = writeln!(out, "\nDispatch to call (ms): p50 {} p90 {} p99 {} p99.9 {} max {} ({} calls)", d.p50, d.p90, d.p99, d.p999, d.max, d.count);
    let l = &r.lambda;
    let _ = writeln!(
        out,
        "\nWorker Lambda: {} invocations ({:.4} per job), at most {} running at once (limit {}), {} throttled, {} jobs aged out unrun, {} executions killed",
        l.invocations, l.invocations_per_job, l.peak_concurrent, l.concurrency_limit, l.throttled, l.aged_out_jobs, l.killed
    );
    let _ = writeln!(
        out,
        "  DynamoDB requests per job: {:.4} ({:.4} for the workers' call and batch records)",
        l.dynamodb_requests_per_job, l.call_record_requests_per_job
    );
    let _ = writeln!(out, "\nAWS requests:");
    let mut requests = text_table(&["operation", "requests", "per job"], &[1, 2]);
    for (op, n) in &r.aws_requests {
        requests.add_row(vec![op.clone(), n.to_string(), format!("{:.4}", *n as f64 / r.jobs.max(1) as f64)]);
    }
    let _ = writeln!(out, "{requests}");
    let c = &r.cost;
    let _ = writeln!(out, "\nEstimated AWS cost ({} list prices, {}; excludes {}):", c.prices.region, c.prices.as_of, c.prices.excludes);
    let mut cost = text_table(&["item", "quantity", "unit", "USD", "per million jobs"], &[1, 3, 4]);
    for line in &c.lines {
        let per_million = format!("${:.3}", line.per_million_jobs_usd);
        cost.add_row(vec![line.item.to_owned(), format!("{:.1}", line.quantity), line.unit.to_owned(), format!("{:.4}", line.usd), per_million]);
    }
    let _ = writeln!(out, "{cost}");
    let _ = writeln!(out, "  total ${:.4}, per million jobs ${:.2}", c.total_usd, c.per_million_jobs_usd);
    out
}

/// Dispatchers side by side on the same workload: a table for the terminal, or (with
/// `markdown`) for docs/benchmarks.md.
#[must_use]
pub fn render_comparison(reports: &[SimReport], markdown: bool) -> String {
    let mut table =
        text_table(&["dispatcher", "violations", "utilization (per tier)", "time to drain", "dead-lettered", "dispatch-to-call p99"], &[1, 3, 4, 5]);
    if markdown {
        table.load_preset(presets::ASCII_MARKDOWN).set_content_arrangement(ContentArrangement::Disabled);
    }
    for r in reports {
        let utilization: Vec<String> = r.tiers.iter().map(|t| format!("{} {:.1}%", t.tier, t.utilization * 100.0)).collect();
        let drain = if r.drained { human(r.time_to_drain_s) } else { format!("not drained in {}", human(r.time_to_drain_s)) };
        table.add_row(vec![
            r.dispatcher.clone(),
            r.violations().to_string(),
            utilization.join(", "),
            drain,
            r.outcomes.dead_lettered.to_string(),
            format!("{} ms", r.dispatch_to_call_ms.p99),
        ]);
    }
    table.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let p = Percentiles::of((1..=1000).rev().collect());
        assert_eq!((p.count, p.p50, p.p90, p.p99, p.p999, p.max), (1000, 500, 900, 990, 999, 1000));
        assert_eq!(Percentiles::of(Vec::new()), Percentiles::default());
    }
}
