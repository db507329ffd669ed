//! The job envelope producers put on the queue, the payloads the orchestrator hands to
//! workers (versioned), and the reasons a message ends in a dead-letter queue.
//!
//! A job is parsed once from its JSON into types that cannot be wrong: the path is
//! relative to the configured API (absolute URLs to other hosts are refused), the method
//! is a real HTTP token, the cost is at least one unit.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::breaker::TripRule;
use crate::lane::{LaneId, LaneIdError};
use crate::time::UnixMillis;

/// Version of the worker payload format this build writes. Version 2 carries the job as
/// its JSON text (so a body keeps its bytes); version 1 (the job as an object) is still
/// read.
pub const PAYLOAD_VERSION: u32 = 2;

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
            return Err(JobError::Id(text.chars().take(40).flat_map(char::escape_default).collect()));
        }
        Ok(Self(text.to_owned()))
    }

    /// The id a message's JSON names, whether or not the rest of it is a valid job: a
    /// malformed job keeps its id in its dead letter and outcome record.
    #[must_use]
    pub fn named_in(body: &str) -> Option<Self> {
        let value: serde_json::Value = serde_json::from_str(body).ok()?;
        Self::parse(value.get("id")?.as_str()?).ok()
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
    /// A JSON body, sent as the producer wrote it; a JSON string is sent as plain text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<Body>,
}

/// A request body exactly as the producer wrote it: the raw JSON text, never
/// re-serialised, so key order, big integers and number spellings reach the API intact
/// (signed bodies stay valid). Read it only through `serde_json` (it is a
/// `serde_json::value::RawValue`).
#[derive(Clone, Debug)]
pub struct Body(Box<serde_json::value::RawValue>);

impl Body {
    /// The body's JSON text, byte for byte.
    #[must_use]
    pub fn json(&self) -> &str {
        self.0.get()
    }

    /// The text to send as `text/plain` when the body is a JSON string.
    #[must_use]
    pub fn as_text(&self) -> Option<String> {
        self.json().starts_with('"').then(|| serde_json::from_str(self.json()).ok()).flatten()
    }

    /// Bytes on the wire.
    #[must_use]
    pub fn len(&self) -> usize {
        self.json().len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.json().is_empty()
    }
}

impl PartialEq for Body {
    fn eq(&self, other: &Self) -> bool {
        self.json() == other.json()
    }
}

impl Serialize for Body {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Body {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Box::<serde_json::value::RawValue>::deserialize(deserializer).map(Self)
    }
}

/// A validated job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Job {
    pub id: JobId,
    /// The lane whose quota the call spends (absent: the default lane).
    #[serde(default, skip_serializing_if = "LaneId::is_default")]
    pub lane: LaneId,
    pub request: ApiRequest,
    /// Quota units this call spends (default 1).
    pub cost: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<serde_json::Value>,
    /// No outcome record for this job: nobody reads its answer.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fire_and_forget: bool,
    /// When the job was first put on the queue: stamped by the orchestrator from the
    /// queue at its first dispatch, and kept across re-queues (the outcome's `enqueued`).
    #[serde(default, with = "crate::time::rfc3339::option", skip_serializing_if = "Option::is_none")]
    pub enqueued_at: Option<UnixMillis>,
    /// Calls of this job the API answered 429, kept across re-queues: they are not
    /// failures (`retry.max_attempts` counts the others), only `retry.max_rate_limited`
    /// bounds them. Reset with the attempts by a redrive.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rate_limited: u32,
    /// How late workers started for this job, after its slot's last moment (each miss at
    /// least doubles it, up to [`MAX_LATE_START`]): the orchestrator that receives it
    /// hands every job off that much earlier for a while.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub late_start_ms: u64,
    /// Its lane is ordered (`ordering = "fifo"`), as the orchestrator found it when it
    /// handed the job off: the worker marks what came of the call in the lane's order
    /// mark, and a retry goes back ahead of the lane's later jobs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ordered: bool,
}

fn is_zero<T: Default + PartialEq>(n: &T) -> bool {
    *n == T::default()
}

