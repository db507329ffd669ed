//! `simulate --plot FILE`: what the provider saw over simulated time, drawn with plotters
//! to PNG or SVG (by the file's extension). One panel per tier against its limit: a
//! rolling tier as calls in its own window (mean and busiest per point), a calendar tier
//! as cumulative use in its day or month. Outages are shaded, calls refused as over quota
//! are marked, and baselines (`--baselines`) are overlaid. With `--lanes`, one panel per
//! shared tier, the lanes with most calls stacked under its limit.

use std::fmt;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use paceline_shared::quota::{Period, Quota, Tier};
use paceline_shared::time::UnixMillis;
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::lanes::LanesReport;
use crate::report::SimReport;
use crate::SIM_START;

/// The figure's width, and each panel's height, in pixels.
const WIDTH: u32 = 1200;
/// The legend's column, right of each panel.
const LEGEND_WIDTH: u32 = 330;
const PANEL_HEIGHT: u32 = 300;
const TITLE_HEIGHT: u32 = 56;
/// Points per line at most: seconds are gathered into this many buckets.
const MAX_POINTS: usize = 150;
/// The font every label is set in, bundled so that a machine without fonts draws text
/// (DejaVu Sans; its licence is beside it).
const FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
pub(crate) const FAMILY: &str = "sans-serif";

const LANE_COLOUR: RGBColor = RGBColor(31, 111, 235);
const LIMIT_COLOUR: RGBColor = RGBColor(200, 30, 30);
const OUTAGE_COLOUR: RGBColor = RGBColor(255, 150, 0);
/// The bands of a stacked panel, the lane with most calls first.
const STACK_COLOURS: [RGBColor; 7] = [
    RGBColor(31, 111, 235),
    RGBColor(230, 120, 0),
    RGBColor(40, 150, 70),
    RGBColor(140, 70, 170),
    RGBColor(200, 60, 110),
    RGBColor(0, 150, 160),
    RGBColor(150, 150, 150),
];
const BASELINE_COLOURS: [RGBColor; 5] = [RGBColor(230, 120, 0), RGBColor(40, 150, 70), RGBColor(140, 70, 170), RGBColor(140, 90, 50), RGBColor(110, 110, 110)];

/// Why a plot was not written.
#[derive(Debug)]
pub struct PlotError(pub(crate) String);

impl fmt::Display for PlotError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PlotError {}

/// The image formats a plot is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Png,
    Svg,
}

impl Format {
    /// The format `path`'s extension names.
    ///
    /// # Errors
    /// Any extension but `.png` or `.svg`.
    pub fn of(path: &Path) -> Result<Self, PlotError> {
        match path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
            Some("png") => Ok(Self::Png),
            Some("svg") => Ok(Self::Svg),
            _ => Err(PlotError(format!("--plot {}: the file must end in .png or .svg", path.display()))),
        }
    }
}

/// Checks, before a long simulation, that a plot can be written to `path`: its extension
/// names a format and the file can be created.
///
/// # Errors
/// An unknown extension or a file that cannot be created.
pub fn check_path(path: &Path) -> Result<Format, PlotError> {
    let format = Format::of(path)?;
    std::fs::OpenOptions::new().write(true).create(true).truncate(false).open(path).map_err(|e| PlotError(format!("--plot {}: {e}", path.display())))?;
    Ok(format)
}

/// One line in a panel: a dispatcher's use of the panel's tier.
#[derive(Clone, Debug, PartialEq)]
pub struct Line {
    pub name: String,
    /// (seconds, value): the mean over each point's seconds (a calendar tier: the use at
    /// the point's end).
    pub mean: Vec<(f64, f64)>,
    /// (seconds, value): the busiest window within each point's seconds (rolling tiers).
    pub busiest: Vec<(f64, f64)>,
    /// (seconds, value on the line) of the points in which calls were refused as over quota.
    pub refused: Vec<(f64, f64)>,
    /// Calls refused as over quota in all.
    pub refused_total: u64,
}

/// One tier's panel.
#[derive(Clone, Debug, PartialEq)]
pub struct Panel {
    pub caption: String,
    /// What the y axis counts, with its unit.
    pub y_unit: String,
    pub limit: f64,
    pub lines: Vec<Line>,
    /// The lines are bands stacked from the first up (each line's values include the
    /// ones below it), drawn as filled areas.
    pub stacked: bool,
}

