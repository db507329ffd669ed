//! Dead letters as an operator sees them: one record shape for both DLQs (the jobs DLQ
//! and the worker's Lambda on-failure destination), cause matching for `--cause`, the
//! filters of `paceline dlq`, and the per-cause summary. Pure: no I/O.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::job::{JobId, WorkerPayload};
use crate::lane::LaneId;
use crate::outcome::OutcomeRecord;
use crate::time::UnixMillis;

/// Which dead-letter queue a record is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DlqSource {
    /// Jobs the orchestrator or worker dead-lettered with a reason.
    Jobs,
    /// Worker invocations Lambda gave up on (its async on-failure destination).
    Worker,
}

impl fmt::Display for DlqSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Self::Jobs => "jobs",
            Self::Worker => "worker",
        })
    }
}

impl std::str::FromStr for DlqSource {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "jobs" => Ok(Self::Jobs),
            "worker" => Ok(Self::Worker),
            other => Err(format!("unknown DLQ `{other}` (expected `jobs` or `worker`)")),
        }
    }
}

/// One dead letter, from either DLQ.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeadLetterRecord {
    pub source: DlqSource,
    /// What `remove` and `unhide` take: a receipt (SQS) or a row number (embedded).
    #[serde(skip)]
    pub handle: String,
    /// The dead letter's own id in its DLQ.
    pub message_id: String,
    /// The job's id, when the record holds a readable job.
    pub job_id: Option<String>,
    /// The lane the job was for (the default lane when it names none).
    #[serde(skip_serializing_if = "LaneId::is_default")]
    pub lane: LaneId,
    /// The job message a redrive puts back on the jobs queue; `None` when there is no
    /// job to redrive (a health check, an unreadable Lambda record).
    #[serde(skip)]
    pub job_body: Option<String>,
    /// The attempt it was dead-lettered at, counted from 0 (its message's attempt: what a
    /// redrive keeping attempts starts from). [`DeadLetterRecord::calls_made`] is what
    /// operators are shown.
    pub attempt: u32,
    /// `http_404`, `attempts_exhausted:http_503`, `malformed`, `worker:retries_exhausted`...
    pub cause: String,
    pub detail: String,
    #[serde(serialize_with = "crate::time::rfc3339::serialize")]
    pub dead_at: UnixMillis,
    /// The stored message as it is.
    pub raw: String,
    /// The job's outcome record, when the worker dead-lettered it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome: Option<OutcomeRecord>,
    /// Where the job sat in a worker batch whose invocation failed: one worker-DLQ
    /// message holds the whole batch, shown and redriven job by job.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<BatchEntry>,
}

/// A job's place in a worker batch of the worker DLQ.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BatchEntry {
    pub batch: String,
    pub index: u32,
    /// The jobs the message holds.
    pub of: u32,
}

impl DeadLetterRecord {
    /// The calls made for the job, as its outcome record's `attempts` and the worker's
    /// "gave up after" count them: its attempts before the last, and the last one's call
    /// when an answer ended it (`http_404`, `attempts_exhausted:...`); a job dead-lettered
    /// before its call (`malformed`, `never_fits`) or by the worker's DLQ made no more.
    #[must_use]
    pub fn calls_made(&self) -> u32 {
        let last_called = self.source == DlqSource::Jobs && (self.cause.starts_with("http_") || self.cause.starts_with("attempts_exhausted"));
        self.attempt + u32::from(last_called)
    }

    /// The same record with the job's outcome record.
    #[must_use]
    pub fn with_outcome(self, outcome: Option<OutcomeRecord>) -> Self {
        Self { outcome, ..self }
    }
}

/// Whether a record's cause label answers to `wanted`: the whole label
/// (`attempts_exhausted:http_503`), one of its parts (`attempts_exhausted`, `http_503`,
/// `worker`), a status (`503` for `http_503`) or a status class (`5xx` matches any
/// `http_5..` part).
#[must_use]
pub fn cause_matches(label: &str, wanted: &str) -> bool {
    label == wanted || label.split(':').any(|part| part == wanted || part.strip_prefix("http_") == Some(wanted) || in_status_class(part, wanted))
}

fn in_status_class(part: &str, class: &str) -> bool {
    let class = class.as_bytes();
    let Some(status) = part.strip_prefix("http_").map(str::as_bytes) else { return false };
    class.len() == 3 && class[0].is_ascii_digit() && class[1..].eq_ignore_ascii_case(b"xx") && status.len() == 3 && status[0] == class[0]
}

