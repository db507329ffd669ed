//! The job envelope producers put on the queue, the payloads the orchestrator hands to
//! workers (versioned), and the reasons a message ends in a dead-letter queue.
//!
//! A job is parsed once from its JSON into types that cannot be wrong: the path is
//! relative to the configured API (absolute URLs to other hosts are refused), the method
//! is a real HTTP token, the cost is at least one unit.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::time::UnixMillis;

/// Version of the worker payload format this build writes and reads.
pub const PAYLOAD_VERSION: u32 = 1;

/// A job's identity: given by the producer, or generated.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct JobId(String);

impl JobId {
    /// A fresh random id.
    #[must_use]
    pub fn generate() -> Self {
        Self(uuid::Uuid::new_v4().to_string())
    }

    /// Parses a producer's id: 1 to 128 visible ASCII characters.
    ///
    /// # Errors
    /// [`JobError::Id`] otherwise.
    pub fn parse(text: &str) -> Result<Self, JobError> {
        if text.is_empty() || text.len() > 128 || !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(JobError::Id(text.chars().take(40).collect()));
        }
        Ok(Self(text.to_owned()))
    }

    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The HTTP request of a job, relative to the lane's API base URL.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ApiRequest {
    pub method: String,
    pub path: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub query: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// A JSON body; a JSON string is sent as plain text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<serde_json::Value>,
}

/// A validated job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Job {
    pub id: JobId,
    pub request: ApiRequest,
    /// Quota units this call spends (default 1).
    pub cost: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<serde_json::Value>,
}

/// Why a message is not a job. The text names the field and the problem.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum JobError {
    #[error("not a job: {0}")]
    Json(String),
    #[error("id `{0}` must be 1 to 128 visible ASCII characters")]
    Id(String),
    #[error("request.method `{0}` is not an HTTP method")]
    Method(String),
    #[error("request.path `{0}` must be a path on the configured API starting with `/`; absolute URLs are refused")]
    Path(String),
    #[error("request.headers: `{0}` may not be set by a job")]
    Header(String),
    #[error("cost must be a whole number of at least 1, got {0}")]
    Cost(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJob {
    id: Option<String>,
    request: ApiRequest,
    cost: Option<serde_json::Value>,
    metadata: Option<serde_json::Value>,
}

/// Headers a job may not set: they belong to the connection or to the lane's auth.
const RESERVED_HEADERS: &[&str] = &["host", "authorization", "proxy-authorization", "content-length", "transfer-encoding", "connection"];

impl Job {
    /// Parses and validates a job message.
    ///
    /// # Errors
    /// [`JobError`] naming the first thing wrong.
    pub fn parse(text: &str) -> Result<Self, JobError> {
        let raw: RawJob = serde_json::from_str(text).map_err(|e| JobError::Json(e.to_string()))?;
        let id = match raw.id {
            Some(id) => JobId::parse(&id)?,
            None => JobId::generate(),
        };
        let mut request = raw.request;
        request.method = parse_method(&request.method)?;
        check_path(&request.path)?;
        if let Some(name) = request.headers.keys().find(|h| RESERVED_HEADERS.contains(&h.to_ascii_lowercase().as_str())) {
            return Err(JobError::Header(name.clone()));
        }
        let cost = match raw.cost {
            None => 1,
            Some(v) => v.as_u64().filter(|c| *c >= 1).ok_or_else(|| JobError::Cost(v.to_string()))?,
        };
        Ok(Self { id, request, cost, metadata: raw.metadata })
    }

    /// The job as JSON, id included: what is re-queued.
    #[must_use]
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

fn parse_method(method: &str) -> Result<String, JobError> {
    let upper = method.to_ascii_uppercase();
    let token = !upper.is_empty() && upper.len() <= 16 && upper.bytes().all(|b| b.is_ascii_uppercase());
    if token { Ok(upper) } else { Err(JobError::Method(method.to_owned())) }
}

/// A path must stay on the configured API: `/` first, no scheme, no `//host`, no `..`
/// segments, no backslashes or control characters that a URL parser might reinterpret.
fn check_path(path: &str) -> Result<(), JobError> {
    let refused = !path.starts_with('/')
        || path.starts_with("//")
        || path.contains("://")
        || path.contains('\\')
        || path.contains('?')
        || path.contains('#')
        || path.chars().any(char::is_control)
        || path.split('/').any(|segment| segment == ".." || segment.eq_ignore_ascii_case("%2e%2e"));
    if refused { Err(JobError::Path(path.chars().take(80).collect())) } else { Ok(()) }
}

/// What the orchestrator hands to a worker.
// One payload is built per hand-off and serialized at once: boxing the job would buy
// nothing but an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WorkerPayload {
    /// Call the API for this job.
    Job {
        job: Job,
        /// How many times it was tried before (0 on first dispatch).
        attempt: u32,
        /// The circuit epoch when dispatched, so a late failure cannot reopen a newer state.
        circuit_epoch: u64,
        dispatched_at: UnixMillis,
        /// Dispatched ahead of its pacer slot: call inside this slot or not at all.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        slot: Option<CallSlot>,
    },
    /// Call the health-check request; close the circuit if it is healthy.
    HealthCheck {
        circuit_epoch: u64,
        sent_at: UnixMillis,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        slot: Option<CallSlot>,
    },
}

/// The second phase of a dispatch-ahead token: the orchestrator spent the pacer slot
/// `not_before` when it handed the job off early; the worker waits for it and calls then.
/// A worker that starts after `call_by` has missed the slot: calling then could crowd the
/// next slot at the provider, so it does not call and re-queues the job instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallSlot {
    pub not_before: UnixMillis,
    pub call_by: UnixMillis,
}

