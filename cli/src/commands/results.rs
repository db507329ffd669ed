//! `paceline results`: the outcome records of an embedded lane's jobs (the API's status,
//! chosen headers and body, attempts, times), filtered by job, lane, time and status; as a
//! table or JSON lines, and followed as new ones arrive. On AWS the records go to the
//! results destination instead (docs/jobs.md shows how to read the results queue).

use std::time::Duration;

use anyhow::bail;
use paceline_shared::adapters::embedded::OutcomeQuery;
use paceline_shared::lane::LaneId;
use paceline_shared::outcome::{OutcomeRecord, StatusFilter};
use paceline_shared::time::{system_now, Clock as _, SystemClock, UnixMillis};

use crate::commands::ConfigArg;
use crate::stack::{load_config_for_operations, open_store, IfMissing};

/// How often `--follow` looks for new records.
const FOLLOW_EVERY: Duration = Duration::from_millis(500);
/// Records read per query.
const PAGE: usize = 500;

/// Show the outcome records of the lane's jobs (embedded lanes).
#[derive(Debug, clap::Args)]
pub struct ResultsArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Print JSON lines, one record per line.
    #[arg(long)]
    pub json: bool,
    /// Keep printing records as they arrive (Ctrl-C stops).
    #[arg(long)]
    pub follow: bool,
    /// Only this job's records.
    #[arg(long = "job")]
    pub job_id: Option<String>,
    /// Only records kept since this time: RFC 3339 (2026-11-23T20:00:00Z) or a duration
    /// ago (10m, 2h).
    #[arg(long, value_parser = parse_since)]
    pub since: Option<UnixMillis>,
    /// Only the records of this lane's jobs (`default`: jobs that name no lane).
    #[arg(long, value_name = "ID")]
    pub lane: Option<LaneId>,
    /// Only these: an HTTP status class (2xx, 4xx, 5xx) or dead-lettered jobs (dead).
    #[arg(long)]
    pub status: Option<StatusFilter>,
}

/// `--since` (and `serve`'s `since`): an RFC 3339 time, or a duration before now.
///
/// # Errors
/// Neither, saying what is accepted.
pub(crate) fn parse_since(text: &str) -> Result<UnixMillis, String> {
    if let Ok(ago) = humantime::parse_duration(text) {
        return Ok(system_now().minus(ago));
    }
    UnixMillis::parse_rfc3339(text).map_err(|e| format!("{e}, or a duration ago such as 10m"))
}

impl ResultsArgs {
    /// # Errors
    /// A bad or missing config, an AWS lane, or an unreadable store.
    pub async fn run(self) -> anyhow::Result<()> {
        let config = load_config_for_operations(&self.config.config)?;
        if matches!(config.backend, paceline_shared::config::Backend::Aws(_)) {
            bail!("on AWS, outcome records go to the worker's results destination (the stack's ResultsQueueUrl): read them there, as docs/jobs.md shows");
        }
        let store = open_store(&config, IfMissing::Refuse)?;
        let mut query =
            OutcomeQuery { job_id: self.job_id.clone(), lane: self.lane.clone(), since: self.since, status: self.status, after_row: 0, limit: PAGE };
        let mut shown = 0_usize;
        if !self.json {
            println!("{}", header());
        }
        loop {
            let page = store.outcomes(&query)?;
            for kept in &page {
                println!("{}", if self.json { kept.record.to_json() } else { row(&kept.record) });
                query.after_row = kept.row;
            }
            shown += page.len();
            if page.len() == PAGE {
                continue;
            }
            if !self.follow {
                break;
            }
            tokio::select! {
                () = SystemClock.sleep_until_coarse(system_now().plus(FOLLOW_EVERY)) => {}
                _ = tokio::signal::ctrl_c() => break,
            }
        }
        if shown == 0 && !self.json && !self.follow {
            eprintln!("no outcome records match (records are kept for [outcomes] retention; jobs marked fire_and_forget have none)");
        }
        Ok(())
    }
}

const COLUMNS: [(&str, usize); 6] = [("answered", 24), ("job", 24), ("outcome", 13), ("status", 6), ("tries", 5), ("body", 0)];

fn header() -> String {
    COLUMNS.iter().map(|(name, width)| format!("{name:<width$}")).collect::<Vec<_>>().join("  ").trim_end().to_owned()
}

/// One record as a table row: when answered, job, outcome, status, attempts, and the start
/// of the body (or the reason of a dead letter).
fn row(record: &OutcomeRecord) -> String {
    let answered = record.times.answered.map_or_else(|| "-".to_owned(), UnixMillis::to_rfc3339);
    let status = record.status.map_or_else(|| "-".to_owned(), |s| s.to_string());
    let body = record.body.as_ref().map_or_else(String::new, |body| match body {
        serde_json::Value::String(text) => text.clone(),
        json => json.to_string(),
    });
    let detail = match (&record.reason, body.is_empty()) {
        (Some(reason), true) => reason.clone(),
        _ => body,
    };
    let cells =
        [answered, ellipsize(&record.job_id, COLUMNS[1].1), record.outcome.label().to_owned(), status, record.attempts.to_string(), ellipsize(&detail, 60)];
    cells.iter().zip(COLUMNS).map(|(cell, (_, width))| format!("{cell:<width$}")).collect::<Vec<_>>().join("  ").trim_end().to_owned()
}

/// `text` on one line, cut to `width` characters with an ellipsis.
fn ellipsize(text: &str, width: usize) -> String {
    let line = text.replace(['\n', '\r'], " ");
    if line.chars().count() <= width {
        return line;
    }
    let mut cut: String = line.chars().take(width.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_takes_a_time_or_a_duration_ago() {
        assert_eq!(parse_since("2026-11-23T20:00:00Z"), UnixMillis::parse_rfc3339("2026-11-23T20:00:00Z"));
        let ago = parse_since("10m").unwrap();
        assert!(system_now().since(ago) >= Duration::from_secs(600));
        assert!(parse_since("last tuesday").unwrap_err().contains("RFC 3339"));
    }

    #[test]
    fn rows_show_the_body_or_the_reason_on_one_line() {
        let job = paceline_shared::job::Job::parse(r#"{"id":"j-1","request":{"method":"GET","path":"/"}}"#).unwrap();
        let mut record = OutcomeRecord::new(
            &job,
            paceline_shared::outcome::Ending::Succeeded,
            1,
            &paceline_shared::outcome::Answer { status: Some(200), ..Default::default() },
            &[],
            paceline_shared::outcome::OutcomeTimes::default(),
        );
        record.body = Some(serde_json::json!({"echo": "a\nb"}));
        let shown = row(&record);
        assert!(shown.contains("j-1") && shown.contains("succeeded") && shown.contains(r#"{"echo":"a\nb"}"#), "{shown}");
        record.body = None;
        record.reason = Some("http_404: the API answered HTTP 404".into());
        assert!(row(&record).ends_with("http_404: the API answered HTTP 404"));
        assert_eq!(ellipsize("abcdef", 4), "abc…");
    }
}
