//! The lane's configuration file (TOML), parsed once into checked types.
//!
//! Every key is known (a typo is an error naming it), every value is parsed where it is
//! read (tiers, durations, time zone, URL), and secrets are read from the environment
//! into `SecretString`s that never print. Errors say which key is wrong and why.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use secrecy::SecretString;
use serde::{Deserialize, Deserializer};

use crate::breaker::TripSettings;
use crate::job::ApiRequest;
use crate::lane::LaneId;
use crate::order::{JobOrder, LaneOrdering};
use crate::outcome::{OutcomeSettings, RecordOutcomes};
use crate::quota::{Quota, Tier};

mod lanes;
mod serve;

pub use lanes::{CoolDownScope, LaneChange, LaneSettings, LanesConfig, LANE_PLACEHOLDER};
pub use serve::{ServeConfig, MIN_TOKEN_LEN};

/// Why the configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The OS error is part of the message, not a separate cause, so it prints once.
    #[error("cannot read config {path}: {error}")]
    Read { path: PathBuf, error: std::io::Error },
    #[error("config {path}: {problem}")]
    Invalid { path: PathBuf, problem: ConfigProblem },
}

/// What is wrong in a config: the key (`retry.max_attempts`, `api.headers.X-Key`), when
/// the problem is one key's, and the message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{message}", key.as_deref().map(|key| format!("{key}: ")).unwrap_or_default())]
pub struct ConfigProblem {
    pub key: Option<String>,
    pub message: String,
}

impl ConfigProblem {
    fn at(key: impl Into<String>, message: impl std::fmt::Display) -> Self {
        Self { key: Some(key.into()), message: message.to_string() }
    }
}

/// A whole lane.
#[derive(Debug, Clone)]
pub struct Config {
    pub api: ApiConfig,
    pub quota: Quota,
    pub circuit: CircuitConfig,
    pub retry: RetryConfig,
    pub orchestrator: OrchestratorConfig,
    pub outcomes: OutcomeSettings,
    pub backend: Backend,
    /// `[lanes]`: many lanes under `quota`, shared. `None`: one lane, `default`, whose
    /// quota is `quota`.
    pub lanes: Option<LanesConfig>,
    /// `[serve]`: `paceline serve`'s tokens and limits.
    pub serve: ServeConfig,
    /// `[quota] ordering`: how a stack without lanes orders its jobs (with `[lanes]`,
    /// each lane's `ordering` says).
    pub quota_ordering: JobOrder,
}

/// The third-party API.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    pub base_url: url::Url,
    pub timeout: Duration,
    /// Headers added to every call, secrets included.
    pub headers: Vec<(String, SecretString)>,
    pub health_check: ApiRequest,
    /// The largest request body a job may carry, in bytes (refused at enqueue, and by the
    /// worker before any call).
    pub max_body: usize,
    /// A header that carries the job id on every call of a job (`Idempotency-Key`), so
    /// providers that support it deduplicate on their side too. Lower case.
    pub idempotency_header: Option<String>,
}

/// The circuit breaker (see `breaker`).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CircuitConfig {
    /// The first break after the circuit opens, before a health check.
    #[serde(deserialize_with = "duration", default = "defaults::health_check_interval")]
    pub health_check_interval: Duration,
    /// The longest break: each re-opening from half-open doubles it up to this.
    #[serde(deserialize_with = "duration", default = "defaults::max_break")]
    pub max_break: Duration,
    /// The share of failed calls (0 to 1) among the recent ones that opens the circuit.
    #[serde(default = "defaults::failure_rate_threshold")]
    pub failure_rate_threshold: f64,
    /// How many recent calls the failure rate looks at (at the current pace).
    #[serde(default = "defaults::minimum_calls")]
    pub minimum_calls: u64,
    /// The fewest failures that open the circuit.
    #[serde(default = "defaults::minimum_failures")]
    pub minimum_failures: u64,
    /// After a healthy check, jobs flow at this share of the pace (0 to 1)...
    #[serde(default = "defaults::ramp_start")]
    pub ramp_start: f64,
    /// ...doubling every `ramp_step` until the full pace closes the circuit.
    #[serde(deserialize_with = "duration", default = "defaults::ramp_step")]
    pub ramp_step: Duration,
    /// Ramp up the same way at a lane's first run (providers that want new clients to).
    #[serde(default)]
    pub warm_up: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// Failed calls per job at most; a job that failed this often goes to the DLQ. A
    /// 429 is "not now", not a failure: it does not count here.
    #[serde(default = "defaults::max_attempts")]
    pub max_attempts: u32,
    /// Calls per job the API may answer 429 before it goes to the DLQ: a generous bound
    /// that only a quota configured well above the API's reaches.
    #[serde(default = "defaults::max_rate_limited")]
    pub max_rate_limited: u32,
    /// Cool-down after a 429 that says nothing of when to come back.
    #[serde(deserialize_with = "duration", default = "defaults::default_cool_down")]
    pub default_cool_down: Duration,
    /// The longest cool-down any answer may impose (`Retry-After`, `X-RateLimit-Reset`
    /// and the like are capped to it), so a far-future date cannot halt the lane.
    #[serde(deserialize_with = "duration", default = "defaults::max_cool_down")]
    pub max_cool_down: Duration,
    /// A failed call's job is retried after a random delay of up to `backoff_base *
    /// 2^attempt` ("full jitter")...
    #[serde(deserialize_with = "duration", default = "defaults::backoff_base")]
    pub backoff_base: Duration,
    /// ...and never more than this (SQS delays a message at most 15 minutes).
    #[serde(deserialize_with = "duration", default = "defaults::backoff_max")]
    pub backoff_max: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OrchestratorConfig {
    #[serde(deserialize_with = "duration", default = "defaults::lease_ttl")]
    pub lease_ttl: Duration,
    #[serde(deserialize_with = "duration", default = "defaults::visibility_timeout")]
    pub visibility_timeout: Duration,
    /// How often quota usage is written back (also at exit).
    #[serde(deserialize_with = "duration", default = "defaults::flush_interval")]
    pub flush_interval: Duration,
    /// How often the circuit and cool-down are re-read.
    #[serde(deserialize_with = "duration", default = "defaults::state_refresh")]
    pub state_refresh: Duration,
    /// Stop dispatching this long before the run's deadline.
    #[serde(deserialize_with = "duration", default = "defaults::deadline_margin")]
    pub deadline_margin: Duration,
    /// Hand each job to its worker this long before its pacer slot, with the slot in the
    /// payload; the worker waits for it (see `CallSlot`). Zero dispatches at the slot.
    /// Unset, where the workers run decides ([`Self::dispatch_ahead`]).
    #[serde(deserialize_with = "optional_duration", default)]
    pub dispatch_ahead: Option<Duration>,
    /// The most jobs one worker invocation carries (1: one job each). Unset, where the
    /// workers run decides ([`Self::worker_batch`]).
    #[serde(default)]
    pub worker_batch: Option<u32>,
    /// A batch carries the jobs whose slots fall within this long of its first: each
    /// job is handed off this much earlier, and a batch goes once its first job must.
    /// Shortened to what fills `worker_batch` at the quota's pace.
    #[serde(deserialize_with = "duration", default = "defaults::batch_window")]
    pub batch_window: Duration,
    /// The most calls a second one worker is given: a faster pace goes to several
    /// batches at once, in stripes (each job to the next).
    #[serde(default = "defaults::worker_pace")]
    pub worker_pace: u32,
}

