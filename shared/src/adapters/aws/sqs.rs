//! The jobs queue and its dead-letter queue on SQS.
//!
//! A job's attempt count travels as the `attempt` message attribute (SQS resets its
//! receive count for a re-queued message). Dead letters carry their reason as
//! attributes (`cause`, `detail`, `reason` as JSON) so operators can group them.
//! Every job goes in its lane's message group (a standard queue with groups is an SQS
//! fair queue); FIFO queues (`.fifo`) get a deduplication id too. The worker's own
//! DLQ (Lambda's async on-failure destination) is read for operators, never written.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry, Message, MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
    SendMessageBatchRequestEntry,
};
use aws_sdk_sqs::Client;

use super::{build_error, map_sdk_error};
use crate::dlq::{jobs_record, worker_records, DeadLetterRecord, DlqSource};
use crate::job::DeadLetterReason;
use crate::lane::LaneId;
use crate::order::message_group;
use crate::outcome::OutcomeRecord;
use crate::ports::{DeadLetterQueues, JobQueue, OutgoingMessage, PortError, PortResult, QueueDepth, QueuedMessage, VisibleAgain};
use crate::time::{system_now, UnixMillis};

/// SQS allows at most this many entries per batch call.
const BATCH: usize = 10;
/// The most an SQS message (body and attributes) may hold.
const MAX_MESSAGE_BYTES: usize = 256 * 1024;
/// SQS delays a message at most 15 minutes.
const MAX_DELAY_SECONDS: u64 = 900;

/// The jobs queue and its DLQ.
#[derive(Clone, Debug)]
pub struct SqsQueue {
    client: Client,
    queue_url: String,
    dlq_url: String,
    worker_dlq_url: Option<String>,
}

fn number(value: impl ToString) -> PortResult<MessageAttributeValue> {
    MessageAttributeValue::builder().data_type("Number").string_value(value.to_string()).build().map_err(build_error)
}

fn text(value: impl Into<String>) -> PortResult<MessageAttributeValue> {
    MessageAttributeValue::builder().data_type("String").string_value(value).build().map_err(build_error)
}

fn is_fifo(url: &str) -> bool {
    url.ends_with(".fifo")
}

/// A deduplication id SQS accepts (at most 128 of `A-Za-z0-9` and punctuation): a job id
/// is one (`JobId` allows 1 to 128 visible ASCII characters).
fn fifo_dedup_id(id: &str) -> String {
    id.chars().filter(char::is_ascii_graphic).take(128).collect()
}

impl SqsQueue {
    #[must_use]
    pub fn new(client: Client, queue_url: impl Into<String>, dlq_url: impl Into<String>) -> Self {
        Self { client, queue_url: queue_url.into(), dlq_url: dlq_url.into(), worker_dlq_url: None }
    }

    /// The jobs queue at `queue_url` (another shard's), with this one's client and DLQs.
    #[must_use]
    pub fn at(&self, queue_url: impl Into<String>) -> Self {
        Self { queue_url: queue_url.into(), ..self.clone() }
    }

    /// Adds the worker's DLQ, for operator commands.
    #[must_use]
    pub fn with_worker_dlq(mut self, url: Option<String>) -> Self {
        self.worker_dlq_url = url;
        self
    }

    fn dlq(&self, source: DlqSource) -> PortResult<&str> {
        match source {
            DlqSource::Jobs => Ok(&self.dlq_url),
            DlqSource::Worker => self
                .worker_dlq_url
                .as_deref()
                .ok_or_else(|| PortError::Fatal("no worker DLQ is configured (set worker_dlq_url, or PACELINE_WORKER_DLQ_URL)".into())),
        }
    }

    /// Receives up to `max` messages from `url` with the message attributes named
    /// (`All` for every one) and the time each was sent.
    async fn receive_from(&self, url: &str, max: usize, wait: Duration, visibility: Duration, attributes: &str) -> PortResult<Vec<Message>> {
        let out = self
            .client
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(i32::try_from(max.clamp(1, BATCH)).unwrap_or(10))
            .wait_time_seconds(i32::try_from(wait.as_secs().min(20)).unwrap_or(20))
            .visibility_timeout(i32::try_from(visibility.as_secs().max(1)).unwrap_or(i32::MAX))
            .message_attribute_names(attributes)
            .message_system_attribute_names(MessageSystemAttributeName::SentTimestamp)
            .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
            .send()
            .await
            .map_err(|e| map_sdk_error("sqs ReceiveMessage", &e))?;
        Ok(out.messages.unwrap_or_default())
    }