/// The upload rate a call's body is assumed to leave at: a call is paced on its arrival
/// at the provider, not on its send, so the pacer counts a large body's call that much
/// after its slot (1 MiB: 105 ms; measured on loopback: 5 to 83 ms late) and the next
/// call keeps its distance from the arrival.
pub const UPLOAD_BYTES_PER_SECOND: u64 = 10_000_000;

/// The rate a hand-off is assumed to move a payload at (serialised, written to the store
/// or sent to Lambda, read by the worker): a job is handed off that much earlier than
/// the usual lead, so its worker starts before its slot (10 MB: 500 ms).
pub const HAND_OFF_BYTES_PER_SECOND: u64 = 20_000_000;

/// The most a job's learned lateness ([`Job::late_start_ms`]) grows to, and the most
/// late starts add to an orchestrator's lead: its calls are decided no further ahead
/// than its configured lead and this, which its shards and the run after a crash wait
/// out. A job whose worker starts late again once it carried this much goes to the DLQ
/// ([`Job::after_late_start`]): its workers start later than any lead it gets.
pub const MAX_LATE_START: Duration = Duration::from_secs(1);

fn time_to_move(bytes: usize, bytes_per_second: u64) -> Duration {
    Duration::from_millis((bytes as u64).saturating_mul(1_000) / bytes_per_second)
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
    #[error("request.headers: {0}")]
    HeaderInvalid(String),
    #[error("cost must be a whole number of at least 1, got {0}")]
    Cost(String),
    #[error("lane: {0}")]
    Lane(#[from] LaneIdError),
    #[error("metadata: {0} bytes of JSON, over the {MAX_METADATA} an outcome record carries (it must fit an SQS message beside the answer)")]
    Metadata(usize),
}

/// The most bytes of JSON a job's `metadata` may hold: it is copied into the job's
/// outcome record, which on AWS travels in one SQS message (256 KiB) beside up to
/// 192 KiB of the answer's body.
pub const MAX_METADATA: usize = 16 * 1024;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJob {
    id: Option<String>,
    lane: Option<String>,
    request: ApiRequest,
    cost: Option<serde_json::Value>,
    metadata: Option<serde_json::Value>,
    #[serde(default)]
    fire_and_forget: bool,
    #[serde(default, with = "crate::time::rfc3339::option")]
    enqueued_at: Option<UnixMillis>,
    #[serde(default)]
    rate_limited: u32,
    #[serde(default)]
    late_start_ms: u64,
    #[serde(default)]
    ordered: bool,
}

/// Headers that belong to the connection and its framing, not to an API call: neither a
/// job nor the lane's configuration sets them (a job id carried in `Content-Length`
/// would drop the call's body; `Upgrade` or `Expect` change what the client does).
const CONNECTION_HEADERS: &[&str] =
    &["host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer", "keep-alive", "proxy-connection", "expect"];

/// Headers that carry the lane's credentials: a job may not set them.
const AUTH_HEADERS: &[&str] = &["authorization", "proxy-authorization"];

/// Whether `name` belongs to the connection (see `CONNECTION_HEADERS`).
#[must_use]
pub fn is_connection_header(name: &str) -> bool {
    CONNECTION_HEADERS.contains(&name.to_ascii_lowercase().as_str())
}

/// Whether a job may not set `name`: a connection header or the lane's credentials.
#[must_use]
pub fn is_reserved_header(name: &str) -> bool {
    is_connection_header(name) || AUTH_HEADERS.contains(&name.to_ascii_lowercase().as_str())
}

/// Whether `value` can be sent as a header value: visible ASCII, spaces and tabs (no
/// CR/LF that could inject a header, nothing an HTTP client refuses to send).
#[must_use]
pub fn is_header_value(value: &str) -> bool {
    value.bytes().all(|b| b == b'\t' || (b' '..=b'~').contains(&b))
}

impl ApiRequest {
    /// How much later than its slot the call may arrive because of its body's size.
    #[must_use]
    pub fn upload_allowance(&self) -> Duration {
        time_to_move(self.body.as_ref().map_or(0, Body::len), UPLOAD_BYTES_PER_SECOND)
    }

    /// How long handing off a payload carrying this request may take, by its body's size.
    #[must_use]
    pub fn hand_off_allowance(&self) -> Duration {
        time_to_move(self.body.as_ref().map_or(0, Body::len), HAND_OFF_BYTES_PER_SECOND)
    }
}

impl Job {
    /// The same job, carrying what a worker that started `late` after its slot's last
    /// moment shows (at least double what it carried): the orchestrator that receives it
    /// hands every job off that much earlier for a while.
    #[must_use]
    pub fn started_late_by(self, late: Duration) -> Self {
        let late_ms = u64::try_from(late.as_millis()).unwrap_or(u64::MAX).max(1);
        let cap = u64::try_from(MAX_LATE_START.as_millis()).unwrap_or(u64::MAX);
        Self { late_start_ms: late_ms.max(self.late_start_ms.saturating_mul(2)).min(cap), ..self }
    }

    /// The job to put back after a worker started `late` past its slot's last moment,
    /// carrying what that shows; `None` when it already carried the most lateness a job
    /// learns ([`MAX_LATE_START`]) and started late again: its workers start later than
    /// any lead it gets, and put back it would miss its slot for ever (dead-letter it).
    /// A lateness past that most (an event Lambda ran again after a failure, an invoke
    /// it held back) teaches nothing, since no lead would have served it: the job goes
    /// back as it came.
    #[must_use]
    pub fn after_late_start(self, late: Duration) -> Option<Self> {
        if late > MAX_LATE_START {
            return Some(self);
        }
        if Duration::from_millis(self.late_start_ms) >= MAX_LATE_START {
            return None;
        }
        Some(self.started_late_by(late))
    }

    /// Parses and validates a job message.
    ///
    /// # Errors
    /// [`JobError`] naming the first thing wrong.
    pub fn parse(text: &str) -> Result<Self, JobError> {
        Self::parse_in_lane(text, &LaneId::default())
    }

    /// Parses and validates a job message; one that names no lane goes in `lane`
    /// (`paceline enqueue --lane`).
    ///
    /// # Errors
    /// [`JobError`] naming the first thing wrong.
    pub fn parse_in_lane(text: &str, lane: &LaneId) -> Result<Self, JobError> {
        let raw: RawJob = serde_json::from_str(text).map_err(|e| JobError::Json(e.to_string()))?;
        let id = match raw.id {
            Some(id) => JobId::parse(&id)?,
            None => JobId::generate(),
        };
        let lane = raw.lane.as_deref().map_or_else(|| Ok(lane.clone()), LaneId::parse)?;
        let mut request = raw.request;
        request.method = parse_method(&request.method)?;
        check_path(&request.path)?;
        check_headers(&request.headers)?;
        if let Some(size) = raw.metadata.as_ref().map(|m| m.to_string().len()).filter(|size| *size > MAX_METADATA) {
            return Err(JobError::Metadata(size));
        }
        let cost = match raw.cost {
            None => 1,
            Some(v) => v.as_u64().filter(|c| *c >= 1).ok_or_else(|| JobError::Cost(v.to_string()))?,
        };
        Ok(Self {
            id,
            lane,
            request,
            cost,
            metadata: raw.metadata,
            fire_and_forget: raw.fire_and_forget,
            enqueued_at: raw.enqueued_at,
            rate_limited: raw.rate_limited,
            late_start_ms: raw.late_start_ms.min(u64::try_from(MAX_LATE_START.as_millis()).unwrap_or(u64::MAX)),
            ordered: raw.ordered,
        })
    }

    /// The job as JSON, id included: what is re-queued.
    #[must_use]
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// Methods a job may use: the ones an API call is made with. TRACE and CONNECT are
/// connection-level tools, never an API call.
const METHODS: &[&str] = &["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"];

fn parse_method(method: &str) -> Result<String, JobError> {
    let upper = method.to_ascii_uppercase();
    if METHODS.contains(&upper.as_str()) {
        Ok(upper)
    } else {
        Err(JobError::Method(method.to_owned()))
    }
}

/// A header name is an RFC 9110 token, not a reserved one; a value is a valid header
/// value ([`is_header_value`]). Checked
/// here so that a bad header is the job's fault (dead-lettered as malformed) and never
/// looks like the API failing.
fn check_headers(headers: &BTreeMap<String, String>) -> Result<(), JobError> {
    for (name, value) in headers {
        let shown: String = name.chars().take(40).flat_map(char::escape_default).collect();
        if is_reserved_header(name) {
            return Err(JobError::Header(shown));
        }
        if !is_header_name(name) {
            return Err(JobError::HeaderInvalid(format!("`{shown}` is not a valid header name")));
        }
        if !is_header_value(value) {
            return Err(JobError::HeaderInvalid(format!("the value of `{shown}` holds a control or non-ASCII character")));
        }
    }
    Ok(())
}

/// Whether `name` is an RFC 9110 token, as a header name must be.
#[must_use]
pub fn is_header_name(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(is_token_byte)
}

fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A path must stay on the configured API: `/` first, no scheme, no `//host`, no dot
/// segments (`.`, `..`, percent-encoded or not: URL parsers resolve `.%2e` as `..`), no
/// encoded slashes or backslashes, no control characters a URL parser might reinterpret.
fn check_path(path: &str) -> Result<(), JobError> {
    let refused = !path.starts_with('/')
        || path.starts_with("//")
        || path.contains("://")
        || path.contains('\\')
        || path.contains('?')
        || path.contains('#')
        || path.chars().any(char::is_control)
        || path.split('/').any(is_dot_or_encoded_separator);
    if refused {
        Err(JobError::Path(path.chars().take(80).flat_map(char::escape_default).collect()))
    } else {
        Ok(())
    }
}

/// `.` or `..` once `%2e` is decoded, or a segment hiding a `/` or `\` as `%2f`/`%5c`.
fn is_dot_or_encoded_separator(segment: &str) -> bool {
    let lower = segment.to_ascii_lowercase();
    let decoded = lower.replace("%2e", ".");
    decoded == "." || decoded == ".." || lower.contains("%2f") || lower.contains("%5c")
}

/// What the orchestrator hands to a worker.
#[expect(clippy::large_enum_variant, reason = "one payload is built per hand-off and serialized at once: boxing the job would buy nothing but an allocation")]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WorkerPayload {
    /// Call the API for this job.
    Job {
        #[serde(with = "job_as_text")]
        job: Job,
        /// How many times it was tried before (0 on first dispatch).
        attempt: u32,
        /// The circuit epoch when dispatched, so a late failure cannot reopen a newer state.
        circuit_epoch: u64,
        dispatched_at: UnixMillis,
        /// Dispatched ahead of its pacer slot: call inside this slot or not at all.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        slot: Option<CallSlot>,
        /// When failed calls open the circuit (absent in older payloads: the first does).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        trip: Option<TripRule>,
        /// Record the provider's rate-limit headers of this call's answer (the
        /// orchestrator asks about once a second; a 429's are recorded anyway).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        report_limits: bool,
    },
    /// Call the health-check request; close the circuit if it is healthy.
    HealthCheck {
        circuit_epoch: u64,
        sent_at: UnixMillis,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        slot: Option<CallSlot>,
        /// The lane whose circuit it checks (with its headers, at its API).
        #[serde(default, skip_serializing_if = "LaneId::is_default")]
        lane: LaneId,
    },
    /// Many jobs' calls in one invocation, each at its own slot. Each entry is a `job`
    /// payload read on its own, so that an entry that cannot be read is dead-lettered
    /// alone and the others are called (see [`WorkerPayload::batch_calls`]).
    Batch {
        /// Names the batch in logs and in the worker DLQ's view: the orchestrator's run
        /// and a sequence number.
        id: String,
        calls: Vec<serde_json::Value>,
    },
}

/// One entry of a batch that is not a job's payload: the entry as it came, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct UnreadableCall {
    pub entry: serde_json::Value,
    pub problem: String,
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

/// A job inside a worker payload travels as its JSON text: a payload is read through
/// serde's buffered enum path, which cannot hold a body's raw bytes. Version 1 payloads
/// carried the job as an object; they are still read.
mod job_as_text {
    use serde::{Deserialize, Deserializer, Serializer};

    use super::Job;

    pub fn serialize<S: Serializer>(job: &Job, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&job.to_json())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Job, D::Error> {
        let text = match serde_json::Value::deserialize(deserializer)? {
            serde_json::Value::String(text) => text,
            object => object.to_string(),
        };
        Job::parse(&text).map_err(serde::de::Error::custom)
    }
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
    /// The job of a job payload of an ordered lane, and its attempt.
    #[must_use]
    pub fn ordered_job(&self) -> Option<(&Job, u32)> {
        match self {
            Self::Job { job, attempt, .. } if job.ordered => Some((job, *attempt)),
            _ => None,
        }
    }

    /// A batch named `id` carrying `calls` (job payloads; anything else is refused when
    /// the batch is read).
    #[must_use]
    pub fn batch(id: String, calls: &[Self]) -> Self {
        Self::Batch { id, calls: calls.iter().map(|call| serde_json::to_value(call).unwrap_or_default()).collect() }
    }

    /// The job payloads of a batch, each read on its own: an entry that is not a job's
    /// payload (a health check, a batch, something unreadable) comes back as an
    /// [`UnreadableCall`]. A payload that is no batch is its own only call.
    #[must_use]
    pub fn batch_calls(&self) -> Vec<Result<Self, UnreadableCall>> {
        let Self::Batch { calls, .. } = self else { return vec![Ok(self.clone())] };
        calls
            .iter()
            .map(|entry| match serde_json::from_value::<Self>(entry.clone()) {
                Ok(call @ Self::Job { .. }) => Ok(call),
                Ok(_) => Err(UnreadableCall { entry: entry.clone(), problem: "a batch carries only job payloads".into() }),
                Err(e) => Err(UnreadableCall { entry: entry.clone(), problem: e.to_string() }),
            })
            .collect()
    }

    /// How many jobs the payload carries: one for a job, none for a health check, a
    /// batch's entries.
    #[must_use]
    pub fn job_count(&self) -> usize {
        match self {
            Self::Job { .. } => 1,
            Self::HealthCheck { .. } => 0,
            Self::Batch { calls, .. } => calls.len(),
        }
    }

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
            Some(v) if v == 1 || v == u64::from(PAYLOAD_VERSION) => {}
            Some(v) => return Err(PayloadError::Version(u32::try_from(v).unwrap_or(u32::MAX))),
            None => return Err(PayloadError::Invalid("missing version field `v`".into())),
        }
        serde_json::from_value::<VersionedPayload>(value).map(|p| p.payload).map_err(|e| PayloadError::Invalid(e.to_string()))
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
    /// Its lane's credentials could not be read (a header's environment variable is not
    /// set): never called without them.
    Credentials,
    /// A worker batch's earlier delivery claimed its call and stopped (a crash, a
    /// timeout, a write that failed) before it said the call settled: the call may have
    /// been made, so it is not made again unless an operator redrives it.
    CallInDoubt,
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
            Self::Credentials => "credentials".into(),
            Self::CallInDoubt => "call_in_doubt".into(),
        }
    }
}

