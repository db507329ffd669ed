//! Pure classification of an API call's result into what the worker does next.
//!
//! - 2xx: success.
//! - 429: a rate limit, not an outage: cool down until the time the provider names
//!   (`Retry-After` as seconds or an HTTP date, `RateLimit`/`RateLimit-Reset`, or
//!   `X-RateLimit-Reset[-After]`), then re-queue.
//!   Every cool-down is capped (`retry.max_cool_down`): a far-future date cannot halt
//!   the lane.
//! - 5xx, timeouts, connection errors: an outage: open the circuit, re-queue.
//! - Anything else (other 4xx, unfollowed 3xx, and 501 Not Implemented, which is about
//!   the request, not the API's health): permanent, to the DLQ with the status.

use std::time::Duration;

use paceline_shared::adaptive::ProviderReading;
use paceline_shared::config::RetryConfig;
pub use paceline_shared::outcome::CappedBody;
use paceline_shared::time::UnixMillis;

/// What came back from one call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallResult {
    /// An answer: its status, its headers, and as much of its body as outcomes keep.
    Response {
        status: u16,
        headers: Vec<(String, String)>,
        body: CappedBody,
    },
    Timeout,
    Connect(String),
}

/// What the worker does about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Success { status: u16 },
    RateLimited { until: UnixMillis },
    Outage { reason: String },
    Rejected { status: u16 },
}

/// Epoch values above this are absolute times in seconds, not deltas (year 2001+).
const EPOCH_SECONDS_FLOOR: u64 = 1_000_000_000;

/// The shortest cool-down a 429 imposes: one asking for none (`Retry-After: 0`) in a
/// storm of them would otherwise have every job call again at once, at full pace.
pub const MIN_COOL_DOWN: std::time::Duration = std::time::Duration::from_millis(100);

/// Classifies `result` observed at `now`. A 429 naming no time cools down for
/// `retry.default_cool_down`; none cools down for less than [`MIN_COOL_DOWN`] or longer
/// than `retry.max_cool_down`.
#[must_use]
pub fn classify(result: &CallResult, now: UnixMillis, retry: &RetryConfig) -> Outcome {
    match result {
        CallResult::Timeout => Outcome::Outage { reason: "timeout".into() },
        CallResult::Connect(e) => Outcome::Outage { reason: format!("connection error: {e}") },
        CallResult::Response { status, .. } if (200..300).contains(status) => Outcome::Success { status: *status },
        CallResult::Response { status: 429, headers, .. } => {
            let asked = cool_down_until(headers, now).unwrap_or_else(|| now.plus(retry.default_cool_down));
            Outcome::RateLimited { until: asked.max(now.plus(MIN_COOL_DOWN)).min(now.plus(retry.max_cool_down)) }
        }
        CallResult::Response { status: 501, .. } => Outcome::Rejected { status: 501 },
        CallResult::Response { status, .. } if *status >= 500 => Outcome::Outage { reason: format!("HTTP {status}") },
        CallResult::Response { status, .. } => Outcome::Rejected { status: *status },
    }
}

/// A short label of a failed call, as dead letters record the last one: `http_503`,
/// `timeout`, `connection`.
#[must_use]
pub fn failure_label(result: &CallResult) -> String {
    match result {
        CallResult::Timeout => "timeout".into(),
        CallResult::Connect(_) => "connection".into(),
        CallResult::Response { status, .. } => format!("http_{status}"),
    }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.trim())
}

/// The instant the provider says to come back, from the first header that names one.
#[must_use]
pub fn cool_down_until(headers: &[(String, String)], now: UnixMillis) -> Option<UnixMillis> {
    if let Some(value) = header(headers, "retry-after") {
        if let Ok(seconds) = value.parse::<f64>() {
            return seconds_after(now, seconds);
        }
        if let Ok(date) = httpdate::parse_http_date(value) {
            let millis = date.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis();
            return Some(UnixMillis(u64::try_from(millis).ok()?).max(now));
        }
    }
    quota_reset_at(headers, now)
}

