//! Worker batch benchmark: prints figures, asserts nothing (run: `cargo bench -p
//! paceline-worker --bench batch`). One worker (the real HTTP client, an in-memory
//! embedded store for its call records, a multi-threaded runtime as the Lambda binary
//! has) runs a batch of N jobs whose slots are spread at 10,000 calls/s (or `BENCH_PACE`), against an API
//! on loopback that answers each call in 300 ms with a 1 KiB body. For each N (1, 100,
//! 1,000 and 5,000, or the counts given after `--`): the most heap the batch held at
//! once (counted by the global allocator), the run's wall time, the calls that missed
//! their slot, and how far after its slot each call went out (p50, p99).
#![expect(clippy::disallowed_methods, reason = "a benchmark: it measures and waits on this machine's clock")]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use paceline_shared::adapters::embedded::EmbeddedStore;
use paceline_shared::config::{ApiConfig, RetryConfig};
use paceline_shared::job::{CallSlot, Job, WorkerPayload};
use paceline_shared::ports::WorkerHandler;
use paceline_shared::testing::alloc::CountingAllocator;
use paceline_shared::time::{system_now, Clock, SystemClock, UnixMillis};
use paceline_worker::{ApiClient, Worker, WorkerStats};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator::new();

/// The API's answer time, and the pace the slots are spread at.
const API_LATENCY: Duration = Duration::from_millis(300);
/// `BENCH_PACE` calls a second, 10,000 unless set.
fn calls_per_second() -> f64 {
    std::env::var("BENCH_PACE").ok().and_then(|p| p.parse().ok()).unwrap_or(10_000.0)
}
/// The first slot is this far after the batch starts (the hand-off's lead, less the
/// async start).
const FIRST_SLOT_IN: Duration = Duration::from_millis(200);

/// An API on loopback answering every call after `API_LATENCY` with 1 KiB of JSON, and
/// when each job's call arrived (by the job's number, its path's last segment).
async fn slow_api() -> (String, Arc<Mutex<Vec<(usize, UnixMillis)>>>) {
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let seen = arrivals.clone();
    let body = format!(r#"{{"padding":"{}"}}"#, "x".repeat(1_000));
    let app = axum::Router::new().fallback(move |uri: axum::http::Uri| {
        let (seen, body) = (seen.clone(), body.clone());
        async move {
            let job: usize = uri.path().rsplit('/').next().and_then(|n| n.parse().ok()).unwrap_or(usize::MAX);
            seen.lock().unwrap().push((job, system_now()));
            tokio::time::sleep(API_LATENCY).await;
            ([("content-type", "application/json")], body)
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{address}/v1"), arrivals)
}

fn worker(base_url: &str) -> Worker {
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let store = Arc::new(EmbeddedStore::in_memory(clock.clone()).unwrap());
    let health_check = Job::parse(r#"{"request":{"method":"GET","path":"/health"}}"#).unwrap().request;
    let config = ApiConfig {
        base_url: base_url.parse().unwrap(),
        timeout: Duration::from_secs(10),
        headers: Vec::new(),
        health_check: health_check.clone(),
        max_body: 1 << 20,
        idempotency_header: None,
    };
    let api = Arc::new(ApiClient::new(&config).unwrap().keeping_bodies(64 * 1024));
    Worker::new(api, store.clone(), store, clock, RetryConfig::default(), health_check)
}

/// A batch of `n` jobs, slots from `first` on at the bench's pace.
fn batch(n: usize, first: UnixMillis) -> WorkerPayload {
    let calls: Vec<WorkerPayload> = (0..n)
        .map(|i| {
            let job = Job::parse(&format!(r#"{{"id":"bench-{i}","request":{{"method":"POST","path":"/items/{i}","body":{{"n":{i}}}}}}}"#)).unwrap();
            let not_before = first.plus(Duration::from_secs_f64(i as f64 / calls_per_second()));
            let slot = Some(CallSlot { not_before, call_by: not_before.plus(Duration::from_millis(5)) });
            WorkerPayload::Job { job, attempt: 0, circuit_epoch: 0, dispatched_at: system_now(), slot, trip: None, report_limits: false }
        })
        .collect();
    WorkerPayload::batch(format!("bench-{n}"), &calls)
}

fn percentile(sorted: &[u64], q: f64) -> u64 {
    sorted.get(((sorted.len() as f64 * q).ceil() as usize).saturating_sub(1)).copied().unwrap_or(0)
}

#[tokio::main]
async fn main() {
    let sizes: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let sizes = if sizes.is_empty() { vec![1, 100, 1_000, 5_000] } else { sizes };
    let (base_url, arrivals) = slow_api().await;
    println!("{} calls/s, API answering in {} ms\n", calls_per_second(), API_LATENCY.as_millis());
    println!("| jobs in the batch | peak heap | per job | run | missed slots | call after its slot p50 / p99 |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: |");
    for n in sizes {
        let worker = worker(&base_url);
        arrivals.lock().unwrap().clear();
        let first = system_now().plus(FIRST_SLOT_IN);
        let payload = batch(n, first);
        let slots: Vec<UnixMillis> = payload
            .batch_calls()
            .into_iter()
            .flatten()
            .filter_map(|call| match call {
                WorkerPayload::Job { slot, .. } => slot.map(|s| s.not_before),
                _ => None,
            })
            .collect();
        let started = std::time::Instant::now();
        let before = ALLOCATOR.live();
        ALLOCATOR.reset_peak();
        worker.handle(payload).await.unwrap();
        let peak = ALLOCATOR.peak().saturating_sub(before);
        let run = started.elapsed();
        let arrived = arrivals.lock().unwrap().clone();
        let mut lags: Vec<u64> = arrived.iter().filter_map(|(job, at)| slots.get(*job).map(|slot| at.0.saturating_sub(slot.0))).collect();
        lags.sort_unstable();
        println!(
            "| {n} | {:.1} MB | {:.1} KB | {:.2} s | {} | {} / {} ms |",
            peak as f64 / 1e6,
            peak as f64 / n as f64 / 1e3,
            run.as_secs_f64(),
            WorkerStats::get(&worker.stats().missed_slots),
            percentile(&lags, 0.5),
            percentile(&lags, 0.99),
        );
    }
}
