//! A worker batch's outcome records, sent to an SQS results queue one message per job in
//! the shape Lambda's `OnSuccess` destination gives a lone job's (the record is the
//! `responsePayload`), so a producer reads both alike (see `outcome::from_destination`).

use async_trait::async_trait;
use aws_sdk_sqs::types::SendMessageBatchRequestEntry;
use aws_sdk_sqs::Client;

use super::{build_error, map_sdk_error};
use crate::outcome::OutcomeRecord;
use crate::ports::{OutcomeSink, PortError, PortResult};
use crate::time::system_now;

/// Records sent in one `SendMessageBatch` at most: SQS's limit.
const BATCH: usize = 10;
/// The most one `SendMessageBatch` carries (SQS's limit is 256 KiB), with room to spare.
const MAX_BATCH_BYTES: usize = 240 * 1024;

/// The results queue.
#[derive(Clone, Debug)]
pub struct SqsResults {
    client: Client,
    queue_url: String,
}

impl SqsResults {
    #[must_use]
    pub fn new(client: Client, queue_url: impl Into<String>) -> Self {
        Self { client, queue_url: queue_url.into() }
    }

    /// The message body of `record`: a Lambda destination record around it.
    fn body(record: &OutcomeRecord) -> PortResult<String> {
        let body = serde_json::json!({
            "version": "1.0",
            "timestamp": system_now().to_rfc3339(),
            "requestContext": { "condition": "Success", "source": "paceline worker batch" },
            "responsePayload": record,
        });
        serde_json::to_string(&body).map_err(|e| PortError::Fatal(format!("an outcome record as JSON: {e}")))
    }

    async fn send(&self, bodies: &[String]) -> PortResult<()> {
        let entries = bodies
            .iter()
            .enumerate()
            .map(|(i, body)| SendMessageBatchRequestEntry::builder().id(i.to_string()).message_body(body).build().map_err(build_error))
            .collect::<PortResult<Vec<_>>>()?;
        let out = self
            .client
            .send_message_batch()
            .queue_url(&self.queue_url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|e| map_sdk_error("sqs SendMessageBatch (results)", &e))?;
        match out.failed().first() {
            None => Ok(()),
            Some(failed) => Err(PortError::Transient(format!(
                "sqs SendMessageBatch (results): {} record(s) not sent: {}: {}",
                out.failed().len(),
                failed.code(),
                failed.message().unwrap_or("")
            ))),
        }
    }
}

#[async_trait]
impl OutcomeSink for SqsResults {
    async fn record_outcome(&self, record: &OutcomeRecord) -> PortResult<()> {
        self.record_outcomes(std::slice::from_ref(record)).await
    }

    async fn record_outcomes(&self, records: &[OutcomeRecord]) -> PortResult<()> {
        let (mut pending, mut bytes) = (Vec::new(), 0);
        for record in records {
            let body = Self::body(record)?;
            if !pending.is_empty() && (pending.len() == BATCH || bytes + body.len() > MAX_BATCH_BYTES) {
                self.send(&pending).await?;
                (pending, bytes) = (Vec::new(), 0);
            }
            bytes += body.len();
            pending.push(body);
        }
        if pending.is_empty() {
            return Ok(());
        }
        self.send(&pending).await
    }
}
