//! Dispatch benchmark: prints figures, asserts nothing (run: `cargo bench -p
//! paceline-orchestrator --bench dispatch`). The lane is set up as a Lambda one is: jobs
//! go ahead of their slots by `dispatch_ahead`'s default there (500 ms).
//!
//! 1. AWS requests per dispatched job, by operation, at saturation of a few quotas. The
//!    ports are wrapped in counters that map each call to the AWS requests its adapter
//!    makes (a delete of n receipts is ceil(n/10) `DeleteMessageBatch` calls...). Runs
//!    under paused tokio time, so the counts are exact and repeatable.
//! 2. Dispatches per second from one orchestrator in real time, with every invoke
//!    answered only after 20 ms (Lambda's `Event` invoke takes about that), and again
//!    with 10 ms added to every queue receive.
#![expect(clippy::disallowed_methods, reason = "a benchmark: it measures and waits on this machine's clock")]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use paceline_orchestrator::{Orchestrator, RunOptions, Settings};
use paceline_shared::adapters::embedded::EmbeddedStore;
use paceline_shared::adapters::memory::RecordingInvoker;
use paceline_shared::adaptive::ProviderReading;
use paceline_shared::breaker::Circuit;
use paceline_shared::config::WorkerHost;
use paceline_shared::job::{DeadLetterReason, WorkerPayload};
use paceline_shared::ports::{
    BatchClaim, BatchProgress, CallClaim, Invoker, JobQueue, LaneSignals, Lease, OutgoingMessage, PacerSnapshot, PortResult, QueueDepth, QueuedMessage,
    StateStore, VisibleAgain,
};
use paceline_shared::quota::Quota;
use paceline_shared::time::{Clock, TokioClock, UnixMillis};

type Counts = Arc<Mutex<BTreeMap<&'static str, u64>>>;

/// Wraps a port, counting the AWS requests each call stands for, and optionally adding
/// latency to receives.
struct Counting<T> {
    inner: Arc<T>,
    counts: Counts,
    clock: Arc<dyn Clock>,
    receive_latency: Duration,
}

impl<T> Counting<T> {
    fn count(&self, operation: &'static str, n: u64) {
        *self.counts.lock().unwrap().entry(operation).or_default() += n;
    }
}

fn batches(n: usize) -> u64 {
    n.div_ceil(10) as u64
}

#[async_trait]
impl JobQueue for Counting<EmbeddedStore> {
    async fn receive(&self, max: usize, wait: Duration, visibility: Duration) -> PortResult<Vec<QueuedMessage>> {
        self.count("sqs:ReceiveMessage", 1);
        if !self.receive_latency.is_zero() {
            self.clock.sleep_until(self.clock.now().plus(self.receive_latency)).await;
        }
        self.inner.receive(max, wait, visibility).await
    }
    async fn delete(&self, receipts: &[String]) -> PortResult<()> {
        self.count("sqs:DeleteMessageBatch", batches(receipts.len()));
        self.inner.delete(receipts).await
    }
    async fn release(&self, messages: &[VisibleAgain]) -> PortResult<()> {
        self.count("sqs:ChangeMessageVisibilityBatch", batches(messages.len()));
        self.inner.release(messages).await
    }
    async fn send(&self, messages: &[OutgoingMessage]) -> PortResult<()> {
        self.count("sqs:SendMessageBatch", batches(messages.len()));
        self.inner.send(messages).await
    }
    async fn dead_letter(&self, message_id: &str, body: &str, attempt: u32, reason: &DeadLetterReason) -> PortResult<()> {
        self.count("sqs:SendMessage", 1);
        self.inner.dead_letter(message_id, body, attempt, reason).await
    }
    async fn depth(&self) -> PortResult<QueueDepth> {
        self.count("sqs:GetQueueAttributes", 2);
        self.inner.depth().await
    }
}