impl Panel {
    fn y_max(&self) -> f64 {
        let highest = self.lines.iter().flat_map(|l| l.mean.iter().chain(&l.busiest)).map(|(_, y)| *y).fold(0.0, f64::max);
        highest.max(self.limit) * 1.15
    }
}

/// Everything drawn, computed from the reports before any drawing.
#[derive(Clone, Debug, PartialEq)]
pub struct Figure {
    pub title: String,
    pub subtitle: String,
    /// The x axis' end, in seconds.
    pub seconds: f64,
    /// (start, end) in seconds of each outage of the API.
    pub outages: Vec<(f64, f64)>,
    pub panels: Vec<Panel>,
}

/// The figure for `main` (the configured lane) and `others` (baselines) under `quota`.
#[must_use]
pub fn figure(main: &SimReport, others: &[SimReport], quota: &Quota) -> Figure {
    let reports: Vec<&SimReport> = std::iter::once(main).chain(others).collect();
    let (seconds, bucket) = time_axis(reports.iter().map(|r| r.offered_per_second.len()));
    let panels = tier_panels(quota, |tier, measure| {
        let lines = reports.iter().map(|r| measure.line(r, seconds, bucket)).collect();
        Panel { caption: measure.caption(tier), y_unit: measure.y_unit(), limit: measure.limit, lines, stacked: false }
    });
    let drained = if main.drained { "drained in" } else { "not drained after" };
    Figure {
        title: format!("{} jobs, quota {}: {drained} {}", main.jobs, main.quota.join(", "), clock_label(main.time_to_drain_s, main.time_to_drain_s)),
        subtitle: format!("{} (seed {}); {} calls refused as over quota; {} health checks", main.dispatcher, main.seed, main.violations(), main.health_checks),
        seconds: seconds as f64,
        outages: main.failures.outages.iter().map(|o| (o.start.as_secs_f64(), (o.start + o.length).as_secs_f64())).collect(),
        panels,
    }
}

/// The figure of a simulation of many lanes (`--lanes`) under the shared `quota`: for
/// each shared tier, the lanes with most calls and the others stacked, against its limit.
#[must_use]
pub fn lanes_figure(report: &LanesReport, quota: &Quota) -> Figure {
    let (seconds, bucket) = time_axis(report.calls_per_second.iter().map(|(_, calls)| calls.len()));
    let panels = tier_panels(quota, |tier, measure| {
        let calendar = matches!(measure.kind, MeasureKind::Calendar { .. });
        let mut below = vec![0.0; seconds];
        let lines = report
            .calls_per_second
            .iter()
            .map(|(lane, calls)| {
                for (sum, value) in below.iter_mut().zip(measure.per_second(calls, seconds)) {
                    *sum += value;
                }
                Line { name: lane.clone(), mean: bucketed(&below, bucket, seconds, calendar), busiest: Vec::new(), refused: Vec::new(), refused_total: 0 }
            })
            .collect();
        let caption = format!("shared tier {tier}: the lanes with most calls, stacked, against the limit");
        Panel { caption, y_unit: measure.y_unit(), limit: measure.limit, lines, stacked: true }
    });
    let fairness = report.jain_index_mean.map_or(String::new(), |jain| format!("; Jain's index {jain:.4}"));
    Figure {
        title: format!(
            "{} jobs over {} lanes, shared quota {}: drained in {}",
            report.jobs,
            report.lanes,
            quota_label(quota),
            clock_label(report.seconds, report.seconds)
        ),
        subtitle: format!(
            "{}; {} calls over a lane's tier, {} over a shared tier{fairness}",
            report.dispatcher, report.lane_violations, report.shared_violations
        ),
        seconds: seconds as f64,
        outages: Vec::new(),
        panels,
    }
}

/// The x axis' length in seconds (the longest of `lengths`, at least one) and how many
/// seconds each point gathers.
fn time_axis(lengths: impl Iterator<Item = usize>) -> (usize, usize) {
    let seconds = lengths.max().unwrap_or(0).max(1);
    (seconds, seconds.div_ceil(MAX_POINTS).max(1))
}

