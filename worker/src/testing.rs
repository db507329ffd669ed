//! Test doubles of the worker's ports, for this crate's tests and the workspace's
//! (feature `test-util`).

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use paceline_shared::job::ApiRequest;
use paceline_shared::time::{Clock, UnixMillis};

use crate::{Api, ApiError, CallResult, CappedBody};

/// The API: answers 200 at once and records when each call was made.
pub struct InstantApi {
    clock: Arc<dyn Clock>,
    calls: Mutex<Vec<UnixMillis>>,
}

impl InstantApi {
    #[must_use]
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self { clock, calls: Mutex::default() }
    }

    /// When each call was made, in order.
    #[must_use]
    pub fn calls(&self) -> Vec<UnixMillis> {
        self.calls.lock().expect("not poisoned").clone()
    }
}

#[async_trait]
impl Api for InstantApi {
    async fn call(&self, _request: &ApiRequest, _job_id: Option<&str>) -> Result<CallResult, ApiError> {
        self.calls.lock().expect("not poisoned").push(self.clock.now());
        Ok(CallResult::Response { status: 200, headers: Vec::new(), body: CappedBody::default() })
    }
}
