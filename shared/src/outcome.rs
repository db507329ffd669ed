//! A job's outcome record: what the API answered (status, the chosen headers, the body
//! kept as JSON or text up to a cap) and when each step happened, for the producer to
//! read from the results destination (AWS) or with `paceline results` (embedded).

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine;
use serde::{Deserialize, Serialize};

use crate::job::{DeadLetterReason, Job, JobId};
use crate::lane::LaneId;
use crate::time::{rfc3339, UnixMillis};

/// The record's schema version (`v`).
pub const OUTCOME_VERSION: u32 = 1;

/// How a job, or one attempt of it, ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Ending {
    /// The API answered 2xx.
    Succeeded,
    /// The job went to the DLQ; `reason` says why.
    DeadLettered,
    /// This attempt failed and the job is tried again (recorded with
    /// `[outcomes] record = "every_attempt"` only).
    Retrying,
}

impl Ending {
    /// The name in records and `--status dead`'s sense.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::DeadLettered => "dead_lettered",
            Self::Retrying => "retrying",
        }
    }
}

/// When each step of the job's last attempt happened (RFC 3339 in JSON). A time the
/// job never reached (no call for a malformed request) is `null`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutcomeTimes {
    /// When the producer put it on the queue (its first enqueue, across retries).
    #[serde(with = "rfc3339::option", default)]
    pub enqueued: Option<UnixMillis>,
    /// When the orchestrator handed it to a worker.
    #[serde(with = "rfc3339::option", default)]
    pub dispatched: Option<UnixMillis>,
    /// The pacer slot the call was given.
    #[serde(with = "rfc3339::option", default)]
    pub slotted: Option<UnixMillis>,
    #[serde(with = "rfc3339::option", default)]
    pub called: Option<UnixMillis>,
    #[serde(with = "rfc3339::option", default)]
    pub answered: Option<UnixMillis>,
}

/// The answer's body as kept: JSON stays JSON, text is a string, anything else is
/// base64 (`body_base64`); over the cap it is cut (then as text or base64) and
/// `truncated` is set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CappedBody {
    /// The first bytes of the body, at most the cap.
    pub bytes: Vec<u8>,
    /// The body was longer than the cap.
    pub truncated: bool,
}

impl CappedBody {
    /// Keeps the first `max` bytes of `body`.
    #[must_use]
    pub fn keep(body: &[u8], max: usize) -> Self {
        Self { bytes: body[..body.len().min(max)].to_vec(), truncated: body.len() > max }
    }
}

/// A job's outcome: what a producer reads to learn the API's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutcomeRecord {
    pub v: u32,
    pub job_id: String,
    /// The job's lane (absent: the default lane).
    #[serde(default, skip_serializing_if = "LaneId::is_default")]
    pub lane: LaneId,
    pub outcome: Ending,
    /// The HTTP status; `null` when no answer came (a timeout, a dead connection, a
    /// request that could not be sent).
    pub status: Option<u16>,
    /// The answer's headers named in `[outcomes] headers`, lower-cased.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// The answer's body: JSON as JSON, text as a string, `null` when empty or none.
    pub body: Option<serde_json::Value>,
    /// The body is base64 (it was neither JSON nor UTF-8 text).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub body_base64: bool,
    /// The body was longer than `[outcomes] max_body` and was cut.
    #[serde(default)]
    pub truncated: bool,
    /// Calls made for the job, this one included.
    pub attempts: u32,
    /// The job's own metadata, as the producer wrote it.
    #[serde(default)]
    pub metadata: Option<serde_json::Value>,
    /// Why the job went to the DLQ (`cause: detail`), or why this attempt failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub times: OutcomeTimes,
}

/// The API's answer as an outcome sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Answer<'a> {
    pub status: Option<u16>,
    pub headers: &'a [(String, String)],
    pub body: Option<&'a CappedBody>,
}

impl OutcomeRecord {
    /// The record of `job` ending as `outcome` after `attempts` calls, with what the API
    /// answered (headers filtered to `keep_headers`, lower-case names).
    #[must_use]
    pub fn new(job: &Job, outcome: Ending, attempts: u32, answer: &Answer<'_>, keep_headers: &[String], times: OutcomeTimes) -> Self {
        let headers = answer
            .headers
            .iter()
            .filter(|(name, _)| keep_headers.iter().any(|kept| kept.eq_ignore_ascii_case(name)))
            .map(|(name, value)| (name.to_ascii_lowercase(), value.clone()))
            .collect::<BTreeMap<_, _>>();
        let content_type = answer.headers.iter().find(|(name, _)| name.eq_ignore_ascii_case("content-type")).map(|(_, value)| value.as_str());
        let (body, body_base64) = answer.body.map_or((None, false), |body| body_value(body, content_type));
        Self {
            v: OUTCOME_VERSION,
            job_id: job.id.as_str().to_owned(),
            lane: job.lane.clone(),
            outcome,
            status: answer.status,
            headers,
            body,
            body_base64,
            truncated: answer.body.is_some_and(|body| body.truncated),
            attempts,
            metadata: job.metadata.clone(),
            reason: None,
            times,
        }
    }

