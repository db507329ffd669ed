//! Fault injection for tests: [`Faulty`] wraps any adapter and makes the next calls of
//! a chosen port method fail with a chosen error (or panic), counting every call.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;

use crate::adaptive::ProviderReading;
use crate::breaker::Circuit;
use crate::job::{DeadLetterReason, WorkerPayload};
use crate::ports::{
    BatchClaim, BatchProgress, CallClaim, Invoker, JobQueue, Lease, OutgoingMessage, PacerSnapshot, PortError, PortResult, QueueDepth, QueuedMessage,
    StateStore, VisibleAgain,
};
use crate::time::UnixMillis;

/// A port method, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Method {
    Receive,
    Delete,
    Release,
    Send,
    DeadLetter,
    Depth,
    AcquireLease,
    RenewLease,
    ReleaseLease,
    Lease,
    LoadUsage,
    AddUsage,
    LoadPacer,
    SavePacer,
    Circuit,
    SwapCircuit,
    CoolDown,
    ExtendCoolDown,
    ClearCoolDown,
    ProviderReading,
    RecordProviderReading,
    ClaimCall,
    FinishCall,
    ClaimBatch,
    SaveBatch,
    ReleaseCall,
    ForgetCall,
    TakeCallSlot,
    ReleaseCallSlot,
    CallSlotsInUse,
    Invoke,
}

/// What an injected fault does.
#[derive(Clone, Debug)]
enum Fault {
    Fail(PortError),
    Panic,
}

/// An adapter whose calls fail on request.
pub struct Faulty<T: ?Sized> {
    inner: Arc<T>,
    faults: Mutex<HashMap<Method, VecDeque<Fault>>>,
    calls: Mutex<HashMap<Method, u64>>,
}

impl<T: ?Sized> Faulty<T> {
    #[must_use]
    pub fn new(inner: Arc<T>) -> Self {
        Self { inner, faults: Mutex::default(), calls: Mutex::default() }
    }

    /// The next `n` calls of `method` fail with `error` (after any faults already queued).
    pub fn fail_next(&self, method: Method, n: usize, error: &PortError) {
        self.queue(method, n, &Fault::Fail(error.clone()));
    }

    /// The next call of `method` panics, as a bug in an adapter would.
    pub fn panic_next(&self, method: Method) {
        self.queue(method, 1, &Fault::Panic);
    }

    fn queue(&self, method: Method, n: usize, fault: &Fault) {
        let mut faults = self.faults.lock().unwrap_or_else(PoisonError::into_inner);
        faults.entry(method).or_default().extend(std::iter::repeat_n(fault.clone(), n));
    }

    /// How many times `method` was called, failed calls included.
    #[must_use]
    pub fn calls(&self, method: Method) -> u64 {
        self.calls.lock().unwrap_or_else(PoisonError::into_inner).get(&method).copied().unwrap_or(0)
    }

    /// Counts a call of `method` and plays its next fault, if one is queued.
    fn call(&self, method: Method) -> PortResult<()> {
        *self.calls.lock().unwrap_or_else(PoisonError::into_inner).entry(method).or_default() += 1;
        let fault = self.faults.lock().unwrap_or_else(PoisonError::into_inner).get_mut(&method).and_then(VecDeque::pop_front);
        match fault {
            None => Ok(()),
            Some(Fault::Fail(error)) => Err(error),
            Some(Fault::Panic) => panic!("injected panic in {method:?}"),
        }
    }
}

#[async_trait]
impl<T: JobQueue + ?Sized> JobQueue for Faulty<T> {
    async fn receive(&self, max: usize, wait: Duration, visibility: Duration) -> PortResult<Vec<QueuedMessage>> {
        self.call(Method::Receive)?;
        self.inner.receive(max, wait, visibility).await
    }
    async fn delete(&self, receipts: &[String]) -> PortResult<()> {
        self.call(Method::Delete)?;
        self.inner.delete(receipts).await
    }
    async fn release(&self, messages: &[VisibleAgain]) -> PortResult<()> {
        self.call(Method::Release)?;
        self.inner.release(messages).await
    }
    async fn send(&self, messages: &[OutgoingMessage]) -> PortResult<()> {
        self.call(Method::Send)?;
        self.inner.send(messages).await
    }
    async fn dead_letter(&self, message_id: &str, body: &str, attempt: u32, reason: &DeadLetterReason) -> PortResult<()> {
        self.call(Method::DeadLetter)?;
        self.inner.dead_letter(message_id, body, attempt, reason).await
    }
    async fn depth(&self) -> PortResult<QueueDepth> {
        self.call(Method::Depth)?;
        self.inner.depth().await
    }
}

