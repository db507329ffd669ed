//! What the simulated world is like: latency distributions of each AWS call and of the
//! API, injected failures, and a seeded sampler that draws the same values for the same
//! job whatever dispatcher runs it.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, LogNormal};
use rand_pcg::Pcg64Mcg;
use serde::Serialize;

/// z-score of the 99th percentile of a standard normal distribution.
const Z_P99: f64 = 2.326_347_874;

/// A latency distribution: fixed, or log-normal fitted to a median and a 99th percentile
/// (the usual shape of network and start-up latencies: a floor and a long right tail).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Latency {
    Fixed(Duration),
    LogNormal { p50: Duration, p99: Duration },
}

impl Latency {
    /// Log-normal with this median and 99th percentile (`p99 >= p50 > 0`).
    #[must_use]
    pub const fn log_normal(p50_ms: u64, p99_ms: u64) -> Self {
        Self::LogNormal { p50: Duration::from_millis(p50_ms), p99: Duration::from_millis(p99_ms) }
    }

    /// One draw, in whole milliseconds (the virtual clock's unit), rounded to nearest.
    pub fn sample(&self, rng: &mut Pcg64Mcg) -> Duration {
        match *self {
            Self::Fixed(d) => d,
            Self::LogNormal { p50, p99 } => {
                let median = p50.as_secs_f64() * 1e3;
                let sigma = ((p99.as_secs_f64() * 1e3) / median).ln() / Z_P99;
                let dist = LogNormal::new(median.ln(), sigma.max(0.0)).expect("finite, non-negative sigma");
                let ms: f64 = dist.sample(rng);
                Duration::from_millis(ms.round().clamp(0.0, 3.6e6) as u64)
            }
        }
    }
}

impl fmt::Display for Latency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Fixed(d) => write!(f, "{}", humantime::format_duration(*d)),
            Self::LogNormal { p50, p99 } => write!(f, "p50 {} / p99 {}", humantime::format_duration(*p50), humantime::format_duration(*p99)),
        }
    }
}

impl Serialize for Latency {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl FromStr for Latency {
    type Err = String;

    /// `20ms` (fixed) or `73ms/225ms` (median / 99th percentile).
    fn from_str(text: &str) -> Result<Self, String> {
        let parse = |t: &str| humantime::parse_duration(t.trim()).map_err(|e| format!("`{t}` is not a duration ({e})"));
        match text.split_once('/') {
            None => Ok(Self::Fixed(parse(text)?)),
            Some((p50, p99)) => {
                let (p50, p99) = (parse(p50)?, parse(p99)?);
                if p50.is_zero() || p99 < p50 {
                    return Err(format!("`{text}`: need 0 < p50 <= p99"));
                }
                Ok(Self::LogNormal { p50, p99 })
            }
        }
    }
}

/// Where time goes, call by call.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LatencyProfile {
    /// Any SQS call (receive, delete, send).
    pub sqs: Latency,
    /// Lambda `Invoke` with `InvocationType=Event`, until the 202.
    pub invoke: Latency,
    /// From the 202 until the worker's handler runs (Lambda's async start delay).
    pub async_start: Latency,
    /// Any DynamoDB call.
    pub dynamodb: Latency,
    /// The API's whole response time, as the worker waits for it.
    pub api: Latency,
    /// From the worker's send until the request reaches the provider's rate limiter.
    pub api_arrival: Latency,
    /// From the scheduled minute until EventBridge's kick starts the orchestrator.
    pub kick: Latency,
}

impl Default for LatencyProfile {
    /// Published figures where AWS gives them: Lambda async start p50 ~73 ms / p99
    /// ~225 ms; SQS and DynamoDB "tens of" and "single-digit" milliseconds. The API's
    /// times are placeholders: set `--latency api=...` to your provider's.
    fn default() -> Self {
        Self {
            sqs: Latency::log_normal(12, 40),
            invoke: Latency::log_normal(20, 60),
            async_start: Latency::log_normal(73, 225),
            dynamodb: Latency::log_normal(5, 15),
            api: Latency::log_normal(300, 1_000),
            api_arrival: Latency::log_normal(4, 6),
            kick: Latency::log_normal(300, 1_500),
        }
    }
}