/// When the quota resets, from the rate-limit headers (not `Retry-After`): `RateLimit`'s
/// `reset`/`t`, `RateLimit-Reset`, `X-RateLimit-Reset-After` or `X-RateLimit-Reset`
/// (epoch seconds or milliseconds, or a delta), at most a day ahead.
fn quota_reset_at(headers: &[(String, String)], now: UnixMillis) -> Option<UnixMillis> {
    let after_seconds = |seconds: f64| seconds_after(now, seconds);
    if let Some(seconds) = header(headers, "ratelimit").and_then(|v| parameter(ratelimit_item(v), &["reset", "t"])) {
        return after_seconds(seconds);
    }
    if let Some(seconds) = header(headers, "ratelimit-reset").and_then(|v| v.parse::<f64>().ok()) {
        return after_seconds(seconds);
    }
    if let Some(seconds) = header(headers, "x-ratelimit-reset-after").and_then(|v| v.parse::<f64>().ok()) {
        return after_seconds(seconds);
    }
    if let Some(reset) = header(headers, "x-ratelimit-reset").and_then(|v| v.parse::<f64>().ok()) {
        // Providers send either an epoch time (seconds, sometimes milliseconds) or a delta.
        return if reset >= EPOCH_SECONDS_FLOOR as f64 * 1000.0 {
            Some(UnixMillis(reset as u64).max(now))
        } else if reset >= EPOCH_SECONDS_FLOOR as f64 {
            Some(UnixMillis((reset * 1000.0) as u64).max(now))
        } else {
            after_seconds(reset)
        };
    }
    None
}

/// `seconds` after `now` (at most a day), if `seconds` is a time span at all.
fn seconds_after(now: UnixMillis, seconds: f64) -> Option<UnixMillis> {
    (seconds.is_finite() && seconds >= 0.0).then(|| now.plus(Duration::from_secs_f64(seconds.min(86_400.0))))
}

/// The part of a `RateLimit` header about one quota: draft 7's whole dictionary
/// (`limit=100, remaining=50, reset=30`), or draft 8's first item (`"a";r=5;t=3, ...`).
fn ratelimit_item(value: &str) -> &str {
    if value.starts_with('"') {
        first_item(value)
    } else {
        value
    }
}

/// The first item of a list header (`a;x=1, b;x=2` gives `a;x=1`).
fn first_item(value: &str) -> &str {
    value.split(',').next().unwrap_or_default().trim()
}

/// The first of `keys` in `key=value` parameters separated by `;` or `,`, as a number.
fn parameter(value: &str, keys: &[&str]) -> Option<f64> {
    value
        .split([',', ';'])
        .filter_map(|part| part.trim().split_once('='))
        .find(|(key, _)| keys.contains(&key.trim()))
        .and_then(|(_, v)| v.trim().trim_matches('"').parse().ok())
}

/// The leading number of a header value (`100`, or `100, 100;w=60`).
fn leading_number(value: &str) -> Option<u64> {
    first_item(value).split(';').next()?.trim().parse().ok()
}

