//! Settings of the Lambda functions, from `PACELINE_*` environment variables. A missing
//! or invalid variable fails the cold start with its name and the problem, using the
//! same parsers as the config file.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Duration;

use crate::config::{
    check_health_request, check_idempotency_header, check_max_in_flight, check_timeout, defaults, parse_base_url, parse_size, resolve_headers, ApiConfig,
    CircuitConfig, HeaderSource, Invalid, LanesConfig, OrchestratorConfig, RetryConfig, LAMBDA_DISPATCH_AHEAD, LAMBDA_WORKER_BATCH,
};
use crate::order::JobOrder;
use crate::outcome::{OutcomeSettings, RecordOutcomes};
use crate::quota::{Quota, Tier};

/// A cold-start step's result: on failure, the error (prefixed `cold start: `) is
/// reported to Lambda's Runtime API as the init error (`/runtime/init/error`, where
/// Lambda shows it on the invocation that started the environment) before the caller
/// exits with it.
///
/// # Errors
/// The step's error, prefixed.
pub async fn cold_start<T>(step: Result<T, String>) -> Result<T, String> {
    match step {
        Ok(value) => Ok(value),
        Err(e) => {
            let message = format!("cold start: {e}");
            if let Ok(api) = std::env::var("AWS_LAMBDA_RUNTIME_API") {
                report_init_error(&api, &message).await;
            }
            Err(message)
        }
    }
}

/// Posts `message` to the Runtime API at `api` (host:port) as the init error, over plain
/// HTTP/1.1 as the Runtime API speaks it; a failure to report is printed, not returned
/// (the function fails either way).
async fn report_init_error(api: &str, message: &str) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let body = serde_json::json!({ "errorType": "Paceline.ConfigError", "errorMessage": message }).to_string();
    let request = format!(
        "POST /2018-06-01/runtime/init/error HTTP/1.1\r\nHost: {api}\r\nLambda-Runtime-Function-Error-Type: Paceline.ConfigError\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let sent = async {
        let mut stream = tokio::net::TcpStream::connect(api).await?;
        stream.write_all(request.as_bytes()).await?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.map(|_| ())
    };
    if let Err(e) = tokio::time::timeout(Duration::from_secs(2), sent).await.unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into())) {
        eprintln!("could not report the init error to the Runtime API at {api}: {e}");
    }
}

/// Reads variables from a source (the process environment, or a map in tests).
pub struct Env<'a> {
    get: &'a dyn Fn(&str) -> Option<String>,
}

impl<'a> Env<'a> {
    #[must_use]
    pub fn new(get: &'a dyn Fn(&str) -> Option<String>) -> Self {
        Self { get }
    }

    /// A variable that must be set and not empty.
    ///
    /// # Errors
    /// Names the variable.
    pub fn required(&self, name: &str) -> Result<String, String> {
        (self.get)(name).filter(|v| !v.trim().is_empty()).ok_or_else(|| format!("{name} is not set"))
    }

    /// An optional variable, `None` when unset or empty.
    #[must_use]
    pub fn optional(&self, name: &str) -> Option<String> {
        (self.get)(name).filter(|v| !v.trim().is_empty())
    }

    /// The stack's name, the `Lane` dimension of the functions' metrics:
    /// `PACELINE_STACK`, or the older `PACELINE_LANE` (deprecated: a lane is now one
    /// quota within a stack), or `paceline`.
    #[must_use]
    pub fn stack_name(&self) -> String {
        if let Some(name) = self.optional("PACELINE_STACK") {
            return name;
        }
        match self.optional("PACELINE_LANE") {
            Some(name) => {
                tracing::warn!("PACELINE_LANE is deprecated: set PACELINE_STACK (a lane is now one quota within a stack)");
                name
            }
            None => "paceline".to_owned(),
        }
    }

    fn parsed<T>(&self, name: &str, default: T, parse: impl Fn(&str) -> Result<T, String>) -> Result<T, String> {
        match (self.get)(name).filter(|v| !v.trim().is_empty()) {
            None => Ok(default),
            Some(text) => parse(text.trim()).map_err(|e| format!("{name}: {e}")),
        }
    }