/// One panel per tier of `quota`, each made by `panel` from the tier and its measure.
fn tier_panels(quota: &Quota, panel: impl Fn(&Tier, Measure) -> Panel) -> Vec<Panel> {
    quota.tiers().iter().map(|tier| panel(tier, Measure::of(tier, quota))).collect()
}

fn quota_label(quota: &Quota) -> String {
    quota.tiers().iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// `values` (one a second) in points of `bucket` seconds: each point's mean, or for a
/// calendar tier the use at its end.
fn bucketed(values: &[f64], bucket: usize, seconds: usize, calendar: bool) -> Vec<(f64, f64)> {
    values
        .chunks(bucket)
        .enumerate()
        .map(|(index, chunk)| {
            let x = ((index * bucket) as f64).min(seconds as f64);
            (x, if calendar { chunk.last().copied().unwrap_or(0.0) } else { chunk.iter().sum::<f64>() / chunk.len() as f64 })
        })
        .collect()
}

/// How a tier's use is measured each second.
struct Measure {
    limit: f64,
    kind: MeasureKind,
}

enum MeasureKind {
    /// Calls in the trailing window of this many whole seconds, times `scale` (a window
    /// that is not a whole number of seconds is measured over the next whole number and
    /// scaled to the tier's length).
    Rolling { window_s: usize, scale: f64, tier_window: Duration },
    /// Calls so far in the calendar day or month.
    Calendar { tier: Tier, zone: paceline_shared::quota::chrono_tz::Tz },
}

impl Measure {
    fn of(tier: &Tier, quota: &Quota) -> Self {
        let limit = tier.limit as f64;
        match tier.period {
            Period::Rolling(window) => {
                let window_s = (window.as_secs_f64().ceil() as usize).max(1);
                let scale = window.as_secs_f64() / window_s as f64;
                Self { limit, kind: MeasureKind::Rolling { window_s, scale, tier_window: window } }
            }
            Period::Day | Period::Month => Self { limit, kind: MeasureKind::Calendar { tier: *tier, zone: quota.zone() } },
        }
    }

    fn caption(&self, tier: &Tier) -> String {
        match &self.kind {
            MeasureKind::Rolling { .. } => format!("tier {tier}: calls in each {} against the limit", self.y_unit_window()),
            MeasureKind::Calendar { .. } => format!("tier {tier}: calls so far in the {} against the limit", self.y_unit_window()),
        }
    }

    fn y_unit_window(&self) -> String {
        match &self.kind {
            MeasureKind::Rolling { tier_window, .. } => window_name(*tier_window),
            MeasureKind::Calendar { tier, .. } => if tier.period == Period::Day { "day" } else { "month" }.to_owned(),
        }
    }

    fn y_unit(&self) -> String {
        match &self.kind {
            MeasureKind::Rolling { .. } => format!("calls per {}", self.y_unit_window()),
            MeasureKind::Calendar { .. } => format!("calls this {}", self.y_unit_window()),
        }
    }

    /// The tier's use, second by second.
    fn per_second(&self, calls: &[u32], seconds: usize) -> Vec<f64> {
        match &self.kind {
            MeasureKind::Rolling { window_s, scale, .. } => trailing_counts(calls, seconds, *window_s).into_iter().map(|c| c as f64 * scale).collect(),
            MeasureKind::Calendar { tier, zone } => {
                calendar_use(calls, seconds, |s| tier.window_at(*zone, SIM_START.plus(Duration::from_secs(s as u64))).0).into_iter().map(|c| c as f64).collect()
            }
        }
    }

    fn line(&self, report: &SimReport, seconds: usize, bucket: usize) -> Line {
        let values = self.per_second(&report.admitted_per_second, seconds);
        let calendar = matches!(self.kind, MeasureKind::Calendar { .. });
        let mean = bucketed(&values, bucket, seconds, calendar);
        let mut line =
            Line { name: report.dispatcher.clone(), mean: mean.clone(), busiest: Vec::new(), refused: Vec::new(), refused_total: report.violations() };
        for (index, chunk) in values.chunks(bucket).enumerate() {
            let (x, mean) = mean[index];
            if !calendar {
                line.busiest.push((x, chunk.iter().copied().fold(0.0, f64::max)));
            }
            let refused = (index * bucket..(index + 1) * bucket).any(|s| report.refused_per_second.get(s).is_some_and(|n| *n > 0));
            if refused {
                line.refused.push((x, mean));
            }
        }
        line
    }
}

/// For each second, the calls in the `window_s` seconds that end with it.
fn trailing_counts(calls: &[u32], seconds: usize, window_s: usize) -> Vec<u64> {
    let at = |s: usize| u64::from(calls.get(s).copied().unwrap_or(0));
    let mut sum = 0;
    (0..seconds)
        .map(|s| {
            sum += at(s);
            if s >= window_s {
                sum -= at(s - window_s);
            }
            sum
        })
        .collect()
}

/// For each second, the calls so far in its calendar window (`window_start` of a second
/// names the window it falls in).
fn calendar_use(calls: &[u32], seconds: usize, window_start: impl Fn(usize) -> UnixMillis) -> Vec<u64> {
    let mut current = None;
    let mut sum = 0;
    (0..seconds)
        .map(|s| {
            let start = window_start(s);
            if current != Some(start) {
                current = Some(start);
                sum = 0;
            }
            sum += u64::from(calls.get(s).copied().unwrap_or(0));
            sum
        })
        .collect()
}

/// "second", "minute", "hour" or the window's length ("5s").
fn window_name(window: Duration) -> String {
    match window.as_millis() {
        1_000 => "second".into(),
        60_000 => "minute".into(),
        3_600_000 => "hour".into(),
        _ => humantime::format_duration(window).to_string(),
    }
}

/// `seconds` as h:mm when the axis runs an hour or more (`span`), else m:ss.
fn clock_label(seconds: f64, span: f64) -> String {
    let s = seconds.round().max(0.0) as u64;
    if span >= 3_600.0 {
        format!("{}:{:02}", s / 3_600, s % 3_600 / 60)
    } else {
        format!("{}:{:02}", s / 60, s % 60)
    }
}

/// Seconds per unit of the x axis for a run of `seconds`: seconds under two minutes,
/// minutes under two hours, else hours.
fn time_unit(seconds: f64) -> f64 {
    if seconds < 120.0 {
        1.0
    } else if seconds < 7_200.0 {
        60.0
    } else {
        3_600.0
    }
}

/// A y tick: whole numbers where the axis is tall, thousands as k.
fn count_label(value: f64, top: f64) -> String {
    if value == 0.0 {
        "0".into()
    } else if top >= 20_000.0 {
        format!("{}k", (value / 1_000.0 * 10.0).round() / 10.0)
    } else if top >= 10.0 {
        format!("{value:.0}")
    } else {
        format!("{}", (value * 100.0).round() / 100.0)
    }
}

pub(crate) fn register_font() -> Result<(), PlotError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_ok());
    if ok {
        Ok(())
    } else {
        Err(PlotError("the bundled font did not load".into()))
    }
}