    /// The record of a malformed job dead-lettered before any call, by the id its JSON
    /// names (nothing else in it is trusted: no metadata).
    #[must_use]
    pub fn of_malformed(job_id: &JobId, attempts: u32, reason: &DeadLetterReason, times: OutcomeTimes) -> Self {
        Self {
            v: OUTCOME_VERSION,
            job_id: job_id.as_str().to_owned(),
            lane: LaneId::default(),
            outcome: Ending::DeadLettered,
            status: None,
            headers: BTreeMap::new(),
            body: None,
            body_base64: false,
            truncated: false,
            attempts,
            metadata: None,
            reason: Some(Self::dead_letter_reason(reason)),
            times,
        }
    }

    /// The same record with the reason of a dead letter or a failed attempt.
    #[must_use]
    pub fn because(self, reason: String) -> Self {
        Self { reason: Some(reason), ..self }
    }

    /// A dead letter's reason as a record states it: `cause: detail`.
    #[must_use]
    pub fn dead_letter_reason(reason: &DeadLetterReason) -> String {
        format!("{}: {}", reason.cause.label(), reason.detail)
    }

    /// The record as one line of JSON.
    #[must_use]
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// Reads a job's outcome record out of what the worker's async `OnSuccess` destination
/// delivers: Lambda's invocation record, as an SQS message's body, an SNS message (also
/// when the topic feeds a queue) or an EventBridge event's `detail`. `None` for an
/// invocation that ended no job (a re-queue, a health check, a fire-and-forget job: its
/// `responsePayload` is null).
///
/// # Errors
/// When the text is not such a record, or its payload is not an outcome record.
pub fn from_destination(text: &str) -> Result<Option<OutcomeRecord>, String> {
    let mut value: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    if let Some(message) = value.get("Message").and_then(serde_json::Value::as_str) {
        value = serde_json::from_str(message).map_err(|e| format!("the SNS message is not JSON: {e}"))?;
    }
    if let Some(detail) = value.get_mut("detail") {
        value = detail.take();
    }
    let payload = value.get_mut("responsePayload").ok_or("not a Lambda invocation record (no responsePayload)")?.take();
    if payload.is_null() {
        return Ok(None);
    }
    serde_json::from_value(payload).map(Some).map_err(|e| format!("the responsePayload is not an outcome record: {e}"))
}

/// The body as JSON when it is whole JSON, else as text, else base64 (`true`).
fn body_value(body: &CappedBody, content_type: Option<&str>) -> (Option<serde_json::Value>, bool) {
    if body.bytes.is_empty() {
        return (None, false);
    }
    let says_json = content_type.is_some_and(|t| {
        let essence = t.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
        essence == "application/json" || essence.ends_with("+json")
    });
    if says_json && !body.truncated {
        if let Ok(json) = serde_json::from_slice(&body.bytes) {
            return (Some(json), false);
        }
    }
    // A cut body may end inside a character: keep the text up to it.
    let text = match std::str::from_utf8(&body.bytes) {
        Ok(text) => Some(text),
        Err(e) if body.truncated && e.error_len().is_none() => std::str::from_utf8(&body.bytes[..e.valid_up_to()]).ok(),
        Err(_) => None,
    };
    match text {
        Some(text) => (Some(serde_json::Value::String(text.to_owned())), false),
        None => (Some(serde_json::Value::String(base64::engine::general_purpose::STANDARD.encode(&body.bytes))), true),
    }
}

/// `--status`: an HTTP status class (`2xx`) or dead-lettered jobs (`dead`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusFilter {
    Class(u8),
    Dead,
}

impl std::str::FromStr for StatusFilter {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "dead" => Ok(Self::Dead),
            class @ ("1xx" | "2xx" | "3xx" | "4xx" | "5xx") => Ok(Self::Class(class.as_bytes()[0] - b'0')),
            _ => Err(format!("`{text}` is not a status filter: use 2xx, 4xx, 5xx or dead")),
        }
    }
}

/// Which outcomes a lane records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordOutcomes {
    /// One record per job that ends: succeeded or dead-lettered.
    #[default]
    Final,
    /// That, and one per failed attempt that is retried.
    EveryAttempt,
    /// None (every job is fire-and-forget).
    None,
}