/// How many jobs a Lambda worker invocation carries at most unless configured: at
/// 10,000 calls/s, ten invocations a second; a 300 ms API then keeps about 300 calls in
/// flight in each.
pub const LAMBDA_WORKER_BATCH: u32 = 1_000;

/// The most jobs a worker invocation may be configured to carry.
pub const MAX_WORKER_BATCH: u32 = 10_000;

/// The longest `batch_window`: a job's slot is decided this much earlier, so its lane's
/// circuit and cool-down reach it that much later.
pub const MAX_BATCH_WINDOW: Duration = Duration::from_secs(5);

/// How long before its slot a job goes to a Lambda worker unless configured: above
/// Lambda's async start delay (p99 about 225 ms) with the invoke's own time and its
/// tail, so that start-up jitter does not reach the provider and a worker that starts
/// late rarely misses its slots (at 400 ms, one batch in a few thousand did, and left a
/// second of a 100/s tier at 88 calls). The AWS lane, the template's default and the
/// simulator all use it.
pub const LAMBDA_DISPATCH_AHEAD: Duration = Duration::from_millis(500);

/// How long before its slot a job goes to an in-process worker unless configured: the
/// hand-off's own work before the call (the invocation's write, the task's start, the
/// claim's write) then happens before the slot, and the worker calls at the slot itself.
/// At the slot, a hand-off that ran late on a busy machine (or in a debug build) put its
/// call that much closer to the next window's and a strict provider saw 11 calls in a
/// second under 10/s.
pub const IN_PROCESS_DISPATCH_AHEAD: Duration = Duration::from_millis(50);

/// Where a lane's workers run, which sets the default `dispatch_ahead`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerHost {
    /// In the orchestrator's process (`paceline run`, the demo): no start delay, but a
    /// hand-off's own work (and a busy scheduler) before the call.
    InProcess,
    /// Lambda functions, invoked asynchronously.
    Lambda,
}

impl ApiConfig {
    /// What this lane's configuration forbids a job's request, beyond `Job::parse`.
    #[must_use]
    pub fn request_limits(&self) -> RequestLimits {
        let configured = self.headers.iter().map(|(name, _)| name.to_ascii_lowercase());
        RequestLimits { lane_headers: configured.chain(self.idempotency_header.clone()).collect(), max_body: self.max_body, timeout: self.timeout }
    }
}

/// Checks `api.idempotency_header`: a header name, not one the lane already sets.
/// Returns it in lower case.
pub(crate) fn check_idempotency_header(name: Option<String>, headers: &[(String, SecretString)]) -> Result<Option<String>, String> {
    let Some(name) = name else { return Ok(None) };
    if !crate::job::is_header_name(&name) {
        return Err(format!("`{name}` is not a header name"));
    }
    if crate::job::is_reserved_header(&name) {
        return Err(format!(
            "`{name}` belongs to the connection or the lane's credentials, not to a job id; name a header of its own, such as Idempotency-Key"
        ));
    }
    let name = name.to_ascii_lowercase();
    if headers.iter().any(|(configured, _)| configured.eq_ignore_ascii_case(&name)) {
        return Err(format!("`{name}` is also in the lane's headers"));
    }
    Ok(Some(name))
}

/// A lane's rules for a job's request: its configured headers always win (a job may not
/// set one: no producer can replace the lane's credential), and its body is at most
/// `api.max_body` bytes and can be sent within `api.timeout`. Checked at enqueue and by
/// the worker before any call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLimits {
    /// Names of the configured headers, lower-cased.
    lane_headers: Vec<String>,
    max_body: usize,
    timeout: Duration,
}

impl RequestLimits {
    /// # Errors
    /// What the request breaks, naming the field.
    pub fn check(&self, request: &ApiRequest) -> Result<(), String> {
        if let Some(name) = request.headers.keys().find(|name| self.lane_headers.contains(&name.to_ascii_lowercase())) {
            return Err(format!("request.headers: `{name}` is set by the lane's configuration and may not be replaced by a job"));
        }
        match request.body.as_ref() {
            Some(body) if body.len() > self.max_body => Err(format!("request.body: {} bytes, over api.max_body ({} bytes)", body.len(), self.max_body)),
            Some(body) if request.upload_allowance() >= self.timeout => Err(format!(
                "request.body: {} bytes take about {:.1} s to send (at the assumed {} MB/s), not within api.timeout ({} s): the call could never finish",
                body.len(),
                request.upload_allowance().as_secs_f64(),
                crate::job::UPLOAD_BYTES_PER_SECOND / 1_000_000,
                self.timeout.as_secs_f64()
            )),
            _ => Ok(()),
        }
    }
}