#[async_trait]
impl<T: StateStore + ?Sized> StateStore for Faulty<T> {
    async fn acquire_lease(&self, holder: &str, ttl: Duration, now: UnixMillis) -> PortResult<Lease> {
        self.call(Method::AcquireLease)?;
        self.inner.acquire_lease(holder, ttl, now).await
    }
    async fn renew_lease(&self, lease: &Lease, ttl: Duration, now: UnixMillis) -> PortResult<Lease> {
        self.call(Method::RenewLease)?;
        self.inner.renew_lease(lease, ttl, now).await
    }
    async fn release_lease(&self, lease: &Lease) -> PortResult<()> {
        self.call(Method::ReleaseLease)?;
        self.inner.release_lease(lease).await
    }
    async fn lease(&self) -> PortResult<Option<Lease>> {
        self.call(Method::Lease)?;
        self.inner.lease().await
    }
    async fn load_usage(&self, keys: &[String]) -> PortResult<Vec<u64>> {
        self.call(Method::LoadUsage)?;
        self.inner.load_usage(keys).await
    }
    async fn add_usage(&self, deltas: &[(String, i64)]) -> PortResult<()> {
        self.call(Method::AddUsage)?;
        self.inner.add_usage(deltas).await
    }
    async fn load_pacer(&self) -> PortResult<Option<PacerSnapshot>> {
        self.call(Method::LoadPacer)?;
        self.inner.load_pacer().await
    }
    async fn save_pacer(&self, lease: &Lease, snapshot: &PacerSnapshot) -> PortResult<()> {
        self.call(Method::SavePacer)?;
        self.inner.save_pacer(lease, snapshot).await
    }
    async fn circuit(&self) -> PortResult<Circuit> {
        self.call(Method::Circuit)?;
        self.inner.circuit().await
    }
    async fn swap_circuit(&self, expected_epoch: u64, next: &Circuit) -> PortResult<()> {
        self.call(Method::SwapCircuit)?;
        self.inner.swap_circuit(expected_epoch, next).await
    }
    async fn cool_down(&self) -> PortResult<UnixMillis> {
        self.call(Method::CoolDown)?;
        self.inner.cool_down().await
    }
    async fn extend_cool_down(&self, until: UnixMillis) -> PortResult<()> {
        self.call(Method::ExtendCoolDown)?;
        self.inner.extend_cool_down(until).await
    }
    async fn clear_cool_down(&self) -> PortResult<()> {
        self.call(Method::ClearCoolDown)?;
        self.inner.clear_cool_down().await
    }
    async fn provider_reading(&self) -> PortResult<Option<ProviderReading>> {
        self.call(Method::ProviderReading)?;
        self.inner.provider_reading().await
    }
    async fn record_provider_reading(&self, reading: &ProviderReading) -> PortResult<()> {
        self.call(Method::RecordProviderReading)?;
        self.inner.record_provider_reading(reading).await
    }
    async fn claim_call(&self, key: &str, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<CallClaim> {
        self.call(Method::ClaimCall)?;
        self.inner.claim_call(key, holder, now, expires_at).await
    }
    async fn finish_call(&self, key: &str, keep_until: UnixMillis) -> PortResult<()> {
        self.call(Method::FinishCall)?;
        self.inner.finish_call(key, keep_until).await
    }
    async fn claim_batch(&self, key: &str, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<BatchClaim> {
        self.call(Method::ClaimBatch)?;
        self.inner.claim_batch(key, holder, now, expires_at).await
    }
    async fn save_batch(&self, key: &str, holder: &str, progress: &BatchProgress, expires_at: UnixMillis) -> PortResult<()> {
        self.call(Method::SaveBatch)?;
        self.inner.save_batch(key, holder, progress, expires_at).await
    }
    async fn release_call(&self, key: &str, holder: &str) -> PortResult<()> {
        self.call(Method::ReleaseCall)?;
        self.inner.release_call(key, holder).await
    }
    async fn forget_call(&self, key: &str) -> PortResult<()> {
        self.call(Method::ForgetCall)?;
        self.inner.forget_call(key).await
    }
    async fn take_call_slot(&self, capacity: u32, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<Option<u32>> {
        self.call(Method::TakeCallSlot)?;
        self.inner.take_call_slot(capacity, holder, now, expires_at).await
    }
    async fn release_call_slot(&self, index: u32, holder: &str) -> PortResult<()> {
        self.call(Method::ReleaseCallSlot)?;
        self.inner.release_call_slot(index, holder).await
    }
    async fn call_slots_in_use(&self, capacity: u32, now: UnixMillis) -> PortResult<u32> {
        self.call(Method::CallSlotsInUse)?;
        self.inner.call_slots_in_use(capacity, now).await
    }
}

#[async_trait]
impl<T: Invoker + ?Sized> Invoker for Faulty<T> {
    async fn invoke(&self, payload: &WorkerPayload, from_receipt: Option<&str>) -> PortResult<()> {
        self.call(Method::Invoke)?;
        self.inner.invoke(payload, from_receipt).await
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }
}
