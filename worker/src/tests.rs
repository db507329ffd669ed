//! Worker tests against a scripted HTTP server on loopback and an in-memory store.
#![expect(clippy::disallowed_methods, reason = "paused-time tests move tokio's clock, the source of the TokioClock under test")]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode};
use paceline_shared::adapters::embedded::EmbeddedStore;
use paceline_shared::breaker::{CircuitStatus, TripRule};
use paceline_shared::config::ApiConfig;
use paceline_shared::outcome::{Ending, OutcomeRecord, OutcomeSettings};
use paceline_shared::ports::{call_record_key, CallClaim};
use paceline_shared::time::TokioClock;

use crate::testing::InstantApi;

use super::*;

/// Answers `/v1/status/CODE` with CODE and a JSON body naming the path (429s carry
/// `Retry-After: 3`; every answer says `X-RateLimit-Remaining: 7` of
/// `X-RateLimit-Limit: 10`) and records the Authorization header of each call.
async fn scripted_api() -> (String, Arc<Mutex<Vec<String>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let app = axum::Router::new().fallback(move |request: Request| {
        let record = record.clone();
        async move {
            let auth = request.headers().get("authorization").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
            let key = request.headers().get("idempotency-key").and_then(|v| v.to_str().ok()).map_or(String::new(), |k| format!(" key={k}"));
            record.lock().unwrap().push(format!("{} {}{key}", request.uri().path(), auth));
            let code: u16 = request.uri().path().rsplit('/').next().and_then(|c| c.parse().ok()).unwrap_or(200);
            let mut headers = HeaderMap::new();
            headers.insert("x-ratelimit-limit", "10".parse().unwrap());
            headers.insert("x-ratelimit-remaining", "7".parse().unwrap());
            if code == 429 {
                headers.insert("retry-after", "3".parse().unwrap());
                // An epoch reset in 2286, as a hostile provider sent it.
                headers.insert("x-ratelimit-reset", "9999999999".parse().unwrap());
            }
            headers.insert("content-type", "application/json".parse().unwrap());
            headers.insert("location", "/v1/items/9".parse().unwrap());
            (StatusCode::from_u16(code).unwrap(), headers, format!(r#"{{"path":"{}"}}"#, request.uri().path()))
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}/v1"), seen)
}

/// A worker whose API answers at once (see [`InstantApi`]), with its store and that API.
fn worker_on_instant_api() -> (Worker, Arc<EmbeddedStore>, Arc<InstantApi>) {
    let (mut worker, store) = new_worker("http://127.0.0.1:9/v1");
    let api = Arc::new(InstantApi::new(worker.clock.clone()));
    worker.api = api.clone();
    (worker, store, api)
}

fn new_worker(base: &str) -> (Worker, Arc<EmbeddedStore>) {
    let clock = Arc::new(TokioClock::new());
    let store = Arc::new(EmbeddedStore::in_memory(clock.clone()).unwrap());
    let health_check = Job::parse(r#"{"request":{"method":"GET","path":"/status/200"}}"#).unwrap().request;
    let api = ApiClient::new(&ApiConfig {
        base_url: base.parse().unwrap(),
        timeout: Duration::from_secs(2),
        headers: vec![("Authorization".into(), "Bearer s3cret".to_owned().into())],
        health_check: health_check.clone(),
        max_body: 1 << 20,
        idempotency_header: Some("idempotency-key".into()),
    })
    .unwrap()
    .keeping_bodies(OutcomeSettings::default().max_body);
    let worker = Worker {
        api: Arc::new(api),
        queue: store.clone(),
        store: store.clone(),
        stack_cool_down: None,
        clock,
        // Back-offs of at most 20 ms for the first retry, so tests see re-queued jobs soon.
        retry: RetryConfig { max_attempts: 3, backoff_base: Duration::from_millis(10), ..RetryConfig::default() },
        health_check,
        stats: Arc::default(),
        call_slots: None,
        claim_for: Duration::from_secs(7),
        call_records: CallRecords::Always,
        outcomes: OutcomeSettings::default(),
        outcome_sink: Some(store.clone()),
        batch_results: None,
        settle_retry_for: SETTLE_RETRY_FOR,
        missed_slots: None,
        opened_circuit: AtomicU64::new(0),
    };
    (worker, store)
}

fn job_to(status: u16) -> WorkerPayload {
    let job = Job::parse(&format!(r#"{{"id":"job-{status}","request":{{"method":"POST","path":"/status/{status}","body":{{"a":1}}}}}}"#)).unwrap();
    WorkerPayload::Job { job, attempt: 0, circuit_epoch: 0, dispatched_at: UnixMillis(0), slot: None, trip: None, report_limits: false }
}

/// The jobs re-queued, once their back-off (at most 40 ms here) is over.
async fn requeued(store: &EmbeddedStore) -> Vec<(String, u32)> {
    tokio::time::sleep(Duration::from_millis(50)).await;
    store
        .receive(10, Duration::ZERO, Duration::from_secs(30))
        .await
        .unwrap()
        .into_iter()
        .map(|m| (Job::parse(&m.body).unwrap().id.to_string(), m.attempt))
        .collect()
}

#[tokio::test]
async fn success_is_counted_and_the_auth_header_reaches_only_the_api() {
    let (base, seen) = scripted_api().await;
    let (worker, store) = new_worker(&base);
    worker.handle(job_to(201)).await.unwrap();
    assert_eq!(WorkerStats::get(&worker.stats.succeeded), 1);
    // The job id goes in `api.idempotency_header` (`Idempotency-Key` here).
    assert_eq!(seen.lock().unwrap().as_slice(), ["/v1/status/201 Bearer s3cret key=job-201"]);
    assert!(requeued(&store).await.is_empty());
}

fn kept_outcomes(store: &EmbeddedStore) -> Vec<OutcomeRecord> {
    let all = paceline_shared::adapters::embedded::OutcomeQuery { limit: 100, ..Default::default() };
    store.outcomes(&all).unwrap().into_iter().map(|kept| kept.record).collect()
}

#[tokio::test]
async fn a_success_returns_its_outcome_record_with_the_answer_and_the_store_keeps_it() {
    let (base, _) = scripted_api().await;
    let (worker, store) = new_worker(&base);
    let job =
        Job::parse(r#"{"id":"created","request":{"method":"POST","path":"/status/201"},"metadata":{"order":7},"enqueued_at":"2026-11-23T20:00:00Z"}"#).unwrap();
    let payload = WorkerPayload::Job { job, attempt: 1, circuit_epoch: 0, dispatched_at: worker.clock.now(), slot: None, trip: None, report_limits: false };
    let record = worker.handle(payload).await.unwrap().expect("an outcome record");
    assert_eq!((record.job_id.as_str(), record.outcome, record.status, record.attempts), ("created", Ending::Succeeded, Some(201), 2));
    assert_eq!(record.body, Some(serde_json::json!({"path": "/v1/status/201"})));
    assert_eq!(record.headers.get("location").map(String::as_str), Some("/v1/items/9"));
    assert!(!record.headers.contains_key("x-ratelimit-limit"), "only the chosen headers");
    assert_eq!(record.metadata, Some(serde_json::json!({"order": 7})));
    let times = &record.times;
    assert_eq!(times.enqueued, Some(UnixMillis::parse_rfc3339("2026-11-23T20:00:00Z").unwrap()));
    assert!(times.dispatched <= times.slotted && times.slotted <= times.called && times.called <= times.answered && times.answered.is_some(), "{times:?}");
    assert_eq!(kept_outcomes(&store), vec![record]);
}

#[tokio::test]
async fn a_rejected_job_s_dead_letter_carries_its_outcome_record_and_fire_and_forget_jobs_record_nothing() {
    let (base, _) = scripted_api().await;
    let (worker, store) = new_worker(&base);
    let record = worker.handle(job_to(404)).await.unwrap().expect("an outcome record");
    assert_eq!((record.outcome, record.status, record.reason.as_deref()), (Ending::DeadLettered, Some(404), Some("http_404: the API answered HTTP 404")));
    let dead = store.dead_letters().unwrap();
    assert_eq!(dead[0].reason.outcome.as_deref(), Some(&record));

    let quiet = Job::parse(r#"{"id":"quiet","request":{"method":"GET","path":"/status/200"},"fire_and_forget":true}"#).unwrap();
    let payload = WorkerPayload::Job { job: quiet, attempt: 0, circuit_epoch: 0, dispatched_at: UnixMillis(0), slot: None, trip: None, report_limits: false };
    assert_eq!(worker.handle(payload).await.unwrap(), None);
    assert_eq!(kept_outcomes(&store), vec![record]);
}

#[tokio::test]
async fn a_retried_attempt_records_nothing_unless_every_attempt_is_asked_for() {
    let (base, _) = scripted_api().await;
    let (worker, store) = new_worker(&base);
    assert_eq!(worker.handle(job_to(503)).await.unwrap(), None);
    let every = OutcomeSettings { record: paceline_shared::outcome::RecordOutcomes::EveryAttempt, ..OutcomeSettings::default() };
    let worker = worker.with_outcomes(every, Some(store.clone()));
    let WorkerPayload::Job { job, .. } = job_to(503) else { unreachable!() };
    let second = WorkerPayload::Job { job, attempt: 1, circuit_epoch: 0, dispatched_at: UnixMillis(0), slot: None, trip: None, report_limits: false };
    let record = worker.handle(second).await.unwrap().expect("an attempt's record");
    assert_eq!((record.outcome, record.status, record.reason.as_deref()), (Ending::Retrying, Some(503), Some("retrying after HTTP 503")));
    assert_eq!(kept_outcomes(&store), vec![record]);
}

#[tokio::test]
async fn rate_limit_sets_the_cool_down_and_requeues_without_opening_the_circuit() {
    let (base, _) = scripted_api().await;
    let (worker, store) = new_worker(&base);
    let before = worker.clock.now();
    worker.handle(job_to(429)).await.unwrap();
    let cool_down = store.cool_down().await.unwrap();
    assert!(cool_down >= before.plus(Duration::from_secs(3)), "cool-down {cool_down} not 3 s after {before}");
    assert_eq!(requeued(&store).await, vec![("job-429".to_string(), 1)]);
    assert!(store.circuit().await.unwrap().is_closed());
}

/// `[lanes] on_429 = "stack"`: a lane's 429 cools the whole stack too.
#[tokio::test]
async fn a_429_cools_the_stack_too_where_the_stack_s_shared_quota_is_the_one_refusing() {
    let (base, _) = scripted_api().await;
    let (worker, store) = new_worker(&base);
    let stack = Arc::new(store.scoped(&paceline_shared::keys::StoreScope::Stack));
    let worker = worker.with_stack_cool_down(stack.clone());
    let before = worker.clock.now();
    worker.handle(job_to(429)).await.unwrap();
    assert!(stack.cool_down().await.unwrap() >= before.plus(Duration::from_secs(3)), "the stack's cool-down");
    assert_eq!(stack.cool_down().await.unwrap(), store.cool_down().await.unwrap(), "the lane's the same");
}

/// The next delivery of the one job on the queue, as the orchestrator hands it off.
async fn next_delivery(store: &EmbeddedStore) -> (Job, u32) {
    let got = store.receive(1, Duration::from_secs(1), Duration::from_secs(30)).await.unwrap();
    store.delete(&[got[0].receipt.clone()]).await.unwrap();
    (Job::parse(&got[0].body).unwrap(), got[0].attempt)
}

fn delivery(job: Job, attempt: u32) -> WorkerPayload {
    WorkerPayload::Job { job, attempt, circuit_epoch: 0, dispatched_at: UnixMillis(0), slot: None, trip: None, report_limits: false }
}

/// With the configured quota above the API's, jobs were dead-lettered as
/// `attempts_exhausted:http_429` after `max_attempts` answers of 429: "not now" was
/// counted as "failed".
#[tokio::test]
async fn answers_of_429_do_not_count_toward_max_attempts_only_toward_their_own_bound() {
    let (base, _) = scripted_api().await;
    let (worker, store) = new_worker(&base);
    let worker = Worker { retry: RetryConfig { backoff_max: Duration::from_millis(20), ..worker.retry }, ..worker };
    let mut payload = job_to(429);
    for _ in 0..2 * worker.retry.max_attempts {
        worker.handle(payload).await.unwrap();
        let (job, attempt) = next_delivery(&store).await;
        payload = delivery(job, attempt);
    }
    assert!(store.dead_letters().unwrap().is_empty(), "answers of 429 exhausted the attempts");
    let WorkerPayload::Job { mut job, mut attempt, .. } = payload else { unreachable!() };
    assert_eq!((job.rate_limited, attempt), (6, 6), "each 429 is counted apart, and each call is an attempt of its own");

    job.request.path = "/status/500".into();
    for _ in 1..worker.retry.max_attempts {
        worker.handle(delivery(job, attempt)).await.unwrap();
        (job, attempt) = next_delivery(&store).await;
    }
    worker.handle(delivery(job, attempt)).await.unwrap();
    let dead = store.dead_letters().unwrap();
    assert_eq!(dead.len(), 1, "the third failed call is the last");
    assert_eq!(dead[0].reason.detail, "gave up after 3 failed calls (and 6 answered 429); last: HTTP 500");

    let bounded = Worker { retry: RetryConfig { max_rate_limited: 2, ..worker.retry }, ..worker };
    let other = Job::parse(r#"{"id":"other","request":{"method":"GET","path":"/status/429"}}"#).unwrap();
    bounded.handle(delivery(other, 0)).await.unwrap();
    let (job, attempt) = next_delivery(&store).await;
    bounded.handle(delivery(job, attempt)).await.unwrap();
    let dead = store.dead_letters().unwrap();
    assert_eq!(dead[1].reason.cause.label(), "attempts_exhausted:http_429");
    assert!(dead[1].reason.detail.contains("answered 429 to 2 calls (retry.max_rate_limited)"), "{}", dead[1].reason.detail);
}

#[tokio::test]
async fn failures_under_the_threshold_retry_their_job_alone_after_a_back_off_and_the_threshold_opens_the_circuit() {
    let (base, _) = scripted_api().await;
    let (worker, store) = new_worker(&base);
    let failing = |n: u32| {
        let job = Job::parse(&format!(r#"{{"id":"f{n}","request":{{"method":"GET","path":"/status/500"}}}}"#)).unwrap();
        let trip = Some(TripRule { bucket_ms: 60_000, failures: 3 });
        WorkerPayload::Job { job, attempt: 0, circuit_epoch: 0, dispatched_at: UnixMillis(0), slot: None, trip, report_limits: false }
    };
    worker.handle(failing(1)).await.unwrap();
    worker.handle(failing(2)).await.unwrap();
    assert!(store.circuit().await.unwrap().is_closed(), "two failures are under the threshold of three");
    // Both are back on the queue, each after its back-off: a random delay of up to
    // 20 ms ("full jitter"), which may be over before the second call is answered on a
    // busy machine, so the count is of both, visible yet or not.
    let depth = store.depth().await.unwrap();
    assert_eq!((depth.visible + depth.not_visible, depth.dead), (2, 0), "both jobs re-queued, none dead-lettered");
    let mut again = requeued(&store).await;
    again.sort();
    assert_eq!(again, vec![("f1".to_string(), 1), ("f2".to_string(), 1)]);
    worker.handle(failing(3)).await.unwrap();
    let circuit = store.circuit().await.unwrap();
    assert_eq!((circuit.status, circuit.reason.as_str()), (CircuitStatus::Open, "HTTP 500"));
}

#[tokio::test]
async fn server_errors_and_dead_connections_open_the_circuit_at_once_for_a_payload_without_a_rule() {
    let (base, _) = scripted_api().await;
    let (worker, store) = new_worker(&base);
    worker.handle(job_to(503)).await.unwrap();
    let circuit = store.circuit().await.unwrap();
    assert_eq!((circuit.status, circuit.epoch, circuit.reason.as_str()), (CircuitStatus::Open, 1, "HTTP 503"));
    assert_eq!(requeued(&store).await, vec![("job-503".to_string(), 1)]);

    // Nothing listens on port 9 of loopback: a connection error, also an outage.
    let (dead, store) = new_worker("http://127.0.0.1:9/v1");
    dead.handle(job_to(200)).await.unwrap();
    assert!(store.circuit().await.unwrap().reason.starts_with("connection error"));
    assert_eq!(requeued(&store).await.len(), 1);
}

#[tokio::test]
async fn other_client_errors_and_exhausted_attempts_are_dead_lettered() {
    let (base, _) = scripted_api().await;
    let (worker, store) = new_worker(&base);
    worker.handle(job_to(404)).await.unwrap();
    let WorkerPayload::Job { job, .. } = job_to(500) else { unreachable!() };
    worker
        .handle(WorkerPayload::Job { job, attempt: 2, circuit_epoch: 0, dispatched_at: UnixMillis(0), slot: None, trip: None, report_limits: false })
        .await
        .unwrap();
    let dead = store.dead_letters().unwrap();
    let causes: Vec<String> = dead.iter().map(|d| d.reason.cause.label()).collect();
    assert_eq!(causes, vec!["http_404", "attempts_exhausted:http_500"]);
    assert!(dead[1].reason.detail.contains("3 failed calls") && dead[1].reason.detail.contains("HTTP 500"), "{}", dead[1].reason.detail);
    assert!(requeued(&store).await.is_empty());
}

#[tokio::test]
async fn a_healthy_check_half_opens_the_circuit_but_a_stale_one_cannot() {
    let (base, _) = scripted_api().await;
    let (worker, store) = new_worker(&base);
    worker.handle(job_to(502)).await.unwrap();
    worker.handle(WorkerPayload::HealthCheck { circuit_epoch: 0, sent_at: UnixMillis(0), slot: None, lane: Default::default() }).await.unwrap();
    assert!(!store.circuit().await.unwrap().is_closed(), "a check from epoch 0 must not close epoch 1");
    worker.handle(WorkerPayload::HealthCheck { circuit_epoch: 1, sent_at: UnixMillis(0), slot: None, lane: Default::default() }).await.unwrap();
    let circuit = store.circuit().await.unwrap();
    assert_eq!((circuit.status, circuit.epoch), (CircuitStatus::HalfOpen, 2));
    assert_eq!(WorkerStats::get(&worker.stats.circuit_closed), 1);
}

#[tokio::test(start_paused = true)]
async fn a_slotted_job_calls_at_its_slot_and_a_late_one_is_requeued_without_calling() {
    let (worker, store, api) = worker_on_instant_api();
    let t0 = worker.clock.now();
    // Each payload is another attempt: one attempt calls once at most.
    let slotted = |not_before: UnixMillis, attempt: u32| {
        let WorkerPayload::Job { job, .. } = job_to(200) else { unreachable!() };
        slotted_for(job, attempt, t0, not_before)
    };
    worker.handle(slotted(t0.plus(Duration::from_millis(250)), 1)).await.unwrap();
    assert_eq!(api.calls(), vec![t0.plus(Duration::from_millis(250))], "waits for the slot, then calls");

    tokio::time::advance(Duration::from_millis(100)).await;
    worker.handle(slotted(t0.plus(Duration::from_millis(300)), 2)).await.unwrap();
    assert_eq!(api.calls().len(), 1, "started 50 ms after the slot: no call");
    assert_eq!(WorkerStats::get(&worker.stats.missed_slots), 1);
    assert_eq!(requeued(&store).await, vec![("job-200".to_string(), 2)], "re-queued; the attempt does not count");
    // Its claim on the call was dropped: the re-queued attempt calls when it comes.
    worker.handle(slotted(worker.clock.now(), 2)).await.unwrap();
    assert_eq!(api.calls().len(), 2);
}

/// A job whose workers start late each time it is handed off, though it already carries
/// the most lateness a job learns (the stack's lead at its longest): put back, it missed
/// its slot for ever, spending one each time. It goes to the DLQ, saying what to change.
#[tokio::test(start_paused = true)]
async fn a_job_late_again_at_the_most_lead_a_stack_takes_is_dead_lettered_not_put_back_for_ever() {
    let (worker, store, api) = worker_on_instant_api();
    let t0 = worker.clock.now();
    let late_by = |late_start_ms: u64, attempt: u32| {
        let WorkerPayload::Job { mut job, .. } = job_to(200) else { unreachable!() };
        job.late_start_ms = late_start_ms;
        slotted_for(job, attempt, t0, t0.minus(Duration::from_millis(50)))
    };
    worker.handle(late_by(500, 1)).await.unwrap();
    assert_eq!(requeued(&store).await, vec![("job-200".to_string(), 1)], "under the most: put back, to go earlier");
    worker.handle(late_by(1_000, 1)).await.unwrap();
    assert!(api.calls().is_empty());
    let dead = store.dead_letters().unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason.cause.label(), "attempts_exhausted:late_start");
    assert!(dead[0].reason.detail.contains("raise dispatch_ahead"), "{}", dead[0].reason.detail);
}

#[tokio::test]
async fn a_request_that_cannot_be_built_is_dead_lettered_as_malformed_and_leaves_the_circuit_closed() {
    let (base, seen) = scripted_api().await;
    let (worker, store) = new_worker(&base);
    // As an older producer or a hand-edited message might carry it, past `Job::parse`.
    let WorkerPayload::Job { mut job, .. } = job_to(200) else { unreachable!() };
    job.request.headers.insert("X-Bad".into(), "a\r\nX-Injected: 1".into());
    worker
        .handle(WorkerPayload::Job { job, attempt: 0, circuit_epoch: 0, dispatched_at: UnixMillis(0), slot: None, trip: None, report_limits: false })
        .await
        .unwrap();
    assert!(store.circuit().await.unwrap().is_closed());
    assert!(seen.lock().unwrap().is_empty(), "the API was called");
    let dead = store.dead_letters().unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason.cause, DeadLetterCause::Malformed);
    assert!(requeued(&store).await.is_empty());
}

/// Every follow-up write the worker makes, failing in turn past the time it is retried:
/// the payload's handling fails with the store's error, so Lambda retries the event (and
/// at last sends it to the on-failure destination) instead of the job being dropped.
#[tokio::test]
async fn a_failed_follow_up_write_fails_the_payload_so_it_is_retried() {
    use paceline_shared::testing::faults::{Faulty, Method};
    let (base, _) = scripted_api().await;
    let conflict = PortError::Conflict("circuit epoch moved".into());
    let cases = [
        (job_to(429), Method::ExtendCoolDown, PortError::Throttled("ThrottlingException".into()), 1),
        (job_to(429), Method::Send, PortError::Transient("connection reset".into()), 1),
        (job_to(503), Method::Circuit, PortError::Transient("timed out".into()), 1),
        (job_to(503), Method::SwapCircuit, PortError::Throttled("ThrottlingException".into()), 1),
        (job_to(503), Method::SwapCircuit, conflict, 3),
        (job_to(503), Method::Send, PortError::Transient("connection reset".into()), 1),
        (job_to(404), Method::DeadLetter, PortError::Transient("connection reset".into()), 1),
        (
            WorkerPayload::HealthCheck { circuit_epoch: 0, sent_at: UnixMillis(0), slot: None, lane: Default::default() },
            Method::SwapCircuit,
            PortError::Transient("timed out".into()),
            1,
        ),
    ];
    for (payload, method, error, times) in cases {
        let (mut worker, store) = new_worker(&base);
        if matches!(payload, WorkerPayload::HealthCheck { .. }) {
            let open = store.circuit().await.unwrap().open(0, "HTTP 503", UnixMillis(0)).unwrap();
            store.swap_circuit(0, &open).await.unwrap();
        }
        let faulty = Arc::new(Faulty::new(store.clone()));
        faulty.fail_next(method, times, &error);
        worker.queue = faulty.clone();
        worker.store = faulty.clone();
        worker.settle_retry_for = Duration::ZERO;
        let payload = match payload {
            WorkerPayload::HealthCheck { sent_at, slot, lane, .. } => {
                WorkerPayload::HealthCheck { circuit_epoch: store.circuit().await.unwrap().epoch, sent_at, slot, lane }
            }
            job => job,
        };
        let result = worker.handle(payload).await;
        assert!(result.as_ref().is_err_and(PortError::is_retryable), "{method:?} failing ({error}) gave {result:?}");
        assert_eq!(faulty.calls(method), times as u64, "{method:?}");
    }
}

#[tokio::test]
async fn the_provider_s_rate_limit_headers_are_recorded_when_asked_and_on_a_429() {
    let (base, _) = scripted_api().await;
    let (worker, store) = new_worker(&base);
    worker.handle(job_to(200)).await.unwrap();
    assert_eq!(store.provider_reading().await.unwrap(), None, "not asked: no write");
    let WorkerPayload::Job { job, .. } = job_to(200) else { unreachable!() };
    let asked = WorkerPayload::Job { job, attempt: 1, circuit_epoch: 0, dispatched_at: UnixMillis(0), slot: None, trip: None, report_limits: true };
    let before = worker.clock.now();
    worker.handle(asked).await.unwrap();
    let reading = store.provider_reading().await.unwrap().expect("asked: recorded");
    assert_eq!((reading.limit, reading.remaining, reading.window_ms), (10, 7, None));
    assert!(reading.at >= before, "as of the call");
    tokio::time::sleep(Duration::from_millis(2)).await;
    worker.handle(job_to(429)).await.unwrap();
    let after_429 = store.provider_reading().await.unwrap().unwrap();
    assert!(after_429.at > reading.at, "a 429's headers are recorded unasked");
}

/// A store busy for a moment after the call was made (another process holding SQLite's
/// lock): the write is retried in place, so the payload does not fail and run again,
/// calling the API a second time.
#[tokio::test]
async fn a_follow_up_write_that_fails_for_a_moment_is_retried_without_calling_again() {
    use paceline_shared::testing::faults::{Faulty, Method};
    let (base, seen) = scripted_api().await;
    for (status, method) in [(429, Method::Send), (503, Method::Send), (404, Method::DeadLetter)] {
        seen.lock().unwrap().clear();
        let (mut worker, store) = new_worker(&base);
        let faulty = Arc::new(Faulty::new(store.clone()));
        faulty.fail_next(method, 2, &PortError::Transient("database is locked".into()));
        worker.queue = faulty.clone();
        worker.store = faulty.clone();
        let result = worker.handle(job_to(status)).await;
        assert!(result.is_ok(), "HTTP {status}, {method:?} failing twice: {result:?}");
        assert_eq!(seen.lock().unwrap().len(), 1, "HTTP {status}: one call");
    }
}

#[tokio::test]
async fn a_reading_s_reset_years_ahead_is_recorded_capped_at_max_cool_down() {
    let (base, _) = scripted_api().await;
    let (worker, store) = new_worker(&base);
    worker.handle(job_to(429)).await.unwrap();
    let reading = store.provider_reading().await.unwrap().expect("a 429's headers are recorded");
    assert_eq!(reading.resets_at, reading.at.plus(worker.retry.max_cool_down), "not the year 2286");
}

#[tokio::test]
async fn a_repeated_delivery_of_an_attempt_does_not_call_the_api_again() {
    let (base, seen) = scripted_api().await;
    let (worker, store) = new_worker(&base);
    worker.handle(job_to(200)).await.unwrap();
    // Lambda delivers the same event again: the attempt's call is done.
    worker.handle(job_to(200)).await.unwrap();
    assert_eq!(seen.lock().unwrap().len(), 1, "one call for one attempt");
    assert_eq!(WorkerStats::get(&worker.stats.repeats_skipped), 1);
    // A delivery that finds the attempt's call under way fails, so Lambda retries it later.
    let record = call_record_key("job-404", 0);
    let now = worker.clock.now();
    assert_eq!(store.claim_call(&record, "another delivery", now, now.plus(Duration::from_secs(30))).await.unwrap(), CallClaim::Taken);
    let err = worker.handle(job_to(404)).await.unwrap_err();
    assert!(matches!(&err, PortError::Transient(m) if m.contains("is calling the API")), "{err}");
    assert_eq!(seen.lock().unwrap().len(), 1, "no call while another delivery calls");
    // The next attempt of a job is its own call.
    let WorkerPayload::Job { job, .. } = job_to(200) else { unreachable!() };
    let next = WorkerPayload::Job { job, attempt: 1, circuit_epoch: 0, dispatched_at: UnixMillis(0), slot: None, trip: None, report_limits: false };
    worker.handle(next).await.unwrap();
    assert_eq!(seen.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn an_in_process_worker_claims_calls_only_ahead_of_their_slot() {
    let (base, seen) = scripted_api().await;
    let (mut worker, store) = new_worker(&base);
    worker.call_records = CallRecords::AheadOfSlot;
    // At the slot (no slot in the payload), a claim's write would delay the call: none.
    worker.handle(job_to(200)).await.unwrap();
    let now = worker.clock.now();
    assert_eq!(store.claim_call(&call_record_key("job-200", 0), "probe", now, now).await.unwrap(), CallClaim::Taken, "no record was written");
    // Ahead of its slot, the claim is taken while the worker waits for the slot.
    let WorkerPayload::Job { job, .. } = job_to(204) else { unreachable!() };
    let slot = CallSlot { not_before: now.plus(Duration::from_millis(20)), call_by: now.plus(Duration::from_secs(5)) };
    let ahead = WorkerPayload::Job { job, attempt: 0, circuit_epoch: 0, dispatched_at: now, slot: Some(slot), trip: None, report_limits: false };
    worker.handle(ahead.clone()).await.unwrap();
    worker.handle(ahead).await.unwrap();
    assert_eq!(seen.lock().unwrap().len(), 2, "the repeated delivery ahead of its slot did not call");
}

#[tokio::test(start_paused = true)]
async fn a_call_whose_follow_up_failed_is_not_done_so_the_retried_event_calls_again() {
    let (base, seen) = scripted_api().await;
    let (mut worker, store) = new_worker(&base);
    let queue = Arc::new(paceline_shared::testing::faults::Faulty::new(store.clone()));
    worker.queue = queue.clone();
    worker.settle_retry_for = Duration::ZERO;
    // The 503's job cannot be re-queued (for longer than the worker retries it): the
    // event fails, and Lambda retries it.
    queue.fail_next(paceline_shared::testing::faults::Method::Send, 1, &PortError::Transient("sqs down".into()));
    assert!(worker.handle(job_to(503)).await.is_err());
    // Lambda's retry comes at least a minute later, after the claim expired: it calls
    // again rather than losing the job.
    tokio::time::advance(Duration::from_secs(60)).await;
    worker.handle(job_to(503)).await.unwrap();
    assert_eq!(seen.lock().unwrap().len(), 2, "called again, the job re-queued this time");
    assert_eq!(requeued(&store).await, vec![("job-503".to_string(), 1)]);
}

/// Job `id` (a call answered 200) handed off at `t0` with the slot `ms` after it (5 ms to
/// make it), attempt 0: a batch's call.
fn in_slot(id: &str, t0: UnixMillis, ms: u64) -> WorkerPayload {
    let job = Job::parse(&format!(r#"{{"id":"{id}","request":{{"method":"GET","path":"/status/200"}}}}"#)).unwrap();
    slotted_for(job, 0, t0, t0.plus(Duration::from_millis(ms)))
}

/// `job` as `attempt`, handed off at `dispatched_at` for the slot `not_before` (called
/// by 5 ms after it).
fn slotted_for(job: Job, attempt: u32, dispatched_at: UnixMillis, not_before: UnixMillis) -> WorkerPayload {
    let slot = Some(CallSlot { not_before, call_by: not_before.plus(Duration::from_millis(5)) });
    WorkerPayload::Job { job, attempt, circuit_epoch: 0, dispatched_at, slot, trip: None, report_limits: false }
}

/// Collects the outcome records sent to it, as the results queue would.
#[derive(Default)]
struct Results(Mutex<Vec<OutcomeRecord>>);

#[async_trait::async_trait]
impl paceline_shared::ports::OutcomeSink for Results {
    async fn record_outcome(&self, record: &OutcomeRecord) -> PortResult<()> {
        self.0.lock().unwrap().push(record.clone());
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn a_batch_calls_each_job_at_its_slot_in_one_invocation_and_settles_each_alone() {
    let (worker, store, api) = worker_on_instant_api();
    let t0 = worker.clock.now();
    let at = |ms: u64| t0.plus(Duration::from_millis(ms));
    let slotted = |n: u64| in_slot(&format!("b-{n}"), t0, 100 * n);
    let WorkerPayload::Batch { id, mut calls } = WorkerPayload::batch("run-1#1".into(), &[slotted(3), slotted(1), slotted(2)]) else { unreachable!() };
    calls.insert(1, serde_json::json!({"kind": "job", "job": "{\"id\":\"b-bad\",\"request\":7}", "attempt": 2}));
    let batch = WorkerPayload::Batch { id, calls };
    let results = Arc::new(Results::default());
    let batches = worker.with_batch_results(results.clone());

    assert_eq!(batches.handle(batch.clone()).await.unwrap(), None, "a batch's records go to the results sink");
    assert_eq!(api.calls(), vec![at(100), at(200), at(300)], "each at its own slot, overlapping in one invocation");
    let mut ended: Vec<_> = results.0.lock().unwrap().iter().map(|r| r.job_id.clone()).collect();
    ended.sort();
    assert_eq!(ended, ["b-1", "b-2", "b-3"], "one outcome record per job");
    let dead = store.dead_letters().unwrap();
    assert_eq!(dead.len(), 1, "the unreadable entry alone: {dead:?}");
    assert_eq!((dead[0].message_id.as_str(), dead[0].attempt, &dead[0].reason.cause), ("b-bad", 2, &DeadLetterCause::Malformed));
    assert!(dead[0].reason.detail.starts_with("entry 1 of batch run-1#1 is not a job's payload"), "{}", dead[0].reason.detail);

    // Lambda delivers the event again: no call is made twice.
    batches.handle(batch).await.unwrap();
    assert_eq!(api.calls().len(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_batch_taken_over_after_its_worker_died_calls_no_job_twice_and_loses_none() {
    let (worker, store, api) = worker_on_instant_api();
    let t0 = worker.clock.now();
    let at = |ms: u64| t0.plus(Duration::from_millis(ms));
    let slotted = |ms: u64| in_slot(&format!("at-{ms}"), t0, ms);
    // Fifty-five calls a millisecond apart from 100 ms (their progress saved at the check
    // after they settled), one at 305 ms, and two the worker will not live to claim.
    let mut calls: Vec<WorkerPayload> = (100..155).map(slotted).collect();
    calls.extend([slotted(305), slotted(400), slotted(2_000)]);
    let batch = WorkerPayload::batch("run-1#7".into(), &calls);

    // The worker dies at 320 ms.
    tokio::select! {
        _ = worker.handle(batch.clone()) => panic!("the batch ran to its end"),
        () = tokio::time::sleep_until(tokio::time::Instant::now() + Duration::from_millis(320)) => {}
    }
    assert_eq!(api.calls().len(), 56);
    assert_eq!(api.calls().last(), Some(&at(305)));
    // Lambda retries a while later: once the claim of the dead delivery expired.
    tokio::time::sleep(Duration::from_secs(60)).await;
    worker.handle(batch.clone()).await.unwrap();
    assert_eq!(api.calls().len(), 56, "no call made twice");
    let dead = store.dead_letters().unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!((dead[0].message_id.as_str(), &dead[0].reason.cause), ("at-305", &DeadLetterCause::CallInDoubt), "made since the last save: in doubt");
    let mut back = requeued(&store).await;
    back.sort();
    assert_eq!(back, vec![("at-2000".to_string(), 0), ("at-400".to_string(), 0)], "never claimed, slots passed: back on the queue, no call");
    assert_eq!(WorkerStats::get(&worker.stats.succeeded), 56);

    // A third delivery finds the batch done.
    worker.handle(batch).await.unwrap();
    assert_eq!((api.calls().len(), store.dead_letters().unwrap().len()), (56, 1));
}

#[tokio::test(start_paused = true)]
async fn a_job_handed_off_in_two_batches_is_called_by_the_first_only() {
    let (worker, _store, api) = worker_on_instant_api();
    let t0 = worker.clock.now();
    // Lambda's 202 for the first batch was lost: the orchestrator handed the job off again.
    worker.handle(WorkerPayload::batch("run-1#1".into(), &[in_slot("twice", t0, 100), in_slot("other-1", t0, 150)])).await.unwrap();
    worker.handle(WorkerPayload::batch("run-1#2".into(), &[in_slot("twice", t0, 1_000), in_slot("other-2", t0, 1_050)])).await.unwrap();
    assert_eq!(api.calls().len(), 3, "the job once, each other job once");
    assert_eq!(WorkerStats::get(&worker.stats.repeats_skipped), 1);
}

#[tokio::test(start_paused = true)]
async fn a_claim_the_store_refuses_puts_its_job_back_without_a_call_and_the_batch_goes_on() {
    use paceline_shared::testing::faults::{Faulty, Method};
    let (mut worker, store, api) = worker_on_instant_api();
    let faulty = Arc::new(Faulty::new(store.clone()));
    faulty.fail_next(Method::ClaimCall, 1, &PortError::Transient("DynamoDB throttled".into()));
    worker.store = faulty;
    let t0 = worker.clock.now();
    let slotted = |n: u64| in_slot(&format!("c-{n}"), t0, 100 * n);
    worker.handle(WorkerPayload::batch("run-1#5".into(), &[slotted(1), slotted(2), slotted(3)])).await.unwrap();
    assert_eq!(api.calls().len(), 2, "the other two called");
    assert_eq!(requeued(&store).await, vec![("c-1".to_string(), 0)], "the first, unclaimed, goes again at the same attempt");
}

/// Builds each lane's worker like `worker` (calling `api`, its state in `store`), or
/// fails with what `refuse` says of the lane.
fn lane_builds(
    worker: &Worker,
    api: Arc<InstantApi>,
    store: &Arc<EmbeddedStore>,
    refuse: impl Fn(&paceline_shared::lane::LaneId) -> Option<String> + Send + Sync + 'static,
) -> Box<crate::lanes::BuildLaneWorker> {
    let (store, clock, health_check) = (store.clone(), worker.clock.clone(), worker.health_check.clone());
    Box::new(move |lane: paceline_shared::lane::LaneId| -> crate::lanes::LaneWorkerBuild {
        let built = match refuse(&lane) {
            Some(why) => Err(why),
            None => Ok(Worker::new(api.clone(), store.clone(), store.clone(), clock.clone(), RetryConfig::default(), health_check.clone())),
        };
        Box::pin(std::future::ready(built))
    })
}

#[tokio::test(start_paused = true)]
async fn a_batch_for_many_lanes_goes_to_each_lane_s_worker_and_a_lane_without_its_key_is_dead_lettered() {
    let (worker, store) = new_worker("http://127.0.0.1:9/v1");
    let clock = worker.clock.clone();
    let api = Arc::new(InstantApi::new(clock.clone()));
    let build = lane_builds(&worker, api.clone(), &store, |lane| (lane.as_str() == "nokey").then(|| "API_KEY_NOKEY is not set".to_owned()));
    let lanes = crate::lanes::LaneWorkers::new(build, store.clone(), store.clone(), clock.clone());
    let t0 = clock.now();
    let in_lane = |id: &str, lane: &str, ms: u64| {
        let WorkerPayload::Job { mut job, attempt, circuit_epoch, dispatched_at, slot, trip, report_limits } = in_slot(id, t0, ms) else { unreachable!() };
        job.lane = lane.parse().unwrap();
        WorkerPayload::Job { job, attempt, circuit_epoch, dispatched_at, slot, trip, report_limits }
    };
    let WorkerPayload::Batch { id, mut calls } =
        WorkerPayload::batch("run-1#8".into(), &[in_slot("plain", t0, 100), in_lane("acme-1", "acme", 200), in_lane("locked", "nokey", 300)])
    else {
        unreachable!()
    };
    calls.push(serde_json::json!({"kind": "job", "job": "{\"id\":\"bad\",\"request\":7}"}));
    tokio::time::timeout(Duration::from_secs(10), lanes.handle(WorkerPayload::Batch { id, calls })).await.expect("the batch ends").unwrap();

    assert_eq!(api.calls(), vec![t0.plus(Duration::from_millis(100)), t0.plus(Duration::from_millis(200))], "each lane's job at its slot");
    let mut dead: Vec<(String, DeadLetterCause)> = store.dead_letters().unwrap().into_iter().map(|d| (d.message_id, d.reason.cause)).collect();
    dead.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(dead, vec![("bad".to_string(), DeadLetterCause::Malformed), ("locked".to_string(), DeadLetterCause::Credentials)]);
}

#[tokio::test(start_paused = true)]
async fn a_lane_s_worker_is_built_again_when_its_keep_ends_and_a_lane_without_its_key_is_tried_again_after_a_while() {
    use std::sync::atomic::{AtomicU32, Ordering};
    let (worker, store) = new_worker("http://127.0.0.1:9/v1");
    let clock = worker.clock.clone();
    let api = Arc::new(InstantApi::new(clock.clone()));
    let builds: Arc<Mutex<Vec<String>>> = Arc::default();
    let secret_exists = Arc::new(AtomicU32::new(0));
    let build = {
        let (builds, secret_exists) = (builds.clone(), secret_exists.clone());
        lane_builds(&worker, api.clone(), &store, move |lane| {
            builds.lock().unwrap().push(lane.to_string());
            let missing = lane.as_str() == "late" && secret_exists.load(Ordering::SeqCst) == 0;
            missing.then(|| "cannot read secret KEY_late (keys/late): ResourceNotFoundException".to_owned())
        })
    };
    let lanes = crate::lanes::LaneWorkers::new(build, store.clone(), store.clone(), clock.clone()).rebuilt_after(Duration::from_secs(300));
    let in_lane = |id: &str, lane: &str| {
        let job = Job::parse(&format!(r#"{{"id":"{id}","lane":"{lane}","request":{{"method":"GET","path":"/items/{id}"}}}}"#)).unwrap();
        WorkerPayload::Job { job, attempt: 0, circuit_epoch: 0, dispatched_at: UnixMillis(0), slot: None, trip: None, report_limits: false }
    };
    let t0 = clock.now();
    for (i, at) in [0_u64, 10, 299, 301].into_iter().enumerate() {
        tokio::time::advance(t0.plus(Duration::from_secs(at)).since(clock.now())).await;
        lanes.handle(in_lane(&format!("acme-{i}"), "acme")).await.unwrap();
        lanes.handle(in_lane(&format!("late-{i}"), "late")).await.unwrap();
        if at == 10 {
            secret_exists.store(1, Ordering::SeqCst);
        }
    }
    let built = builds.lock().unwrap().clone();
    // acme: at 0 s, and again at 301 s (kept 300 s). late: failing at 0 s, tried again
    // at 299 s (30 s on) and found, kept from then.
    assert_eq!(built, ["acme", "late", "late", "acme"], "{built:?}");
    let dead: Vec<String> = store.dead_letters().unwrap().into_iter().map(|d| d.message_id).collect();
    assert_eq!(dead, ["late-0", "late-1"], "within 30 s of the failed read its jobs are dead-lettered without another");
    assert_eq!(api.calls().len(), 6, "every other job called");
}

/// A job of a lane without its key, delivered twice (SQS's at-least-once, an
/// orchestrator that died between its invoke and its delete, Lambda's retry), is
/// dead-lettered once: its call record says the attempt was settled, as a called job's
/// does. Two dead letters would count it twice and redrive it twice.
#[tokio::test(start_paused = true)]
async fn a_job_of_a_lane_without_its_key_delivered_twice_is_dead_lettered_once() {
    let (worker, store) = new_worker("http://127.0.0.1:9/v1");
    let api = Arc::new(InstantApi::new(worker.clock.clone()));
    let build = lane_builds(&worker, api.clone(), &store, |lane| (lane.as_str() == "nokey").then(|| "API_KEY_NOKEY is not set".to_owned()));
    let lanes = crate::lanes::LaneWorkers::new(build, store.clone(), store.clone(), worker.clock.clone());
    let job = Job::parse(r#"{"id":"locked-1","lane":"nokey","request":{"method":"GET","path":"/items/1"}}"#).unwrap();
    let delivery = |dispatched_at: u64| WorkerPayload::Job {
        job: job.clone(),
        attempt: 0,
        circuit_epoch: 0,
        dispatched_at: UnixMillis(dispatched_at),
        slot: None,
        trip: None,
        report_limits: false,
    };
    lanes.handle(delivery(1_000)).await.unwrap();
    lanes.handle(delivery(1_000)).await.unwrap();
    lanes.handle(WorkerPayload::batch("run-2#1".into(), &[delivery(61_000)])).await.unwrap();

    let dead: Vec<(String, DeadLetterCause)> = store.dead_letters().unwrap().into_iter().map(|d| (d.message_id, d.reason.cause)).collect();
    assert_eq!(dead, vec![("locked-1".to_string(), DeadLetterCause::Credentials)]);
    assert!(api.calls().is_empty(), "never called without its key");
}
