//! Simulated SQS, DynamoDB and Lambda: in-memory implementations of the ports with the
//! profile's latency on every call, counting the AWS requests (and capacity units, and
//! Lambda compute time) each call stands for, as the AWS adapters would make them.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use paceline_shared::adaptive::ProviderReading;
use paceline_shared::breaker::Circuit;
use paceline_shared::config::LaneChange;
use paceline_shared::job::{DeadLetterReason, WorkerPayload};
use paceline_shared::keys::StoreScope;
use paceline_shared::lane::LaneId;
use paceline_shared::order::{OrderMark, OrderState};
use paceline_shared::ports::{
    slot_probe_start, BatchClaim, BatchProgress, CallClaim, Invoker, JobQueue, LaneFirstRead, LaneSignals, Lease, MemoryDocuments, OutgoingMessage,
    PacerSnapshot, PortError, PortResult, QueueDepth, QueuedMessage, ScopedStores, SharedReservation, StackDocument, StackDocuments, StateStore, VisibleAgain,
    WorkerHandler, PACERS_A_TRANSACTION,
};
use paceline_shared::time::{Clock, TokioClock, UnixMillis};

use crate::profile::{job_key, Sampler, Stream};
use crate::sqs::{QueueState, Stored};

/// The guard of `m`, poisoned or not (a panicking task fails its own simulation).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// AWS requests by operation, DynamoDB capacity units and Lambda compute time.
#[derive(Debug, Default)]
pub struct Ledger {
    requests: Mutex<BTreeMap<&'static str, u64>>,
    pub dynamodb_read_units: AtomicU64,
    pub dynamodb_write_units: AtomicU64,
    /// Milliseconds the worker function ran, summed over invocations.
    pub worker_ms: AtomicU64,
    /// DynamoDB requests for call and batch records (the workers' part).
    pub call_record_requests: AtomicU64,
    /// Milliseconds the orchestrator function ran, summed over runs.
    pub orchestrator_ms: AtomicU64,
}

impl Ledger {
    /// Counts `n` requests of `operation` (e.g. `sqs:ReceiveMessage`).
    pub fn count(&self, operation: &'static str, n: u64) {
        *lock(&self.requests).entry(operation).or_default() += n;
    }

    /// Requests so far, by operation.
    #[must_use]
    pub fn requests(&self) -> BTreeMap<&'static str, u64> {
        lock(&self.requests).clone()
    }
}

/// What every simulated service shares: the virtual clock, the seeded sampler and the
/// ledger.
pub struct World {
    pub clock: Arc<TokioClock>,
    pub sampler: Sampler,
    pub ledger: Ledger,
    /// When the simulation began.
    pub start: UnixMillis,
    /// Keys for draws that belong to no job (infrastructure calls), in call order.
    call_seq: AtomicU64,
    /// The same for the workers' call records, apart: the records' writes do not shift
    /// the other calls' draws, so a simulation with them meets the same latencies.
    record_seq: AtomicU64,
}

impl World {
    #[must_use]
    pub fn new(clock: Arc<TokioClock>, sampler: Sampler) -> Self {
        let start = clock.now();
        Self { clock, sampler, ledger: Ledger::default(), start, call_seq: AtomicU64::new(0), record_seq: AtomicU64::new(0) }
    }

    /// Waits one draw of `stream`'s latency under `key`.
    pub async fn wait(&self, stream: Stream, key: u64) {
        let latency = self.sampler.latency(stream, key);
        if !latency.is_zero() {
            self.clock.sleep_until(self.clock.now().plus(latency)).await;
        }
    }

    /// Waits one infrastructure call's latency.
    pub(crate) async fn call(&self, stream: Stream) {
        let key = self.call_seq.fetch_add(1, Ordering::Relaxed);
        self.wait(stream, key).await;
    }

    /// Waits one call-record write's latency (DynamoDB, keyed apart from other calls).
    async fn record_call(&self) {
        let key = self.record_seq.fetch_add(1, Ordering::Relaxed) | (1 << 62);
        self.wait(Stream::DynamoDb, key).await;
    }
}

/// An SQS queue with its DLQ: visibility timeouts, long polling, batches of 10; a
/// standard queue, or a fair one (its messages grouped by lane).
pub struct SimQueue {
    world: Arc<World>,
    state: Mutex<QueueState>,
    arrived: tokio::sync::Notify,
}

impl SimQueue {
    /// A standard queue.
    #[must_use]
    pub fn new(world: Arc<World>) -> Self {
        Self { world, state: Mutex::new(QueueState::standard()), arrived: tokio::sync::Notify::new() }
    }

    /// A fair queue: the quiet lanes' messages are handed out first.
    #[must_use]
    pub fn fair(world: Arc<World>) -> Self {
        Self { world, state: Mutex::new(QueueState::fair()), arrived: tokio::sync::Notify::new() }
    }

    /// A FIFO queue: each lane's messages in order, none while one of them is in flight.
    #[must_use]
    pub fn fifo(world: Arc<World>) -> Self {
        Self { world, state: Mutex::new(QueueState::fifo()), arrived: tokio::sync::Notify::new() }
    }

