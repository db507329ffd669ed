//! The orchestrator as a Lambda function: built once at cold start from `PACELINE_*`
//! variables, then each invocation (the EventBridge schedule or an operator's kick)
//! runs the drain loop until the invocation's deadline, minus the margin (a scheduled
//! run hands over just before the next kick it would overlap), and prints its figures as
//! CloudWatch metrics (embedded metric format) for the stack's alarms.

use std::sync::Arc;
use std::time::Duration;

use lambda_runtime::LambdaEvent;
use paceline_shared::adapters::aws::{AwsAdapters, AwsNames};
use paceline_shared::lambda_env::Env;
use paceline_shared::time::{SystemClock, UnixMillis};
use serde_json::{json, Value};

use crate::{handover_deadline, Orchestrator, RunError, RunOptions, RunReport, Settings};

/// How often the stack's schedule kicks the orchestrator (`rate(1 minute)` in
/// `infra/template.yaml`).
const SCHEDULE_EVERY: Duration = Duration::from_secs(60);

/// Builds the orchestrator from the environment and an SDK configuration.
///
/// # Errors
/// The first missing or invalid variable, named.
pub fn from_env(env: &Env<'_>, sdk: &aws_config::SdkConfig, lambda_endpoint: Option<&str>) -> Result<Orchestrator, String> {
    let names = AwsNames::from_env(env, true)?;
    let settings = Settings { quota: env.quota()?, orchestrator: env.orchestrator()?, circuit: env.circuit()? };
    let aws = AwsAdapters::new(sdk, &names, lambda_endpoint);
    Ok(Orchestrator::new(Arc::new(aws.queue), Arc::new(aws.store), Arc::new(aws.invoker), Arc::new(SystemClock), settings))
}

/// Handles one kick. A kick while another run holds the lease is not an error: it
/// returns at once, saying so.
///
/// # Errors
/// A fatal adapter error (the run released what it held first).
pub async fn handle(event: LambdaEvent<Value>, orchestrator: &Orchestrator) -> Result<Value, lambda_runtime::Error> {
    let deadline = UnixMillis(event.context.deadline);
    let deadline = match scheduled_for(&event.payload) {
        Some(tick) => handover_deadline(deadline, tick, SCHEDULE_EVERY, orchestrator.settings.orchestrator.deadline_margin),
        None => deadline,
    };
    let opts = RunOptions { holder: format!("lambda:{}", event.context.request_id), deadline, drain: false, stop: None };
    match orchestrator.run(&opts).await {
        Ok(report) => {
            let circuit_open = orchestrator.progress.circuit_open.load(std::sync::atomic::Ordering::Relaxed);
            let lane = std::env::var("PACELINE_LANE").unwrap_or_else(|_| "paceline".into());
            // Lambda sends standard output to CloudWatch Logs, which turns this into metrics.
            println!("{}", metrics_record(&report, circuit_open, &lane));
            Ok(serde_json::to_value(report)?)
        }
        Err(RunError::LeaseHeld(why)) => {
            tracing::info!(%why, "another run holds the lease; nothing to do");
            Ok(json!({ "skipped": why }))
        }
        Err(e) => Err(e.into()),
    }
}

/// The minute an EventBridge scheduled event was due (its `time`); `None` for any other
/// event (an operator's kick).
fn scheduled_for(event: &Value) -> Option<UnixMillis> {
    if event.get("detail-type").and_then(Value::as_str) != Some("Scheduled Event") {
        return None;
    }
    let time = chrono::DateTime::parse_from_rfc3339(event.get("time")?.as_str()?).ok()?;
    u64::try_from(time.timestamp_millis()).ok().map(UnixMillis)
}

/// The run's figures as one CloudWatch embedded-metric-format record in namespace
/// `Paceline`, dimension `Lane`: `Dispatched`, `DeadLettered`, `HealthChecks`,
/// `CircuitOpen` (1 when the run ended with the circuit open) and `QuotaExhausted`
/// (1 when a day or month tier has no room left).
#[must_use]
pub fn metrics_record(report: &RunReport, circuit_open: bool, lane: &str) -> Value {
    let exhausted = report.tiers.iter().any(|t| t.tier.is_calendar() && t.utilization >= 1.0);
    json!({
        "_aws": {
            "Timestamp": report.ended_at.0,
            "CloudWatchMetrics": [{
                "Namespace": "Paceline",
                "Dimensions": [["Lane"]],
                "Metrics": [
                    { "Name": "Dispatched", "Unit": "Count" },
                    { "Name": "DeadLettered", "Unit": "Count" },
                    { "Name": "HealthChecks", "Unit": "Count" },
                    { "Name": "CircuitOpen", "Unit": "None" },
                    { "Name": "QuotaExhausted", "Unit": "None" }
                ]
            }]
        },
        "Lane": lane,
        "Dispatched": report.dispatched,
        "DeadLettered": report.dead_lettered,
        "HealthChecks": report.health_checks,
        "CircuitOpen": u8::from(circuit_open),
        "QuotaExhausted": u8::from(exhausted),
        "Stop": report.stop,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{StopReason, TierReport};

    #[test]
    fn metrics_record_flags_an_open_circuit_and_an_exhausted_calendar_tier() {
        let tier = |text: &str, utilization: f64| TierReport { tier: text.parse().unwrap(), units: 5, peak_window: 5, utilization };
        let mut report = RunReport {
            started_at: UnixMillis(1_000),
            ended_at: UnixMillis(61_000),
            stop: StopReason::Deadline,
            dispatched: 42,
            health_checks: 1,
            dead_lettered: 2,
            released: 0,
            paced_ms: 60_000,
            tiers: vec![tier("10/s", 1.0), tier("1000/day", 0.5)],
        };
        let record = metrics_record(&report, true, "sms");
        assert_eq!((record["Dispatched"].as_u64(), record["CircuitOpen"].as_u64(), record["QuotaExhausted"].as_u64()), (Some(42), Some(1), Some(0)));
        assert_eq!(record["_aws"]["CloudWatchMetrics"][0]["Metrics"].as_array().unwrap().len(), 5);
        assert_eq!((record["Lane"].as_str(), record["_aws"]["Timestamp"].as_u64()), (Some("sms"), Some(61_000)));
        report.tiers[1].utilization = 1.0;
        assert_eq!(metrics_record(&report, false, "sms")["QuotaExhausted"], 1);
    }

    #[test]
    fn only_scheduled_events_carry_a_tick() {
        let scheduled = json!({ "detail-type": "Scheduled Event", "time": "2026-11-23T01:46:00Z", "source": "aws.events" });
        assert_eq!(scheduled_for(&scheduled), Some(UnixMillis(1_795_398_360_000)));
        assert_eq!(scheduled_for(&json!({ "kick": "operator" })), None);
        assert_eq!(scheduled_for(&json!({ "detail-type": "Scheduled Event", "time": "soon" })), None);
    }
}