#[async_trait]
impl StateStore for Counting<EmbeddedStore> {
    async fn acquire_lease(&self, holder: &str, ttl: Duration, now: UnixMillis) -> PortResult<Lease> {
        self.count("dynamodb:UpdateItem", 1);
        self.inner.acquire_lease(holder, ttl, now).await
    }
    async fn renew_lease(&self, lease: &Lease, ttl: Duration, now: UnixMillis) -> PortResult<Lease> {
        self.count("dynamodb:UpdateItem", 1);
        self.inner.renew_lease(lease, ttl, now).await
    }
    async fn release_lease(&self, lease: &Lease) -> PortResult<()> {
        self.count("dynamodb:UpdateItem", 1);
        self.inner.release_lease(lease).await
    }
    async fn lease(&self) -> PortResult<Option<Lease>> {
        self.count("dynamodb:GetItem", 1);
        self.inner.lease().await
    }
    async fn load_usage(&self, keys: &[String]) -> PortResult<Vec<u64>> {
        self.count("dynamodb:GetItem", keys.len() as u64);
        self.inner.load_usage(keys).await
    }
    async fn add_usage(&self, deltas: &[(String, i64)]) -> PortResult<()> {
        self.count("dynamodb:UpdateItem", deltas.len() as u64);
        self.inner.add_usage(deltas).await
    }
    async fn load_pacer(&self) -> PortResult<Option<PacerSnapshot>> {
        self.count("dynamodb:GetItem", 1);
        self.inner.load_pacer().await
    }
    async fn save_pacer(&self, lease: &Lease, snapshot: &PacerSnapshot) -> PortResult<()> {
        self.count("dynamodb:TransactWriteItems", 1);
        self.inner.save_pacer(lease, snapshot).await
    }
    async fn circuit(&self) -> PortResult<Circuit> {
        self.count("dynamodb:GetItem", 1);
        self.inner.circuit().await
    }
    async fn swap_circuit(&self, expected_epoch: u64, next: &Circuit) -> PortResult<()> {
        self.count("dynamodb:PutItem", 1);
        self.inner.swap_circuit(expected_epoch, next).await
    }
    async fn cool_down(&self) -> PortResult<UnixMillis> {
        self.count("dynamodb:GetItem", 1);
        self.inner.cool_down().await
    }
    async fn shared_state(&self) -> PortResult<LaneSignals> {
        self.count("dynamodb:BatchGetItem", 1);
        self.inner.shared_state().await
    }
    async fn provider_reading(&self) -> PortResult<Option<ProviderReading>> {
        self.count("dynamodb:GetItem", 1);
        self.inner.provider_reading().await
    }
    async fn record_provider_reading(&self, reading: &ProviderReading) -> PortResult<()> {
        self.count("dynamodb:UpdateItem", 1);
        self.inner.record_provider_reading(reading).await
    }
    async fn claim_call(&self, key: &str, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<CallClaim> {
        self.count("dynamodb:UpdateItem", 1);
        self.inner.claim_call(key, holder, now, expires_at).await
    }
    async fn finish_call(&self, key: &str, keep_until: UnixMillis) -> PortResult<()> {
        self.count("dynamodb:UpdateItem", 1);
        self.inner.finish_call(key, keep_until).await
    }
    async fn claim_batch(&self, key: &str, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<BatchClaim> {
        self.count("dynamodb:UpdateItem", 1);
        self.inner.claim_batch(key, holder, now, expires_at).await
    }
    async fn save_batch(&self, key: &str, holder: &str, progress: &BatchProgress, expires_at: UnixMillis) -> PortResult<()> {
        self.count("dynamodb:UpdateItem", 1);
        self.inner.save_batch(key, holder, progress, expires_at).await
    }
    async fn release_call(&self, key: &str, holder: &str) -> PortResult<()> {
        self.count("dynamodb:DeleteItem", 1);
        self.inner.release_call(key, holder).await
    }
    async fn forget_call(&self, key: &str) -> PortResult<()> {
        self.count("dynamodb:DeleteItem", 1);
        self.inner.forget_call(key).await
    }
    async fn take_call_slot(&self, capacity: u32, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<Option<u32>> {
        self.count("dynamodb:UpdateItem", 1);
        self.inner.take_call_slot(capacity, holder, now, expires_at).await
    }
    async fn release_call_slot(&self, index: u32, holder: &str) -> PortResult<()> {
        self.count("dynamodb:UpdateItem", 1);
        self.inner.release_call_slot(index, holder).await
    }
    async fn call_slots_in_use(&self, capacity: u32, now: UnixMillis) -> PortResult<u32> {
        self.count("dynamodb:BatchGetItem", 1);
        self.inner.call_slots_in_use(capacity, now).await
    }
    async fn extend_cool_down(&self, until: UnixMillis) -> PortResult<()> {
        self.count("dynamodb:UpdateItem", 1);
        self.inner.extend_cool_down(until).await
    }
    async fn clear_cool_down(&self) -> PortResult<()> {
        self.count("dynamodb:DeleteItem", 1);
        self.inner.clear_cool_down().await
    }
}

struct CountingInvoker {
    inner: RecordingInvoker,
    counts: Counts,
}

#[async_trait]
impl Invoker for CountingInvoker {
    async fn invoke(&self, payload: &WorkerPayload, from_receipt: Option<&str>) -> PortResult<()> {
        *self.counts.lock().unwrap().entry("lambda:Invoke").or_default() += 1;
        self.inner.invoke(payload, from_receipt).await
    }
}

struct Bench {
    orchestrator: Orchestrator,
    counts: Counts,
}

async fn lane(tiers: &[&str], jobs: usize, invoke_latency: Duration, receive_latency: Duration) -> Bench {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let store = Arc::new(EmbeddedStore::in_memory(clock.clone()).unwrap());
    let body = r#"{"request":{"method":"POST","path":"/v1/messages","body":{"to":"+15550100"}}}"#;
    let messages: Vec<OutgoingMessage> = (0..jobs).map(|_| OutgoingMessage::fresh(body)).collect();
    for batch in messages.chunks(500) {
        store.send(batch).await.unwrap();
    }
    let counts = Counts::default();
    let counting = Arc::new(Counting { inner: store, counts: counts.clone(), clock: clock.clone(), receive_latency });
    let quota = Quota::new(tiers.iter().map(|t| t.parse().unwrap()).collect(), chrono_tz::UTC, Duration::from_millis(10)).unwrap();
    let invoker = Arc::new(CountingInvoker { inner: RecordingInvoker::new(clock.clone()).with_latency(invoke_latency), counts: counts.clone() });
    let settings = Settings::defaults_for(quota, WorkerHost::Lambda);
    let orchestrator = Orchestrator::new(counting.clone(), counting, invoker, clock, settings);
    Bench { orchestrator, counts }
}

fn drain_within(clock: &dyn Clock, d: Duration) -> RunOptions {
    RunOptions { holder: "bench".into(), deadline: clock.now().plus(d), drain: true, stop: None }
}

fn requests_per_job() {
    println!("## AWS requests per dispatched job (saturated, 60 s simulated, 20 ms invoke latency)\n");
    println!("| quota | jobs | operation | requests | per job |");
    println!("| --- | ---: | --- | ---: | ---: |");
    for (tier, rate) in [("10/s", 10usize), ("100/s", 100), ("1000/s", 1000)] {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
        runtime.block_on(async {
            let jobs = rate * 60;
            let bench = lane(&[tier, "10000000/day"], jobs, Duration::from_millis(20), Duration::from_millis(10)).await;
            let report = bench.orchestrator.run(&drain_within(bench.orchestrator.clock().as_ref(), Duration::from_secs(600))).await.unwrap();
            assert_eq!(report.dispatched as usize, jobs);
            let counts = bench.counts.lock().unwrap().clone();
            let mut besides_invoke = 0.0;
            for (operation, n) in &counts {
                let per_job = *n as f64 / jobs as f64;
                if *operation != "lambda:Invoke" {
                    besides_invoke += per_job;
                }
                println!("| {tier} | {jobs} | {operation} | {n} | {per_job:.4} |");
            }
            println!("| {tier} | {jobs} | **SQS + DynamoDB** | | **{besides_invoke:.4}** |");
        });
    }
    println!();
}

fn dispatch_rate() {
    println!("## Dispatches per second from one orchestrator (real time, quota 5000/s)\n");
    println!("| invoke latency | receive latency | jobs | seconds | dispatches/s |");
    println!("| ---: | ---: | ---: | ---: | ---: |");
    for receive_latency in [Duration::ZERO, Duration::from_millis(10)] {
        // One thread, as the orchestrator Lambda runs.
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let jobs = 10_000;
            let bench = lane(&["5000/s"], jobs, Duration::from_millis(20), receive_latency).await;
            let started = Instant::now();
            let report = bench.orchestrator.run(&drain_within(bench.orchestrator.clock().as_ref(), Duration::from_secs(120))).await.unwrap();
            let seconds = started.elapsed().as_secs_f64();
            assert_eq!(report.dispatched as usize, jobs);
            println!("| 20 ms | {} ms | {jobs} | {seconds:.2} | {:.0} |", receive_latency.as_millis(), jobs as f64 / seconds);
        });
    }
    println!();
}

fn main() {
    requests_per_job();
    dispatch_rate();
}
