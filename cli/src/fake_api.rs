//! A third-party API stand-in on loopback that enforces its quota strictly: a call that
//! would put more than a tier's limit into any window of that tier (wherever the window
//! starts) is refused with 429. Every answer carries the shortest rolling tier's
//! `RateLimit` and `RateLimit-Policy` headers. It can fail for a stretch (an outage: 503
//! for every call), answer a share of calls with 500 all along (the background errors
//! real APIs have), refuse calls past a number in flight at once (429), count other
//! clients' calls against the same quota, answers `/missing/...` with 404, and takes a
//! while to answer, like a real API. It records every call, so `paceline demo` and the
//! end-to-end tests can check compliance and count each job's calls.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode};
use paceline_shared::check::StrictWindowLimiter;
use paceline_shared::quota::{Period, Tier};
use paceline_shared::time::{system_now, Clock as _, SystemClock, UnixMillis};
use serde::Serialize;

/// How the fake API behaves (by default: no tier, instant answers, no failure).
#[derive(Clone, Debug, Default)]
pub struct FakeApiSpec {
    /// Rolling tiers are enforced strictly; calendar tiers count calls in the run.
    pub tiers: Vec<Tier>,
    /// Response time: from `.0` up to `.1`, varying call by call.
    pub latency: (Duration, Duration),
    /// `Some((after, length))`: every call fails with 503 from `after` the first call
    /// on, for `length`.
    pub outage: Option<(Duration, Duration)>,
    /// `Some(n)`: every n-th call (within quota) fails with 500.
    pub server_error_every: Option<u32>,
    /// `Some(n)`: a call arriving while `n` are in flight is refused with 429.
    pub max_concurrent: Option<u32>,
    /// Other clients of the same quota call this often a second, evenly, from the first
    /// call on; each is admitted where the rolling windows have room.
    pub others_per_second: f64,
}

/// What the fake API saw.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FakeApiLog {
    /// Every call's arrival time, in order.
    pub arrivals: Vec<UnixMillis>,
    pub ok: u64,
    pub quota_rejections: u64,
    pub outage_failures: u64,
    /// Calls answered 500 by `server_error_every`.
    pub server_errors: u64,
    /// Calls refused because `max_concurrent` were in flight.
    pub concurrency_rejections: u64,
    /// The most calls in flight at once.
    pub peak_in_flight: u32,
    /// Other clients' calls admitted (`others_per_second`).
    pub others_admitted: u64,
    pub not_found: u64,
    /// Calls to `/health` (a lane's health checks, in the demo's config).
    pub health_checks: u64,
    /// Successful calls per path (job paths carry the job id).
    pub ok_by_path: BTreeMap<String, u32>,
    /// Every call's path and whether it was answered OK, in arrival order (what an
    /// ordered lane's test reads).
    #[serde(skip)]
    pub calls: Vec<(String, bool)>,
    /// Calls per `Authorization` header they carried (`-` for none): which key a lane
    /// called with. Never printed.
    #[serde(skip)]
    pub by_authorization: BTreeMap<String, u64>,
    pub first_call: Option<UnixMillis>,
}

struct State {
    spec: FakeApiSpec,
    /// The rolling tiers' limiters, with each tier.
    limiters: Vec<(Tier, StrictWindowLimiter)>,
    calendar_calls: u64,
    in_flight: u32,
    /// How many of the other clients' calls have arrived.
    others_arrived: u64,
    log: FakeApiLog,
}

impl State {
    /// The other clients' calls due by `now`, in order, each admitted where it fits.
    fn serve_others_until(&mut self, now: UnixMillis, first: UnixMillis) {
        if self.spec.others_per_second <= 0.0 {
            return;
        }
        let every_ms = 1000.0 / self.spec.others_per_second;
        loop {
            let at = first.plus(Duration::from_secs_f64(self.others_arrived as f64 * every_ms / 1000.0));
            if at > now {
                return;
            }
            self.others_arrived += 1;
            if self.limiters.iter_mut().all(|(_, l)| l.fits(at, 1)) {
                self.limiters.iter_mut().for_each(|(_, l)| l.record(at, 1));
                self.log.others_admitted += 1;
            }
        }
    }

    /// The shortest rolling tier's `RateLimit-Policy` and `RateLimit` (IETF draft 8+).
    fn rate_limit_headers(&mut self, now: UnixMillis) -> Vec<(&'static str, String)> {
        let Some((tier, limiter)) = self.limiters.iter_mut().min_by_key(|(tier, _)| tier.nominal_window()) else { return Vec::new() };
        let (remaining, frees) = limiter.remaining(now);
        let window = tier.nominal_window().as_secs().max(1);
        vec![
            ("ratelimit-policy", format!("\"fake\";q={};w={window}", tier.limit)),
            ("ratelimit", format!("\"fake\";r={remaining};t={}", frees.since(now).as_millis().div_ceil(1000))),
        ]
    }
}

/// A running fake API.
pub struct FakeApi {
    pub base_url: String,
    state: Arc<Mutex<State>>,
    server: tokio::task::JoinHandle<()>,
}

enum Verdict {
    Ok,
    OverQuota,
    TooManyAtOnce,
    Outage,
    ServerError,
    NotFound,
}