#[derive(Serialize, Deserialize)]
struct VersionedPayload {
    v: u32,
    #[serde(flatten)]
    payload: WorkerPayload,
}

/// Why a payload could not be read.
#[derive(Debug, thiserror::Error)]
pub enum PayloadError {
    #[error("payload version {0} is not supported (this build reads version {PAYLOAD_VERSION})")]
    Version(u32),
    #[error("payload is not valid: {0}")]
    Invalid(String),
}

impl WorkerPayload {
    /// The versioned JSON form.
    #[must_use]
    pub fn to_json(&self) -> String {
        serde_json::to_string(&VersionedPayload { v: PAYLOAD_VERSION, payload: self.clone() }).unwrap_or_default()
    }

    /// Reads the versioned JSON form.
    ///
    /// # Errors
    /// [`PayloadError`] for another version or a malformed payload.
    pub fn from_json(text: &str) -> Result<Self, PayloadError> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| PayloadError::Invalid(e.to_string()))?;
        match value.get("v").and_then(serde_json::Value::as_u64) {
            Some(v) if v == u64::from(PAYLOAD_VERSION) => {}
            Some(v) => return Err(PayloadError::Version(u32::try_from(v).unwrap_or(u32::MAX))),
            None => return Err(PayloadError::Invalid("missing version field `v`".into())),
        }
        serde_json::from_value::<VersionedPayload>(value)
            .map(|p| p.payload)
            .map_err(|e| PayloadError::Invalid(e.to_string()))
    }
}

/// Why a message was dead-lettered, grouped by cause for operators.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cause", rename_all = "snake_case")]
pub enum DeadLetterCause {
    /// Not a valid job.
    Malformed,
    /// The API refused it for good (a 4xx other than 429).
    Rejected { status: u16 },
    /// Tried as often as allowed; `last_failure` labels the last try (`http_503`,
    /// `http_429`, `timeout`, `connection`).
    AttemptsExhausted {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        last_failure: Option<String>,
    },
    /// Costs more than a whole tier allows.
    NeverFits,
}