/// What an answer's rate-limit headers say about the quota, as of the call made at
/// `called_at`; `None` without a limit and a remaining count. Read, in this order:
/// - `RateLimit` and `RateLimit-Policy` (IETF draft 8 and later:
///   `"default";r=50;t=30` with `"default";q=100;w=60`; draft 7:
///   `limit=100, remaining=50, reset=30` with `100;w=60`);
/// - `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` (earlier drafts);
/// - `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset[-After]`.
///
/// A window comes from the policy's `w` (or a `;w=` on the limit). Without a reset the
/// quota is taken to reset a window (or a second) after the call.
#[must_use]
pub fn provider_reading(headers: &[(String, String)], called_at: UnixMillis) -> Option<ProviderReading> {
    let ratelimit = header(headers, "ratelimit").map(ratelimit_item);
    let policy_header = header(headers, "ratelimit-policy");
    // Draft 8+ names the policy a `RateLimit` item is about.
    let name = ratelimit.and_then(|v| v.strip_prefix('"')).and_then(|v| v.split('"').next());
    let policy = policy_header.map(|p| {
        let mut items = p.split(',').map(str::trim);
        let named = name.and_then(|name| items.clone().find(|item| item.starts_with(&format!("\"{name}\""))));
        named.unwrap_or_else(|| items.next().unwrap_or_default())
    });
    let limit_header = header(headers, "ratelimit-limit").or_else(|| header(headers, "x-ratelimit-limit"));
    let limit = ratelimit
        .and_then(|v| parameter(v, &["limit"]))
        .or_else(|| policy.and_then(|p| parameter(p, &["q"]).or_else(|| leading_number(p).map(|n| n as f64))))
        .map(|n| n as u64)
        .or_else(|| limit_header.and_then(leading_number))?;
    let remaining = ratelimit
        .and_then(|v| parameter(v, &["remaining", "r"]))
        .map(|n| n as u64)
        .or_else(|| header(headers, "ratelimit-remaining").or_else(|| header(headers, "x-ratelimit-remaining")).and_then(leading_number))?;
    let window_ms = policy
        .and_then(|p| parameter(p, &["w"]))
        .or_else(|| limit_header.and_then(|v| v.split(',').nth(1)).and_then(|item| parameter(item, &["w"])))
        .filter(|w| w.is_finite() && *w > 0.0)
        .map(|seconds| (seconds * 1000.0) as u64);
    let resets_at = quota_reset_at(headers, called_at).unwrap_or_else(|| called_at.plus(Duration::from_millis(window_ms.unwrap_or(1_000))));
    Some(ProviderReading { limit, remaining: remaining.min(limit), window_ms, resets_at, at: called_at })
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: UnixMillis = UnixMillis(1_795_824_000_000); // Sat, 28 Nov 2026 00:00:00 GMT
    const DEFAULT: &RetryConfig = &RetryConfig {
        max_attempts: 5,
        max_rate_limited: 100,
        default_cool_down: Duration::from_secs(1),
        max_cool_down: Duration::from_secs(3600),
        backoff_base: Duration::from_secs(1),
        backoff_max: Duration::from_secs(300),
    };

    fn response(status: u16, headers: &[(&str, &str)]) -> CallResult {
        CallResult::Response { status, headers: headers.iter().map(|(n, v)| ((*n).to_owned(), (*v).to_owned())).collect(), body: CappedBody::default() }
    }

    fn until(headers: &[(&str, &str)]) -> Outcome {
        classify(&response(429, headers), NOW, DEFAULT)
    }

    #[test]
    fn statuses_map_to_outcomes() {
        assert_eq!(classify(&response(204, &[]), NOW, DEFAULT), Outcome::Success { status: 204 });
        assert_eq!(classify(&response(503, &[]), NOW, DEFAULT), Outcome::Outage { reason: "HTTP 503".into() });
        assert_eq!(classify(&response(404, &[]), NOW, DEFAULT), Outcome::Rejected { status: 404 });
        assert_eq!(classify(&response(302, &[]), NOW, DEFAULT), Outcome::Rejected { status: 302 });
        assert_eq!(classify(&CallResult::Timeout, NOW, DEFAULT), Outcome::Outage { reason: "timeout".into() });
        assert!(matches!(classify(&CallResult::Connect("refused".into()), NOW, DEFAULT), Outcome::Outage { .. }));
    }

    #[test]
    fn not_implemented_is_the_request_s_fault_not_an_outage() {
        assert_eq!(classify(&response(501, &[]), NOW, DEFAULT), Outcome::Rejected { status: 501 });
    }

    /// A 429 storm with `Retry-After: 0` dead-lettered every job in about 1.5 s: each
    /// answer let the whole lane call again at once.
    #[test]
    fn a_429_asking_for_no_wait_still_cools_down_for_the_minimum() {
        let floor = Outcome::RateLimited { until: NOW.plus(MIN_COOL_DOWN) };
        assert_eq!(until(&[("Retry-After", "0")]), floor);
        assert_eq!(until(&[("RateLimit", "limit=10, remaining=0, reset=0")]), floor);
        assert_eq!(until(&[("X-RateLimit-Reset", "1795823990")]), floor, "a reset already past");
    }

    #[test]
    fn a_far_future_retry_after_is_capped_at_max_cool_down() {
        let hour = Outcome::RateLimited { until: NOW.plus(Duration::from_secs(3600)) };
        assert_eq!(until(&[("Retry-After", "Fri, 31 Dec 9999 23:59:59 GMT")]), hour);
        assert_eq!(until(&[("X-RateLimit-Reset", "253402300799")]), hour);
        assert_eq!(until(&[("X-RateLimit-Reset", "253402300799000")]), hour);
        assert_eq!(until(&[("Retry-After", "999999999")]), hour);
        let short = RetryConfig { max_cool_down: Duration::from_secs(60), ..*DEFAULT };
        assert_eq!(classify(&response(429, &[("Retry-After", "600")]), NOW, &short), Outcome::RateLimited { until: NOW.plus(Duration::from_secs(60)) });
    }

    #[test]
    fn rate_limit_headers_set_the_cool_down_to_the_millisecond() {
        let at = |ms: u64| Outcome::RateLimited { until: UnixMillis(NOW.0 + ms) };
        assert_eq!(until(&[]), at(1_000));
        assert_eq!(until(&[("Retry-After", "7")]), at(7_000));
        assert_eq!(until(&[("retry-after", "0.25")]), at(250));
        assert_eq!(until(&[("Retry-After", "Sat, 28 Nov 2026 00:00:30 GMT")]), at(30_000));
        assert_eq!(until(&[("RateLimit", "limit=100, remaining=0, reset=12")]), at(12_000));
        assert_eq!(until(&[("RateLimit", "\"default\";r=0;t=3")]), at(3_000));
        assert_eq!(until(&[("RateLimit-Reset", "4")]), at(4_000));
        assert_eq!(until(&[("X-RateLimit-Reset-After", "2.5")]), at(2_500));
        assert_eq!(until(&[("X-RateLimit-Reset", "1795824005")]), at(5_000));
        assert_eq!(until(&[("X-RateLimit-Reset", "1795824000750")]), at(750));
        assert_eq!(until(&[("X-RateLimit-Reset", "9")]), at(9_000));
        // Retry-After wins over the others; a date in the past means now, and now the
        // shortest cool-down.
        assert_eq!(until(&[("X-RateLimit-Reset", "9"), ("Retry-After", "2")]), at(2_000));
        assert_eq!(until(&[("Retry-After", "Fri, 27 Nov 2026 00:00:00 GMT")]), at(100));
        assert_eq!(until(&[("Retry-After", "soon")]), at(1_000));
    }

    fn reading(headers: &[(&str, &str)]) -> Option<(u64, u64, Option<u64>, u64)> {
        let CallResult::Response { headers, .. } = response(200, headers) else { unreachable!() };
        provider_reading(&headers, NOW).map(|r| (r.limit, r.remaining, r.window_ms, r.resets_at.0 - NOW.0))
    }

    #[test]
    fn every_kind_of_rate_limit_header_gives_a_reading() {
        // IETF draft 8 and later: the named policy's quota and window.
        let named = [("RateLimit", "\"burst\";r=40;t=1"), ("RateLimit-Policy", "\"daily\";q=5000;w=86400, \"burst\";q=100;w=1")];
        assert_eq!(reading(&named), Some((100, 40, Some(1_000), 1_000)));
        // Draft 7: a dictionary and a policy list.
        assert_eq!(reading(&[("RateLimit", "limit=100, remaining=50, reset=30"), ("RateLimit-Policy", "100;w=60")]), Some((100, 50, Some(60_000), 30_000)));
        // Earlier drafts, with the window on the limit.
        let split = [("RateLimit-Limit", "10, 10;w=1"), ("RateLimit-Remaining", "3"), ("RateLimit-Reset", "0.5")];
        assert_eq!(reading(&split), Some((10, 3, Some(1_000), 500)));
        // The de facto X- headers (GitHub's, with an epoch reset), no window named.
        let github = [("X-RateLimit-Limit", "5000"), ("X-RateLimit-Remaining", "4990"), ("X-RateLimit-Reset", "1795827600")];
        assert_eq!(reading(&github), Some((5_000, 4_990, None, 3_600_000)));
        // No reset: a window (or a second) after the call.
        assert_eq!(reading(&[("X-RateLimit-Limit", "60"), ("X-RateLimit-Remaining", "59")]), Some((60, 59, None, 1_000)));
        // Remaining above the limit is the limit.
        assert_eq!(reading(&[("X-RateLimit-Limit", "60"), ("X-RateLimit-Remaining", "99")]), Some((60, 60, None, 1_000)));
    }

    #[test]
    fn headers_without_a_limit_and_a_remaining_count_are_no_reading() {
        assert_eq!(reading(&[]), None);
        assert_eq!(reading(&[("Retry-After", "3")]), None);
        assert_eq!(reading(&[("X-RateLimit-Limit", "60")]), None);
        assert_eq!(reading(&[("X-RateLimit-Limit", "lots"), ("X-RateLimit-Remaining", "5")]), None);
        assert_eq!(reading(&[("RateLimit", "\"a\";r=5;t=1")]), None, "a draft 8 reading needs its policy for the limit");
    }
}
