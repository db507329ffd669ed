//! The JSON API under `/v1`: the operator commands' own functions behind HTTP (enqueue,
//! status, lanes, results, dead letters, redrive, the circuit), each bad request a 4xx
//! JSON error naming its problem, and the OpenAPI document generated from these
//! handlers' annotations.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use indicatif::ProgressBar;
use paceline_shared::adapters::embedded::OutcomeQuery;
use paceline_shared::dlq::{DeadLetterRecord, DlqSource};
use paceline_shared::lane::LaneId;
use paceline_shared::outcome::{OutcomeRecord, StatusFilter};
use paceline_shared::ports::PortError;
use paceline_shared::time::system_now;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, OpenApi, ToSchema};

use super::Served;
use crate::commands::circuit::{change_circuit, Change, CircuitAction, CircuitChanged, OpenChange};
use crate::commands::dlq::{collect, remove, summarize, RemovalKind, RemovalTarget, Selection};
use crate::commands::enqueue::{parse_lines, send_jobs};
use crate::commands::lanes::lane_views;
use crate::commands::results::parse_since;
use crate::commands::status::read_status;

/// How long dead letters being read stay hidden from other readers (SQS), as `dlq`'s
/// `--hold` defaults.
const DLQ_HOLD: Duration = Duration::from_secs(120);
/// The most records one `results` or `dlq` answer holds.
const MOST_PER_ANSWER: usize = 1_000;

/// A request `serve` refuses or could not carry out, as JSON: `{"error": "..."}` and, for
/// a partial enqueue, what went in.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    /// Further fields of the answer.
    detail: Option<serde_json::Value>,
}

/// An error's answer.
#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    /// What was wrong, in words.
    error: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), detail: None }
    }

    /// A request that is wrong as sent.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, message)
    }

    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, message)
    }

    /// An operation that failed: the store's fault is a 503 (try again), anything else
    /// the request's (a lane the stack does not have, a circuit that moved on).
    fn of_operation(error: &anyhow::Error) -> Self {
        let store_failed = error.chain().any(|cause| cause.downcast_ref::<PortError>().is_some());
        let status = if store_failed { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::UNPROCESSABLE_ENTITY };
        Self::new(status, format!("{error:#}"))
    }

    fn with_detail(mut self, detail: serde_json::Value) -> Self {
        self.detail = Some(detail);
        self
    }
}

impl From<anyhow::Error> for ApiError {
    fn from(error: anyhow::Error) -> Self {
        Self::of_operation(&error)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = serde_json::json!({ "error": self.message });
        if let (Some(serde_json::Value::Object(detail)), Some(fields)) = (self.detail, body.as_object_mut()) {
            fields.extend(detail);
        }
        let mut response = (self.status, Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
        }
        response
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// A query string, or a 400 naming what in it is wrong.
fn query<T>(query: Result<Query<T>, QueryRejection>) -> ApiResult<T> {
    query.map(|Query(query)| query).map_err(|rejection| ApiError::bad_request(rejection.body_text()))
}

/// A request body, or the 4xx that says why not (413 over `[serve] max_request`).
fn body(body: Result<Bytes, BytesRejection>) -> ApiResult<Bytes> {
    body.map_err(|rejection| ApiError::new(rejection.status(), rejection.body_text()))
}

/// A JSON request body (an empty one is `{}`), or a 400 naming what in it is wrong.
fn json_body<T: serde::de::DeserializeOwned>(bytes: &Bytes) -> ApiResult<T> {
    let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) { b"{}" } else { bytes };
    serde_json::from_slice(text).map_err(|e| ApiError::bad_request(format!("request body: {e}")))
}

fn lane(text: Option<&str>) -> ApiResult<Option<LaneId>> {
    text.map(|text| text.parse::<LaneId>().map_err(|e| ApiError::bad_request(format!("lane: {e}")))).transpose()
}

fn duration(name: &str, text: Option<&str>) -> ApiResult<Option<Duration>> {
    text.map(|text| humantime::parse_duration(text).map_err(|e| ApiError::bad_request(format!("{name}: {e} (e.g. 90s, 10m, 2h)")))).transpose()
}

/// The `lane` query parameter.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct LaneParam {
    /// One lane (with `[lanes]`; `default` without).
    lane: Option<String>,
}