/// Where queue and state live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// One SQLite file (resolved against the config file's folder).
    Embedded { path: PathBuf },
    /// AWS resources by name.
    Aws(AwsBackend),
}

/// A lane's AWS resources, as the operator commands reach them (the Lambda functions
/// take theirs from `PACELINE_*` variables).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AwsBackend {
    pub queue_url: String,
    pub dlq_url: String,
    pub table: String,
    /// The worker's Lambda on-failure destination (`paceline dlq` reads it too).
    #[serde(default)]
    pub worker_dlq_url: Option<String>,
    /// What `paceline kick` invokes.
    #[serde(default)]
    pub orchestrator_function: Option<String>,
    #[serde(default)]
    pub worker_function: Option<String>,
    /// Defaults to the SDK's own (`AWS_REGION`, profile).
    #[serde(default)]
    pub region: Option<String>,
    /// The shared config/credentials profile; defaults to the SDK's own (`AWS_PROFILE`).
    #[serde(default)]
    pub profile: Option<String>,
    /// Points every client elsewhere (a local emulator); `AWS_ENDPOINT_URL*` work too.
    #[serde(default)]
    pub endpoint_url: Option<String>,
}

/// The longest a worker may be asked to wait for its slot (it is billed while it waits).
pub const MAX_DISPATCH_AHEAD: Duration = Duration::from_secs(10);

pub(crate) mod defaults {
    use std::time::Duration;
    /// Half a second: at 100/s, fifty jobs an invocation. A longer window saves few
    /// invocations more and costs the quota at each hand-over between runs (simulated at
    /// 100/s: 98.0% of the tier with 250 ms or 500 ms, 96.7% with 1 s).
    pub fn batch_window() -> Duration {
        Duration::from_millis(500)
    }
    /// 500 calls a second: one worker's calls then go out within a millisecond or so of
    /// their slots (the worker batch bench: p99 1 ms at 500/s, 4 ms at 1,000/s, 7 ms at
    /// 2,000/s on a core).
    pub fn worker_pace() -> u32 {
        500
    }
    pub fn health_check_interval() -> Duration {
        Duration::from_secs(5)
    }
    pub fn max_attempts() -> u32 {
        5
    }
    pub fn max_rate_limited() -> u32 {
        100
    }
    pub fn default_cool_down() -> Duration {
        Duration::from_secs(1)
    }
    pub fn max_cool_down() -> Duration {
        Duration::from_secs(3600)
    }
    pub fn backoff_base() -> Duration {
        Duration::from_secs(1)
    }
    pub fn backoff_max() -> Duration {
        Duration::from_secs(300)
    }
    pub fn max_break() -> Duration {
        Duration::from_secs(30)
    }
    pub fn failure_rate_threshold() -> f64 {
        0.5
    }
    pub fn minimum_calls() -> u64 {
        20
    }
    pub fn minimum_failures() -> u64 {
        5
    }
    pub fn ramp_start() -> f64 {
        0.1
    }
    pub fn ramp_step() -> Duration {
        Duration::from_secs(2)
    }
    pub fn max_body() -> usize {
        256 * 1024
    }
    pub fn lease_ttl() -> Duration {
        Duration::from_secs(30)
    }
    pub fn visibility_timeout() -> Duration {
        Duration::from_secs(60)
    }
    pub fn flush_interval() -> Duration {
        Duration::from_secs(2)
    }
    pub fn state_refresh() -> Duration {
        Duration::from_secs(1)
    }
    pub fn deadline_margin() -> Duration {
        Duration::from_secs(5)
    }
    pub fn timeout() -> Duration {
        Duration::from_secs(10)
    }
    pub fn safety_margin() -> Duration {
        Duration::from_millis(10)
    }
}

impl Default for CircuitConfig {
    fn default() -> Self {
        Self {
            health_check_interval: defaults::health_check_interval(),
            max_break: defaults::max_break(),
            failure_rate_threshold: defaults::failure_rate_threshold(),
            minimum_calls: defaults::minimum_calls(),
            minimum_failures: defaults::minimum_failures(),
            ramp_start: defaults::ramp_start(),
            ramp_step: defaults::ramp_step(),
            warm_up: false,
        }
    }
}

impl CircuitConfig {
    /// What opens the circuit, as the trip rule needs it.
    #[must_use]
    pub fn trip_settings(&self) -> TripSettings {
        TripSettings { failure_rate_threshold: self.failure_rate_threshold, minimum_calls: self.minimum_calls, minimum_failures: self.minimum_failures }
    }

    /// # Errors
    /// The first field out of range.
    pub fn check(&self) -> Result<(), Invalid> {
        at_least("health_check_interval", self.health_check_interval, Duration::from_millis(100))?;
        let share = |field: &'static str, value: f64| {
            if value > 0.0 && value <= 1.0 {
                Ok(())
            } else {
                Err(Invalid { field, problem: format!("{value} is not a share above 0 and at most 1") })
            }
        };
        share("failure_rate_threshold", self.failure_rate_threshold)?;
        share("ramp_start", self.ramp_start)?;
        if self.minimum_calls == 0 || self.minimum_failures == 0 {
            return Err(Invalid { field: if self.minimum_calls == 0 { "minimum_calls" } else { "minimum_failures" }, problem: "must be at least 1".into() });
        }
        Ok(())
    }
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            max_attempts: defaults::max_attempts(),
            max_rate_limited: defaults::max_rate_limited(),
            default_cool_down: defaults::default_cool_down(),
            max_cool_down: defaults::max_cool_down(),
            backoff_base: defaults::backoff_base(),
            backoff_max: defaults::backoff_max(),
        }
    }
}

