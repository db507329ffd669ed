//! The simulated third-party API: a strict rate limiter at every tier of the quota (it
//! refuses with 429 any call that would overfill a window, as a real provider does),
//! counting rolling tiers as the chosen [`ProviderModel`] does; injected outages and
//! error rates; and the independent checker whose figures the report gives: arrivals,
//! violations, the busiest window (hence the worst fixed-window alignment), utilization,
//! and each job's dispatch-to-call delay.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use paceline_shared::check::{StrictBucketLimiter, StrictFixedWindowLimiter, StrictWindowLimiter, WindowPeak};
use paceline_shared::job::ApiRequest;
use paceline_shared::quota::{Period, Quota, Spread, Tier};
use paceline_shared::time::{Clock, UnixMillis};
use paceline_worker::{Api, ApiError, CallResult, CappedBody};
use serde::Serialize;

use crate::aws::World;
use crate::profile::{job_key, Failures, Stream};

/// The request path of job `n` (what the simulation enqueues).
#[must_use]
pub fn job_path(n: u64) -> String {
    format!("/jobs/{n}")
}

/// How the provider counts a rolling tier. A tier configured with `burst=N` is a
/// bucket of N in every model: that option says what the provider is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProviderModel {
    /// No window of the tier's length, wherever it starts, holds more than the limit.
    #[default]
    SlidingWindow,
    /// Windows aligned on the epoch, each holding at most the limit.
    FixedWindow,
    /// A strict leaky bucket at the tier's rate with room for one call (nginx's
    /// `limit_req` without `burst`).
    LeakyBucket,
}

impl std::str::FromStr for ProviderModel {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "sliding-window" => Ok(Self::SlidingWindow),
            "fixed-window" => Ok(Self::FixedWindow),
            "leaky-bucket" => Ok(Self::LeakyBucket),
            other => Err(format!("unknown provider model `{other}` (sliding-window, fixed-window or leaky-bucket)")),
        }
    }
}

/// A rolling tier's limiter, as the provider model has it.
enum RollingLimiter {
    Sliding(StrictWindowLimiter),
    Fixed(StrictFixedWindowLimiter),
    Bucket(StrictBucketLimiter),
}

impl RollingLimiter {
    fn new(model: ProviderModel, tier: &Tier, window: std::time::Duration) -> Self {
        match (tier.spread, model) {
            (Spread::Burst(units), _) => Self::Bucket(StrictBucketLimiter::new(units, tier.limit, window)),
            (_, ProviderModel::SlidingWindow) => Self::Sliding(StrictWindowLimiter::new(tier.limit, window)),
            (_, ProviderModel::FixedWindow) => Self::Fixed(StrictFixedWindowLimiter::new(tier.limit, window)),
            (_, ProviderModel::LeakyBucket) => Self::Bucket(StrictBucketLimiter::new(1, tier.limit, window)),
        }
    }

    fn fits(&mut self, now: UnixMillis) -> bool {
        match self {
            Self::Sliding(limiter) => limiter.fits(now, 1),
            Self::Fixed(limiter) => limiter.fits(now, 1),
            Self::Bucket(limiter) => limiter.fits(now),
        }
    }

    fn record(&mut self, now: UnixMillis) {
        match self {
            Self::Sliding(limiter) => limiter.record(now, 1),
            Self::Fixed(limiter) => limiter.record(now, 1),
            Self::Bucket(limiter) => limiter.record(now, 1),
        }
    }

    /// Units left at `now` and when the quota frees, as the provider's headers say.
    fn remaining(&mut self, now: UnixMillis) -> (u64, UnixMillis) {
        match self {
            Self::Sliding(limiter) => limiter.remaining(now),
            Self::Fixed(limiter) => limiter.remaining(now),
            Self::Bucket(limiter) => limiter.remaining(now),
        }
    }
}

/// One tier as the provider enforces and the checker measures it.
enum TierGate {
    Rolling { limiter: RollingLimiter, offered: WindowPeak },
    Calendar { window: (UnixMillis, UnixMillis), used: u64, windows: u64 },
}

struct TierCheck {
    tier: Tier,
    gate: TierGate,
    admitted: u64,
    violations: u64,
    first: Option<UnixMillis>,
    last: UnixMillis,
}