    /// Each receipt's message visible again in its number of seconds, ten a request.
    async fn change_visibility(&self, url: &str, receipts: &[(&str, i32)]) -> PortResult<()> {
        for batch in receipts.chunks(BATCH) {
            let entries = batch
                .iter()
                .enumerate()
                .map(|(i, (receipt, seconds))| {
                    ChangeMessageVisibilityBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(*receipt)
                        .visibility_timeout(*seconds)
                        .build()
                        .map_err(build_error)
                })
                .collect::<PortResult<Vec<_>>>()?;
            self.client
                .change_message_visibility_batch()
                .queue_url(url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(|e| map_sdk_error("sqs ChangeMessageVisibilityBatch", &e))?;
        }
        Ok(())
    }

    async fn delete_from(&self, url: &str, receipts: &[String]) -> PortResult<()> {
        for batch in receipts.chunks(BATCH) {
            let entries = batch
                .iter()
                .enumerate()
                .map(|(i, r)| DeleteMessageBatchRequestEntry::builder().id(i.to_string()).receipt_handle(r).build().map_err(build_error))
                .collect::<PortResult<Vec<_>>>()?;
            let out = self
                .client
                .delete_message_batch()
                .queue_url(url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(|e| map_sdk_error("sqs DeleteMessageBatch", &e))?;
            // An expired receipt is not ours to delete any more; anything else is retried.
            if let Some(failed) = out.failed().iter().find(|f| f.code() != "ReceiptHandleIsInvalid") {
                return Err(PortError::Transient(format!("sqs DeleteMessageBatch: {}: {}", failed.code(), failed.message().unwrap_or(""))));
            }
        }
        Ok(())
    }

    async fn counts(&self, url: &str) -> PortResult<(u64, u64)> {
        let out = self
            .client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
            .send()
            .await
            .map_err(|e| map_sdk_error("sqs GetQueueAttributes", &e))?;
        let attributes = out.attributes().cloned().unwrap_or_default();
        let get = |name: QueueAttributeName| attributes.get(&name).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        Ok((
            get(QueueAttributeName::ApproximateNumberOfMessages),
            get(QueueAttributeName::ApproximateNumberOfMessagesNotVisible) + get(QueueAttributeName::ApproximateNumberOfMessagesDelayed),
        ))
    }
}

#[async_trait]
impl JobQueue for SqsQueue {
    async fn receive(&self, max: usize, wait: Duration, visibility: Duration) -> PortResult<Vec<QueuedMessage>> {
        let messages = self.receive_from(&self.queue_url, max, wait, visibility, "attempt").await?;
        Ok(messages
            .iter()
            .map(|m| QueuedMessage {
                message_id: m.message_id().unwrap_or_default().to_owned(),
                receipt: m.receipt_handle().unwrap_or_default().to_owned(),
                body: m.body().unwrap_or_default().to_owned(),
                attempt: m.message_attributes().and_then(|a| a.get("attempt")).and_then(|v| v.string_value()).and_then(|v| v.parse().ok()).unwrap_or(0),
                enqueued_at: sent_timestamp(m),
                group: m.attributes().and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId)).cloned(),
            })
            .collect())
    }

    async fn delete(&self, receipts: &[String]) -> PortResult<()> {
        self.delete_from(&self.queue_url, receipts).await
    }

    async fn release(&self, messages: &[VisibleAgain]) -> PortResult<()> {
        // SQS counts visibility in whole seconds: never sooner than asked.
        let seconds = |after: Duration| i32::try_from(after.as_millis().div_ceil(1000)).unwrap_or(i32::MAX);
        let receipts: Vec<(&str, i32)> = messages.iter().map(|m| (m.receipt.as_str(), seconds(m.after))).collect();
        self.change_visibility(&self.queue_url, &receipts).await
    }