impl std::str::FromStr for RecordOutcomes {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text.trim() {
            "final" => Ok(Self::Final),
            "every_attempt" => Ok(Self::EveryAttempt),
            "none" => Ok(Self::None),
            _ => Err(format!("`{text}` is not one of final, every_attempt, none")),
        }
    }
}

/// `[outcomes]`: what the worker records of each job's end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutcomeSettings {
    pub record: RecordOutcomes,
    /// The most bytes of an answer's body a record keeps.
    pub max_body: usize,
    /// The answer headers a record keeps, lower-cased.
    pub headers: Vec<String>,
    /// How long the embedded store keeps records.
    pub retention: Duration,
}

/// The body cap by default: a record then fits an SQS message or an async Lambda
/// result (256 KiB) with room for the rest.
pub const DEFAULT_MAX_BODY: usize = 64 * 1024;
/// The most a record may keep: the rest of the record must fit beside it in 256 KiB.
pub const MAX_BODY_CAP: usize = 192 * 1024;

impl Default for OutcomeSettings {
    fn default() -> Self {
        Self {
            record: RecordOutcomes::Final,
            max_body: DEFAULT_MAX_BODY,
            headers: ["content-type", "location", "etag", "last-modified"].map(str::to_owned).to_vec(),
            retention: Duration::from_secs(7 * 86_400),
        }
    }
}

impl OutcomeSettings {
    /// Whether a job that ends as `ending` gets a record (never for a fire-and-forget job).
    #[must_use]
    pub fn records(&self, job: &Job, ending: Ending) -> bool {
        self.records_ending(ending) && !job.fire_and_forget
    }

    /// Whether a job ending as `ending` gets a record, whatever the job says (a malformed
    /// one says nothing that can be trusted).
    #[must_use]
    pub fn records_ending(&self, ending: Ending) -> bool {
        match self.record {
            RecordOutcomes::None => false,
            RecordOutcomes::Final => ending != Ending::Retrying,
            RecordOutcomes::EveryAttempt => true,
        }
    }

    /// How many bytes of each answer's body the worker must keep: none when nothing is
    /// recorded.
    #[must_use]
    pub fn body_cap(&self) -> usize {
        if self.record == RecordOutcomes::None {
            0
        } else {
            self.max_body
        }
    }