impl TierCheck {
    fn new(tier: Tier, model: ProviderModel) -> Self {
        let gate = match tier.period {
            Period::Rolling(window) => TierGate::Rolling { limiter: RollingLimiter::new(model, &tier, window), offered: WindowPeak::new(window) },
            Period::Day | Period::Month => TierGate::Calendar { window: (UnixMillis(0), UnixMillis(0)), used: 0, windows: 0 },
        };
        Self { tier, gate, admitted: 0, violations: 0, first: None, last: UnixMillis(0) }
    }

    /// Whether one more unit at `now` fits (a refused call is not counted by the provider).
    fn fits(&mut self, quota: &Quota, now: UnixMillis) -> bool {
        match &mut self.gate {
            TierGate::Rolling { limiter, offered } => {
                offered.push(now, 1);
                limiter.fits(now)
            }
            TierGate::Calendar { window, used, windows } => {
                if now >= window.1 {
                    *window = self.tier.window_at(quota.zone(), now);
                    *used = 0;
                    *windows += 1;
                }
                *used < self.tier.limit
            }
        }
    }

    /// Counts a call at `now` against the tier's limit.
    fn spend(&mut self, now: UnixMillis) {
        match &mut self.gate {
            TierGate::Rolling { limiter, .. } => limiter.record(now),
            TierGate::Calendar { used, .. } => *used += 1,
        }
    }

    /// Whether another client's call fits at `now` (not counted in our figures).
    fn fits_foreign(&mut self, quota: &Quota, now: UnixMillis) -> bool {
        match &mut self.gate {
            TierGate::Rolling { limiter, .. } => limiter.fits(now),
            TierGate::Calendar { .. } => self.fits(quota, now),
        }
    }

    /// The `RateLimit` and `RateLimit-Policy` headers (IETF draft 8 and later) of a
    /// rolling tier at `now`; none for a calendar tier.
    fn rate_limit_headers(&mut self, now: UnixMillis) -> Vec<(String, String)> {
        let TierGate::Rolling { limiter, .. } = &mut self.gate else { return Vec::new() };
        let (remaining, frees) = limiter.remaining(now);
        let window_seconds = self.tier.nominal_window().as_secs().max(1);
        let reset_seconds = frees.since(now).as_millis().div_ceil(1000);
        vec![
            ("ratelimit-policy".into(), format!("\"sim\";q={};w={window_seconds}", self.tier.limit)),
            ("ratelimit".into(), format!("\"sim\";r={remaining};t={reset_seconds}")),
        ]
    }

    fn admit(&mut self, now: UnixMillis) {
        self.spend(now);
        self.admitted += 1;
        self.first.get_or_insert(now);
        self.last = now;
    }

    fn figures(&self) -> TierFigures {
        let (peak, worst_alignment_offset_ms, capacity) = match &self.gate {
            TierGate::Rolling { offered, .. } => {
                let Period::Rolling(window) = self.tier.period else { unreachable!("a rolling gate has a rolling tier") };
                let window_ms = (window.as_millis() as u64).max(1);
                let span = self.first.map_or(0, |first| self.last.0 - first.0);
                // Calls within one window can at most fill it; over longer, the rate counts.
                // A bucket also holds its burst at the start.
                let burst = match self.tier.spread {
                    Spread::Burst(units) => units as f64,
                    Spread::Window | Spread::Smooth => 1.0,
                };
                let capacity =
                    if span < window_ms && burst <= 1.0 { self.tier.limit as f64 } else { self.tier.limit as f64 * span as f64 / window_ms as f64 + burst };
                (Some(offered.peak()), Some(offered.peak_window_start().0 % window_ms), capacity)
            }
            TierGate::Calendar { windows, .. } => (None, None, (self.tier.limit * windows) as f64),
        };
        TierFigures {
            tier: self.tier.to_string(),
            limit: self.tier.max_in_one_window(),
            calendar: self.tier.is_calendar(),
            admitted: self.admitted,
            violations: self.violations,
            peak_offered_in_any_window: peak,
            worst_alignment_offset_ms,
            utilization: if capacity > 0.0 { self.admitted as f64 / capacity } else { 0.0 },
        }
    }
}