    /// Puts messages on the queue as a producer would, at no latency (the producer's
    /// `SendMessageBatch` requests are still counted).
    pub fn preload(&self, bodies: impl IntoIterator<Item = String>) {
        let now = self.world.clock.now();
        let mut state = lock(&self.state);
        let mut sent: u64 = 0;
        for body in bodies {
            let message = stored(&mut state, body, 0, false, now);
            state.push_back(message);
            sent += 1;
        }
        self.world.ledger.count("sqs:SendMessageBatch (producer)", sent.div_ceil(10));
    }

    /// Dead letters so far, as (cause label, count).
    #[must_use]
    pub fn dead_letter_causes(&self) -> BTreeMap<String, u64> {
        let mut causes = BTreeMap::new();
        for (_, cause) in &lock(&self.state).dead {
            *causes.entry(cause.clone()).or_default() += 1;
        }
        causes
    }

    /// How many messages are in the DLQ.
    #[must_use]
    pub fn dead_count(&self) -> u64 {
        lock(&self.state).dead.len() as u64
    }

    /// Whether the queue holds the most messages in flight it lets be, now.
    fn refuses_receives(&self) -> bool {
        let mut state = lock(&self.state);
        state.reveal_due(self.world.clock.now());
        state.in_flight_at_most()
    }

    /// The most messages in flight at once so far.
    #[must_use]
    pub fn in_flight_peak(&self) -> u64 {
        lock(&self.state).in_flight_peak
    }

    fn take(&self, max: usize, visibility: Duration) -> Vec<QueuedMessage> {
        let now = self.world.clock.now();
        let mut state = lock(&self.state);
        state.reveal_due(now);
        let received = state.receive(max.min(10), now.plus(visibility));
        received
            .into_iter()
            .map(|(receipt, message)| QueuedMessage {
                message_id: message.id.to_string(),
                receipt: receipt.to_string(),
                body: message.body,
                attempt: message.attempt,
                enqueued_at: message.sent_at,
                group: None,
            })
            .collect()
    }

    /// The message a receipt names (this queue's receipts are numbers); none for others.
    fn receipt(receipt: &str) -> Option<u64> {
        receipt.parse().ok()
    }
}

/// A new message with `body`, in its lane's group (or its retries', `ahead`).
fn stored(state: &mut QueueState, body: String, attempt: u32, ahead: bool, now: UnixMillis) -> Stored {
    let id = state.next_id;
    state.next_id += 1;
    let group = state.group_of(&body, ahead);
    Stored { id, body, attempt, sent_at: now, group }
}

#[async_trait]
impl JobQueue for SimQueue {
    async fn receive(&self, max: usize, wait: Duration, visibility: Duration) -> PortResult<Vec<QueuedMessage>> {
        self.world.ledger.count("sqs:ReceiveMessage", 1);
        self.world.call(Stream::Sqs).await;
        let deadline = self.world.clock.now().plus(wait);
        if wait.is_zero() && self.refuses_receives() {
            return Err(PortError::Throttled("sqs ReceiveMessage: OverLimit: the queue's most messages in flight".into()));
        }
        loop {
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            let received = self.take(max, visibility);
            let now = self.world.clock.now();
            if !received.is_empty() || now >= deadline {
                return Ok(received);
            }
            let wake = lock(&self.state).next_wake().map_or(deadline, |t| t.min(deadline));
            tokio::select! {
                biased;
                () = arrived => {}
                () = self.world.clock.sleep_until(wake) => {}
            }
        }
    }

    async fn delete(&self, receipts: &[String]) -> PortResult<()> {
        self.world.ledger.count("sqs:DeleteMessageBatch", receipts.len().div_ceil(10) as u64);
        self.world.call(Stream::Sqs).await;
        let mut state = lock(&self.state);
        for receipt in receipts.iter().filter_map(|receipt| Self::receipt(receipt)) {
            state.delete(receipt);
        }
        Ok(())
    }

    async fn release(&self, messages: &[VisibleAgain]) -> PortResult<()> {
        self.world.ledger.count("sqs:ChangeMessageVisibilityBatch", messages.len().div_ceil(10) as u64);
        self.world.call(Stream::Sqs).await;
        let now = self.world.clock.now();
        let mut state = lock(&self.state);
        // In reverse, so that messages put back at once keep their order at the front.
        for message in messages.iter().rev() {
            if let Some(receipt) = Self::receipt(&message.receipt) {
                state.release(receipt, (!message.after.is_zero()).then(|| now.plus(message.after)));
            }
        }
        drop(state);
        self.arrived.notify_waiters();
        Ok(())
    }

    async fn send(&self, messages: &[OutgoingMessage]) -> PortResult<()> {
        let operation = if messages.len() == 1 { "sqs:SendMessage" } else { "sqs:SendMessageBatch" };
        self.world.ledger.count(operation, messages.len().div_ceil(10) as u64);
        self.world.call(Stream::Sqs).await;
        let now = self.world.clock.now();
        let mut state = lock(&self.state);
        for message in messages {
            let stored = stored(&mut state, message.body.clone(), message.attempt, message.ahead, now);
            if message.delay.is_zero() {
                state.push_back(stored);
            } else {
                state.delay(stored, now.plus(message.delay));
            }
        }
        drop(state);
        self.arrived.notify_waiters();
        Ok(())
    }

    async fn dead_letter(&self, message_id: &str, _body: &str, _attempt: u32, reason: &DeadLetterReason) -> PortResult<()> {
        self.world.ledger.count("sqs:SendMessage (DLQ)", 1);
        self.world.call(Stream::Sqs).await;
        lock(&self.state).dead.push((message_id.parse().unwrap_or(u64::MAX), reason.cause.label()));
        Ok(())
    }