    /// Names the variable a checked field comes from: `PACELINE_` and the field upper-cased.
    fn named(prefix: &str, e: Invalid) -> String {
        format!("PACELINE_{prefix}{}: {}", e.field.to_ascii_uppercase(), e.problem)
    }

    /// Variable `name` as a duration (`5m`, `30s`, `250ms`), `default` when unset.
    ///
    /// # Errors
    /// Names the variable and the problem.
    pub fn duration(&self, name: &str, default: Duration) -> Result<Duration, String> {
        self.parsed(name, default, crate::time::parse_setting_duration)
    }

    /// `PACELINE_TIERS` (comma-separated, e.g. `10/s,500/min`), `PACELINE_TIME_ZONE`,
    /// `PACELINE_SAFETY_MARGIN`. With `PACELINE_LANES` this is the quota the lanes share; empty, they share none
    /// (lanes that are different APIs).
    ///
    /// # Errors
    /// Names the variable and the problem.
    pub fn quota(&self) -> Result<Quota, String> {
        let zone = self.parsed("PACELINE_TIME_ZONE", chrono_tz::UTC, |t| t.parse().map_err(|_| format!("unknown time zone `{t}`")))?;
        let margin = self.duration("PACELINE_SAFETY_MARGIN", defaults::safety_margin())?;
        if self.optional("PACELINE_TIERS").is_none() && self.optional("PACELINE_LANES").is_some() {
            return Ok(Quota::unlimited(zone, margin).with_max_in_flight(self.max_in_flight()?));
        }
        let text = self.required("PACELINE_TIERS")?;
        let tiers = text.split(',').map(|t| Tier::from_str(t.trim()).map_err(|e| format!("PACELINE_TIERS: {e}"))).collect::<Result<Vec<_>, _>>()?;
        let quota = Quota::new(tiers, zone, margin).map_err(|e| format!("PACELINE_TIERS: {e}"))?;
        Ok(quota.with_max_in_flight(self.max_in_flight()?))
    }

    /// `PACELINE_LANES`: the stack's lanes under `shared`, written as the body of a
    /// config file's `[lanes]` table (`tiers = ["5/s"]`, then `[acme]` with a lane's
    /// own settings); unset or blank, the stack is one lane, `default`. More lanes'
    /// settings than a variable holds are kept in the table (`paceline lanes set`).
    ///
    /// # Errors
    /// Names the variable and the setting.
    pub fn lanes(&self, shared: &Quota) -> Result<Option<LanesConfig>, String> {
        self.optional("PACELINE_LANES").map(|text| LanesConfig::parse_text(&text, shared).map_err(|problem| format!("PACELINE_LANES: {problem}"))).transpose()
    }

    /// `PACELINE_SHARD_QUEUES`: each shard's jobs queue by index, in a stack of shards
    /// (a JSON list of URLs, shard 0's first); empty for a stack of one shard.
    ///
    /// # Errors
    /// Names the variable when it is not a JSON list of URLs.
    pub fn shard_queues(&self) -> Result<Vec<String>, String> {
        let Some(queues) = self.optional("PACELINE_SHARD_QUEUES") else { return Ok(Vec::new()) };
        let queues: Vec<String> = serde_json::from_str(&queues).map_err(|e| format!("PACELINE_SHARD_QUEUES: not a JSON list of queue URLs: {e}"))?;
        Ok(if queues.len() > 1 { queues } else { Vec::new() })
    }

    /// `PACELINE_ORDERING`: how a stack without lanes orders its jobs (`fifo`, or `none`,
    /// the default; with lanes, `PACELINE_LANES` says for each).
    ///
    /// # Errors
    /// Names the variable and the problem.
    pub fn ordering(&self) -> Result<JobOrder, String> {
        self.parsed("PACELINE_ORDERING", JobOrder::None, str::parse)
    }