    async fn send(&self, messages: &[OutgoingMessage]) -> PortResult<()> {
        let fifo = is_fifo(&self.queue_url);
        for batch in messages.chunks(BATCH) {
            // In the batch's order: a FIFO queue keeps a group's messages in the order of
            // the entries that carry them.
            let mut pending: BTreeMap<usize, SendMessageBatchRequestEntry> = BTreeMap::new();
            for (i, m) in batch.iter().enumerate() {
                let mut entry =
                    SendMessageBatchRequestEntry::builder().id(i.to_string()).message_body(&m.body).message_attributes("attempt", number(m.attempt)?);
                // The job's lane is its message group: a standard queue is then a fair
                // queue (SQS favours the quiet lanes' messages when one lane's backlog
                // is most of what is in flight); a FIFO queue keeps each lane in order.
                // An ordered lane's retry has a group of its own, which the lane's later
                // jobs, held while it is called, do not hold back.
                entry = entry.message_group_id(message_group(&LaneId::named_in(&m.body), m.ahead));
                if fifo {
                    let dedup_id = m.dedup_id.as_deref().map_or_else(|| uuid::Uuid::new_v4().to_string(), fifo_dedup_id);
                    entry = entry.message_deduplication_id(dedup_id);
                } else {
                    entry = entry.delay_seconds(i32::try_from(m.delay.as_secs().min(MAX_DELAY_SECONDS)).unwrap_or(0));
                }
                pending.insert(i, entry.build().map_err(build_error)?);
            }
            // Entries that failed for a passing reason are sent once more.
            for round in 0..2 {
                let out = self
                    .client
                    .send_message_batch()
                    .queue_url(&self.queue_url)
                    .set_entries(Some(pending.values().cloned().collect()))
                    .send()
                    .await
                    .map_err(|e| map_sdk_error("sqs SendMessageBatch", &e))?;
                for ok in out.successful() {
                    if let Ok(i) = ok.id().parse::<usize>() {
                        pending.remove(&i);
                    }
                }
                if pending.is_empty() {
                    break;
                }
                if round == 1 || out.failed().iter().any(|f| f.sender_fault()) {
                    let reason = out.failed().first().map(|f| format!("{}: {}", f.code(), f.message().unwrap_or(""))).unwrap_or_default();
                    return Err(PortError::Transient(format!("sqs SendMessageBatch: {} message(s) not sent: {reason}", pending.len())));
                }
            }
        }
        Ok(())
    }

    async fn dead_letter(&self, message_id: &str, body: &str, attempt: u32, reason: &DeadLetterReason) -> PortResult<()> {
        let detail: String = reason.detail.chars().take(1000).collect();
        let outcome = reason.outcome.as_deref().and_then(|outcome| outcome_attribute(outcome, body.len()));
        let reason = DeadLetterReason { outcome: None, ..reason.clone() };
        let mut request = self
            .client
            .send_message()
            .queue_url(&self.dlq_url)
            .message_body(body)
            .message_attributes("attempt", number(attempt)?)
            .message_attributes("cause", text(reason.cause.label())?)
            .message_attributes("detail", text(if detail.is_empty() { "-".to_owned() } else { detail })?)
            .message_attributes("reason", text(serde_json::to_string(&reason).unwrap_or_default())?)
            .message_attributes("original_message_id", text(if message_id.is_empty() { "-" } else { message_id })?)
            .message_attributes("dead_at", number(system_now().0)?);
        if let Some(outcome) = outcome {
            request = request.message_attributes("outcome", text(outcome)?);
        }
        if is_fifo(&self.dlq_url) {
            request = request.message_group_id("paceline-dlq").message_deduplication_id(uuid::Uuid::new_v4().to_string());
        }
        request.send().await.map_err(|e| map_sdk_error("sqs SendMessage (DLQ)", &e))?;
        Ok(())
    }

    /// Every job goes in its lane's message group: a standard queue is then a fair queue
    /// (a FIFO queue holds a group back while one of its messages is in flight instead).
    fn serves_groups_fairly(&self) -> bool {
        !is_fifo(&self.queue_url)
    }

    async fn depth(&self) -> PortResult<QueueDepth> {
        let (visible, not_visible) = self.counts(&self.queue_url).await?;
        let (dead_visible, dead_hidden) = self.counts(&self.dlq_url).await?;
        Ok(QueueDepth { visible, not_visible, dead: dead_visible + dead_hidden })
    }
}