    fn serves_groups_fairly(&self) -> bool {
        lock(&self.state).is_fair()
    }

    async fn depth(&self) -> PortResult<QueueDepth> {
        self.world.ledger.count("sqs:GetQueueAttributes", 1);
        self.world.call(Stream::Sqs).await;
        let state = lock(&self.state);
        Ok(QueueDepth { visible: state.visible_len() as u64, not_visible: state.hidden_len() as u64, dead: state.dead.len() as u64 })
    }
}

#[derive(Default)]
struct StoreState {
    lease: Option<Lease>,
    epoch: u64,
    usage: BTreeMap<String, u64>,
    pacer: Option<PacerSnapshot>,
    circuit: Circuit,
    cool_down: UnixMillis,
    provider_reading: Option<ProviderReading>,
    /// Call records by key: state, holder and expiry.
    calls: BTreeMap<String, (CallClaim, String, UnixMillis)>,
    /// Call slots by index: holder and expiry.
    call_slots: BTreeMap<u32, (String, UnixMillis)>,
    /// Worker batches' records by key: holder, expiry and progress.
    batches: BTreeMap<String, (String, UnixMillis, BatchProgress)>,
    /// An ordered lane's mark.
    order_mark: Option<OrderMark>,
}

impl StoreState {
    fn signals(&self) -> LaneSignals {
        LaneSignals { circuit: self.circuit.clone(), cool_down: self.cool_down, provider_reading: self.provider_reading }
    }
}

/// The DynamoDB state table, with the calls (and capacity units) the DynamoDB adapter
/// makes for each operation.
pub struct SimStore {
    world: Arc<World>,
    state: Mutex<StoreState>,
    /// The next run's final snapshot and lease release fail (a fault at the hand-over).
    fail_release: std::sync::atomic::AtomicBool,
    /// A lane's items: the stack's, which hold the lease its writes are conditioned on.
    stack: Option<Arc<SimStore>>,
    /// A stack of shards' documents (the share book, the lanes' homes).
    documents: MemoryDocuments,
}

impl SimStore {
    #[must_use]
    pub fn new(world: Arc<World>) -> Self {
        Self { world, state: Mutex::default(), fail_release: std::sync::atomic::AtomicBool::new(false), stack: None, documents: MemoryDocuments::default() }
    }

    /// Keeps `snapshot` as this store's pacer state while `lease` is held (the request,
    /// its latency and units counted by the caller).
    fn keep_pacer(&self, lease: &Lease, snapshot: &PacerSnapshot) -> PortResult<()> {
        if snapshot.at_exit && self.fail_release.load(Ordering::Relaxed) {
            return Err(PortError::Transient("injected: the final snapshot write failed".into()));
        }
        if !self.holds(lease) {
            return Err(PortError::Conflict("the lease was lost".into()));
        }
        self.state().pacer = Some(snapshot.clone());
        Ok(())
    }

    /// Whether `lease` is the one held (in the stack's items, for a lane's).
    fn holds(&self, lease: &Lease) -> bool {
        match &self.stack {
            Some(stack) => stack.holds(lease),
            None => self.state().lease.as_ref().is_some_and(|l| l.epoch == lease.epoch && l.holder == lease.holder),
        }
    }

    /// Who holds the lease at `now`, if anyone.
    #[must_use]
    pub fn lease_holder(&self, now: UnixMillis) -> Option<String> {
        self.state().lease.as_ref().filter(|lease| lease.expires_at > now).map(|lease| lease.holder.clone())
    }

    /// The next final snapshot (written at a run's end) and the next lease release fail
    /// with a passing fault: the next run finds a snapshot written mid-run and a lease
    /// that holds until it expires.
    pub fn fail_next_release(&self) {
        self.fail_release.store(true, Ordering::Relaxed);
    }

    fn count_read(&self, items: u64) {
        self.world.ledger.count("dynamodb:GetItem", items);
        self.world.ledger.dynamodb_read_units.fetch_add(items, Ordering::Relaxed);
    }

    fn count_write(&self, operation: &'static str, requests: u64, units: u64) {
        self.world.ledger.count(operation, requests);
        self.world.ledger.dynamodb_write_units.fetch_add(units, Ordering::Relaxed);
    }

    async fn read(&self, items: u64) {
        self.count_read(items);
        self.world.call(Stream::DynamoDb).await;
    }

    async fn write(&self, operation: &'static str, requests: u64, units: u64) {
        self.count_write(operation, requests, units);
        self.world.call(Stream::DynamoDb).await;
    }

    /// A write of a call record: counted as any, its latency drawn apart.
    async fn record_write(&self, operation: &'static str) {
        self.count_write(operation, 1, 1);
        self.world.ledger.call_record_requests.fetch_add(1, Ordering::Relaxed);
        self.world.record_call().await;
    }

    /// A read of a call record, likewise.
    async fn record_read(&self) {
        self.count_read(1);
        self.world.ledger.call_record_requests.fetch_add(1, Ordering::Relaxed);
        self.world.record_call().await;
    }

    fn state(&self) -> MutexGuard<'_, StoreState> {
        lock(&self.state)
    }
}