/// Which dead letters a `dlq` command acts on. Empty lists match everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeadLetterFilter {
    /// Any of these causes (see [`cause_matches`]).
    pub causes: Vec<String>,
    /// Any of these job ids or DLQ message ids.
    pub ids: Vec<String>,
    /// Dead-lettered at least this long ago.
    pub older_than: Option<Duration>,
    /// Dead-lettered at most this long ago.
    pub newer_than: Option<Duration>,
    /// Only this lane's jobs.
    pub lane: Option<LaneId>,
}

impl DeadLetterFilter {
    /// Whether the filter narrows anything down.
    #[must_use]
    pub fn is_everything(&self) -> bool {
        self.causes.is_empty() && self.ids.is_empty() && self.older_than.is_none() && self.newer_than.is_none() && self.lane.is_none()
    }

    #[must_use]
    pub fn matches(&self, record: &DeadLetterRecord, now: UnixMillis) -> bool {
        let age = now.since(record.dead_at);
        (self.causes.is_empty() || self.causes.iter().any(|c| cause_matches(&record.cause, c)))
            && (self.ids.is_empty() || self.ids.iter().any(|id| *id == record.message_id || Some(id) == record.job_id.as_ref()))
            && self.older_than.is_none_or(|d| age >= d)
            && self.newer_than.is_none_or(|d| age <= d)
            && self.lane.as_ref().is_none_or(|lane| *lane == record.lane)
    }
}

/// Dead letters of one cause in one DLQ.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CauseGroup {
    pub source: DlqSource,
    pub cause: String,
    pub count: u64,
    #[serde(serialize_with = "crate::time::rfc3339::serialize")]
    pub first_seen: UnixMillis,
    #[serde(serialize_with = "crate::time::rfc3339::serialize")]
    pub last_seen: UnixMillis,
    /// The detail of the most recent one, as an example.
    pub example: String,
}

/// Dead letters grouped by DLQ and cause as they are read, so a summary of a large DLQ
/// holds one group per cause, not every record.
#[derive(Debug, Default)]
pub struct CauseSummary {
    groups: BTreeMap<(DlqSource, String), CauseGroup>,
    total: u64,
}

impl CauseSummary {
    pub fn add(&mut self, r: &DeadLetterRecord) {
        self.total += 1;
        let group = self.groups.entry((r.source, r.cause.clone())).or_insert_with(|| CauseGroup {
            source: r.source,
            cause: r.cause.clone(),
            count: 0,
            first_seen: r.dead_at,
            last_seen: r.dead_at,
            example: r.detail.clone(),
        });
        group.count += 1;
        group.first_seen = group.first_seen.min(r.dead_at);
        if r.dead_at >= group.last_seen {
            group.last_seen = r.dead_at;
            group.example.clone_from(&r.detail);
        }
    }

    /// How many records were added.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The groups, the biggest first.
    #[must_use]
    pub fn groups(self) -> Vec<CauseGroup> {
        let mut groups: Vec<CauseGroup> = self.groups.into_values().collect();
        groups.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| (a.source, &a.cause).cmp(&(b.source, &b.cause))));
        groups
    }
}

/// The parts of a Lambda on-failure destination record that a dead letter needs.
#[derive(Clone, Debug, PartialEq)]
pub struct LambdaFailure {
    /// `worker:retries_exhausted`, `worker:event_age_exceeded`, with the error type when
    /// Lambda gave one (`worker:retries_exhausted:Unhandled`).
    pub cause: String,
    pub detail: String,
    pub failed_at: Option<UnixMillis>,
    /// The payload the worker was invoked with.
    pub payload: Option<WorkerPayload>,
}