/// What `POST /v1/jobs` did: every good line went in, in order; the rejected ones did not.
#[derive(Serialize, ToSchema)]
pub struct Enqueued {
    enqueued: usize,
    /// The ids of the jobs enqueued (generated ones too), in the order of their lines.
    job_ids: Vec<String>,
    /// `line N: problem` for each line not enqueued.
    rejected: Vec<String>,
}

/// Enqueue jobs: one JSON job (`Content-Type: application/json`), or many as JSON
/// lines (`application/x-ndjson`, one job per line). Each is checked as `paceline
/// enqueue` checks it; good lines go in even when others are rejected, and the answer
/// says which.
#[utoipa::path(post, path = "/v1/jobs", tag = "jobs", params(LaneParam),
    request_body(content = String, description = "A job as JSON, or jobs as JSON lines", content_type = "application/x-ndjson"),
    responses(
        (status = 202, description = "Every line enqueued", body = Enqueued),
        (status = 207, description = "Some lines enqueued, some rejected (see `rejected`)", body = Enqueued),
        (status = 400, description = "No line could be enqueued", body = ErrorBody),
        (status = 413, description = "Over `[serve] max_request` bytes or `max_lines` lines", body = ErrorBody),
        (status = 503, description = "The queue failed part-way: `enqueued` and `job_ids` say what went in", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub async fn post_jobs(
    State(served): State<Arc<Served>>,
    headers: HeaderMap,
    params: Result<Query<LaneParam>, QueryRejection>,
    sent: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let into_lane = lane(query(params)?.lane.as_deref())?.unwrap_or_default();
    let sent = body(sent)?;
    let text = std::str::from_utf8(&sent).map_err(|e| ApiError::bad_request(format!("request body is not UTF-8: {e}")))?;
    let one_json_object = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("application/json"));
    let lines: Vec<std::io::Result<String>> = if one_json_object {
        // A job as JSON may span lines; it is one line to the parser.
        vec![Ok(text.replace(['\n', '\r'], " "))]
    } else {
        text.lines().map(|line| Ok(line.to_owned())).collect()
    };
    let limit = served.limits.max_lines;
    if lines.len() > limit {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("{} lines, over [serve] max_lines ({limit}): send them in several requests", lines.len()),
        ));
    }
    // Reading a thousand jobs is milliseconds of CPU: off the runtime's threads, so the
    // lanes' timers in this process are not held behind it.
    let reading = served.clone();
    let (jobs, rejected) = tokio::task::spawn_blocking(move || parse_lines(lines.into_iter(), reading.stack.config.as_ref(), &into_lane))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("reading the jobs failed: {e}")))?;
    if jobs.is_empty() {
        let message = if rejected.is_empty() { "no job in the request body".to_owned() } else { format!("no line was enqueued: {}", rejected.join("; ")) };
        return Err(ApiError::bad_request(message).with_detail(serde_json::json!({ "enqueued": 0, "job_ids": [], "rejected": rejected })));
    }
    let mut went = 0;
    let job_ids: Vec<String> = jobs.iter().map(|job| job.id.to_string()).collect();
    if let Err(failed) = send_jobs(served.stack.queues.as_ref(), &jobs, |sent| went += sent).await {
        let detail = serde_json::json!({ "enqueued": went, "job_ids": job_ids[..went], "rejected": rejected });
        return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("{failed:#}")).with_detail(detail));
    }
    let status = if rejected.is_empty() { StatusCode::ACCEPTED } else { StatusCode::MULTI_STATUS };
    Ok((status, Json(Enqueued { enqueued: jobs.len(), job_ids, rejected })).into_response())
}