impl FakeApi {
    /// Starts it on an ephemeral loopback port.
    ///
    /// # Errors
    /// When no port can be bound.
    pub async fn start(spec: FakeApiSpec) -> std::io::Result<Self> {
        let limiters = spec
            .tiers
            .iter()
            .filter_map(|t| match t.period {
                Period::Rolling(window) => Some((*t, StrictWindowLimiter::new(t.limit, window))),
                Period::Day | Period::Month => None,
            })
            .collect();
        let state = Arc::new(Mutex::new(State { spec, limiters, calendar_calls: 0, in_flight: 0, others_arrived: 0, log: FakeApiLog::default() }));
        let shared = state.clone();
        let app = axum::Router::new().fallback(move |request: Request| {
            let state = shared.clone();
            async move { answer(&state, request).await }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base_url = format!("http://{}", listener.local_addr()?);
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { base_url, state, server })
    }

    /// A copy of everything seen so far.
    #[must_use]
    pub fn log(&self) -> FakeApiLog {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner).log.clone()
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// Answers a call: within quota, `{"ok":true,"path":...,"echo":...}` (the `echo` query
/// parameter, if any), JSON like every answer.
async fn answer(state: &Mutex<State>, request: Request) -> (StatusCode, HeaderMap, String) {
    let now = system_now();
    let path = request.uri().path().to_owned();
    let echo = request
        .uri()
        .query()
        .and_then(|query| url::form_urlencoded::parse(query.as_bytes()).find(|(name, _)| name == "echo").map(|(_, value)| value.into_owned()));
    let (verdict, latency, rate_limit) = {
        let mut s = state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let first = *s.log.first_call.get_or_insert(now);
        s.serve_others_until(now, first);
        s.log.arrivals.push(now);
        let authorization = request.headers().get("authorization").and_then(|value| value.to_str().ok()).unwrap_or("-");
        *s.log.by_authorization.entry(authorization.to_owned()).or_default() += 1;
        if path == "/health" {
            s.log.health_checks += 1;
        }
        let n = s.log.arrivals.len() as u32;
        let (low, high) = s.spec.latency;
        let latency = low + (high.saturating_sub(low)) * (n.wrapping_mul(2_654_435_761) % 1000) / 1000;
        let fits = s.limiters.iter_mut().all(|(_, l)| l.fits(now, 1)) && s.spec.tiers.iter().filter(|t| t.is_calendar()).all(|t| s.calendar_calls < t.limit);
        s.limiters.iter_mut().for_each(|(_, l)| l.record(now, 1));
        s.calendar_calls += 1;
        let in_outage = s.spec.outage.is_some_and(|(after, length)| now >= first.plus(after) && now < first.plus(after + length));
        let crowded = s.spec.max_concurrent.is_some_and(|max| s.in_flight >= max);
        s.in_flight += 1;
        s.log.peak_in_flight = s.log.peak_in_flight.max(s.in_flight);
        let verdict = if !fits {
            s.log.quota_rejections += 1;
            Verdict::OverQuota
        } else if crowded {
            s.log.concurrency_rejections += 1;
            Verdict::TooManyAtOnce
        } else if in_outage {
            s.log.outage_failures += 1;
            Verdict::Outage
        } else if s.spec.server_error_every.is_some_and(|every| n.is_multiple_of(every.max(1))) {
            s.log.server_errors += 1;
            Verdict::ServerError
        } else if path.starts_with("/missing") {
            s.log.not_found += 1;
            Verdict::NotFound
        } else {
            s.log.ok += 1;
            *s.log.ok_by_path.entry(path.clone()).or_default() += 1;
            Verdict::Ok
        };
        s.log.calls.push((path.clone(), matches!(verdict, Verdict::Ok)));
        (verdict, latency, s.rate_limit_headers(now))
    };
    SystemClock.sleep_until_coarse(system_now().plus(latency)).await;
    state.lock().unwrap_or_else(std::sync::PoisonError::into_inner).in_flight -= 1;
    let mut headers = HeaderMap::new();
    headers.insert("content-type", axum::http::HeaderValue::from_static("application/json"));
    for (name, value) in rate_limit {
        if let Ok(value) = axum::http::HeaderValue::from_str(&value) {
            headers.insert(name, value);
        }
    }
    let error = |text: &str| serde_json::json!({ "error": text }).to_string();
    match verdict {
        Verdict::Ok => (StatusCode::OK, headers, serde_json::json!({ "ok": true, "path": path, "echo": echo }).to_string()),
        Verdict::NotFound => (StatusCode::NOT_FOUND, headers, error("not found")),
        Verdict::Outage => (StatusCode::SERVICE_UNAVAILABLE, headers, error("down")),
        Verdict::ServerError => (StatusCode::INTERNAL_SERVER_ERROR, headers, error("oops")),
        Verdict::OverQuota => {
            headers.insert("retry-after", axum::http::HeaderValue::from_static("1"));
            (StatusCode::TOO_MANY_REQUESTS, headers, error("quota exceeded"))
        }
        Verdict::TooManyAtOnce => {
            headers.insert("retry-after", axum::http::HeaderValue::from_static("1"));
            (StatusCode::TOO_MANY_REQUESTS, headers, error("too many requests at once"))
        }
    }
}