    /// `PACELINE_MAX_IN_FLIGHT` (unset or 0: no cap).
    ///
    /// # Errors
    /// Names the variable and the problem.
    pub fn max_in_flight(&self) -> Result<Option<u32>, String> {
        let given = self.parsed("PACELINE_MAX_IN_FLIGHT", 0, |t| t.parse::<u32>().map_err(|_| format!("`{t}` is not a whole number")))?;
        check_max_in_flight((given > 0).then_some(given)).map_err(|e| format!("PACELINE_MAX_IN_FLIGHT: {e}"))
    }

    /// `PACELINE_LEASE_TTL`, `PACELINE_VISIBILITY_TIMEOUT`, `PACELINE_FLUSH_INTERVAL`,
    /// `PACELINE_STATE_REFRESH`, `PACELINE_DEADLINE_MARGIN`, `PACELINE_DISPATCH_AHEAD`,
    /// `PACELINE_WORKER_BATCH`, `PACELINE_BATCH_WINDOW`, `PACELINE_WORKER_PACE`.
    ///
    /// # Errors
    /// Names the variable and the problem.
    pub fn orchestrator(&self) -> Result<OrchestratorConfig, String> {
        let config = OrchestratorConfig {
            lease_ttl: self.duration("PACELINE_LEASE_TTL", defaults::lease_ttl())?,
            visibility_timeout: self.duration("PACELINE_VISIBILITY_TIMEOUT", defaults::visibility_timeout())?,
            flush_interval: self.duration("PACELINE_FLUSH_INTERVAL", defaults::flush_interval())?,
            state_refresh: self.duration("PACELINE_STATE_REFRESH", defaults::state_refresh())?,
            deadline_margin: self.duration("PACELINE_DEADLINE_MARGIN", defaults::deadline_margin())?,
            dispatch_ahead: Some(self.duration("PACELINE_DISPATCH_AHEAD", LAMBDA_DISPATCH_AHEAD)?),
            worker_batch: Some(
                self.parsed("PACELINE_WORKER_BATCH", LAMBDA_WORKER_BATCH, |t| t.parse::<u32>().map_err(|_| format!("`{t}` is not a whole number")))?,
            ),
            batch_window: self.duration("PACELINE_BATCH_WINDOW", defaults::batch_window())?,
            worker_pace: self
                .parsed("PACELINE_WORKER_PACE", defaults::worker_pace(), |t| t.parse::<u32>().map_err(|_| format!("`{t}` is not a whole number")))?,
        };
        config.check().map_err(|e| Self::named("", e))?;
        Ok(config)
    }

    /// `PACELINE_HEALTH_CHECK_INTERVAL`, `PACELINE_MAX_BREAK`,
    /// `PACELINE_FAILURE_RATE_THRESHOLD`, `PACELINE_MINIMUM_CALLS`,
    /// `PACELINE_MINIMUM_FAILURES`, `PACELINE_RAMP_START`, `PACELINE_RAMP_STEP`,
    /// `PACELINE_WARM_UP` (`true` or `false`).
    ///
    /// # Errors
    /// Names the variable and the problem.
    pub fn circuit(&self) -> Result<CircuitConfig, String> {
        let number = |name: &str, default: f64| self.parsed(name, default, |t| t.parse::<f64>().map_err(|_| format!("`{t}` is not a number")));
        let count = |name: &str, default: u64| self.parsed(name, default, |t| t.parse::<u64>().map_err(|_| format!("`{t}` is not a whole number")));
        let config = CircuitConfig {
            health_check_interval: self.duration("PACELINE_HEALTH_CHECK_INTERVAL", defaults::health_check_interval())?,
            max_break: self.duration("PACELINE_MAX_BREAK", defaults::max_break())?,
            failure_rate_threshold: number("PACELINE_FAILURE_RATE_THRESHOLD", defaults::failure_rate_threshold())?,
            minimum_calls: count("PACELINE_MINIMUM_CALLS", defaults::minimum_calls())?,
            minimum_failures: count("PACELINE_MINIMUM_FAILURES", defaults::minimum_failures())?,
            ramp_start: number("PACELINE_RAMP_START", defaults::ramp_start())?,
            ramp_step: self.duration("PACELINE_RAMP_STEP", defaults::ramp_step())?,
            warm_up: self.parsed("PACELINE_WARM_UP", false, |t| t.parse::<bool>().map_err(|_| format!("`{t}` is not true or false")))?,
        };
        config.check().map_err(|e| Self::named("", e))?;
        Ok(config)
    }