/// The DynamoDB table of a stack of many lanes: the stack's items (its lease, the shared
/// quota's) and each lane's apart, as the DynamoDB adapter keeps them under `lane#ID#`
/// keys, every request counted in the one ledger.
pub struct SimStores {
    world: Arc<World>,
    stack: Arc<SimStore>,
    lanes: Mutex<HashMap<LaneId, Arc<SimStore>>>,
}

impl SimStores {
    #[must_use]
    pub fn new(world: Arc<World>) -> Self {
        Self { stack: Arc::new(SimStore::new(world.clone())), world, lanes: Mutex::default() }
    }

    /// The stack's own items: its lease and the shared quota's state.
    #[must_use]
    pub fn stack(&self) -> Arc<SimStore> {
        self.stack.clone()
    }
}

#[async_trait]
impl ScopedStores for SimStores {
    /// As the DynamoDB adapter reads them: four items a lane, 100 a BatchGetItem.
    async fn lanes_signals(&self, lanes: &[LaneId]) -> PortResult<Vec<(LaneSignals, Option<LaneChange>)>> {
        self.batch_read(4 * lanes.len() as u64).await;
        let store = |lane: &LaneId| lock(&self.lanes).get(lane).cloned();
        Ok(lanes.iter().map(|lane| (store(lane).map_or_else(LaneSignals::default, |store| store.state().signals()), None)).collect())
    }

    /// As the DynamoDB adapter reads them: five items a lane, 100 a BatchGetItem.
    async fn lanes_first_reads(&self, lanes: &[LaneId]) -> PortResult<Vec<LaneFirstRead>> {
        self.batch_read(5 * lanes.len() as u64).await;
        let store = |lane: &LaneId| lock(&self.lanes).get(lane).cloned();
        Ok(lanes
            .iter()
            .map(|lane| match store(lane) {
                Some(store) => {
                    let state = store.state();
                    LaneFirstRead { pacer: Ok(state.pacer.clone()), signals: state.signals(), change: None }
                }
                None => LaneFirstRead { pacer: Ok(None), signals: LaneSignals::default(), change: None },
            })
            .collect())
    }

    fn scoped(&self, scope: &StoreScope) -> Arc<dyn StateStore> {
        self.store_of(scope)
    }

    /// As the DynamoDB adapter saves them: [`PACERS_A_TRANSACTION`] a transaction, beside the
    /// lease's condition check (two units for it, and two per KiB of each put).
    async fn save_pacers(&self, lease: &Lease, snapshots: &[(StoreScope, PacerSnapshot)]) -> PortResult<()> {
        for transaction in snapshots.chunks(PACERS_A_TRANSACTION) {
            let kib: u64 = transaction.iter().map(|(_, snapshot)| snapshot_kib(snapshot)).sum();
            self.stack.write("dynamodb:TransactWriteItems", 1, 2 * (1 + kib)).await;
            for (scope, snapshot) in transaction {
                self.store_of(scope).keep_pacer(lease, snapshot)?;
            }
        }
        Ok(())
    }
}

impl SimStores {
    /// A read of `items` items together, as the DynamoDB adapter reads them: 100 a
    /// BatchGetItem, one after the other.
    async fn batch_read(&self, items: u64) {
        for _ in 0..items.div_ceil(100) {
            self.world.ledger.count("dynamodb:BatchGetItem", 1);
            self.world.call(Stream::DynamoDb).await;
        }
        self.world.ledger.dynamodb_read_units.fetch_add(items, Ordering::Relaxed);
    }

    /// The store of `scope`'s items.
    fn store_of(&self, scope: &StoreScope) -> Arc<SimStore> {
        match scope {
            // Each simulated shard has a table of its own: its share is its stack's.
            StoreScope::Stack | StoreScope::Shard(_) => self.stack.clone(),
            StoreScope::Lane(lane) => lock(&self.lanes)
                .entry(lane.clone())
                .or_insert_with(|| Arc::new(SimStore { stack: Some(self.stack.clone()), ..SimStore::new(self.world.clone()) }))
                .clone(),
        }
    }
}

/// A snapshot's size in KiB, at least one: what its write costs in units.
fn snapshot_kib(snapshot: &PacerSnapshot) -> u64 {
    serde_json::to_string(snapshot).map_or(1, |json| (json.len() as u64).div_ceil(1024).max(1))
}

/// A stack's documents, one item each: a consistent read, and a conditional put.
#[async_trait]
impl StackDocuments for SimStore {
    async fn document(&self, document: StackDocument) -> PortResult<Option<(String, u64)>> {
        self.read(1).await;
        self.documents.document(document).await
    }

    async fn put_document(&self, document: StackDocument, json: &str, expected: Option<u64>) -> PortResult<bool> {
        self.write("dynamodb:PutItem", 1, 1).await;
        self.documents.put_document(document, json, expected).await
    }

    async fn shared_counts(&self, keys: &[String]) -> PortResult<Vec<u64>> {
        self.read(keys.len() as u64).await;
        self.documents.shared_counts(keys).await
    }

    /// One conditional write; where the other shards hold some of the units asked, its
    /// condition fails, and a read and (for what is left, if any) a second write follow.
    async fn reserve_shared(&self, key: &str, wanted: u64, limit: u64) -> PortResult<SharedReservation> {
        self.write("dynamodb:UpdateItem", 1, 1).await;
        let reserved = self.documents.reserve_shared(key, wanted, limit).await?;
        if reserved.units < wanted.min(limit) {
            self.read(1).await;
            if reserved.units > 0 {
                self.write("dynamodb:UpdateItem", 1, 1).await;
            }
        }
        Ok(reserved)
    }

