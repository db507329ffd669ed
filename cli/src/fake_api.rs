//! A third-party API stand-in on loopback that enforces its quota strictly: a call that
//! would put more than a tier's limit into any window of that tier (wherever the window
//! starts) is refused with 429. It can fail for a stretch (an outage: 503 for every
//! call), answer a share of calls with 500 all along (the background errors real APIs
//! have), answers `/missing/...` with 404, and takes a while to answer, like a real API.
//! It records every call, so `paceline demo` and the end-to-end tests can check
//! compliance and count each job's calls.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode};
use paceline_shared::check::StrictWindowLimiter;
use paceline_shared::quota::{Period, Tier};
use paceline_shared::time::{system_now, UnixMillis};
use serde::Serialize;

/// How the fake API behaves.
#[derive(Clone, Debug)]
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
    pub not_found: u64,
    /// Successful calls per path (job paths carry the job id).
    pub ok_by_path: BTreeMap<String, u32>,
    pub first_call: Option<UnixMillis>,
}

struct State {
    spec: FakeApiSpec,
    limiters: Vec<StrictWindowLimiter>,
    calendar_calls: u64,
    log: FakeApiLog,
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
                Period::Rolling(window) => Some(StrictWindowLimiter::new(t.limit, window)),
                Period::Day | Period::Month => None,
            })
            .collect();
        let state = Arc::new(Mutex::new(State { spec, limiters, calendar_calls: 0, log: FakeApiLog::default() }));
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

async fn answer(state: &Mutex<State>, request: Request) -> (StatusCode, HeaderMap, &'static str) {
    let now = system_now();
    let path = request.uri().path().to_owned();
    let (verdict, latency) = {
        let mut s = state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let first = *s.log.first_call.get_or_insert(now);
        s.log.arrivals.push(now);
        let n = s.log.arrivals.len() as u32;
        let (low, high) = s.spec.latency;
        let latency = low + (high.saturating_sub(low)) * (n.wrapping_mul(2_654_435_761) % 1000) / 1000;
        let fits = s.limiters.iter_mut().all(|l| l.fits(now, 1)) && s.spec.tiers.iter().filter(|t| t.is_calendar()).all(|t| s.calendar_calls < t.limit);
        s.limiters.iter_mut().for_each(|l| l.record(now, 1));
        s.calendar_calls += 1;
        let in_outage = s.spec.outage.is_some_and(|(after, length)| now >= first.plus(after) && now < first.plus(after + length));
        let verdict = if !fits {
            s.log.quota_rejections += 1;
            Verdict::OverQuota
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
            *s.log.ok_by_path.entry(path).or_default() += 1;
            Verdict::Ok
        };
        (verdict, latency)
    };
    tokio::time::sleep(latency).await;
    let mut headers = HeaderMap::new();
    match verdict {
        Verdict::Ok => (StatusCode::OK, headers, "{\"ok\":true}"),
        Verdict::NotFound => (StatusCode::NOT_FOUND, headers, "{\"error\":\"not found\"}"),
        Verdict::Outage => (StatusCode::SERVICE_UNAVAILABLE, headers, "{\"error\":\"down\"}"),
        Verdict::ServerError => (StatusCode::INTERNAL_SERVER_ERROR, headers, "{\"error\":\"oops\"}"),
        Verdict::OverQuota => {
            headers.insert("retry-after", axum::http::HeaderValue::from_static("1"));
            (StatusCode::TOO_MANY_REQUESTS, headers, "{\"error\":\"quota exceeded\"}")
        }
    }
}