/// Draws `figure` to `path`, PNG or SVG by its extension.
///
/// # Errors
/// An unknown extension, or a file that cannot be written.
pub fn write(path: &Path, figure: &Figure) -> Result<(), PlotError> {
    let format = Format::of(path)?;
    register_font()?;
    let size = (WIDTH, TITLE_HEIGHT + PANEL_HEIGHT * figure.panels.len().max(1) as u32);
    match format {
        Format::Png => draw(BitMapBackend::new(path, size).into_drawing_area(), figure),
        Format::Svg => draw(SVGBackend::new(path, size).into_drawing_area(), figure),
    }
    .map_err(|e| PlotError(format!("--plot {}: {e}", path.display())))
}

type DrawResult = Result<(), Box<dyn std::error::Error>>;

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, figure: &Figure) -> DrawResult
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let (head, body) = root.split_vertically(TITLE_HEIGHT);
    head.draw(&Text::new(figure.title.as_str(), (16, 8), (FAMILY, 20).into_font().color(&BLACK)))?;
    head.draw(&Text::new(figure.subtitle.as_str(), (16, 32), (FAMILY, 14).into_font().color(&BLACK.mix(0.7))))?;
    for (area, panel) in body.split_evenly((figure.panels.len().max(1), 1)).iter().zip(&figure.panels) {
        draw_panel(area, panel, figure)?;
    }
    root.present()?;
    Ok(())
}