    /// Checks the body cap and the header names; lower-cases the names.
    ///
    /// # Errors
    /// The field (`max_body`, `headers`) and what is wrong.
    pub fn checked(self) -> Result<Self, (&'static str, String)> {
        if self.max_body > MAX_BODY_CAP {
            return Err(("max_body", format!("{} bytes is over {MAX_BODY_CAP} (a record must fit in 256 KiB)", self.max_body)));
        }
        if let Some(bad) = self.headers.iter().find(|name| !crate::job::is_header_name(name)) {
            return Err(("headers", format!("`{bad}` is not a header name")));
        }
        Ok(Self { headers: self.headers.iter().map(|name| name.to_ascii_lowercase()).collect(), ..self })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::DeadLetterCause;

    fn job(extra: &str) -> Job {
        Job::parse(&format!(r#"{{"id":"j-1","request":{{"method":"GET","path":"/x"}},"metadata":{{"order":7}}{extra}}}"#)).unwrap()
    }

    fn answer<'a>(content_type: &str, body: &'a CappedBody, headers: &'a mut Vec<(String, String)>) -> Answer<'a> {
        headers.push(("Content-Type".into(), content_type.into()));
        headers.push(("Set-Cookie".into(), "session=secret".into()));
        headers.push(("Location".into(), "/items/9".into()));
        Answer { status: Some(201), headers, body: Some(body) }
    }

    fn record(content_type: &str, body: &[u8], max: usize) -> OutcomeRecord {
        let body = CappedBody::keep(body, max);
        let mut headers = Vec::new();
        let settings = OutcomeSettings::default();
        OutcomeRecord::new(&job(""), Ending::Succeeded, 1, &answer(content_type, &body, &mut headers), &settings.headers, OutcomeTimes::default())
    }

    #[test]
    fn json_stays_json_and_only_the_chosen_headers_are_kept() {
        let r = record("application/json; charset=utf-8", br#"{"id":9,"tags":["a"]}"#, 1024);
        assert_eq!(r.body, Some(serde_json::json!({"id": 9, "tags": ["a"]})));
        assert_eq!(r.headers.keys().collect::<Vec<_>>(), ["content-type", "location"], "set-cookie is not chosen");
        assert_eq!((r.status, r.truncated, r.body_base64, r.metadata.clone()), (Some(201), false, false, Some(serde_json::json!({"order": 7}))));
        let line: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!((line["job_id"].as_str(), line["outcome"].as_str(), line["times"]["called"].is_null()), (Some("j-1"), Some("succeeded"), true));
        assert_eq!(serde_json::from_str::<OutcomeRecord>(&r.to_json()).unwrap(), r);
    }

    #[test]
    fn a_body_over_the_cap_is_cut_as_text_at_a_character_boundary_and_flagged() {
        let r = record("application/json", r#"{"name":"Zoë"}"#.as_bytes(), 12);
        assert_eq!((r.body, r.truncated), (Some(serde_json::Value::String(r#"{"name":"Zo"#.into())), true));
        let r = record("text/plain", b"hello", 5);
        assert_eq!((r.body, r.truncated), (Some(serde_json::Value::String("hello".into())), false));
    }

    #[test]
    fn binary_bodies_are_base64_and_empty_ones_null() {
        let r = record("application/octet-stream", &[0xff, 0x00, 0xfe], 1024);
        assert_eq!((r.body, r.body_base64), (Some(serde_json::Value::String("/wD+".into())), true));
        assert_eq!(record("text/plain", b"", 1024).body, None);
        let r = record("application/json", b"not json", 1024);
        assert_eq!(r.body, Some(serde_json::Value::String("not json".into())), "a body that is not the JSON it claims is kept as text");
    }

    #[test]
    fn times_are_rfc3339_and_reasons_name_the_cause() {
        let times = OutcomeTimes { enqueued: Some(UnixMillis(1_700_000_000_000)), answered: Some(UnixMillis(1_700_000_000_250)), ..OutcomeTimes::default() };
        let reason = DeadLetterReason { cause: DeadLetterCause::Rejected { status: 404 }, detail: "the API answered HTTP 404".into(), outcome: None };
        let r = OutcomeRecord::new(&job(""), Ending::DeadLettered, 1, &Answer { status: Some(404), ..Answer::default() }, &[], times)
            .because(OutcomeRecord::dead_letter_reason(&reason));
        let line: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!(line["times"]["enqueued"], "2023-11-14T22:13:20.000Z");
        assert_eq!(line["times"]["answered"], "2023-11-14T22:13:20.250Z");
        assert_eq!(line["reason"], "http_404: the API answered HTTP 404");
    }

    #[test]
    fn records_are_read_from_sqs_sns_and_eventbridge_deliveries_and_null_payloads_are_none() {
        let r = record("application/json", br#"{"id":9}"#, 1024);
        let invocation = serde_json::json!({
            "version": "1.0",
            "requestContext": { "condition": "Success" },
            "responseContext": { "statusCode": 200 },
            "responsePayload": serde_json::to_value(&r).unwrap(),
        });
        assert_eq!(from_destination(&invocation.to_string()), Ok(Some(r.clone())));
        let sns = serde_json::json!({ "Type": "Notification", "Message": invocation.to_string() });
        assert_eq!(from_destination(&sns.to_string()), Ok(Some(r.clone())));
        let event = serde_json::json!({ "detail-type": "Lambda Function Invocation Result - Success", "detail": invocation });
        assert_eq!(from_destination(&event.to_string()), Ok(Some(r)));
        assert_eq!(from_destination(r#"{"responsePayload":null}"#), Ok(None));
        assert!(from_destination(r#"{"hello":1}"#).unwrap_err().contains("responsePayload"));
    }

    #[test]
    fn settings_choose_what_is_recorded_and_fire_and_forget_jobs_opt_out() {
        let settings = OutcomeSettings::default();
        assert!(settings.records(&job(""), Ending::Succeeded) && settings.records(&job(""), Ending::DeadLettered));
        assert!(!settings.records(&job(""), Ending::Retrying));
        assert!(!settings.records(&job(r#","fire_and_forget":true"#), Ending::Succeeded));
        let every = OutcomeSettings { record: RecordOutcomes::EveryAttempt, ..OutcomeSettings::default() };
        assert!(every.records(&job(""), Ending::Retrying));
        let none = OutcomeSettings { record: RecordOutcomes::None, ..OutcomeSettings::default() };
        assert!(!none.records(&job(""), Ending::Succeeded));
        assert_eq!(OutcomeSettings { max_body: MAX_BODY_CAP + 1, ..OutcomeSettings::default() }.checked().unwrap_err().0, "max_body");
        assert_eq!(OutcomeSettings { headers: vec!["bad header".into()], ..OutcomeSettings::default() }.checked().unwrap_err().0, "headers");
        assert_eq!("dead".parse(), Ok(StatusFilter::Dead));
        assert!("6xx".parse::<StatusFilter>().unwrap_err().contains("2xx, 4xx, 5xx or dead"));
    }
}