/// The stack's state as `paceline status --json` shows it: tiers used against their
/// limits, the queue and DLQ depths, the circuit, the lease, the rate, and with
/// `[lanes]` every lane; or one lane's with `lane`.
#[utoipa::path(get, path = "/v1/status", tag = "status", params(LaneParam),
    responses((status = 200, description = "The state", body = Object), (status = 400, body = ErrorBody), (status = 422, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn get_status(State(served): State<Arc<Served>>, params: Result<Query<LaneParam>, QueryRejection>) -> ApiResult<Response> {
    let lane = lane(query(params)?.lane.as_deref())?;
    let status = read_status(&served.stack, lane.as_ref(), system_now()).await?;
    Ok(Json(status).into_response())
}

/// Every lane with its settings, backlog and circuit, as `paceline lanes list --json`.
#[utoipa::path(get, path = "/v1/lanes", tag = "status",
    responses((status = 200, description = "The lanes", body = Object), (status = 422, description = "A stack without `[lanes]`", body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn get_lanes(State(served): State<Arc<Served>>) -> ApiResult<Response> {
    Ok(Json(lane_views(&served.stack).await?).into_response())
}

/// The filters of `GET /v1/results`, as `paceline results` takes them.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct ResultsParams {
    /// Only this job's records.
    job: Option<String>,
    /// Only the records of this lane's jobs.
    lane: Option<String>,
    /// Only records kept since: RFC 3339, or a duration ago (`10m`).
    since: Option<String>,
    /// `2xx`, `4xx`, `5xx`, or `dead`.
    status: Option<String>,
    /// Only records after this row (the `next_after` of the previous answer).
    after: Option<i64>,
    /// At most this many (default 100, at most 1,000).
    limit: Option<usize>,
}

/// A page of outcome records.
#[derive(Serialize, ToSchema)]
pub struct ResultsPage {
    #[schema(value_type = Vec<Object>)]
    records: Vec<OutcomeRecord>,
    /// Pass as `after` for the records that follow.
    next_after: i64,
}

/// The outcome records of the stack's jobs (the embedded store keeps them; on AWS they
/// go to the results destination), oldest first.
#[utoipa::path(get, path = "/v1/results", tag = "results", params(ResultsParams),
    responses((status = 200, body = ResultsPage), (status = 400, body = ErrorBody), (status = 404, description = "An AWS stack: records go to its results destination", body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn get_results(State(served): State<Arc<Served>>, params: Result<Query<ResultsParams>, QueryRejection>) -> ApiResult<Response> {
    let params = query(params)?;
    let Some(store) = &served.stack.embedded else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "on AWS, outcome records go to the worker's results destination (the stack's ResultsQueueUrl): read them there",
        ));
    };
    let since = params.since.as_deref().map(parse_since).transpose().map_err(|e| ApiError::bad_request(format!("since: {e}")))?;
    let status = params.status.as_deref().map(str::parse::<StatusFilter>).transpose().map_err(|e| ApiError::bad_request(format!("status: {e}")))?;
    let limit = params.limit.unwrap_or(100).clamp(1, MOST_PER_ANSWER);
    let query = OutcomeQuery { job_id: params.job, lane: lane(params.lane.as_deref())?, since, status, after_row: params.after.unwrap_or(0), limit };
    let kept = store.outcomes(&query).map_err(|e| ApiError::of_operation(&e.into()))?;
    let next_after = kept.last().map_or(query.after_row, |kept| kept.row);
    Ok(Json(ResultsPage { records: kept.into_iter().map(|kept| kept.record).collect(), next_after }).into_response())
}

/// Which dead letters: the filters of `paceline dlq`.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct DlqParams {
    /// `jobs` or `worker`.
    dlq: Option<String>,
    /// Causes (`http_404`, `5xx`, `attempts_exhausted`...), comma-separated.
    cause: Option<String>,
    /// Job ids or dead-letter ids, comma-separated.
    id: Option<String>,
    lane: Option<String>,
    /// Dead-lettered at least this long ago (`1h`).
    older_than: Option<String>,
    /// Dead-lettered at most this long ago.
    newer_than: Option<String>,
    /// At most this many records (default 100, at most 1,000).
    limit: Option<usize>,
}

fn listed(text: Option<&str>) -> Vec<String> {
    text.map(|text| text.split(',').map(str::trim).filter(|item| !item.is_empty()).map(str::to_owned).collect()).unwrap_or_default()
}

impl DlqParams {
    fn selection(&self) -> ApiResult<Selection> {
        Ok(Selection {
            dlq: self.dlq.as_deref().map(str::parse::<DlqSource>).transpose().map_err(|e| ApiError::bad_request(format!("dlq: {e}")))?,
            cause: listed(self.cause.as_deref()),
            id: listed(self.id.as_deref()),
            older_than: duration("older_than", self.older_than.as_deref())?,
            newer_than: duration("newer_than", self.newer_than.as_deref())?,
            lane: lane(self.lane.as_deref())?,
        })
    }
}

/// The dead letters selected, and all of them counted by DLQ and cause.
#[derive(Serialize, ToSchema)]
pub struct DlqView {
    /// By DLQ and cause, the largest group first.
    #[schema(value_type = Vec<Object>)]
    summary: Vec<paceline_shared::dlq::CauseGroup>,
    total: u64,
    /// The selected dead letters, oldest first in each DLQ, each with its job and why.
    #[schema(value_type = Vec<Object>)]
    records: Vec<DeadLetterRecord>,
}

/// The dead letters: a summary by cause, and the ones selected in full.
#[utoipa::path(get, path = "/v1/dlq", tag = "dead letters", params(DlqParams),
    responses((status = 200, body = DlqView), (status = 400, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn get_dlq(State(served): State<Arc<Served>>, params: Result<Query<DlqParams>, QueryRejection>) -> ApiResult<Response> {
    let params = query(params)?;
    let select = params.selection()?;
    let queues = served.stack.queues.as_ref();
    let summary = summarize(queues, &Selection { dlq: select.dlq, ..Selection::default() }, DLQ_HOLD).await?;
    let records = collect(queues, &select, DLQ_HOLD, params.limit.unwrap_or(100).clamp(1, MOST_PER_ANSWER)).await?;
    Ok(Json(DlqView { total: summary.total(), summary: summary.groups(), records }).into_response())
}

/// Which dead letters to redrive, and how.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RedriveRequest {
    /// `jobs` or `worker`.
    dlq: Option<String>,
    #[serde(default)]
    cause: Vec<String>,
    #[serde(default)]
    id: Vec<String>,
    lane: Option<String>,
    older_than: Option<String>,
    newer_than: Option<String>,
    /// Every dead letter (refused without a filter or this).
    #[serde(default)]
    all: bool,
    /// Say what would move, and move nothing.
    #[serde(default)]
    dry_run: bool,
    /// Keep each job's attempt count (by default it starts again from 0).
    #[serde(default)]
    keep_attempts: bool,
}

/// Puts dead letters back on the jobs queue, where they are paced like any job (as
/// `paceline dlq redrive`).
#[utoipa::path(post, path = "/v1/dlq/redrive", tag = "dead letters", request_body = RedriveRequest,
    responses((status = 200, description = "What moved (or would, on a dry run)", body = Object), (status = 400, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn post_redrive(State(served): State<Arc<Served>>, sent: Result<Bytes, BytesRejection>) -> ApiResult<Response> {
    let request: RedriveRequest = json_body(&body(sent)?)?;
    let params = DlqParams {
        dlq: request.dlq,
        cause: Some(request.cause.join(",")),
        id: Some(request.id.join(",")),
        lane: request.lane,
        older_than: request.older_than,
        newer_than: request.newer_than,
        limit: None,
    };
    let target = RemovalTarget { select: params.selection()?, all: request.all };
    if target.select.filter().is_everything() && !target.all {
        return Err(ApiError::bad_request(
            "say which dead letters: cause, id, lane, older_than, newer_than, or \"all\": true (add \"dry_run\": true to see first)",
        ));
    }
    let kind = RemovalKind::Redrive { keep_attempts: request.keep_attempts };
    let removal = remove(&served.stack, &target, DLQ_HOLD, kind, request.dry_run, &ProgressBar::hidden()).await?;
    Ok(Json(removal).into_response())
}

/// An operator's change to a circuit.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CircuitRequest {
    /// The lane whose circuit (with `[lanes]`; the stack's without).
    lane: Option<String>,
    /// Why (shown by `status` as `operator: REASON`).
    reason: Option<String>,
    /// Change it only if it is still at this epoch.
    epoch: Option<u64>,
    /// `open` only: keep it open, with no health checks, until it is closed.
    #[serde(default)]
    hold: bool,
}

/// The circuit after a change.
#[derive(Serialize, ToSchema)]
pub struct CircuitAnswer {
    #[schema(value_type = Object)]
    circuit: CircuitChanged,
    /// What happened, in words.
    said: String,
}

async fn circuit_change(served: &Served, sent: Result<Bytes, BytesRejection>, open: bool) -> ApiResult<Response> {
    let request: CircuitRequest = json_body(&body(sent)?)?;
    let change = Change { reason: request.reason, epoch: request.epoch };
    let action = match (open, request.hold) {
        (true, hold) => CircuitAction::Open(OpenChange { change, hold }),
        (false, false) => CircuitAction::Close(change),
        (false, true) => return Err(ApiError::bad_request("hold: only an open circuit is held")),
    };
    let (circuit, said, _) = change_circuit(&served.stack, lane(request.lane.as_deref())?.as_ref(), &action).await?;
    Ok(Json(CircuitAnswer { circuit, said }).into_response())
}

/// Opens a circuit: no job goes until a health check half-opens it (or, with `hold`,
/// until it is closed).
#[utoipa::path(post, path = "/v1/circuit/open", tag = "circuit", request_body = CircuitRequest,
    responses((status = 200, body = CircuitAnswer), (status = 400, body = ErrorBody), (status = 422, description = "The circuit moved past `epoch`", body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn post_circuit_open(State(served): State<Arc<Served>>, sent: Result<Bytes, BytesRejection>) -> ApiResult<Response> {
    circuit_change(&served, sent, true).await
}

/// Closes a circuit: jobs flow at the full pace at once; a hold, a cool-down and the
/// provider's rate reading are cleared.
#[utoipa::path(post, path = "/v1/circuit/close", tag = "circuit", request_body = CircuitRequest,
    responses((status = 200, body = CircuitAnswer), (status = 400, body = ErrorBody), (status = 422, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn post_circuit_close(State(served): State<Arc<Served>>, sent: Result<Bytes, BytesRejection>) -> ApiResult<Response> {
    circuit_change(&served, sent, false).await
}

/// Live events as server-sent events: `call`, `dead_letter`, `circuit` and `queue`, each
/// a JSON object. At most `[serve] max_streams` streams are open at once.
#[utoipa::path(get, path = "/v1/events", tag = "status",
    responses((status = 200, description = "text/event-stream", content_type = "text/event-stream", body = String), (status = 429, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn get_events(State(served): State<Arc<Served>>) -> ApiResult<Response> {
    let Ok(permit) = served.streams.clone().try_acquire_owned() else {
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!("{} event streams are open, [serve] max_streams: close one", served.limits.max_streams),
        ));
    };
    let receiver = served.events.subscribe();
    let stopping = served.stopping.clone();
    let stream = futures_util::stream::unfold((receiver, stopping, permit), |(mut receiver, mut stopping, permit)| async move {
        let event = tokio::select! {
            received = receiver.recv() => received,
            _ = stopping.wait_for(|stop| *stop) => return None,
        };
        let sent = match event {
            Ok(event) => Event::default().event(event.name).data(&event.json),
            Err(tokio::sync::broadcast::error::RecvError::Lagged(missed)) => Event::default().event("lagged").data(missed.to_string()),
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
        };
        Some((Ok::<Event, Infallible>(sent), (receiver, stopping, permit)))
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()).into_response())
}

/// Adds the bearer scheme every `/v1` path names.
struct BearerScheme;

impl utoipa::Modify for BearerScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme("bearer", SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()));
    }
}

/// The API's OpenAPI document, from the handlers above.
#[derive(OpenApi)]
#[openapi(
    info(title = "Paceline", description = "Enqueue jobs, inspect a stack of lanes, and act on its dead letters and circuits. Every path needs `Authorization: Bearer <token>`; a read-only token may only GET."),
    paths(post_jobs, get_status, get_lanes, get_results, get_dlq, post_redrive, post_circuit_open, post_circuit_close, get_events),
    components(schemas(ErrorBody, Enqueued, ResultsPage, DlqView, RedriveRequest, CircuitRequest, CircuitAnswer)),
    modifiers(&BearerScheme)
)]
pub struct ApiDoc;

/// `GET /v1/openapi.json`.
pub async fn get_openapi() -> Response {
    Json(ApiDoc::openapi()).into_response()
}

/// Any other path under `/v1`.
pub async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such path: /v1/openapi.json lists them")
}