/// A dead-letter reason: the cause and a human sentence.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetterReason {
    #[serde(flatten)]
    pub cause: DeadLetterCause,
    pub detail: String,
    /// The job's outcome record, when the worker dead-lettered it after a call (or could
    /// not make one): what the results destination also gets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Box<crate::outcome::OutcomeRecord>>,
}

impl DeadLetterReason {
    /// Its workers started after its slot each time it was handed off, the last time
    /// with the most lead a stack takes (see [`Job::after_late_start`]), `late` after it:
    /// the reason the worker and the simulated worker give.
    #[must_use]
    pub fn late_start(job: &Job, late: Duration) -> Self {
        let detail = format!(
            "workers started after its slot each time it was handed off, the last {} ms late, though the stack handed it off {} ms earlier than configured: raise dispatch_ahead (DispatchAheadMilliseconds) above how late workers start",
            late.as_millis(),
            job.late_start_ms
        );
        Self { cause: DeadLetterCause::AttemptsExhausted { last_failure: Some("late_start".into()) }, detail, outcome: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_names_its_lane_or_goes_in_the_default_one_and_a_bad_lane_is_refused_by_name() {
        let parse = |lane: &str| Job::parse(&format!(r#"{{"id":"l"{lane},"request":{{"method":"GET","path":"/"}}}}"#));
        let acme = parse(r#","lane":"acme""#).unwrap();
        assert_eq!(acme.lane.as_str(), "acme");
        assert_eq!(Job::parse(&acme.to_json()).unwrap().lane, acme.lane, "the lane travels with the job");
        let default = parse("").unwrap();
        assert!(default.lane.is_default());
        assert!(!default.to_json().contains("lane"), "a single-lane job's JSON is as before");
        assert_eq!(parse(r#","lane":"a b""#).unwrap_err().to_string(), "lane: lane id \"a b\" has ' ': only A-Za-z0-9._:- are allowed");
        assert_eq!(parse(r#","lane":"tiers""#).unwrap_err(), JobError::Lane(LaneIdError::Reserved("tiers".into())));
    }

    /// A 3 MB `metadata` was accepted and copied into the outcome record, which on AWS
    /// must fit one SQS message.
    #[test]
    fn metadata_over_its_bound_is_refused_naming_its_size() {
        let job = |bytes: usize| format!(r#"{{"id":"m","request":{{"method":"GET","path":"/"}},"metadata":{{"note":"{}"}}}}"#, "x".repeat(bytes));
        assert!(Job::parse(&job(MAX_METADATA - 20)).is_ok());
        let refused = Job::parse(&job(3_000_000)).unwrap_err();
        assert_eq!(refused, JobError::Metadata(3_000_011));
        assert!(refused.to_string().starts_with("metadata: 3000011 bytes of JSON, over the 16384"), "{refused}");
    }

    /// A job whose worker missed its slot went back with nothing learned, and missed
    /// again, for ever.
    #[test]
    fn a_job_that_missed_its_slot_is_handed_off_earlier_each_time_up_to_a_bound() {
        let job = Job::parse(r#"{"id":"j","request":{"method":"GET","path":"/"}}"#).unwrap();
        assert_eq!(job.late_start_ms, 0);
        let once = job.started_late_by(Duration::from_millis(30));
        assert_eq!(once.late_start_ms, 30);
        let twice = Job::parse(&once.to_json()).unwrap().started_late_by(Duration::from_millis(5));
        assert_eq!(twice.late_start_ms, 60, "kept across the queue, and at least doubled");
        let many = (0..20).fold(twice.clone(), |job, _| job.started_late_by(Duration::from_millis(5)));
        assert_eq!(Duration::from_millis(many.late_start_ms), MAX_LATE_START);
        assert_eq!(twice.clone().after_late_start(Duration::from_millis(5)).map(|job| job.late_start_ms), Some(120));
        assert!(many.clone().after_late_start(Duration::from_millis(5)).is_none(), "late again at the most: to the DLQ");
        // An event run again a minute later (a failed batch's retry) teaches nothing.
        let retried = twice.after_late_start(Duration::from_secs(60)).unwrap();
        assert_eq!(retried.late_start_ms, 60);
        assert!(many.after_late_start(Duration::from_secs(60)).is_some());
    }

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
        let payload = WorkerPayload::Job { job, attempt: 2, circuit_epoch: 4, dispatched_at: UnixMillis(9), slot: None, trip: None, report_limits: false };
        let text = payload.to_json();
        assert!(text.contains(r#""v":2"#) && text.contains(r#""kind":"job""#));
        assert_eq!(WorkerPayload::from_json(&text).unwrap(), payload);
        let check = WorkerPayload::HealthCheck { circuit_epoch: 3, sent_at: UnixMillis(1), slot: None, lane: LaneId::default_lane() };
        assert_eq!(WorkerPayload::from_json(&check.to_json()).unwrap(), check);
        assert!(matches!(WorkerPayload::from_json(&text.replace(r#""v":2"#, r#""v":3"#)), Err(PayloadError::Version(3))));
    }

    #[test]
    fn header_names_and_values_that_no_http_client_can_send_are_malformed() {
        let with_header = |name: &str, value: &str| serde_json::json!({"request": {"method": "GET", "path": "/", "headers": {name: value}}}).to_string();
        for (name, value) in [("X-A", "a\r\nX-Injected: 1"), ("X-A", "line\nbreak"), ("Bad Name", "v"), ("X-A", "caf\u{e9}"), ("", "v"), ("X-A", "nul\0")] {
            let err = Job::parse(&with_header(name, value)).unwrap_err();
            assert!(matches!(err, JobError::HeaderInvalid(_)), "{name:?}: {value:?} gave {err}");
        }
        assert!(Job::parse(&with_header("X-Trace-Id", "abc 123\tok")).is_ok());
    }

    /// Jobs could still send `Upgrade`, `TE`, `Keep-Alive`, `Proxy-Connection` and
    /// `Expect`, though connection headers are refused.
    #[test]
    fn every_connection_header_is_refused() {
        for name in ["Upgrade", "te", "Keep-Alive", "Proxy-Connection", "Expect", "Trailer", "Host", "Connection"] {
            let text = serde_json::json!({"request": {"method": "GET", "path": "/", "headers": {name: "x"}}}).to_string();
            assert!(matches!(Job::parse(&text), Err(JobError::Header(_))), "{name} was accepted");
        }
    }

    #[test]
    fn trace_and_connect_are_refused() {
        for method in ["TRACE", "connect", "track"] {
            let text = serde_json::json!({"request": {"method": method, "path": "/"}}).to_string();
            assert!(matches!(Job::parse(&text), Err(JobError::Method(_))), "{method} was accepted");
        }
    }

    #[test]
    fn percent_encoded_dot_segments_cannot_leave_the_base_path() {
        for path in ["/.%2E/v1x/secret", "/%2e./x", "/%2E%2e/x", "/a/.%2e", "/./x", "/%2e/x", "/a%2F..%2Fb", "/a%5c..%5cb"] {
            let text = serde_json::json!({"request": {"method": "GET", "path": path}}).to_string();
            assert!(matches!(Job::parse(&text), Err(JobError::Path(_))), "{path} was accepted");
        }
        assert!(Job::parse(r#"{"request":{"method":"GET","path":"/a.b/..c/%2Ex"}}"#).is_ok());
    }

    #[test]
    fn request_bodies_keep_the_bytes_the_producer_wrote() {
        let body = r#"{"z": 1, "a": 123456789012345678901234567890, "e": 1e3}"#;
        let text = format!(r#"{{"id":"b","request":{{"method":"POST","path":"/","body":{body}}}}}"#);
        let job = Job::parse(&text).unwrap();
        assert_eq!(job.request.body.as_ref().unwrap().json(), body);
        // Through a re-queue and a worker payload, still the same bytes.
        let again = Job::parse(&job.to_json()).unwrap();
        assert_eq!(again.request.body.as_ref().unwrap().json(), body);
        let payload = WorkerPayload::Job { job, attempt: 0, circuit_epoch: 0, dispatched_at: UnixMillis(1), slot: None, trip: None, report_limits: false };
        let WorkerPayload::Job { job, .. } = WorkerPayload::from_json(&payload.to_json()).unwrap() else { panic!("not a job") };
        assert_eq!(job.request.body.unwrap().json(), body);
        let text_body = Job::parse(r#"{"request":{"method":"POST","path":"/","body":"plain \"text\""}}"#).unwrap();
        assert_eq!(text_body.request.body.unwrap().as_text().as_deref(), Some("plain \"text\""));
    }

    #[test]
    fn version_1_payloads_are_still_read() {
        let text = r#"{"v":1,"kind":"job","job":{"id":"j","request":{"method":"GET","path":"/x"},"cost":1},"attempt":0,"circuit_epoch":0,"dispatched_at":5}"#;
        let WorkerPayload::Job { job, .. } = WorkerPayload::from_json(text).unwrap() else { panic!("not a job") };
        assert_eq!(job.id.as_str(), "j");
    }

    #[test]
    fn dead_letter_reasons_have_labels() {
        let reason = DeadLetterReason { cause: DeadLetterCause::Rejected { status: 404 }, detail: "not found".into(), outcome: None };
        assert_eq!(reason.cause.label(), "http_404");
        assert_eq!(serde_json::to_string(&reason).unwrap(), r#"{"cause":"rejected","status":404,"detail":"not found"}"#);
    }
}