impl Default for OrchestratorConfig {
    fn default() -> Self {
        Self {
            lease_ttl: defaults::lease_ttl(),
            visibility_timeout: defaults::visibility_timeout(),
            flush_interval: defaults::flush_interval(),
            state_refresh: defaults::state_refresh(),
            deadline_margin: defaults::deadline_margin(),
            dispatch_ahead: None,
            worker_batch: None,
            batch_window: defaults::batch_window(),
            worker_pace: defaults::worker_pace(),
        }
    }
}

/// A setting that cannot be used: the field (as named in the config file's section, and
/// in `PACELINE_*` upper-cased) and the problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub field: &'static str,
    pub problem: String,
}

fn at_least(field: &'static str, value: Duration, least: Duration) -> Result<(), Invalid> {
    if value < least {
        return Err(Invalid { field, problem: format!("must be at least {}", humantime::format_duration(least)) });
    }
    Ok(())
}

impl OrchestratorConfig {
    /// `dispatch_ahead` as configured, or else the default where the workers run:
    /// [`LAMBDA_DISPATCH_AHEAD`] for Lambda functions, [`IN_PROCESS_DISPATCH_AHEAD`] in
    /// one process.
    #[must_use]
    pub fn dispatch_ahead(&self, workers: WorkerHost) -> Duration {
        self.dispatch_ahead.unwrap_or(match workers {
            WorkerHost::InProcess => IN_PROCESS_DISPATCH_AHEAD,
            WorkerHost::Lambda => LAMBDA_DISPATCH_AHEAD,
        })
    }

    /// `worker_batch` as configured, or else the default where the workers run:
    /// [`LAMBDA_WORKER_BATCH`] for Lambda functions, 1 in one process (an in-process
    /// worker costs nothing to start).
    #[must_use]
    pub fn worker_batch(&self, workers: WorkerHost) -> u32 {
        self.worker_batch.unwrap_or(match workers {
            WorkerHost::InProcess => 1,
            WorkerHost::Lambda => LAMBDA_WORKER_BATCH,
        })
    }

    /// Refuses values that would harm the lane (a zero refresh spins a core).
    ///
    /// # Errors
    /// The first field out of range.
    pub fn check(&self) -> Result<(), Invalid> {
        at_least("lease_ttl", self.lease_ttl, Duration::from_secs(2))?;
        at_least("visibility_timeout", self.visibility_timeout, Duration::from_secs(1))?;
        at_least("flush_interval", self.flush_interval, Duration::from_millis(100))?;
        at_least("state_refresh", self.state_refresh, Duration::from_millis(100))?;
        if self.dispatch_ahead.is_some_and(|ahead| ahead > MAX_DISPATCH_AHEAD) {
            return Err(Invalid { field: "dispatch_ahead", problem: format!("at most {}", humantime::format_duration(MAX_DISPATCH_AHEAD)) });
        }
        if self.worker_batch.is_some_and(|batch| batch == 0 || batch > MAX_WORKER_BATCH) {
            return Err(Invalid { field: "worker_batch", problem: format!("must be from 1 to {MAX_WORKER_BATCH}") });
        }
        if self.worker_pace == 0 {
            return Err(Invalid { field: "worker_pace", problem: "must be at least 1".into() });
        }
        if self.batch_window > MAX_BATCH_WINDOW {
            return Err(Invalid { field: "batch_window", problem: format!("at most {}", humantime::format_duration(MAX_BATCH_WINDOW)) });
        }
        Ok(())
    }
}

impl RetryConfig {
    /// # Errors
    /// The first field out of range.
    pub fn check(&self) -> Result<(), Invalid> {
        if self.max_attempts == 0 {
            return Err(Invalid { field: "max_attempts", problem: "must be at least 1".into() });
        }
        if self.max_rate_limited == 0 {
            return Err(Invalid { field: "max_rate_limited", problem: "must be at least 1".into() });
        }
        at_least("max_cool_down", self.max_cool_down, Duration::from_secs(1))
    }
}

/// The most call slots a lane may have: each is an item a worker may have to try.
pub const MAX_CALL_SLOTS: u32 = 100;

/// Checks `quota.max_in_flight`: 1 to [`MAX_CALL_SLOTS`] when given.
///
/// # Errors
/// When it is out of that range.
pub fn check_max_in_flight(max_in_flight: Option<u32>) -> Result<Option<u32>, String> {
    match max_in_flight {
        Some(n) if n == 0 || n > MAX_CALL_SLOTS => Err(format!("{n} is not between 1 and {MAX_CALL_SLOTS} (leave it out for no cap)")),
        other => Ok(other),
    }
}

/// Checks an API call timeout: a zero timeout would make every call a timeout.
///
/// # Errors
/// When it is under 100 ms.
pub fn check_timeout(timeout: Duration) -> Result<(), Invalid> {
    at_least("timeout", timeout, Duration::from_millis(100))
}

