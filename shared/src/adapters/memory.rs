//! In-memory doubles for tests: an invoker that records every hand-off with its time,
//! can refuse some with scripted errors, and can pass payloads on to a worker.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use crate::job::WorkerPayload;
use crate::outcome::OutcomeRecord;
use crate::ports::{Invoker, PortError, PortResult, WorkerHandler};
use crate::time::{Clock, UnixMillis};

/// Records each accepted invocation as `(time, payload)`.
pub struct RecordingInvoker {
    clock: Arc<dyn Clock>,
    accepted: Mutex<Vec<(UnixMillis, WorkerPayload)>>,
    scripted_errors: Mutex<VecDeque<PortError>>,
    forward_to: Option<Arc<dyn WorkerHandler>>,
    latency: std::time::Duration,
    /// Each pace the orchestrator said it hands off at, with when.
    paces: Mutex<Vec<(UnixMillis, f64)>>,
}

impl RecordingInvoker {
    #[must_use]
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            accepted: Mutex::default(),
            scripted_errors: Mutex::default(),
            forward_to: None,
            latency: std::time::Duration::ZERO,
            paces: Mutex::default(),
        }
    }

    /// Answers each invoke only after `latency` (recorded at the call, like Lambda's
    /// clock would see the request).
    #[must_use]
    pub fn with_latency(mut self, latency: std::time::Duration) -> Self {
        self.latency = latency;
        self
    }

    /// Also runs each accepted payload on `handler` (awaited inline).
    #[must_use]
    pub fn forwarding_to(mut self, handler: Arc<dyn WorkerHandler>) -> Self {
        self.forward_to = Some(handler);
        self
    }

    /// The next invocations fail with these errors, in order, before any is accepted.
    pub fn fail_next(&self, errors: impl IntoIterator<Item = PortError>) {
        self.scripted_errors.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend(errors);
    }

    /// Every accepted invocation so far.
    #[must_use]
    pub fn accepted(&self) -> Vec<(UnixMillis, WorkerPayload)> {
        self.accepted.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Every pace the orchestrator said it hands off at (`Invoker::pace_changed`), with
    /// when.
    #[must_use]
    pub fn paces(&self) -> Vec<(UnixMillis, f64)> {
        self.paces.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

#[async_trait]
impl Invoker for RecordingInvoker {
    async fn invoke(&self, payload: &WorkerPayload, _from_receipt: Option<&str>) -> PortResult<()> {
        if let Some(error) = self.scripted_errors.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop_front() {
            return Err(error);
        }
        self.accepted.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((self.clock.now(), payload.clone()));
        if let Some(handler) = &self.forward_to {
            handler.handle(payload.clone()).await?;
        }
        if !self.latency.is_zero() {
            let until = self.clock.now().plus(self.latency);
            self.clock.sleep_until(until).await;
        }
        Ok(())
    }

    fn pace_changed(&self, per_second: f64) {
        self.paces.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((self.clock.now(), per_second));
    }
}

/// A worker that records each payload it runs and does nothing else.
#[derive(Default)]
pub struct RecordingWorker {
    ran: Mutex<Vec<WorkerPayload>>,
}

impl RecordingWorker {
    /// Every payload run so far, in order.
    #[must_use]
    pub fn ran(&self) -> Vec<WorkerPayload> {
        self.ran.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

#[async_trait]
impl WorkerHandler for RecordingWorker {
    async fn handle(&self, payload: WorkerPayload) -> PortResult<Option<OutcomeRecord>> {
        self.ran.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(payload);
        Ok(None)
    }
}