    async fn return_shared(&self, key: &str, units: u64) -> PortResult<()> {
        self.write("dynamodb:UpdateItem", 1, 1).await;
        self.documents.return_shared(key, units).await
    }
}

#[async_trait]
impl StateStore for SimStore {
    async fn acquire_lease(&self, holder: &str, ttl: Duration, now: UnixMillis) -> PortResult<Lease> {
        self.write("dynamodb:UpdateItem", 1, 1).await;
        let mut state = self.state();
        if let Some(lease) = state.lease.as_ref().filter(|l| l.expires_at > now) {
            return Err(PortError::Conflict(format!("held by {} until {}", lease.holder, lease.expires_at)));
        }
        state.epoch += 1;
        let lease = Lease { holder: holder.to_owned(), epoch: state.epoch, expires_at: now.plus(ttl) };
        state.lease = Some(lease.clone());
        Ok(lease)
    }

    async fn renew_lease(&self, lease: &Lease, ttl: Duration, now: UnixMillis) -> PortResult<Lease> {
        self.write("dynamodb:UpdateItem", 1, 1).await;
        let mut state = self.state();
        match state.lease.as_mut() {
            // Past its expiry too, as long as no one took it (the ports' lease rules).
            Some(current) if current.epoch == lease.epoch && current.holder == lease.holder => {
                current.expires_at = now.plus(ttl);
                Ok(current.clone())
            }
            _ => Err(PortError::Conflict("the lease was lost".into())),
        }
    }

    async fn release_lease(&self, lease: &Lease) -> PortResult<()> {
        self.write("dynamodb:UpdateItem", 1, 1).await;
        if self.fail_release.swap(false, Ordering::Relaxed) {
            return Err(PortError::Transient("injected: the lease release failed".into()));
        }
        let mut state = self.state();
        if state.lease.as_ref().is_some_and(|l| l.epoch == lease.epoch) {
            state.lease = None;
        }
        Ok(())
    }

    async fn lease(&self) -> PortResult<Option<Lease>> {
        self.read(1).await;
        Ok(self.state().lease.clone())
    }

    async fn load_usage(&self, keys: &[String]) -> PortResult<Vec<u64>> {
        self.read(keys.len() as u64).await;
        let state = self.state();
        Ok(keys.iter().map(|k| state.usage.get(k).copied().unwrap_or(0)).collect())
    }

    async fn add_usage(&self, deltas: &[(String, i64)]) -> PortResult<()> {
        self.write("dynamodb:UpdateItem", deltas.len() as u64, deltas.len() as u64).await;
        let mut state = self.state();
        for (key, delta) in deltas {
            let used = state.usage.entry(key.clone()).or_default();
            *used = used.saturating_add_signed(*delta);
        }
        Ok(())
    }

    async fn load_pacer(&self) -> PortResult<Option<PacerSnapshot>> {
        self.read(1).await;
        Ok(self.state().pacer.clone())
    }

    async fn save_pacer(&self, lease: &Lease, snapshot: &PacerSnapshot) -> PortResult<()> {
        // A transaction of a condition check and a put: two units per item per KiB.
        self.write("dynamodb:TransactWriteItems", 1, 2 * (1 + snapshot_kib(snapshot))).await;
        self.keep_pacer(lease, snapshot)
    }

    async fn circuit(&self) -> PortResult<Circuit> {
        self.read(1).await;
        Ok(self.state().circuit.clone())
    }

    async fn swap_circuit(&self, expected_epoch: u64, next: &Circuit) -> PortResult<()> {
        self.write("dynamodb:PutItem", 1, 1).await;
        let mut state = self.state();
        if state.circuit.epoch != expected_epoch {
            return Err(PortError::Conflict(format!("circuit is at epoch {}", state.circuit.epoch)));
        }
        state.circuit = next.clone();
        Ok(())
    }

    async fn cool_down(&self) -> PortResult<UnixMillis> {
        self.read(1).await;
        Ok(self.state().cool_down)
    }