    /// `PACELINE_MAX_ATTEMPTS`, `PACELINE_MAX_RATE_LIMITED`, `PACELINE_DEFAULT_COOL_DOWN`, `PACELINE_MAX_COOL_DOWN`,
    /// `PACELINE_BACKOFF_BASE`, `PACELINE_BACKOFF_MAX`.
    ///
    /// # Errors
    /// Names the variable and the problem.
    pub fn retry(&self) -> Result<RetryConfig, String> {
        let at_least_one = |t: &str| t.parse::<u32>().ok().filter(|n| *n >= 1).ok_or_else(|| format!("`{t}` is not a whole number of at least 1"));
        let config = RetryConfig {
            max_attempts: self.parsed("PACELINE_MAX_ATTEMPTS", defaults::max_attempts(), at_least_one)?,
            max_rate_limited: self.parsed("PACELINE_MAX_RATE_LIMITED", defaults::max_rate_limited(), at_least_one)?,
            default_cool_down: self.duration("PACELINE_DEFAULT_COOL_DOWN", defaults::default_cool_down())?,
            max_cool_down: self.duration("PACELINE_MAX_COOL_DOWN", defaults::max_cool_down())?,
            backoff_base: self.duration("PACELINE_BACKOFF_BASE", defaults::backoff_base())?,
            backoff_max: self.duration("PACELINE_BACKOFF_MAX", defaults::backoff_max())?,
        };
        config.check().map_err(|e| Self::named("", e))?;
        Ok(config)
    }

    /// `PACELINE_OUTCOMES` (`final`, `every_attempt` or `none`), `PACELINE_OUTCOME_MAX_BODY`,
    /// `PACELINE_OUTCOME_HEADERS` (comma-separated; the record is the worker's function
    /// result, so there is no retention here).
    ///
    /// # Errors
    /// Names the variable and the problem.
    pub fn outcomes(&self) -> Result<OutcomeSettings, String> {
        let defaults = OutcomeSettings::default();
        let settings = OutcomeSettings {
            record: self.parsed("PACELINE_OUTCOMES", RecordOutcomes::Final, RecordOutcomes::from_str)?,
            max_body: self.parsed("PACELINE_OUTCOME_MAX_BODY", defaults.max_body, parse_size)?,
            headers: self.parsed("PACELINE_OUTCOME_HEADERS", defaults.headers.clone(), |t| {
                Ok(t.split(',').map(str::trim).filter(|name| !name.is_empty()).map(str::to_owned).collect())
            })?,
            retention: defaults.retention,
        };
        settings.checked().map_err(|(field, problem)| format!("PACELINE_OUTCOME_{}: {problem}", field.to_ascii_uppercase()))
    }