impl LatencyProfile {
    /// Sets one latency from `name=value` (`api=250ms/900ms`).
    ///
    /// # Errors
    /// Names the unknown latency or the bad value.
    pub fn set(&mut self, assignment: &str) -> Result<(), String> {
        let (name, value) = assignment.split_once('=').ok_or_else(|| format!("`{assignment}`: expected NAME=LATENCY"))?;
        let latency: Latency = value.parse().map_err(|e| format!("latency {name}: {e}"))?;
        let slot = match name.trim() {
            "sqs" => &mut self.sqs,
            "invoke" => &mut self.invoke,
            "async_start" | "start" => &mut self.async_start,
            "dynamodb" => &mut self.dynamodb,
            "api" => &mut self.api,
            "api_arrival" | "arrival" => &mut self.api_arrival,
            "kick" => &mut self.kick,
            other => return Err(format!("unknown latency `{other}` (sqs, invoke, async_start, dynamodb, api, api_arrival, kick)")),
        };
        *slot = latency;
        Ok(())
    }
}

/// A window during which every API call fails with 503.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Outage {
    /// From the start of the simulation.
    #[serde(serialize_with = "as_millis")]
    pub start: Duration,
    #[serde(serialize_with = "as_millis")]
    pub length: Duration,
}

fn all_as_millis<S: serde::Serializer>(ds: &[Duration], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(ds.iter().map(|d| d.as_millis() as u64))
}

fn as_millis<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u128(d.as_millis())
}

impl FromStr for Outage {
    type Err = String;

    /// `START+LENGTH`, e.g. `10m+2m`.
    fn from_str(text: &str) -> Result<Self, String> {
        let (start, length) = text.split_once('+').ok_or_else(|| format!("outage `{text}`: expected START+LENGTH, e.g. 10m+2m"))?;
        let parse = |t: &str| humantime::parse_duration(t.trim()).map_err(|e| format!("outage `{text}`: `{t}` is not a duration ({e})"));
        Ok(Self { start: parse(start)?, length: parse(length)? })
    }
}

/// Failures the simulated API injects, besides refusing calls over its quota.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Failures {
    pub outages: Vec<Outage>,
    /// Share of calls answered 429 (`Retry-After: 1`) although within quota.
    pub rate_429: f64,
    /// Share of calls answered 500.
    pub rate_5xx: f64,
    /// Share of the quota other clients of the same account spend at the provider: a
    /// steady stream of their calls at that share of the binding tier's rate.
    pub foreign_load: f64,
    /// Share of worker events Lambda delivers twice, and of hand-offs whose 202 is lost
    /// (the orchestrator sends them again).
    pub rate_duplicate_delivery: f64,
    /// Share of the executions of a worker batch killed part-way (Lambda retries the
    /// event a minute later).
    pub rate_worker_crash: f64,
    /// Instants (from the start) at which the orchestrator run going is killed: no final
    /// snapshot, no release (its lease expires).
    #[serde(skip_serializing_if = "Vec::is_empty", serialize_with = "all_as_millis")]
    pub kill_run_at: Vec<Duration>,
    /// Instants at which the next run to end fails its final snapshot write and its
    /// lease release.
    #[serde(skip_serializing_if = "Vec::is_empty", serialize_with = "all_as_millis")]
    pub fail_release_at: Vec<Duration>,
}

impl Failures {
    /// Checks the rates are shares.
    ///
    /// # Errors
    /// Names the rate out of range.
    pub fn check(&self) -> Result<(), String> {
        let rates = [
            ("429 rate", self.rate_429),
            ("5xx rate", self.rate_5xx),
            ("foreign load", self.foreign_load),
            ("duplicate delivery rate", self.rate_duplicate_delivery),
            ("worker crash rate", self.rate_worker_crash),
        ];
        for (name, rate) in rates {
            if !(0.0..=1.0).contains(&rate) {
                return Err(format!("{name} {rate} is not between 0 and 1"));
            }
        }
        Ok(())
    }

    /// Whether `at` (from the start of the simulation) falls in an outage.
    #[must_use]
    pub fn in_outage(&self, at: Duration) -> bool {
        self.outages.iter().any(|o| at >= o.start && at < o.start + o.length)
    }
}