/// Parses the API's base URL: http or https with a host (`http:///v1` is refused, not
/// read as host `v1`), no user or password (credentials belong in `api.headers`), no
/// query or fragment (they would be dropped).
///
/// # Errors
/// What is wrong with it.
pub fn parse_base_url(text: &str) -> Result<url::Url, String> {
    let url = url::Url::parse(text).map_err(|e| format!("`{text}` is not a URL: {e}"))?;
    let authority = text.split_once("://").map_or("", |(_, rest)| rest);
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() || authority.is_empty() || authority.starts_with('/') {
        return Err(format!("`{text}` must be an http or https URL with a host"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err("must not hold a user or password: put credentials in api.headers (from the environment)".into());
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(format!("`{text}` must not have a query or fragment"));
    }
    Ok(url)
}

/// Parses a size in bytes: `1048576`, `256KiB`, `1MiB`, `500kB`, `1MB`.
///
/// # Errors
/// When it is not a size.
pub fn parse_size(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let unit_bytes = match unit.trim() {
        "" | "B" => 1,
        "kB" | "KB" => 1_000,
        "KiB" => 1_024,
        "MB" => 1_000_000,
        "MiB" => 1_048_576,
        _ => return Err(format!("`{text}` is not a size (write for example 262144, 256KiB, 1MiB)")),
    };
    number.parse::<usize>().ok().and_then(|n| n.checked_mul(unit_bytes)).filter(|n| *n > 0).ok_or_else(|| format!("`{text}` is not a size of at least 1 byte"))
}

fn size<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(u64),
        Text(String),
    }
    match Size::deserialize(d)? {
        Size::Bytes(n) => usize::try_from(n).ok().filter(|n| *n > 0).ok_or_else(|| serde::de::Error::custom("must be at least 1 byte")),
        Size::Text(text) => parse_size(&text).map_err(serde::de::Error::custom),
    }
}

fn optional_size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    size(d).map(Some)
}

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    crate::time::parse_setting_duration(&text).map_err(serde::de::Error::custom)
}

fn optional_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    duration(d).map(Some)
}

fn time_zone<'de, D: Deserializer<'de>>(d: D) -> Result<chrono_tz::Tz, D::Error> {
    let text = String::deserialize(d)?;
    text.parse().map_err(|_| serde::de::Error::custom(format!("unknown time zone `{text}` (use an IANA name such as UTC or America/New_York)")))
}

fn base_url<'de, D: Deserializer<'de>>(d: D) -> Result<url::Url, D::Error> {
    let text = String::deserialize(d)?;
    parse_base_url(&text).map_err(serde::de::Error::custom)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    api: RawApi,
    /// Left out only with `[lanes]` (lanes with nothing in common).
    quota: Option<RawQuota>,
    #[serde(default)]
    circuit: CircuitConfig,
    #[serde(default)]
    retry: RetryConfig,
    #[serde(default)]
    orchestrator: OrchestratorConfig,
    #[serde(default)]
    outcomes: RawOutcomes,
    #[serde(default)]
    backend: RawBackend,
    lanes: Option<toml::Table>,
    #[serde(default)]
    serve: serve::RawServe,
}

/// `[outcomes]` as written; defaults from [`OutcomeSettings::default`].
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawOutcomes {
    #[serde(default)]
    record: RecordOutcomes,
    #[serde(deserialize_with = "optional_size", default)]
    max_body: Option<usize>,
    headers: Option<Vec<String>>,
    #[serde(deserialize_with = "optional_duration", default)]
    retention: Option<Duration>,
}