    /// `PACELINE_API_BASE_URL`, `PACELINE_API_TIMEOUT`, `PACELINE_API_MAX_BODY`, `PACELINE_API_HEADERS` (JSON:
    /// `{"Authorization": {"env": "API_TOKEN", "prefix": "Bearer "}}`),
    /// `PACELINE_HEALTH_CHECK` (JSON request, default `GET /`) and
    /// `PACELINE_IDEMPOTENCY_HEADER` (unset or empty: none).
    ///
    /// # Errors
    /// Names the variable and the problem.
    pub fn api(&self) -> Result<ApiConfig, String> {
        let base = self.required("PACELINE_API_BASE_URL")?;
        let base_url = parse_base_url(&base).map_err(|e| format!("PACELINE_API_BASE_URL: {e}"))?;
        let sources: BTreeMap<String, HeaderSource> =
            self.parsed("PACELINE_API_HEADERS", BTreeMap::new(), |t| serde_json::from_str(t).map_err(|e| format!("not a JSON object of headers: {e}")))?;
        let health: Option<serde_json::Value> =
            self.parsed("PACELINE_HEALTH_CHECK", None, |t| serde_json::from_str(t).map(Some).map_err(|e| format!("not a JSON request: {e}")))?;
        let timeout = self.duration("PACELINE_API_TIMEOUT", defaults::timeout())?;
        check_timeout(timeout).map_err(|e| Self::named("API_", e))?;
        let headers = resolve_headers(sources, "PACELINE_API_HEADERS", self.get).map_err(|problem| problem.to_string())?;
        let idempotency_header = self.required("PACELINE_IDEMPOTENCY_HEADER").ok().filter(|name| !name.is_empty());
        Ok(ApiConfig {
            base_url,
            timeout,
            max_body: self.parsed("PACELINE_API_MAX_BODY", defaults::max_body(), parse_size)?,
            idempotency_header: check_idempotency_header(idempotency_header, &headers).map_err(|e| format!("PACELINE_IDEMPOTENCY_HEADER: {e}"))?,
            headers,
            health_check: check_health_request(health).map_err(|e| format!("PACELINE_HEALTH_CHECK: {e}"))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn the_stack_is_named_by_paceline_stack_or_the_deprecated_paceline_lane() {
        assert_eq!(Env::new(&env_of(&[("PACELINE_STACK", "orders"), ("PACELINE_LANE", "old")])).stack_name(), "orders");
        assert_eq!(Env::new(&env_of(&[("PACELINE_LANE", "old")])).stack_name(), "old");
        assert_eq!(Env::new(&env_of(&[])).stack_name(), "paceline");
    }

    #[test]
    fn reads_settings_with_defaults() {
        let get = env_of(&[
            ("PACELINE_TIERS", "10/s, 500/min,1000/day"),
            ("PACELINE_API_BASE_URL", "https://api.example.com"),
            ("PACELINE_API_HEADERS", r#"{"Authorization":{"env":"TOKEN","prefix":"Bearer "}}"#),
            ("TOKEN", "t0k"),
            ("PACELINE_VISIBILITY_TIMEOUT", "45s"),
        ]);
        let env = Env::new(&get);
        assert_eq!(env.quota().unwrap().tiers().len(), 3);
        assert_eq!(env.orchestrator().unwrap().visibility_timeout, Duration::from_secs(45));
        assert_eq!(env.retry().unwrap().max_attempts, 5);
        let api = env.api().unwrap();
        assert_eq!(api.headers.len(), 1);
        assert!(!format!("{api:?}").contains("t0k"));
        assert_eq!(env.outcomes().unwrap(), OutcomeSettings::default());
    }

    #[test]
    fn lanes_come_from_paceline_lanes_under_the_shared_tiers_or_none() {
        let lanes = "tiers = [\"2/s\"]\n[acme]\ntiers = [\"5/s\"]\nweight = 3\n";
        let get = env_of(&[("PACELINE_TIERS", "20/s"), ("PACELINE_LANES", lanes)]);
        let env = Env::new(&get);
        let shared = env.quota().unwrap();
        let config = env.lanes(&shared).unwrap().expect("lanes");
        let acme = config.lane(&crate::lane::LaneId::parse("acme").unwrap());
        assert_eq!((acme.quota.tiers()[0].to_string(), acme.weight), ("5/s".to_owned(), 3.0));
        assert_eq!(config.defaults.quota.tiers()[0].to_string(), "2/s");
        // The same as one line of JSON, as a template parameter holds it.
        let json = r#"{"tiers": ["2/s"], "acme": {"tiers": ["5/s"], "weight": 3}}"#;
        let from_json = Env::new(&env_of(&[("PACELINE_TIERS", "20/s"), ("PACELINE_LANES", json)])).lanes(&shared).unwrap().expect("lanes");
        assert_eq!(format!("{from_json:?}"), format!("{config:?}"));
        // Lanes that share nothing: no shared tiers.
        let apart = env_of(&[("PACELINE_TIERS", ""), ("PACELINE_LANES", lanes)]);
        assert!(Env::new(&apart).quota().unwrap().tiers().is_empty());
        // No lanes: one lane, and its tiers are required.
        let one = env_of(&[("PACELINE_TIERS", "20/s")]);
        assert!(Env::new(&one).lanes(&shared).unwrap().is_none());
        assert!(Env::new(&env_of(&[("PACELINE_TIERS", "")])).quota().unwrap_err().starts_with("PACELINE_TIERS"));
        let bad = env_of(&[("PACELINE_TIERS", "20/s"), ("PACELINE_LANES", "[acme]\nweight = 0\n")]);
        let problem = Env::new(&bad).lanes(&shared).unwrap_err();
        assert!(problem.starts_with("PACELINE_LANES: lanes.acme.weight: 0 is not a weight"), "{problem}");
    }

    #[test]
    fn outcome_settings_come_from_their_variables() {
        let get = env_of(&[("PACELINE_OUTCOMES", "every_attempt"), ("PACELINE_OUTCOME_MAX_BODY", "2KiB"), ("PACELINE_OUTCOME_HEADERS", "ETag, X-Request-Id")]);
        let outcomes = Env::new(&get).outcomes().unwrap();
        assert_eq!(
            (outcomes.record, outcomes.max_body, outcomes.headers),
            (RecordOutcomes::EveryAttempt, 2048, vec!["etag".to_owned(), "x-request-id".to_owned()])
        );
        let get = env_of(&[("PACELINE_OUTCOME_MAX_BODY", "10MiB")]);
        assert!(Env::new(&get).outcomes().unwrap_err().starts_with("PACELINE_OUTCOME_MAX_BODY"));
        let get = env_of(&[("PACELINE_OUTCOMES", "maybe")]);
        assert!(Env::new(&get).outcomes().unwrap_err().starts_with("PACELINE_OUTCOMES"));
    }

    #[test]
    fn missing_or_invalid_variables_are_named() {
        let get = env_of(&[
            ("PACELINE_TIERS", "10/s,5/fortnight"),
            ("PACELINE_MAX_ATTEMPTS", "0"),
            ("PACELINE_API_HEADERS", r#"{"X-Key":{"env":"NOPE"}}"#),
            ("PACELINE_API_BASE_URL", "https://x"),
        ]);
        let env = Env::new(&get);
        assert!(env.quota().unwrap_err().starts_with("PACELINE_TIERS: unknown period `fortnight`"));
        assert!(env.retry().unwrap_err().starts_with("PACELINE_MAX_ATTEMPTS"));
        assert!(env.api().unwrap_err().contains("NOPE is not set"));
        let harmful = env_of(&[
            ("PACELINE_STATE_REFRESH", "0s"),
            ("PACELINE_API_TIMEOUT", "0s"),
            ("PACELINE_API_BASE_URL", "http:///v1"),
            ("PACELINE_MAX_COOL_DOWN", "0s"),
        ]);
        let env = Env::new(&harmful);
        assert!(env.orchestrator().unwrap_err().starts_with("PACELINE_STATE_REFRESH: must be at least"));
        assert!(env.api().unwrap_err().starts_with("PACELINE_API_BASE_URL"));
        assert!(env.retry().unwrap_err().starts_with("PACELINE_MAX_COOL_DOWN"));
        let zero_timeout = env_of(&[("PACELINE_API_TIMEOUT", "0s"), ("PACELINE_API_BASE_URL", "https://x")]);
        assert!(Env::new(&zero_timeout).api().unwrap_err().starts_with("PACELINE_API_TIMEOUT"));
        let none = env_of(&[]);
        assert_eq!(Env::new(&none).required("PACELINE_QUEUE_URL").unwrap_err(), "PACELINE_QUEUE_URL is not set");
    }
}