/// One tier's figures at the provider.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TierFigures {
    pub tier: String,
    /// The most calls one window of the tier may hold (a bucket's: its burst plus a
    /// window's refill).
    pub limit: u64,
    /// A day or month tier (its `utilization` is the share of its windows used).
    pub calendar: bool,
    /// Calls the provider admitted under this tier.
    pub admitted: u64,
    /// Calls that arrived when this tier's window was already full (refused with 429).
    pub violations: u64,
    /// Rolling tiers: the most calls that arrived (admitted or not) in any window of
    /// the tier's length, whatever its start; more than the limit means violations.
    pub peak_offered_in_any_window: Option<u64>,
    /// Rolling tiers: a fixed-window limiter aligned at this offset (ms past each window
    /// boundary of the epoch) sees the busiest window. Every alignment is covered: each
    /// sliding window is one alignment's fixed window.
    pub worst_alignment_offset_ms: Option<u64>,
    /// Rolling tiers: the achieved rate's share of the tier's, i.e. admitted calls over
    /// the most the tier allows from the first admitted call to the last
    /// (`limit * span / window + 1`), or over `limit` when they span less than a window
    /// (the busiest window's fill is `peak_offered_in_any_window` of `limit`). Calendar
    /// tiers: admitted over the limits of the days or months calls arrived in.
    #[serde(serialize_with = "paceline_shared::figures::six_digits")]
    pub utilization: f64,
}

/// How the provider answered, by kind.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Answers {
    pub ok: u64,
    /// 429 because a tier was full: a quota violation.
    pub over_quota_429: u64,
    pub injected_429: u64,
    pub injected_5xx: u64,
    pub outage_503: u64,
    /// The most calls in flight at the provider at once (from arrival to answer).
    pub peak_in_flight: u64,
    /// Calls of other clients (`--foreign-load`) that arrived, and those admitted.
    pub foreign_offered: u64,
    pub foreign_admitted: u64,
    /// Calls for a job while another call of it was in flight or after one succeeded:
    /// repeated calls of one attempt (`--rate-duplicate-delivery`).
    pub duplicate_calls: u64,
}

#[derive(Default)]
struct Observations {
    /// Calls arrived and not yet answered.
    in_flight: u64,
    calls_per_job: Vec<u32>,
    /// Per job: calls in flight, and whether one succeeded.
    job_in_flight: Vec<u16>,
    job_succeeded: Vec<bool>,
    health_checks: u64,
    answers: Answers,
    /// Dispatch-to-arrival of every job call, in ms.
    delays_ms: Vec<u32>,
    /// Calls admitted / arrived, per second since the start.
    admitted_per_second: Vec<u32>,
    offered_per_second: Vec<u32>,
    /// Calls refused as over quota, per second since the start.
    refused_per_second: Vec<u32>,
}

/// The simulated API and its checker.
pub struct Provider {
    world: Arc<World>,
    quota: Quota,
    failures: Failures,
    dispatched_at: Arc<Mutex<Vec<UnixMillis>>>,
    tiers: Mutex<Vec<TierCheck>>,
    seen: Mutex<Observations>,
    /// Other clients' calls: one every this long, the next one at `foreign_next`.
    foreign_every: Option<std::time::Duration>,
    foreign_next: Mutex<UnixMillis>,
    /// Every answer carries the shortest rolling tier's rate-limit headers.
    rate_limit_headers: bool,
}

/// Everything the provider saw.
#[derive(Clone, Debug, Serialize)]
pub struct ProviderFigures {
    pub tiers: Vec<TierFigures>,
    pub answers: Answers,
    pub health_checks: u64,
    #[serde(skip)]
    pub delays_ms: Vec<u32>,
    #[serde(skip)]
    pub admitted_per_second: Vec<u32>,
    #[serde(skip)]
    pub offered_per_second: Vec<u32>,
    #[serde(skip)]
    pub refused_per_second: Vec<u32>,
}

fn bump_second(series: &mut Vec<u32>, second: usize) {
    if series.len() <= second {
        series.resize(second + 1, 0);
    }
    series[second] += 1;
}