impl DeadLetterCause {
    /// A short label: `malformed`, `http_404`, `attempts_exhausted:http_503`, `never_fits`.
    #[must_use]
    pub fn label(&self) -> String {
        match self {
            Self::Malformed => "malformed".into(),
            Self::Rejected { status } => format!("http_{status}"),
            Self::AttemptsExhausted { last_failure: None } => "attempts_exhausted".into(),
            Self::AttemptsExhausted { last_failure: Some(last) } => format!("attempts_exhausted:{last}"),
            Self::NeverFits => "never_fits".into(),
        }
    }
}

/// A dead-letter reason: the cause and a human sentence.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetterReason {
    #[serde(flatten)]
    pub cause: DeadLetterCause,
    pub detail: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_full_job_and_defaults() {
        let job = Job::parse(r#"{"id":"a-1","request":{"method":"post","path":"/v1/sms","query":{"x":"1"},"headers":{"X-Trace":"t"},"body":{"to":"+1"}},"cost":3,"metadata":{"k":1}}"#).unwrap();
        assert_eq!((job.id.as_str(), job.request.method.as_str(), job.cost), ("a-1", "POST", 3));
        let job = Job::parse(r#"{"request":{"method":"GET","path":"/ping"}}"#).unwrap();
        assert_eq!(job.cost, 1);
        assert_eq!(job.id.as_str().len(), 36);
        assert_eq!(Job::parse(&job.to_json()).unwrap(), job);
    }

    #[test]
    fn refuses_absolute_urls_and_escapes() {
        for path in ["https://evil.example/x", "//evil.example/x", "x/y", "/a/../../etc", "/a\\b", "/a?b=1", "/a\nb"] {
            let text = serde_json::json!({"request": {"method": "GET", "path": path}}).to_string();
            assert!(matches!(Job::parse(&text), Err(JobError::Path(_))), "{path} was accepted");
        }
    }

    #[test]
    fn names_what_is_wrong() {
        let err = |text: &str| Job::parse(text).unwrap_err().to_string();
        assert!(err("{not json").starts_with("not a job"));
        assert!(err(r#"{"request":{"method":"GET","path":"/"},"cost":0}"#).contains("cost"));
        assert!(err(r#"{"request":{"method":"G T","path":"/"}}"#).contains("request.method"));
        assert!(err(r#"{"request":{"method":"GET","path":"/","headers":{"Authorization":"x"}}}"#).contains("Authorization"));
        assert!(err(r#"{"request":{"method":"GET","path":"/"},"colour":1}"#).contains("colour"));
        assert!(err(r#"{"id":"","request":{"method":"GET","path":"/"}}"#).contains("id"));
    }

    #[test]
    fn payloads_round_trip_with_their_version_and_refuse_others() {
        let job = Job::parse(r#"{"id":"j","request":{"method":"GET","path":"/"}}"#).unwrap();
        let payload = WorkerPayload::Job { job, attempt: 2, circuit_epoch: 4, dispatched_at: UnixMillis(9), slot: None };
        let text = payload.to_json();
        assert!(text.contains(r#""v":1"#) && text.contains(r#""kind":"job""#));
        assert_eq!(WorkerPayload::from_json(&text).unwrap(), payload);
        let check = WorkerPayload::HealthCheck { circuit_epoch: 3, sent_at: UnixMillis(1), slot: None };
        assert_eq!(WorkerPayload::from_json(&check.to_json()).unwrap(), check);
        assert!(matches!(WorkerPayload::from_json(&text.replace(r#""v":1"#, r#""v":2"#)), Err(PayloadError::Version(2))));
    }

    #[test]
    fn dead_letter_reasons_have_labels() {
        let reason = DeadLetterReason { cause: DeadLetterCause::Rejected { status: 404 }, detail: "not found".into() };
        assert_eq!(reason.cause.label(), "http_404");
        assert_eq!(serde_json::to_string(&reason).unwrap(), r#"{"cause":"rejected","status":404,"detail":"not found"}"#);
    }
}