    async fn take_call_slot(&self, capacity: u32, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<Option<u32>> {
        // The DynamoDB adapter tries the slots one conditional update at a time, from
        // one picked by the holder; a busy slot's failed update costs a write too.
        let start = slot_probe_start(holder, capacity);
        let free = {
            let state = self.state();
            (0..capacity).map(|k| (start + k) % capacity.max(1)).position(|index| state.call_slots.get(&index).is_none_or(|(_, until)| *until <= now))
        };
        let probes = free.map_or(u64::from(capacity), |tried| tried as u64 + 1);
        self.write("dynamodb:UpdateItem", probes, probes).await;
        let Some(tried) = free else { return Ok(None) };
        let index = (start + u32::try_from(tried).unwrap_or(0)) % capacity.max(1);
        let mut state = self.state();
        match state.call_slots.get(&index) {
            // Taken meanwhile by another worker: as a failed conditional update.
            Some((_, until)) if *until > now => Ok(None),
            _ => {
                state.call_slots.insert(index, (holder.to_owned(), expires_at));
                Ok(Some(index))
            }
        }
    }

    async fn release_call_slot(&self, index: u32, holder: &str) -> PortResult<()> {
        self.write("dynamodb:UpdateItem", 1, 1).await;
        let mut state = self.state();
        if state.call_slots.get(&index).is_some_and(|(who, _)| who == holder) {
            state.call_slots.remove(&index);
        }
        Ok(())
    }

    async fn claim_call(&self, key: &str, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<CallClaim> {
        self.record_write("dynamodb:UpdateItem").await;
        let found = {
            let mut state = self.state();
            match state.calls.get(key) {
                Some((CallClaim::Done, ..)) => CallClaim::Done,
                Some((_, who, until)) if *until > now && who == holder => CallClaim::ClaimedBefore,
                Some((_, _, until)) if *until > now => CallClaim::Calling,
                _ => {
                    state.calls.insert(key.to_owned(), (CallClaim::Calling, holder.to_owned(), expires_at));
                    CallClaim::Taken
                }
            }
        };
        if found != CallClaim::Taken {
            // The DynamoDB adapter reads the record after a failed claim.
            self.record_read().await;
        }
        Ok(found)
    }

    async fn finish_call(&self, key: &str, keep_until: UnixMillis) -> PortResult<()> {
        self.record_write("dynamodb:UpdateItem").await;
        self.state().calls.insert(key.to_owned(), (CallClaim::Done, String::new(), keep_until));
        Ok(())
    }

    async fn claim_batch(&self, key: &str, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<BatchClaim> {
        self.record_write("dynamodb:UpdateItem").await;
        let found = {
            let mut state = self.state();
            match state.batches.get(key) {
                Some((_, _, progress)) if progress.done => BatchClaim::Done,
                Some((_, until, _)) if *until > now => BatchClaim::Running,
                earlier => {
                    let before = earlier.map(|(_, _, progress)| progress.clone());
                    let progress = before.clone().unwrap_or_default();
                    state.batches.insert(key.to_owned(), (holder.to_owned(), expires_at, progress));
                    BatchClaim::Taken { before }
                }
            }
        };
        if !matches!(found, BatchClaim::Taken { .. }) {
            self.record_read().await;
        }
        Ok(found)
    }

    async fn save_batch(&self, key: &str, holder: &str, progress: &BatchProgress, expires_at: UnixMillis) -> PortResult<()> {
        self.record_write("dynamodb:UpdateItem").await;
        let mut state = self.state();
        match state.batches.get_mut(key) {
            Some(record) if record.0 == holder => {
                *record = (holder.to_owned(), expires_at, progress.clone());
                Ok(())
            }
            _ => Err(PortError::Conflict(format!("batch {key} is held by another delivery"))),
        }
    }

    async fn release_call(&self, key: &str, holder: &str) -> PortResult<()> {
        self.record_write("dynamodb:DeleteItem").await;
        let mut state = self.state();
        if state.calls.get(key).is_some_and(|(claim, who, _)| *claim == CallClaim::Calling && who == holder) {
            state.calls.remove(key);
        }
        Ok(())
    }

    async fn forget_call(&self, key: &str) -> PortResult<()> {
        self.record_write("dynamodb:DeleteItem").await;
        self.state().calls.remove(key);
        Ok(())
    }

    async fn call_slots_in_use(&self, capacity: u32, now: UnixMillis) -> PortResult<u32> {
        self.world.ledger.count("dynamodb:BatchGetItem", 1);
        self.world.ledger.dynamodb_read_units.fetch_add(u64::from(capacity), Ordering::Relaxed);
        self.world.call(Stream::DynamoDb).await;
        let state = self.state();
        Ok(u32::try_from(state.call_slots.iter().filter(|(index, (_, until))| **index < capacity && *until > now).count()).unwrap_or(u32::MAX))
    }

    /// No operator changes a simulated lane; the read is counted as the adapter makes it.
    async fn lane_change(&self) -> PortResult<Option<LaneChange>> {
        self.read(1).await;
        Ok(None)
    }

    async fn order_mark(&self) -> PortResult<Option<OrderMark>> {
        self.read(1).await;
        Ok(self.state().order_mark.clone())
    }

    async fn open_order(&self, mark: &OrderMark) -> PortResult<()> {
        self.write("dynamodb:PutItem", 1, 1).await;
        self.state().order_mark = Some(mark.clone());
        Ok(())
    }

    async fn settle_order(&self, job_id: &str, attempt: u32, state: OrderState) -> PortResult<bool> {
        self.write("dynamodb:UpdateItem", 1, 1).await;
        let mut stored = self.state();
        match stored.order_mark.as_mut().filter(|mark| mark.names(job_id, attempt)) {
            Some(mark) => {
                mark.state = state;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    async fn shared_state(&self) -> PortResult<LaneSignals> {
        self.world.ledger.count("dynamodb:BatchGetItem", 1);
        self.world.ledger.dynamodb_read_units.fetch_add(3, Ordering::Relaxed);
        self.world.call(Stream::DynamoDb).await;
        Ok(self.state().signals())
    }

    async fn provider_reading(&self) -> PortResult<Option<ProviderReading>> {
        self.read(1).await;
        Ok(self.state().provider_reading)
    }

    async fn record_provider_reading(&self, reading: &ProviderReading) -> PortResult<()> {
        self.write("dynamodb:UpdateItem", 1, 1).await;
        let mut state = self.state();
        if state.provider_reading.is_none_or(|current| current.at < reading.at) {
            state.provider_reading = Some(*reading);
        }
        Ok(())
    }

    async fn extend_cool_down(&self, until: UnixMillis) -> PortResult<()> {
        self.write("dynamodb:UpdateItem", 1, 1).await;
        let mut state = self.state();
        state.cool_down = state.cool_down.max(until);
        Ok(())
    }

    async fn clear_cool_down(&self) -> PortResult<()> {
        self.write("dynamodb:DeleteItem", 2, 2).await;
        let mut state = self.state();
        state.cool_down = UnixMillis(0);
        state.provider_reading = None;
        Ok(())
    }
}

/// The job number a payload is about (`None` for health checks): jobs are `job-N`.
#[must_use]
pub fn job_number(payload: &WorkerPayload) -> Option<u64> {
    match payload {
        WorkerPayload::Job { job, .. } => job.id.as_str().strip_prefix("job-").and_then(|n| n.parse().ok()),
        WorkerPayload::HealthCheck { .. } => None,
        // A batch draws as its first job.
        WorkerPayload::Batch { .. } => payload.batch_calls().first().and_then(|call| call.as_ref().ok()).and_then(job_number),
    }
}

/// Lambda's `Event` invoke of the worker: answers 202 after the invoke latency, then
/// runs the real worker after the async start delay, and bills its run time.
pub struct SimLambda {
    world: Arc<World>,
    /// Hand-offs per job so far, so each sees its own draws.
    invokes_per_job: Mutex<Vec<u32>>,
    health_checks: AtomicU64,
    /// When each job was last handed off (for dispatch-to-call delays).
    dispatched_at: Arc<Mutex<Vec<UnixMillis>>>,
    /// Share of events delivered twice, and of hand-offs whose 202 is lost.
    duplicate_delivery: f64,
    /// Where events run.
    executions: Arc<Executions>,
}

/// Lambda's side of an accepted event: runs it when an execution is free, retries it
/// when it fails, and counts.
///
/// The account runs at most `concurrency` executions at once (Lambda's default, 1,000).
/// An event that finds them all busy is throttled: Lambda keeps it and tries again after
/// 1 s, 2 s, 4 s... (at most 5 min apart) until it is older than the function's
/// `MaximumEventAgeInSeconds`, when it goes to the on-failure destination unrun. An
/// execution that fails (an error, or killed part-way: `crash_share` of the executions
/// of a batch) is tried again a minute later, then two, and then goes to the on-failure
/// destination.
pub struct Executions {
    world: Arc<World>,
    worker: Arc<dyn WorkerHandler>,
    concurrency: u64,
    max_event_age: Duration,
    crash_share: f64,
    /// Events accepted and not yet finished (running, starting, throttled or waiting
    /// for a retry).
    pub running: AtomicU64,
    /// Executions under way now, and the most at once.
    executing: AtomicU64,
    pub peak_executing: AtomicU64,
    /// Times an event was throttled.
    pub throttles: AtomicU64,
    /// Jobs whose events aged out unrun, and whose events failed every try (both in the
    /// worker DLQ).
    pub aged_out_jobs: AtomicU64,
    pub worker_errors: AtomicU64,
    /// Executions killed part-way.
    pub crashes: AtomicU64,
}

/// Lambda's default concurrent executions per account and Region.
pub const DEFAULT_LAMBDA_CONCURRENCY: u64 = 1_000;

/// Lambda's default `MaximumEventAgeInSeconds` for asynchronous events: six hours.
pub const DEFAULT_MAX_EVENT_AGE: Duration = Duration::from_secs(21_600);

/// The longest Lambda waits between tries of a throttled async event.
const THROTTLE_RETRY_MAX: Duration = Duration::from_secs(300);

/// Lambda's retries of a failed async event (the template's `MaximumRetryAttempts`), the
/// first a minute after the failure, the second two.
const FAILED_EVENT_RETRIES: u32 = 2;

impl Executions {
    /// Runs `payload` (try `tries` of the event, first accepted at `accepted`) after
    /// its async start.
    fn deliver(self: &Arc<Self>, payload: WorkerPayload, key: u64, accepted: UnixMillis, tries: u32) {
        let this = self.clone();
        this.running.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(async move {
            let world = &this.world;
            world.wait(Stream::AsyncStart, key).await;
            let mut retry = crate::THROTTLE_RETRY;
            // Single-threaded runtime: nothing runs between the read and the add.
            while this.executing.load(Ordering::Relaxed) >= this.concurrency {
                this.throttles.fetch_add(1, Ordering::Relaxed);
                if world.clock.now().plus(retry).since(accepted) > this.max_event_age {
                    this.aged_out_jobs.fetch_add(payload.job_count() as u64, Ordering::Relaxed);
                    this.running.fetch_sub(1, Ordering::Relaxed);
                    return;
                }
                world.clock.sleep_until(world.clock.now().plus(retry)).await;
                retry = (retry * 2).min(THROTTLE_RETRY_MAX);
            }
            let now_executing = this.executing.fetch_add(1, Ordering::Relaxed) + 1;
            this.peak_executing.fetch_max(now_executing, Ordering::Relaxed);
            let started = world.clock.now();
            let crash_draw = world.sampler.uniform(Stream::Delivery, key ^ (1 << 61) ^ u64::from(tries));
            let crashes = payload.job_count() > 1 && crash_draw < this.crash_share;
            let finished = if crashes {
                // Killed somewhere in the first 1.5 s: amid a batch's calls.
                let killed_at = started.plus(Duration::from_secs_f64(crash_draw / this.crash_share * 1.5));
                tokio::select! {
                    biased;
                    result = this.worker.handle(payload.clone()) => result.is_ok(),
                    () = world.clock.sleep_until(killed_at) => {
                        this.crashes.fetch_add(1, Ordering::Relaxed);
                        false
                    }
                }
            } else {
                match this.worker.handle(payload.clone()).await {
                    Ok(_) => true,
                    Err(e) => {
                        tracing::warn!(error = %e, "simulated worker failed");
                        false
                    }
                }
            };
            world.ledger.worker_ms.fetch_add(world.clock.now().since(started).as_millis() as u64, Ordering::Relaxed);
            this.executing.fetch_sub(1, Ordering::Relaxed);
            if !finished {
                if tries < FAILED_EVENT_RETRIES {
                    world.clock.sleep_until(world.clock.now().plus(Duration::from_secs(60 * u64::from(tries + 1)))).await;
                    this.deliver(payload, key ^ (u64::from(tries + 1) << 40), accepted, tries + 1);
                } else {
                    this.worker_errors.fetch_add(payload.job_count() as u64, Ordering::Relaxed);
                }
            }
            this.running.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

impl SimLambda {
    #[must_use]
    pub fn new(world: Arc<World>, worker: Arc<dyn WorkerHandler>, dispatched_at: Arc<Mutex<Vec<UnixMillis>>>, jobs: usize) -> Self {
        let executions = Executions {
            world: world.clone(),
            worker,
            concurrency: DEFAULT_LAMBDA_CONCURRENCY,
            max_event_age: DEFAULT_MAX_EVENT_AGE,
            crash_share: 0.0,
            running: AtomicU64::default(),
            executing: AtomicU64::default(),
            peak_executing: AtomicU64::default(),
            throttles: AtomicU64::default(),
            aged_out_jobs: AtomicU64::default(),
            worker_errors: AtomicU64::default(),
            crashes: AtomicU64::default(),
        };
        Self {
            world,
            invokes_per_job: Mutex::new(vec![0; jobs]),
            health_checks: AtomicU64::new(0),
            dispatched_at,
            duplicate_delivery: 0.0,
            executions: Arc::new(executions),
        }
    }

    /// The same Lambda delivering `share` of events twice and losing the 202 of `share`
    /// of hand-offs (`--rate-duplicate-delivery`).
    #[must_use]
    pub fn with_duplicate_delivery(self, share: f64) -> Self {
        Self { duplicate_delivery: share, ..self }
    }

    /// The same Lambda running at most `concurrency` executions at once, keeping a
    /// throttled event up to `max_event_age`, and killing `crash_share` of the
    /// executions of a batch part-way.
    ///
    /// # Panics
    /// Once an event was delivered.
    #[must_use]
    pub fn with_executions(self, concurrency: u64, max_event_age: Duration, crash_share: f64) -> Self {
        let mut executions = Arc::into_inner(self.executions).expect("set before use");
        executions.concurrency = concurrency.max(1);
        executions.max_event_age = max_event_age;
        executions.crash_share = crash_share;
        Self { executions: Arc::new(executions), ..self }
    }

    /// Where events run, and what they came to.
    #[must_use]
    pub fn executions(&self) -> &Executions {
        &self.executions
    }

    /// The draw key of this hand-off: per job and occurrence, or per health check.
    fn key(&self, payload: &WorkerPayload) -> u64 {
        match job_number(payload) {
            Some(n) => {
                let mut invokes = lock(&self.invokes_per_job);
                let index = usize::try_from(n).unwrap_or(usize::MAX).min(invokes.len().saturating_sub(1));
                let occurrence = invokes.get_mut(index).map_or(0, |count| {
                    *count += 1;
                    *count
                });
                job_key(n, u64::from(occurrence))
            }
            None => job_key(u64::MAX >> 21, self.health_checks.fetch_add(1, Ordering::Relaxed)),
        }
    }
}

#[async_trait]
impl Invoker for SimLambda {
    async fn invoke(&self, payload: &WorkerPayload, _from_receipt: Option<&str>) -> PortResult<()> {
        self.world.ledger.count("lambda:Invoke", 1);
        {
            let now = self.world.clock.now();
            let mut dispatched_at = lock(&self.dispatched_at);
            for n in payload.batch_calls().iter().flatten().filter_map(job_number) {
                if let Some(at) = usize::try_from(n).ok().and_then(|n| dispatched_at.get_mut(n)) {
                    *at = now;
                }
            }
        }
        let key = self.key(payload);
        self.world.wait(Stream::Invoke, key).await;
        let now = self.world.clock.now();
        self.executions.deliver(payload.clone(), key, now, 0);
        let draw = |salt: u64| self.duplicate_delivery > 0.0 && self.world.sampler.uniform(Stream::Delivery, key ^ salt) < self.duplicate_delivery;
        if draw(0) {
            // Lambda delivers the event again (its own async start).
            self.executions.deliver(payload.clone(), key ^ (1 << 63), now, 0);
        }
        if draw(1 << 62) {
            return Err(PortError::Transient("the invoke's 202 was lost".into()));
        }
        Ok(())
    }
}