impl Provider {
    /// A provider enforcing `quota`'s tiers as `model` counts them (its safety margin is
    /// ours, not the provider's); `dispatched_at` is the invoker's record of each job's
    /// hand-off.
    #[must_use]
    pub fn new(world: Arc<World>, quota: &Quota, model: ProviderModel, failures: Failures, dispatched_at: Arc<Mutex<Vec<UnixMillis>>>, jobs: usize) -> Self {
        let tiers = quota.tiers().iter().map(|t| TierCheck::new(*t, model)).collect();
        let seen = Observations { calls_per_job: vec![0; jobs], job_in_flight: vec![0; jobs], job_succeeded: vec![false; jobs], ..Observations::default() };
        let foreign_rate = failures.foreign_load * quota.binding_tier().rate_per_second();
        let foreign_every = (foreign_rate > 0.0).then(|| std::time::Duration::from_secs_f64(1.0 / foreign_rate));
        let foreign_next = Mutex::new(world.start);
        Self {
            world,
            quota: quota.clone(),
            failures,
            dispatched_at,
            tiers: Mutex::new(tiers),
            seen: Mutex::new(seen),
            foreign_every,
            foreign_next,
            rate_limit_headers: true,
        }
    }

    /// The same provider sending rate-limit headers on every answer, or on none.
    #[must_use]
    pub fn with_rate_limit_headers(self, rate_limit_headers: bool) -> Self {
        Self { rate_limit_headers, ..self }
    }

    /// The headers of an answer at `now`: the shortest rolling tier's rate limit, and
    /// on a 429 `Retry-After`.
    fn answer_headers(&self, tiers: &mut [TierCheck], now: UnixMillis, refused: bool) -> Vec<(String, String)> {
        let mut headers = if refused { vec![("retry-after".to_owned(), "1".to_owned())] } else { Vec::new() };
        if self.rate_limit_headers {
            let shortest = tiers.iter_mut().filter(|t| !t.tier.is_calendar()).min_by_key(|t| t.tier.nominal_window());
            headers.extend(shortest.map(|t| t.rate_limit_headers(now)).unwrap_or_default());
        }
        headers
    }

    /// Other clients' calls up to `now`, in time order, each admitted where it fits.
    fn serve_foreign_until(&self, now: UnixMillis, tiers: &mut [TierCheck], answers: &mut Answers) {
        let Some(every) = self.foreign_every else { return };
        let mut next = self.foreign_next.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        while *next <= now {
            let at = *next;
            answers.foreign_offered += 1;
            if tiers.iter_mut().all(|tier| tier.fits_foreign(&self.quota, at)) {
                tiers.iter_mut().for_each(|tier| tier.spend(at));
                answers.foreign_admitted += 1;
            }
            *next = at.plus(every);
        }
    }

    /// The draw key of this call, and the job it is for.
    fn key(&self, request: &ApiRequest) -> (u64, Option<u64>) {
        let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match request.path.strip_prefix("/jobs/").and_then(|n| n.parse::<u64>().ok()) {
            Some(n) => {
                let calls = seen.calls_per_job.get_mut(n as usize).map_or(0, |c| {
                    *c += 1;
                    *c
                });
                (job_key(n, u64::from(calls)), Some(n))
            }
            None => {
                seen.health_checks += 1;
                (job_key(u64::MAX >> 22, seen.health_checks), None)
            }
        }
    }