fn draw_panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, panel: &Panel, figure: &Figure) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let (plot_area, legend_area) = area.split_horizontally(WIDTH - LEGEND_WIDTH);
    let (x_max, y_max) = (figure.seconds, panel.y_max());
    // The x axis counts seconds, minutes or hours, whichever gives round ticks.
    let unit = time_unit(x_max);
    let mut chart = ChartBuilder::on(&plot_area)
        .caption(panel.caption.as_str(), (FAMILY, 16))
        .margin(12)
        .x_label_area_size(42)
        .y_label_area_size(72)
        .build_cartesian_2d(0.0..x_max / unit, 0.0..y_max)?;
    let clock = if x_max >= 3_600.0 { "h:mm" } else { "m:ss" };
    chart
        .configure_mesh()
        .light_line_style(BLACK.mix(0.05))
        .x_labels(12)
        .y_labels(8)
        .x_desc(format!("simulated time ({clock})"))
        .y_desc(panel.y_unit.as_str())
        .x_label_formatter(&|x| clock_label(*x * unit, x_max))
        .y_label_formatter(&|y| count_label(*y, y_max))
        .label_style((FAMILY, 13))
        .axis_desc_style((FAMILY, 14))
        .draw()?;
    let mut legend = Vec::new();
    if panel.stacked {
        // The highest band first, each lower one drawn over it.
        for (index, line) in panel.lines.iter().enumerate().rev() {
            let colour = STACK_COLOURS[index % STACK_COLOURS.len()];
            chart.draw_series(AreaSeries::new(line.mean.iter().map(|(x, y)| (x / unit, *y)), 0.0, colour.mix(0.75)))?;
        }
        legend.extend(
            panel.lines.iter().enumerate().map(|(index, line)| (Swatch::Area(STACK_COLOURS[index % STACK_COLOURS.len()].mix(0.75)), line.name.clone())),
        );
        chart.draw_series(DashedLineSeries::new([(0.0, panel.limit), (x_max / unit, panel.limit)], 8, 5, LIMIT_COLOUR.stroke_width(2)))?;
        legend.push((Swatch::Dashed(LIMIT_COLOUR.into()), format!("limit {}", count_label(panel.limit, panel.limit))));
        return draw_legend(&legend_area, &legend);
    }
    if !figure.outages.is_empty() {
        chart.draw_series(
            figure.outages.iter().map(|(start, end)| Rectangle::new([(*start / unit, 0.0), (*end / unit, y_max)], OUTAGE_COLOUR.mix(0.18).filled())),
        )?;
        legend.push((Swatch::Area(OUTAGE_COLOUR.mix(0.3)), "API outage (503)".to_owned()));
    }
    chart.draw_series(DashedLineSeries::new([(0.0, panel.limit), (x_max / unit, panel.limit)], 8, 5, LIMIT_COLOUR.stroke_width(2)))?;
    legend.push((Swatch::Dashed(LIMIT_COLOUR.into()), format!("limit {}", count_label(panel.limit, panel.limit))));
    for (index, line) in panel.lines.iter().enumerate() {
        let colour = if index == 0 { LANE_COLOUR } else { BASELINE_COLOURS[(index - 1) % BASELINE_COLOURS.len()] };
        let lane = index == 0;
        if lane && !line.busiest.is_empty() {
            chart.draw_series(LineSeries::new(line.busiest.iter().map(|(x, y)| (x / unit, *y)), colour.mix(0.35).stroke_width(1)))?;
            legend.push((Swatch::Line(colour.mix(0.35), 1), format!("{}: busiest window", line.name)));
        }
        let width = if lane { 2 } else { 1 };
        chart.draw_series(LineSeries::new(line.mean.iter().map(|(x, y)| (x / unit, *y)), colour.stroke_width(width)))?;
        let what = if line.busiest.is_empty() { "" } else { ": mean" };
        let refused = if line.refused_total > 0 { format!(" ({} refused)", line.refused_total) } else { String::new() };
        legend.push((Swatch::Line(colour.into(), 2), format!("{}{what}{refused}", line.name)));
        // Where the lane itself was refused, crosses on its line; baselines give their count.
        if lane && !line.refused.is_empty() {
            chart.draw_series(line.refused.iter().map(|(x, y)| Cross::new((x / unit, *y), 5, LIMIT_COLOUR.stroke_width(2))))?;
            legend.push((Swatch::Cross(LIMIT_COLOUR.into()), "calls refused as over quota (429)".to_owned()));
        }
    }
    draw_legend(&legend_area, &legend)
}