/// A dead letter's outcome record as its `outcome` attribute, when it fits beside a body
/// of `body_len` bytes in an SQS message (without the answer's body if only that fits).
fn outcome_attribute(outcome: &OutcomeRecord, body_len: usize) -> Option<String> {
    // What the other attributes and their names take, with room to spare.
    const OTHER_ATTRIBUTES: usize = 4 * 1024;
    let fits = |text: &String| body_len + text.len() + OTHER_ATTRIBUTES <= MAX_MESSAGE_BYTES;
    let whole = outcome.to_json();
    if fits(&whole) {
        return Some(whole);
    }
    let without_body = OutcomeRecord { body: None, body_base64: false, truncated: true, ..outcome.clone() }.to_json();
    fits(&without_body).then_some(without_body)
}

/// When SQS says the message was sent (now, if it does not say).
fn sent_timestamp(m: &Message) -> UnixMillis {
    m.attributes().and_then(|a| a.get(&MessageSystemAttributeName::SentTimestamp)).and_then(|v| v.parse().ok()).map_or_else(system_now, UnixMillis)
}

fn attribute<'a>(m: &'a Message, name: &str) -> Option<&'a str> {
    m.message_attributes().and_then(|a| a.get(name)).and_then(|v| v.string_value())
}

#[async_trait]
impl DeadLetterQueues for SqsQueue {
    fn sources(&self) -> Vec<DlqSource> {
        let mut sources = vec![DlqSource::Jobs];
        if self.worker_dlq_url.is_some() {
            sources.push(DlqSource::Worker);
        }
        sources
    }

    async fn page(&self, source: DlqSource, _after: Option<&str>, max: usize, hold: Duration) -> PortResult<Vec<DeadLetterRecord>> {
        let url = self.dlq(source)?;
        // Long polling: short polling may answer "empty" from a sample of servers.
        let messages = self.receive_from(url, max, Duration::from_secs(1), hold, "All").await?;
        Ok(messages
            .iter()
            .flat_map(|m| {
                let handle = m.receipt_handle().unwrap_or_default().to_owned();
                let message_id = m.message_id().unwrap_or_default().to_owned();
                let body = m.body().unwrap_or_default().to_owned();
                let sent_at = sent_timestamp(m);
                match source {
                    DlqSource::Worker => worker_records(handle, message_id, body, sent_at),
                    DlqSource::Jobs => {
                        // A message SQS itself moved here (redrive policy) has no reason
                        // attributes: it was received too often without being deleted.
                        let cause = attribute(m, "cause").unwrap_or("max_receives").to_owned();
                        let detail = attribute(m, "detail").filter(|d| *d != "-").unwrap_or_default().to_owned();
                        let attempt = attribute(m, "attempt").and_then(|v| v.parse().ok()).unwrap_or(0);
                        let dead_at = attribute(m, "dead_at").and_then(|v| v.parse().ok()).map_or(sent_at, UnixMillis);
                        let outcome = attribute(m, "outcome").and_then(|text| serde_json::from_str(text).ok());
                        vec![jobs_record(handle, message_id, body, attempt, cause, detail, dead_at).with_outcome(outcome)]
                    }
                }
            })
            .collect())
    }

    async fn unhide(&self, source: DlqSource, handles: &[String]) -> PortResult<()> {
        let now: Vec<(&str, i32)> = handles.iter().map(|handle| (handle.as_str(), 0)).collect();
        self.change_visibility(self.dlq(source)?, &now).await
    }

    async fn put_back(&self, source: DlqSource, body: &str) -> PortResult<()> {
        self.client
            .send_message()
            .queue_url(self.dlq(source)?)
            .message_body(body)
            .send()
            .await
            .map_err(|e| map_sdk_error("sqs SendMessage (a dead letter's rest)", &e))?;
        Ok(())
    }

    async fn remove(&self, source: DlqSource, handles: &[String]) -> PortResult<()> {
        self.delete_from(self.dlq(source)?, handles).await
    }

    async fn count(&self, source: DlqSource) -> PortResult<u64> {
        let (visible, hidden) = self.counts(self.dlq(source)?).await?;
        Ok(visible + hidden)
    }
}
