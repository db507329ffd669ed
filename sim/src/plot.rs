//! `--plot out.svg`: achieved call rate at the provider over simulated time, against the
//! quota's sustained rate. Plain SVG (two polylines, axes, labels), no dependencies.

use std::fmt::Write as _;

use paceline_shared::quota::{Period, Quota};

use crate::report::SimReport;

const WIDTH: f64 = 900.0;
const HEIGHT: f64 = 360.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
/// Points per series at most: seconds are averaged into this many buckets.
const MAX_POINTS: usize = 600;

/// The quota's sustained rate in calls per second: the tightest tier's limit over its
/// window (calendar tiers: a day of 86,400 s, a month of 30 days).
#[must_use]
pub fn sustained_rate(quota: &Quota) -> f64 {
    quota
        .tiers()
        .iter()
        .map(|t| {
            let seconds = match t.period {
                Period::Rolling(d) => d.as_secs_f64().max(1e-3),
                Period::Day => 86_400.0,
                Period::Month => 30.0 * 86_400.0,
            };
            t.limit as f64 / seconds
        })
        .fold(f64::INFINITY, f64::min)
}

/// Averages per-second counts into at most `MAX_POINTS` buckets: (bucket seconds, rates).
fn bucketed(per_second: &[u32], seconds: usize) -> (usize, Vec<f64>) {
    let width = seconds.div_ceil(MAX_POINTS).max(1);
    let rates = (0..seconds.div_ceil(width))
        .map(|b| {
            let range = b * width..((b + 1) * width).min(seconds);
            let len = range.len().max(1) as f64;
            range.map(|s| f64::from(per_second.get(s).copied().unwrap_or(0))).sum::<f64>() / len
        })
        .collect();
    (width, rates)
}

fn polyline(rates: &[f64], width_s: usize, seconds: usize, max_rate: f64, colour: &str) -> String {
    let x = |s: f64| LEFT + s / seconds.max(1) as f64 * (WIDTH - LEFT - RIGHT);
    let y = |r: f64| TOP + (1.0 - r / max_rate) * (HEIGHT - TOP - BOTTOM);
    let points: Vec<String> = rates.iter().enumerate().map(|(i, r)| format!("{:.1},{:.1}", x((i * width_s) as f64), y(*r))).collect();
    format!(r#"<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{}"/>"#, points.join(" "))
}

/// The SVG document for `report` under `quota`.
#[must_use]
pub fn svg(report: &SimReport, quota: &Quota) -> String {
    let seconds = report.offered_per_second.len().max(1);
    let (width_s, admitted) = bucketed(&report.admitted_per_second, seconds);
    let (_, offered) = bucketed(&report.offered_per_second, seconds);
    let limit = sustained_rate(quota);
    let max_rate = offered.iter().chain(&admitted).copied().fold(limit, f64::max) * 1.1;
    let y = |r: f64| TOP + (1.0 - r / max_rate) * (HEIGHT - TOP - BOTTOM);
    let mut out = String::new();
    let _ = write!(out, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">"#);
    let _ = write!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let title = format!("{}: {} jobs, quota {}", report.dispatcher, report.jobs, report.quota.join(", "));
    let _ = write!(out, r#"<text x="{LEFT}" y="22" font-size="14">{}</text>"#, escape(&title));
    let (x0, x1, y0, y1) = (LEFT, WIDTH - RIGHT, TOP, HEIGHT - BOTTOM);
    let _ = write!(out, r#"<path d="M{x0},{y0} V{y1} H{x1}" stroke="black" fill="none"/>"#);
    let _ = write!(out, r##"<line x1="{x0}" x2="{x1}" y1="{0:.1}" y2="{0:.1}" stroke="#c33" stroke-dasharray="6 4"/>"##, y(limit));
    let _ = write!(out, r##"<text x="{}" y="{:.1}" fill="#c33" text-anchor="end">quota {limit:.3}/s</text>"##, x1, y(limit) - 4.0);
    out.push_str(&polyline(&offered, width_s, seconds, max_rate, "#999"));
    out.push_str(&polyline(&admitted, width_s, seconds, max_rate, "#1f6feb"));
    let _ = write!(out, r#"<text x="{x0}" y="{:.1}" text-anchor="end" dx="-6">{:.2}</text>"#, y(max_rate / 1.1), max_rate / 1.1);
    let _ = write!(out, r#"<text x="{x0}" y="{y1}" text-anchor="end" dx="-6">0</text>"#);
    let _ = write!(out, r#"<text x="{x1}" y="{}" text-anchor="end">{} s</text>"#, y1 + 18.0, seconds);
    let _ = write!(out, r#"<text x="{x0}" y="{}">0 s (calls per second, averaged over {width_s} s)</text>"#, y1 + 18.0);
    let _ = write!(
        out,
        r##"<text x="{x0}" y="{}" fill="#1f6feb">admitted</text><text x="{}" y="{}" fill="#999">arrived (incl. refused)</text>"##,
        y1 + 36.0,
        x0 + 80.0,
        y1 + 36.0
    );
    out.push_str("</svg>\n");
    out
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_average_seconds_and_keep_the_points_bounded() {
        let per_second = vec![2; 1_800];
        let (width, rates) = bucketed(&per_second, 1_800);
        assert_eq!((width, rates.len()), (3, 600));
        assert!(rates.iter().all(|r| (*r - 2.0).abs() < 1e-9));
    }

    #[test]
    fn sustained_rate_is_the_tightest_tier() {
        let quota =
            Quota::new(vec!["10/s".parse().unwrap(), "86400/day".parse().unwrap()], paceline_shared::quota::chrono_tz::UTC, std::time::Duration::ZERO).unwrap();
        assert!((sustained_rate(&quota) - 1.0).abs() < 1e-9);
    }
}