/// Reads a record Lambda wrote to an async on-failure destination:
/// `{"requestContext": {"condition": ...}, "requestPayload": ..., "responsePayload": ...}`.
///
/// # Errors
/// When the body is not such a record.
pub fn parse_lambda_failure(body: &str) -> Result<LambdaFailure, String> {
    let record: Value = serde_json::from_str(body).map_err(|e| format!("not JSON: {e}"))?;
    let condition =
        record.pointer("/requestContext/condition").and_then(Value::as_str).ok_or("not a Lambda destination record: no requestContext.condition")?;
    let mut cause = format!("worker:{}", snake_case(condition));
    if let Some(kind) = record.pointer("/responseContext/functionError").and_then(Value::as_str) {
        cause.push(':');
        cause.push_str(kind);
    }
    let message = record.pointer("/responsePayload/errorMessage").and_then(Value::as_str);
    let error_type = record.pointer("/responsePayload/errorType").and_then(Value::as_str);
    let invokes = record.pointer("/requestContext/approximateInvokeCount").and_then(Value::as_u64);
    let detail = match (error_type, message) {
        (Some(t), Some(m)) => format!("{t}: {m}"),
        (None, Some(m)) => m.to_owned(),
        (Some(t), None) => t.to_owned(),
        (None, None) => format!("{condition} after {} invocation(s)", invokes.unwrap_or(0)),
    };
    let failed_at = record
        .get("timestamp")
        .and_then(Value::as_str)
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        .and_then(|t| u64::try_from(t.timestamp_millis()).ok())
        .map(UnixMillis);
    let payload = record.get("requestPayload").and_then(|p| WorkerPayload::from_json(&p.to_string()).ok());
    Ok(LambdaFailure { cause, detail, failed_at, payload })
}

