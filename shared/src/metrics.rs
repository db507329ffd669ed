//! CloudWatch embedded metric format (EMF): one JSON log line that CloudWatch Logs turns
//! into metrics in namespace `Paceline` with dimension `Lane`. The Lambda functions print
//! them; nothing is sent to CloudWatch directly.

use serde_json::{json, Map, Value};

use crate::time::UnixMillis;

/// One metric in a record: its name, its CloudWatch unit (`Count`, `Milliseconds`,
/// `None`) and its value.
#[derive(Clone, Debug, PartialEq)]
pub struct Metric {
    pub name: &'static str,
    pub unit: &'static str,
    pub value: Value,
}

impl Metric {
    #[must_use]
    pub fn count(name: &'static str, value: u64) -> Self {
        Self { name, unit: "Count", value: value.into() }
    }

    #[must_use]
    pub fn millis(name: &'static str, value: u64) -> Self {
        Self { name, unit: "Milliseconds", value: value.into() }
    }

    #[must_use]
    pub fn seconds(name: &'static str, value: u64) -> Self {
        Self { name, unit: "Seconds", value: value.into() }
    }

    /// A share, in percent (rounded to a tenth).
    #[must_use]
    pub fn percent(name: &'static str, share: f64) -> Self {
        Self { name, unit: "Percent", value: ((share * 1_000.0).round() / 10.0).into() }
    }

    /// A 0-or-1 flag.
    #[must_use]
    pub fn flag(name: &'static str, on: bool) -> Self {
        Self { name, unit: "None", value: u8::from(on).into() }
    }
}

/// The EMF record of `metrics` for lane `lane` at `at`, with `properties` (searchable in
/// Logs Insights, not metrics) beside them.
#[must_use]
pub fn emf_record(at: UnixMillis, lane: &str, metrics: &[Metric], properties: Map<String, Value>) -> Value {
    emf_record_by(at, &[("Lane", lane)], metrics, properties)
}

/// The EMF record of `metrics` at `at` under the dimensions `dimensions` (name, value),
/// together one dimension set.
#[must_use]
pub fn emf_record_by(at: UnixMillis, dimensions: &[(&str, &str)], metrics: &[Metric], properties: Map<String, Value>) -> Value {
    let declared: Vec<Value> = metrics.iter().map(|m| json!({ "Name": m.name, "Unit": m.unit })).collect();
    let names: Vec<&str> = dimensions.iter().map(|(name, _)| *name).collect();
    let mut record = properties;
    record.insert("_aws".into(), json!({ "Timestamp": at.0, "CloudWatchMetrics": [{ "Namespace": "Paceline", "Dimensions": [names], "Metrics": declared }] }));
    for (name, value) in dimensions {
        record.insert((*name).into(), (*value).into());
    }
    for metric in metrics {
        record.insert(metric.name.into(), metric.value.clone());
    }
    Value::Object(record)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_declares_each_metric_with_its_unit_under_the_lane_dimension() {
        let mut properties = Map::new();
        properties.insert("JobId".into(), "j-1".into());
        let record = emf_record(UnixMillis(61_000), "sms", &[Metric::count("Succeeded", 1), Metric::millis("CallLatency", 180)], properties);
        let declared = &record["_aws"]["CloudWatchMetrics"][0];
        assert_eq!((declared["Namespace"].as_str(), &declared["Dimensions"]), (Some("Paceline"), &json!([["Lane"]])));
        assert_eq!(declared["Metrics"][1], json!({ "Name": "CallLatency", "Unit": "Milliseconds" }));
        assert_eq!((record["Lane"].as_str(), record["Succeeded"].as_u64(), record["CallLatency"].as_u64()), (Some("sms"), Some(1), Some(180)));
        assert_eq!((record["JobId"].as_str(), record["_aws"]["Timestamp"].as_u64()), (Some("j-1"), Some(61_000)));
    }
}