impl RawOutcomes {
    fn settings(self) -> Result<OutcomeSettings, ConfigProblem> {
        let defaults = OutcomeSettings::default();
        let settings = OutcomeSettings {
            record: self.record,
            max_body: self.max_body.unwrap_or(defaults.max_body),
            headers: self.headers.unwrap_or(defaults.headers),
            retention: self.retention.unwrap_or(defaults.retention),
        };
        settings.checked().map_err(|(field, problem)| ConfigProblem::at(format!("outcomes.{field}"), problem))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawApi {
    #[serde(deserialize_with = "base_url")]
    base_url: url::Url,
    #[serde(deserialize_with = "duration", default = "defaults::timeout")]
    timeout: Duration,
    #[serde(default)]
    headers: BTreeMap<String, HeaderSource>,
    /// A request like a job's, read as JSON so that it is checked exactly as one.
    health_check: Option<serde_json::Value>,
    #[serde(deserialize_with = "size", default = "defaults::max_body")]
    max_body: usize,
    idempotency_header: Option<String>,
}

/// Where a header's value comes from: literally, or from an environment variable
/// (optionally with a prefix such as `Bearer `).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, untagged)]
pub(crate) enum HeaderSource {
    Value {
        value: String,
    },
    Env {
        env: String,
        #[serde(default)]
        prefix: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawQuota {
    tiers: Vec<Tier>,
    #[serde(deserialize_with = "time_zone", default = "utc")]
    time_zone: chrono_tz::Tz,
    #[serde(deserialize_with = "duration", default = "defaults::safety_margin")]
    safety_margin: Duration,
    #[serde(default)]
    max_in_flight: Option<u32>,
    #[serde(default)]
    ordering: JobOrder,
}

fn utc() -> chrono_tz::Tz {
    chrono_tz::UTC
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, tag = "kind", rename_all = "snake_case")]
enum RawBackend {
    Embedded {
        #[serde(default = "default_db")]
        path: PathBuf,
    },
    Aws(AwsBackend),
}

fn default_db() -> PathBuf {
    PathBuf::from("paceline.db")
}

impl Default for RawBackend {
    fn default() -> Self {
        Self::Embedded { path: default_db() }
    }
}

/// Refuses ordered lanes on a standard SQS queue: only a FIFO queue gives each lane's
/// jobs back in the order they were sent.
///
/// # Errors
/// Which lane asks for order, and what to deploy instead.
pub fn check_fifo_for_ordering(ordering: &LaneOrdering, queue_url: &str) -> Result<(), String> {
    if queue_url.ends_with(".fifo") || !ordering.any() {
        return Ok(());
    }
    let which = match ordering.named.iter().find(|(_, order)| order.is_ordered()) {
        Some((lane, _)) => format!("lane {lane}'s"),
        None => "the lanes'".to_owned(),
    };
    Err(format!("{which} ordering = \"fifo\" needs a FIFO jobs queue (a URL ending in .fifo: deploy with QueueType=fifo), and {queue_url} is a standard queue"))
}

/// Reads header values, secrets from the environment. `key` names the setting in errors.
pub(crate) fn resolve_headers(
    sources: BTreeMap<String, HeaderSource>,
    key: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<(String, SecretString)>, ConfigProblem> {
    let mut headers = Vec::new();
    for (name, source) in sources {
        let value = match source {
            HeaderSource::Value { value } => value,
            HeaderSource::Env { env: var, prefix } => {
                let value = env(&var).ok_or_else(|| ConfigProblem::at(format!("{key}.{name}"), format!("environment variable {var} is not set")))?;
                format!("{prefix}{value}")
            }
        };
        // Checked here, so every command refuses the config alike (the value is a
        // secret: never shown).
        let problem = if !crate::job::is_header_name(&name) {
            Some("is not a header name".to_owned())
        } else if crate::job::is_connection_header(&name) {
            Some("belongs to the connection, which the HTTP client sets".to_owned())
        } else if !crate::job::is_header_value(&value) {
            Some("has a value with a control (CR, LF...) or non-ASCII character".to_owned())
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(ConfigProblem::at(format!("{key}.{name}"), format!("`{name}` {problem}")));
        }
        headers.push((name, SecretString::from(value)));
    }
    Ok(headers)
}

/// The health-check request, checked like a job's (a path on this API, a real method);
/// `GET /` when none is given.
pub(crate) fn check_health_request(request: Option<serde_json::Value>) -> Result<ApiRequest, crate::job::JobError> {
    match request {
        Some(request) => {
            let probe = serde_json::json!({ "request": request }).to_string();
            Ok(crate::job::Job::parse(&probe)?.request)
        }
        None => Ok(ApiRequest { method: "GET".into(), path: "/".into(), query: BTreeMap::new(), headers: BTreeMap::new(), body: None }),
    }
}

impl Config {
    /// Reads and checks a config file; secrets come from `env` (the process environment
    /// in production, a map in tests).
    ///
    /// # Errors
    /// [`ConfigError`] naming the file, the key and the problem.
    pub fn load(path: &Path, env: &dyn Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read { path: path.to_owned(), error })?;
        let base_dir = path.parent().unwrap_or(Path::new("."));
        Self::parse(&text, base_dir, env).map_err(|problem| ConfigError::Invalid { path: path.to_owned(), problem })
    }

    /// Parses config text; relative paths are resolved against `base_dir`.
    ///
    /// # Errors
    /// [`ConfigProblem`]: the key (where one key is wrong) and the problem. TOML syntax and
    /// type errors give no key; their message says the line and column.
    pub fn parse(text: &str, base_dir: &Path, env: &dyn Fn(&str) -> Option<String>) -> Result<Self, ConfigProblem> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigProblem { key: None, message: e.to_string().trim_end().to_owned() })?;
        let quota_ordering = raw.quota.as_ref().map(|quota| quota.ordering).unwrap_or_default();
        if quota_ordering.is_ordered() && raw.lanes.is_some() {
            return Err(ConfigProblem::at("quota.ordering", "is a stack of one lane's: with [lanes], set `ordering` in [lanes] or [lanes.NAME]"));
        }
        let quota = match raw.quota {
            Some(quota) => {
                let max_in_flight = check_max_in_flight(quota.max_in_flight).map_err(|e| ConfigProblem::at("quota.max_in_flight", e))?;
                Quota::new(quota.tiers, quota.time_zone, quota.safety_margin)
                    .map_err(|e| ConfigProblem::at("quota.tiers", e))?
                    .with_max_in_flight(max_in_flight)
            }
            None if raw.lanes.is_some() => Quota::unlimited(utc(), defaults::safety_margin()),
            None => {
                return Err(ConfigProblem::at(
                    "quota",
                    "missing: the API's quota, e.g. [quota] tiers = [\"10/s\"] (only a config with [lanes] may leave it out)",
                ))
            }
        };
        let in_section = |section: &str, e: Invalid| ConfigProblem::at(format!("{section}.{}", e.field), e.problem);
        raw.circuit.check().map_err(|e| in_section("circuit", e))?;
        raw.retry.check().map_err(|e| in_section("retry", e))?;
        raw.orchestrator.check().map_err(|e| in_section("orchestrator", e))?;
        check_timeout(raw.api.timeout).map_err(|e| in_section("api", e))?;
        let headers = resolve_headers(raw.api.headers, "api.headers", env)?;
        let health_check = check_health_request(raw.api.health_check).map_err(|e| ConfigProblem::at("api.health_check", e))?;
        let idempotency_header = check_idempotency_header(raw.api.idempotency_header, &headers).map_err(|e| ConfigProblem::at("api.idempotency_header", e))?;
        let outcomes = raw.outcomes.settings()?;
        let serve = raw.serve.settings(env)?;
        let backend = match raw.backend {
            RawBackend::Embedded { path } => Backend::Embedded { path: base_dir.join(path) },
            RawBackend::Aws(aws) => Backend::Aws(aws),
        };
        let lanes = raw.lanes.map(|table| LanesConfig::parse(table, &quota)).transpose()?;
        // On AWS the workers read the lanes' keys from Secrets Manager, not this machine.
        if let (Some(lanes), Backend::Embedded { .. }) = (&lanes, &backend) {
            lanes.check_keys(env)?;
        }
        if let Backend::Aws(aws) = &backend {
            let ordering = LanesConfig::ordering_of_stack(lanes.as_ref(), quota_ordering);
            let key = if lanes.is_some() { "lanes" } else { "quota.ordering" };
            check_fifo_for_ordering(&ordering, &aws.queue_url).map_err(|e| ConfigProblem::at(key, e))?;
        }
        Ok(Self {
            api: ApiConfig { base_url: raw.api.base_url, timeout: raw.api.timeout, headers, health_check, max_body: raw.api.max_body, idempotency_header },
            quota,
            circuit: raw.circuit,
            retry: raw.retry,
            orchestrator: raw.orchestrator,
            outcomes,
            backend,
            lanes,
            serve,
            quota_ordering,
        })
    }

    /// Which of the stack's lanes are ordered.
    #[must_use]
    pub fn ordering(&self) -> LaneOrdering {
        LanesConfig::ordering_of_stack(self.lanes.as_ref(), self.quota_ordering)
    }

    /// The quota `lane`'s jobs go under besides the shared one: its own under `[lanes]`,
    /// or, with one lane, `[quota]`.
    #[must_use]
    pub fn lane_quota(&self, lane: &LaneId) -> &Quota {
        self.lanes.as_ref().map_or(&self.quota, |lanes| &lanes.lane(lane).quota)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use secrecy::ExposeSecret;

    fn env(name: &str) -> Option<String> {
        (name == "API_TOKEN").then(|| "s3cret".to_owned())
    }

    fn parse(text: &str) -> Result<Config, String> {
        parse_typed(text).map_err(|problem| problem.to_string())
    }

    fn parse_typed(text: &str) -> Result<Config, ConfigProblem> {
        Config::parse(text, Path::new("/lanes"), &env)
    }

    const MINIMAL: &str = "[api]\nbase_url = \"https://api.example.com/v1\"\n[quota]\ntiers = [\"10/s\"]\n";

    #[test]
    fn minimal_config_gets_defaults() {
        let config = parse(MINIMAL).unwrap();
        assert_eq!(config.quota.tiers().len(), 1);
        assert_eq!(config.quota.safety_margin(), Duration::from_millis(10));
        assert_eq!(config.retry.max_attempts, 5);
        assert_eq!(config.backend, Backend::Embedded { path: PathBuf::from("/lanes/paceline.db") });
        assert_eq!(config.api.health_check.path, "/");
        assert_eq!(config.api.max_body, 256 * 1024);
        assert_eq!(config.retry.max_cool_down, Duration::from_secs(3600));
        assert_eq!(config.outcomes, OutcomeSettings::default());
    }

    #[test]
    fn outcomes_are_configurable_and_checked_by_key() {
        let text = format!("{MINIMAL}[outcomes]\nrecord = \"every_attempt\"\nmax_body = \"4KiB\"\nheaders = [\"X-Request-Id\"]\nretention = \"1d\"\n");
        let outcomes = parse(&text).unwrap().outcomes;
        assert_eq!(
            (outcomes.record, outcomes.max_body, outcomes.headers, outcomes.retention),
            (RecordOutcomes::EveryAttempt, 4096, vec!["x-request-id".to_owned()], Duration::from_secs(86_400))
        );
        assert_eq!(parse_typed(&format!("{MINIMAL}[outcomes]\nmax_body = \"1MiB\"\n")).unwrap_err().key.as_deref(), Some("outcomes.max_body"));
        assert!(parse(&format!("{MINIMAL}[outcomes]\nrecord = \"sometimes\"\n")).unwrap_err().contains("record"));
    }

    #[test]
    fn dispatch_ahead_defaults_to_where_the_workers_run() {
        let unset = parse(MINIMAL).unwrap().orchestrator;
        assert_eq!(unset.dispatch_ahead(WorkerHost::InProcess), IN_PROCESS_DISPATCH_AHEAD);
        assert_eq!(unset.dispatch_ahead(WorkerHost::Lambda), LAMBDA_DISPATCH_AHEAD);
        let at_slot = parse(&format!("{MINIMAL}[orchestrator]\ndispatch_ahead = \"0s\"\n")).unwrap().orchestrator;
        assert_eq!(at_slot.dispatch_ahead(WorkerHost::Lambda), Duration::ZERO);
        let template = include_str!("../../../infra/template.yaml");
        let default = template.split("DispatchAheadMilliseconds:").nth(1).and_then(|rest| rest.split("Default:").nth(1)).and_then(|rest| rest.lines().next());
        assert_eq!(default.map(str::trim), Some(LAMBDA_DISPATCH_AHEAD.as_millis().to_string().as_str()), "the template's default is the same");
    }

    #[test]
    fn full_config_reads_secrets_from_the_environment() {
        let text = r#"
[api]
base_url = "https://api.example.com/v1"
timeout = "3s"
headers = { Authorization = { env = "API_TOKEN", prefix = "Bearer " }, "User-Agent" = { value = "paceline" } }
health_check = { method = "GET", path = "/status" }
idempotency_header = "Idempotency-Key"
[quota]
tiers = ["10/s", "500/min", "100000/day"]
time_zone = "Europe/Paris"
safety_margin = "5ms"
[circuit]
health_check_interval = "2s"
[retry]
max_attempts = 3
[backend]
kind = "embedded"
path = "data/lane.db"
"#;
        let config = parse(text).unwrap();
        let auth = config.api.headers.iter().find(|(n, _)| n == "Authorization").unwrap();
        assert_eq!(auth.1.expose_secret(), "Bearer s3cret");
        assert!(!format!("{config:?}").contains("s3cret"), "a secret reached Debug output");
        assert_eq!(config.quota.zone(), chrono_tz::Europe::Paris);
        assert_eq!(config.circuit.health_check_interval, Duration::from_secs(2));
        assert_eq!(config.backend, Backend::Embedded { path: PathBuf::from("/lanes/data/lane.db") });
        assert_eq!(config.api.idempotency_header.as_deref(), Some("idempotency-key"));
        assert!(config.api.request_limits().lane_headers.contains(&"idempotency-key".to_owned()), "a job may not set it");
    }

    #[test]
    fn errors_name_the_key_and_the_problem() {
        let cases = [
            (MINIMAL.replace("10/s", "10/fortnight"), "fortnight"),
            (MINIMAL.replace("tiers", "tierz"), "tierz"),
            (MINIMAL.replace("https://api.example.com/v1", "ftp://x"), "base_url"),
            (format!("{MINIMAL}[retry]\nmax_attempts = 0\n"), "retry.max_attempts"),
            (format!("{MINIMAL}[circuit]\nhealth_check_interval = \"soon\"\n"), "health_check_interval"),
            (MINIMAL.replace("[quota]", "[quota]\ntime_zone = \"Mars/Olympus\""), "Mars/Olympus"),
            (MINIMAL.replace("[quota]", "[api.headers]\nX-Key = { env = \"MISSING\" }\n[quota]"), "api.headers.X-Key: environment variable MISSING"),
            (MINIMAL.replace("[quota]", "[api.health_check]\nmethod = \"GET\"\npath = \"https://evil.example/\"\n[quota]"), "api.health_check"),
            (MINIMAL.replace("[quota]", "idempotency_header = \"Idempotency Key\"\n[quota]"), "api.idempotency_header: `Idempotency Key` is not a header name"),
            (
                MINIMAL.replace("[quota]", "idempotency_header = \"X-Lane\"\n[api.headers]\nx-lane = { value = \"k\" }\n[quota]"),
                "is also in the lane's headers",
            ),
        ];
        for (text, expected) in cases {
            let err = parse(&text).unwrap_err();
            assert!(err.contains(expected), "error for {expected:?} was: {err}");
        }
    }

    #[test]
    fn a_config_problem_carries_its_key_apart_from_its_message() {
        let problem = parse_typed(&format!("{MINIMAL}[retry]\nmax_attempts = 0\n")).unwrap_err();
        assert_eq!(problem.key.as_deref(), Some("retry.max_attempts"));
        assert!(!problem.message.contains("max_attempts"), "the message is the problem alone: {}", problem.message);
        let missing = parse_typed(&MINIMAL.replace("[quota]", "[api.headers]\nX-Key = { env = \"MISSING\" }\n[quota]")).unwrap_err();
        assert_eq!(missing, ConfigProblem::at("api.headers.X-Key", "environment variable MISSING is not set"));
        let syntax = parse_typed("[api\n").unwrap_err();
        assert!(syntax.key.is_none() && syntax.message.contains("line 1"), "{syntax:?}");
    }

    #[test]
    fn harmful_values_are_refused_with_the_key_named() {
        let cases = [
            (format!("{MINIMAL}[orchestrator]\nstate_refresh = \"0s\"\n"), "orchestrator.state_refresh"),
            (format!("{MINIMAL}[orchestrator]\nflush_interval = \"0s\"\n"), "orchestrator.flush_interval"),
            (MINIMAL.replace("[quota]", "timeout = \"0s\"\n[quota]"), "api.timeout"),
            (MINIMAL.replace("https://api.example.com/v1", "http:///v1"), "base_url"),
            (MINIMAL.replace("https://api.example.com/v1", "https://user:pw@api.example.com/v1"), "user or password"),
            (MINIMAL.replace("https://api.example.com/v1", "https://api.example.com/v1?key=1"), "query"),
            (format!("{MINIMAL}[retry]\nmax_cool_down = \"0s\"\n"), "retry.max_cool_down"),
            (MINIMAL.replace("[quota]", "max_body = \"lots\"\n[quota]"), "max_body"),
        ];
        for (text, expected) in cases {
            let err = parse(&text).unwrap_err();
            assert!(err.contains(expected), "error for {expected:?} was: {err}");
        }
    }

    /// `idempotency_header = "Host"` made a job id the Host header (and `Content-Length`
    /// with id 0 dropped the body); a configured header with CR/LF passed `status` and
    /// `enqueue` and was refused only by `run`.
    #[test]
    fn connection_headers_and_bad_header_values_are_refused_at_load() {
        for name in ["Host", "Content-Length", "Transfer-Encoding", "Connection", "authorization"] {
            let text = MINIMAL.replace("[quota]", &format!("idempotency_header = \"{name}\"\n[quota]"));
            let err = parse(&text).unwrap_err();
            assert!(err.contains("api.idempotency_header") && err.contains("not to a job id"), "{name}: {err}");
        }
        let cases = [
            (MINIMAL.replace("[quota]", "headers = { \"X-Key\" = { value = \"a\\r\\nX-Evil: 1\" } }\n[quota]"), "api.headers.X-Key", "control"),
            (MINIMAL.replace("[quota]", "headers = { Upgrade = { value = \"websocket\" } }\n[quota]"), "api.headers.Upgrade", "connection"),
            (MINIMAL.replace("[quota]", "headers = { \"Bad Name\" = { value = \"x\" } }\n[quota]"), "api.headers.Bad Name", "not a header name"),
        ];
        for (text, key, problem) in cases {
            let err = parse(&text).unwrap_err();
            assert!(err.contains(key) && err.contains(problem), "{key}: {err}");
            assert!(!err.contains("X-Evil"), "the value is not shown: {err}");
        }
    }

    /// `timeout = "500000000000years"` passed and panicked after the run; a tier of
    /// `1/100000000000years` passed `status` and `enqueue` and panicked at the first job.
    #[test]
    fn a_duration_past_a_year_is_refused_at_parse_time_with_the_key_named() {
        let cases = [
            (MINIMAL.replace("[quota]", "timeout = \"500000000000years\"\n[quota]"), "timeout"),
            (format!("{MINIMAL}[retry]\nmax_cool_down = \"400days\"\n"), "max_cool_down"),
            (format!("{MINIMAL}[orchestrator]\nlease_ttl = \"99999999years\"\n"), "lease_ttl"),
        ];
        for (text, expected) in cases {
            let err = parse(&text).unwrap_err();
            assert!(err.contains(expected) && err.contains("longer than"), "error for {expected:?} was: {err}");
        }
        let tier = "1/100000000000years".parse::<crate::quota::Tier>().unwrap_err();
        assert!(tier.to_string().contains("longer than a year"), "{tier}");
    }
}