    /// Decides the answer to a call arriving at `now`, and records it.
    fn arrive(&self, now: UnixMillis, key: u64, job: Option<u64>) -> CallResult {
        let since_start = now.since(self.world.start);
        let second = usize::try_from(since_start.as_secs()).unwrap_or(usize::MAX);
        let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        bump_second(&mut seen.offered_per_second, second);
        if let Some(n) = job {
            let dispatched = self.dispatched_at.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(n as usize).copied();
            if let Some(dispatched) = dispatched {
                seen.delays_ms.push(u32::try_from(now.since(dispatched).as_millis()).unwrap_or(u32::MAX));
            }
        }
        if self.failures.in_outage(since_start) {
            seen.answers.outage_503 += 1;
            return CallResult::Response { status: 503, headers: Vec::new(), body: CappedBody::default() };
        }
        let mut tiers = self.tiers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        self.serve_foreign_until(now, &mut tiers, &mut seen.answers);
        let full: Vec<bool> = tiers.iter_mut().map(|t| !t.fits(&self.quota, now)).collect();
        if full.iter().any(|f| *f) {
            for (tier, _) in tiers.iter_mut().zip(&full).filter(|(_, f)| **f) {
                tier.violations += 1;
            }
            seen.answers.over_quota_429 += 1;
            bump_second(&mut seen.refused_per_second, second);
            return CallResult::Response { status: 429, headers: self.answer_headers(&mut tiers, now, true), body: CappedBody::default() };
        }
        for tier in tiers.iter_mut() {
            tier.admit(now);
        }
        bump_second(&mut seen.admitted_per_second, second);
        let draw = self.world.sampler.uniform(Stream::Fault, key);
        if draw < self.failures.rate_429 {
            seen.answers.injected_429 += 1;
            CallResult::Response { status: 429, headers: self.answer_headers(&mut tiers, now, true), body: CappedBody::default() }
        } else if draw < self.failures.rate_429 + self.failures.rate_5xx {
            seen.answers.injected_5xx += 1;
            CallResult::Response { status: 500, headers: self.answer_headers(&mut tiers, now, false), body: CappedBody::default() }
        } else {
            seen.answers.ok += 1;
            CallResult::Response { status: 200, headers: self.answer_headers(&mut tiers, now, false), body: CappedBody::default() }
        }
    }

    /// A call arrived (+1) or was answered (-1): keeps the peak of calls in flight.
    fn count_in_flight(&self, change: i64) {
        let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        seen.in_flight = seen.in_flight.saturating_add_signed(change);
        seen.answers.peak_in_flight = seen.answers.peak_in_flight.max(seen.in_flight);
    }

    /// A call for job `n` arrived: a repeat if another is in flight or one succeeded.
    fn job_call_arrived(&self, n: usize) {
        let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let repeat = seen.job_in_flight.get(n).is_some_and(|c| *c > 0) || seen.job_succeeded.get(n).copied().unwrap_or(false);
        if repeat {
            seen.answers.duplicate_calls += 1;
        }
        if let Some(count) = seen.job_in_flight.get_mut(n) {
            *count += 1;
        }
    }

    /// The call for job `n` was answered with `result`.
    fn job_call_answered(&self, n: usize, result: &CallResult) {
        let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(count) = seen.job_in_flight.get_mut(n) {
            *count = count.saturating_sub(1);
        }
        if matches!(result, CallResult::Response { status, .. } if (200..300).contains(status)) {
            if let Some(ok) = seen.job_succeeded.get_mut(n) {
                *ok = true;
            }
        }
    }

    /// What the provider saw so far.
    #[must_use]
    pub fn figures(&self) -> ProviderFigures {
        let tiers = self.tiers.lock().unwrap_or_else(std::sync::PoisonError::into_inner).iter().map(TierCheck::figures).collect();
        let seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        ProviderFigures {
            tiers,
            answers: seen.answers.clone(),
            health_checks: seen.health_checks,
            delays_ms: seen.delays_ms.clone(),
            admitted_per_second: seen.admitted_per_second.clone(),
            offered_per_second: seen.offered_per_second.clone(),
            refused_per_second: seen.refused_per_second.clone(),
        }
    }
}

#[async_trait]
impl Api for Provider {
    async fn call(&self, request: &ApiRequest, _job_id: Option<&str>) -> Result<CallResult, ApiError> {
        let (key, job) = self.key(request);
        let total = self.world.sampler.latency(Stream::Api, key);
        let arrival = self.world.sampler.latency(Stream::ApiArrival, key);
        let clock = &self.world.clock;
        clock.sleep_until(clock.now().plus(arrival)).await;
        let job = job.and_then(|n| usize::try_from(n).ok());
        if let Some(n) = job {
            self.job_call_arrived(n);
        }
        let result = self.arrive(clock.now(), key, job.map(|n| n as u64));
        self.count_in_flight(1);
        clock.sleep_until(clock.now().plus(total.saturating_sub(arrival))).await;
        self.count_in_flight(-1);
        if let Some(n) = job {
            self.job_call_answered(n, &result);
        }
        Ok(result)
    }
}
