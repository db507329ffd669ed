//! The hand-off: an asynchronous (`Event`) Lambda invoke. Lambda answers 202 once the
//! event is queued durably on its side; throttling and faults come back as typed port
//! errors so the drain loop retries them with backoff instead of dropping a job.

use async_trait::async_trait;
use aws_sdk_lambda::primitives::Blob;
use aws_sdk_lambda::types::InvocationType;
use aws_sdk_lambda::Client;

use super::map_sdk_error;
use crate::job::WorkerPayload;
use crate::ports::{Invoker, PortError, PortResult};

/// Invokes the worker function.
#[derive(Clone, Debug)]
pub struct LambdaInvoker {
    client: Client,
    function: String,
}

impl LambdaInvoker {
    #[must_use]
    pub fn new(client: Client, function: impl Into<String>) -> Self {
        Self { client, function: function.into() }
    }

    /// The same client, invoking another function (an operator's kick of the orchestrator).
    #[must_use]
    pub fn for_function(&self, function: impl Into<String>) -> Self {
        Self { client: self.client.clone(), function: function.into() }
    }

    /// The function's environment variables, as deployed (an operator reads a stack's
    /// lanes from its orchestrator's).
    ///
    /// # Errors
    /// The function cannot be read.
    pub async fn environment(&self) -> PortResult<std::collections::BTreeMap<String, String>> {
        let out = self
            .client
            .get_function_configuration()
            .function_name(&self.function)
            .send()
            .await
            .map_err(|e| map_sdk_error("lambda GetFunctionConfiguration", &e))?;
        Ok(out.environment().and_then(|env| env.variables()).map(|vars| vars.iter().map(|(k, v)| (k.clone(), v.clone())).collect()).unwrap_or_default())
    }

    /// Hands `payload` (JSON) to the function asynchronously.
    ///
    /// # Errors
    /// As for [`Invoker::invoke`].
    pub async fn invoke_event(&self, payload: String) -> PortResult<()> {
        let out = self
            .client
            .invoke()
            .function_name(&self.function)
            .invocation_type(InvocationType::Event)
            .payload(Blob::new(payload))
            .send()
            .await
            .map_err(|e| map_sdk_error("lambda Invoke", &e))?;
        match out.status_code() {
            202 => Ok(()),
            status => Err(PortError::Transient(format!("lambda Invoke: expected 202 for an Event invoke, got {status}"))),
        }
    }
}

#[async_trait]
impl Invoker for LambdaInvoker {
    async fn invoke(&self, payload: &WorkerPayload, _from_receipt: Option<&str>) -> PortResult<()> {
        self.invoke_event(payload.to_json()).await
    }
}