/// How a legend entry is drawn.
enum Swatch {
    Line(RGBAColor, u32),
    Dashed(RGBAColor),
    Area(RGBAColor),
    Cross(RGBAColor),
}

/// The legend, in a column of its own beside the panel (it never hides a line).
fn draw_legend<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, entries: &[(Swatch, String)]) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let font = (FAMILY, 12).into_font().color(&BLACK);
    for (row, (swatch, label)) in entries.iter().enumerate() {
        let y = 44 + 18 * row as i32;
        match swatch {
            Swatch::Line(colour, width) => area.draw(&PathElement::new([(0, y), (22, y)], colour.stroke_width(*width)))?,
            Swatch::Dashed(colour) => {
                area.draw(&PathElement::new([(0, y), (8, y)], colour.stroke_width(2)))?;
                area.draw(&PathElement::new([(13, y), (22, y)], colour.stroke_width(2)))?;
            }
            Swatch::Area(colour) => area.draw(&Rectangle::new([(0, y - 5), (22, y + 5)], colour.filled()))?,
            Swatch::Cross(colour) => area.draw(&Cross::new((11, y), 5, colour.stroke_width(2)))?,
        }
        area.draw(&Text::new(label.as_str(), (30, y - 7), font.clone()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailing_counts_hold_the_calls_of_each_window_ending_at_a_second() {
        let calls = [1, 2, 3, 4];
        assert_eq!(trailing_counts(&calls, 6, 1), vec![1, 2, 3, 4, 0, 0]);
        assert_eq!(trailing_counts(&calls, 6, 2), vec![1, 3, 5, 7, 4, 0]);
        assert_eq!(trailing_counts(&calls, 4, 60), vec![1, 3, 6, 10]);
    }

    #[test]
    fn calendar_use_starts_again_in_each_window() {
        let calls = [5, 5, 5, 5, 5];
        assert_eq!(calendar_use(&calls, 5, |s| UnixMillis(if s < 3 { 0 } else { 3_000 })), vec![5, 10, 15, 5, 10]);
    }

    #[test]
    fn the_time_axis_reads_minutes_and_seconds_under_an_hour_and_hours_and_minutes_above() {
        assert_eq!(clock_label(125.0, 600.0), "2:05");
        assert_eq!(clock_label(3_725.0, 7_200.0), "1:02");
        assert_eq!(clock_label(0.0, 30.0), "0:00");
    }

    #[test]
    fn counts_are_labelled_to_the_axis_height() {
        assert_eq!(count_label(500.0, 575.0), "500");
        assert_eq!(count_label(20_000.0, 23_000.0), "20k");
        assert_eq!(count_label(0.25, 1.15), "0.25");
        assert_eq!(count_label(0.0, 23_000.0), "0");
    }

    #[test]
    fn only_png_and_svg_files_are_written() {
        assert_eq!(Format::of(Path::new("a/b.PNG")).unwrap(), Format::Png);
        assert_eq!(Format::of(Path::new("b.svg")).unwrap(), Format::Svg);
        let refused = Format::of(Path::new("b.pdf")).unwrap_err().to_string();
        assert!(refused.contains("b.pdf") && refused.contains(".png or .svg"), "{refused}");
    }

    #[test]
    fn a_path_that_cannot_be_created_is_refused_before_a_run() {
        let refused = check_path(Path::new("/nonexistent-directory/plot.png")).unwrap_err().to_string();
        assert!(refused.contains("/nonexistent-directory/plot.png"), "{refused}");
    }
}