fn snake_case(text: &str) -> String {
    let mut out = String::new();
    for (i, c) in text.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// The records of a worker-DLQ message from its stored body: one, or one per job of a
/// batch (each `{message id}/{index}`, sharing the message's handle). Unreadable bodies
/// are kept, with the problem as their detail, so nothing is hidden from the operator.
#[must_use]
pub fn worker_records(handle: String, message_id: String, body: String, received_at: UnixMillis) -> Vec<DeadLetterRecord> {
    let (cause, detail, dead_at, payload) = match parse_lambda_failure(&body) {
        Ok(f) => (f.cause, f.detail, f.failed_at.unwrap_or(received_at), f.payload),
        Err(problem) => ("worker:unreadable".to_owned(), problem, received_at, None),
    };
    let record = |message_id: String, call: Option<&WorkerPayload>, batch: Option<BatchEntry>| {
        let (job_id, lane, job_body, attempt) = match call {
            Some(WorkerPayload::Job { job, attempt, .. }) => (Some(job.id.as_str().to_owned()), job.lane.clone(), Some(job.to_json()), *attempt),
            _ => (None, LaneId::default(), None, 0),
        };
        let (handle, cause, detail, raw) = (handle.clone(), cause.clone(), detail.clone(), body.clone());
        DeadLetterRecord { source: DlqSource::Worker, handle, message_id, job_id, lane, job_body, attempt, cause, detail, dead_at, raw, outcome: None, batch }
    };
    match &payload {
        Some(batch @ WorkerPayload::Batch { id, .. }) => {
            let calls = batch.batch_calls();
            let of = u32::try_from(calls.len()).unwrap_or(u32::MAX);
            (0..of)
                .zip(&calls)
                .map(|(index, call)| record(format!("{message_id}/{index}"), call.as_ref().ok(), Some(BatchEntry { batch: id.clone(), index, of })))
                .collect()
        }
        other => vec![record(message_id.clone(), other.as_ref(), None)],
    }
}

/// The worker-DLQ message `raw` (a Lambda record of a failed batch) without the jobs at
/// `taken`: what stays in the DLQ once those were redriven or purged. `None` when none
/// stay.
#[must_use]
pub fn rest_of_batch(raw: &str, taken: &std::collections::BTreeSet<u32>) -> Option<String> {
    let mut record: Value = serde_json::from_str(raw).ok()?;
    let calls = record.pointer_mut("/requestPayload/calls")?.as_array_mut()?;
    let kept: Vec<Value> = calls.drain(..).enumerate().filter(|(i, _)| u32::try_from(*i).map_or(true, |i| !taken.contains(&i))).map(|(_, c)| c).collect();
    if kept.is_empty() {
        return None;
    }
    *calls = kept;
    Some(record.to_string())
}

/// A jobs-DLQ record from its stored body and reason.
#[must_use]
pub fn jobs_record(handle: String, message_id: String, body: String, attempt: u32, cause: String, detail: String, dead_at: UnixMillis) -> DeadLetterRecord {
    let job_id = JobId::named_in(&body).map(|id| id.as_str().to_owned());
    DeadLetterRecord {
        source: DlqSource::Jobs,
        handle,
        message_id,
        job_id,
        lane: LaneId::named_in(&body),
        job_body: Some(body.clone()),
        attempt,
        cause,
        detail,
        dead_at,
        raw: body,
        outcome: None,
        batch: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::Job;

    fn record(cause: &str, dead_at: u64) -> DeadLetterRecord {
        jobs_record(
            "h".into(),
            format!("m-{dead_at}"),
            r#"{"id":"j","request":{"method":"GET","path":"/"}}"#.into(),
            0,
            cause.into(),
            format!("d{dead_at}"),
            UnixMillis(dead_at),
        )
    }

    #[test]
    fn causes_match_by_label_part_or_status_class() {
        assert!(cause_matches("http_503", "5xx"));
        assert!(cause_matches("attempts_exhausted:http_503", "5xx"));
        assert!(cause_matches("attempts_exhausted:http_503", "attempts_exhausted"));
        assert!(cause_matches("attempts_exhausted:http_503", "http_503"));
        assert!(cause_matches("worker:retries_exhausted:Unhandled", "worker"));
        assert!(!cause_matches("http_404", "5xx"));
        assert!(!cause_matches("attempts_exhausted:http_429", "5xx"));
        assert!(!cause_matches("attempts_exhausted:timeout", "5xx"));
        assert!(!cause_matches("malformed", "mal"));
        assert!(cause_matches("http_404", "4XX"));
        assert!(cause_matches("attempts_exhausted:http_503", "503"));
        assert!(!cause_matches("http_404", "40"));
    }

    #[test]
    fn filters_combine_cause_id_and_age() {
        let now = UnixMillis(100_000);
        let old = record("http_500", 10_000);
        let new = record("http_404", 95_000);
        let f = DeadLetterFilter { older_than: Some(Duration::from_secs(60)), ..DeadLetterFilter::default() };
        assert!(f.matches(&old, now) && !f.matches(&new, now));
        let f = DeadLetterFilter { newer_than: Some(Duration::from_secs(60)), causes: vec!["4xx".into()], ..DeadLetterFilter::default() };
        assert!(!f.matches(&old, now) && f.matches(&new, now));
        let f = DeadLetterFilter { ids: vec!["m-10000".into()], ..DeadLetterFilter::default() };
        assert!(f.matches(&old, now) && !f.matches(&new, now));
        let f = DeadLetterFilter { ids: vec!["j".into()], ..DeadLetterFilter::default() };
        assert!(f.matches(&old, now) && f.matches(&new, now));
        assert!(DeadLetterFilter::default().is_everything());
    }

    #[test]
    fn dead_letters_carry_their_job_s_lane_and_filter_by_it() {
        let now = UnixMillis(100_000);
        let acme = jobs_record("h".into(), "m-1".into(), r#"{"id":"a","lane":"acme","request":1}"#.into(), 0, "malformed".into(), String::new(), now);
        let plain = record("http_404", 95_000);
        assert_eq!((acme.lane.as_str(), plain.lane.as_str()), ("acme", "default"), "a malformed job keeps its lane too");
        let only = |lane: &str| DeadLetterFilter { lane: Some(lane.parse().unwrap()), ..DeadLetterFilter::default() };
        assert!(only("acme").matches(&acme, now) && !only("acme").matches(&plain, now));
        assert!(only("default").matches(&plain, now) && !only("acme").is_everything());
    }

    #[test]
    fn summary_groups_by_queue_and_cause_with_first_and_last_seen() {
        let mut summary = CauseSummary::default();
        for r in [record("http_404", 3), record("http_500", 1), record("http_404", 1), record("http_404", 2)] {
            summary.add(&r);
        }
        assert_eq!(summary.total(), 4);
        let groups = summary.groups();
        assert_eq!(groups.len(), 2);
        assert_eq!((groups[0].cause.as_str(), groups[0].count, groups[0].first_seen, groups[0].last_seen), ("http_404", 3, UnixMillis(1), UnixMillis(3)));
        assert_eq!(groups[0].example, "d3");
        assert_eq!((groups[1].cause.as_str(), groups[1].count), ("http_500", 1));
    }

    /// A job dead-lettered "gave up after 5 attempts" showed 4 in the DLQ's attempts
    /// column (its 0-based attempt).
    #[test]
    fn the_dlq_shows_the_calls_made_as_the_detail_and_the_outcome_record_count_them() {
        let record = |cause: &str, attempt| jobs_record("h".into(), "m".into(), "{}".into(), attempt, cause.into(), String::new(), UnixMillis(0));
        assert_eq!(record("attempts_exhausted:http_429", 4).calls_made(), 5, "the fifth call was the last");
        assert_eq!(record("http_404", 0).calls_made(), 1);
        assert_eq!(record("never_fits: cost 20", 0).calls_made(), 0, "dead-lettered before its call");
        assert_eq!(record("malformed", 2).calls_made(), 2);
    }

    #[test]
    fn reads_lambda_destination_records_and_keeps_unreadable_ones() {
        let payload = WorkerPayload::Job {
            job: Job::parse(r#"{"id":"job-7","request":{"method":"GET","path":"/x"}}"#).unwrap(),
            attempt: 2,
            circuit_epoch: 0,
            dispatched_at: UnixMillis(0),
            slot: None,
            trip: None,
            report_limits: false,
        };
        let body = format!(
            r#"{{"version":"1.0","timestamp":"2026-11-22T10:00:00.000Z","requestContext":{{"requestId":"r","functionArn":"arn:aws:lambda:us-east-1:1:function:w","condition":"RetriesExhausted","approximateInvokeCount":3}},"requestPayload":{},"responseContext":{{"statusCode":200,"executedVersion":"$LATEST","functionError":"Unhandled"}},"responsePayload":{{"errorType":"Transient","errorMessage":"sqs SendMessage: timed out"}}}}"#,
            payload.to_json()
        );
        let r = worker_records("h".into(), "m".into(), body, UnixMillis(1)).remove(0);
        assert_eq!(r.cause, "worker:retries_exhausted:Unhandled");
        assert_eq!(r.detail, "Transient: sqs SendMessage: timed out");
        assert_eq!((r.job_id.as_deref(), r.attempt), (Some("job-7"), 2));
        assert_eq!(r.dead_at, UnixMillis(1_795_341_600_000));
        assert!(r.job_body.unwrap().contains("job-7"));

        let r = worker_records("h".into(), "m".into(), "garbage".into(), UnixMillis(5)).remove(0);
        assert_eq!((r.cause.as_str(), r.dead_at, r.job_body), ("worker:unreadable", UnixMillis(5), None));
    }

    #[test]
    fn a_failed_batch_in_the_worker_dlq_is_one_record_per_job_and_what_is_left_of_it_keeps_the_rest() {
        let job = |n: u32| WorkerPayload::Job {
            job: Job::parse(&format!(r#"{{"id":"job-{n}","request":{{"method":"GET","path":"/x"}}}}"#)).unwrap(),
            attempt: n,
            circuit_epoch: 0,
            dispatched_at: UnixMillis(0),
            slot: None,
            trip: None,
            report_limits: false,
        };
        let batch = WorkerPayload::batch("run#4".into(), &[job(0), job(1), job(2)]);
        let body = format!(
            r#"{{"version":"1.0","timestamp":"2026-11-22T10:00:00.000Z","requestContext":{{"condition":"RetriesExhausted","approximateInvokeCount":3}},"requestPayload":{},"responseContext":{{"functionError":"Unhandled"}},"responsePayload":{{"errorType":"Transient","errorMessage":"timed out"}}}}"#,
            batch.to_json()
        );
        let records = worker_records("h".into(), "m".into(), body.clone(), UnixMillis(1));
        let shown: Vec<_> = records.iter().map(|r| (r.message_id.as_str(), r.job_id.as_deref(), r.attempt, r.handle.as_str())).collect();
        assert_eq!(shown, [("m/0", Some("job-0"), 0, "h"), ("m/1", Some("job-1"), 1, "h"), ("m/2", Some("job-2"), 2, "h")]);
        assert_eq!(records[1].batch, Some(BatchEntry { batch: "run#4".into(), index: 1, of: 3 }));
        assert!(records.iter().all(|r| r.cause == "worker:retries_exhausted:Unhandled" && r.job_body.is_some()));

        let rest = rest_of_batch(&body, &[1].into_iter().collect()).expect("two jobs stay");
        let left: Vec<_> = worker_records("h2".into(), "m2".into(), rest, UnixMillis(1)).into_iter().map(|r| r.job_id.unwrap()).collect();
        assert_eq!(left, ["job-0", "job-2"]);
        assert_eq!(rest_of_batch(&body, &[0, 1, 2].into_iter().collect()), None);
    }
}