/// What a draw is for: each stream is independent of the others.
#[derive(Clone, Copy, Debug)]
pub enum Stream {
    Sqs,
    Invoke,
    AsyncStart,
    DynamoDb,
    Api,
    ApiArrival,
    Kick,
    /// The API's injected failures.
    Fault,
    /// Lambda's repeated deliveries and lost 202s.
    Delivery,
}

/// Seeded draws keyed by (stream, key): the n-th call of a job sees the same latencies
/// in every run with the same seed, whichever dispatcher runs it and in whatever order.
#[derive(Clone, Debug)]
pub struct Sampler {
    seed: u64,
    pub profile: LatencyProfile,
}

impl Sampler {
    #[must_use]
    pub fn new(seed: u64, profile: LatencyProfile) -> Self {
        Self { seed, profile }
    }

    fn rng(&self, stream: Stream, key: u64) -> Pcg64Mcg {
        // SplitMix64-style mixing of seed, stream and key into one well-spread seed.
        let mut x = self.seed ^ (stream as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ key.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Pcg64Mcg::seed_from_u64(x ^ (x >> 31))
    }

    /// A latency draw for `stream` under `key`.
    #[must_use]
    pub fn latency(&self, stream: Stream, key: u64) -> Duration {
        let latency = match stream {
            Stream::Sqs => self.profile.sqs,
            Stream::Invoke => self.profile.invoke,
            Stream::AsyncStart => self.profile.async_start,
            Stream::DynamoDb => self.profile.dynamodb,
            Stream::Api => self.profile.api,
            Stream::ApiArrival => self.profile.api_arrival,
            Stream::Kick => self.profile.kick,
            Stream::Fault | Stream::Delivery => return Duration::ZERO,
        };
        latency.sample(&mut self.rng(stream, key))
    }

    /// A uniform draw in [0, 1) for `stream` under `key`.
    #[must_use]
    pub fn uniform(&self, stream: Stream, key: u64) -> f64 {
        self.rng(stream, key).random::<f64>()
    }
}

/// A key for the `occurrence`-th event of job `job`.
#[must_use]
pub fn job_key(job: u64, occurrence: u64) -> u64 {
    job.wrapping_mul(1 << 20).wrapping_add(occurrence)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_normal_fits_its_median_and_99th_percentile() {
        let sampler = Sampler::new(7, LatencyProfile::default());
        let mut draws: Vec<u64> = (0..20_000).map(|k| sampler.latency(Stream::AsyncStart, k).as_millis() as u64).collect();
        draws.sort_unstable();
        let (p50, p99) = (draws[10_000], draws[19_800]);
        assert!((68..=78).contains(&p50), "p50 {p50}");
        assert!((205..=245).contains(&p99), "p99 {p99}");
    }

    #[test]
    fn draws_repeat_for_the_same_seed_and_key_only() {
        let a = Sampler::new(1, LatencyProfile::default());
        let b = Sampler::new(1, LatencyProfile::default());
        let c = Sampler::new(2, LatencyProfile::default());
        let draws = |s: &Sampler| (0..50).map(|k| s.latency(Stream::Api, k)).collect::<Vec<_>>();
        assert_eq!(draws(&a), draws(&b));
        assert_ne!(draws(&a), draws(&c));
    }

    #[test]
    fn parses_latencies_and_outages_and_names_bad_input() {
        assert_eq!("20ms".parse::<Latency>().unwrap(), Latency::Fixed(Duration::from_millis(20)));
        assert_eq!("73ms/225ms".parse::<Latency>().unwrap(), Latency::log_normal(73, 225));
        assert!("225ms/73ms".parse::<Latency>().unwrap_err().contains("p50 <= p99"));
        assert_eq!("10m+2m".parse::<Outage>().unwrap(), Outage { start: Duration::from_secs(600), length: Duration::from_secs(120) });
        assert!("10m".parse::<Outage>().unwrap_err().contains("START+LENGTH"));
        let mut profile = LatencyProfile::default();
        profile.set("api=2s/5s").unwrap();
        assert_eq!(profile.api, Latency::log_normal(2_000, 5_000));
        assert!(profile.set("ap=1s").unwrap_err().contains("unknown latency `ap`"));
    }
}
