//! Request shape and error mapping of the AWS adapters, with aws-smithy-mocks (no
//! network). The round trip against an emulator is in `tests/`.

use std::time::Duration;

use aws_sdk_dynamodb::operation::get_item::GetItemOutput;
use aws_sdk_dynamodb::operation::put_item::{PutItemError, PutItemOutput};
use aws_sdk_dynamodb::operation::update_item::{UpdateItemError, UpdateItemOutput};
use aws_sdk_dynamodb::types::error::ConditionalCheckFailedException;
use aws_sdk_dynamodb::types::AttributeValue;
use aws_sdk_lambda::operation::invoke::{InvokeError, InvokeOutput};
use aws_sdk_lambda::types::error::TooManyRequestsException;
use aws_sdk_sqs::operation::delete_message_batch::DeleteMessageBatchOutput;
use aws_sdk_sqs::types::BatchResultErrorEntry;
use aws_smithy_mocks::{mock, mock_client, RuleMode};

use super::*;
use crate::breaker::Circuit;
use crate::job::WorkerPayload;
use crate::ports::{Invoker, JobQueue, StateStore};
use crate::time::UnixMillis;

/// Errors as the SDK parses them off the wire: with their code in the metadata.
fn meta(code: &str) -> aws_sdk_dynamodb::error::ErrorMetadata {
    aws_sdk_dynamodb::error::ErrorMetadata::builder().code(code).message("mocked").build()
}

fn conditional_failed() -> ConditionalCheckFailedException {
    ConditionalCheckFailedException::builder().message("The conditional request failed").meta(meta("ConditionalCheckFailedException")).build()
}

#[tokio::test]
async fn a_held_lease_is_a_conflict_naming_its_holder() {
    let update = mock!(aws_sdk_dynamodb::Client::update_item)
        .match_requests(|r| {
            r.table_name() == Some("lane")
                && r.condition_expression() == Some("attribute_not_exists(pk) OR expires_at <= :now")
                && r.update_expression().is_some_and(|e| e.contains("ADD epoch :one"))
        })
        .then_error(|| UpdateItemError::ConditionalCheckFailedException(conditional_failed()));
    let get = mock!(aws_sdk_dynamodb::Client::get_item).then_output(|| {
        GetItemOutput::builder()
            .item("pk", AttributeValue::S("lease".into()))
            .item("holder", AttributeValue::S("orchestrator-abc".into()))
            .item("epoch", AttributeValue::N("7".into()))
            .item("expires_at", AttributeValue::N("99000".into()))
            .build()
    });
    let client = mock_client!(aws_sdk_dynamodb, RuleMode::MatchAny, [&update, &get]);
    let store = DynamoStateStore::new(client, "lane");
    let err = store.acquire_lease("me", Duration::from_secs(30), UnixMillis(1_000)).await.unwrap_err();
    assert!(matches!(&err, PortError::Conflict(why) if why.contains("orchestrator-abc")), "{err}");
    assert_eq!(update.num_calls(), 1);
}

#[tokio::test]
async fn acquiring_returns_the_new_epoch() {
    let update = mock!(aws_sdk_dynamodb::Client::update_item).then_output(|| {
        UpdateItemOutput::builder()
            .attributes("holder", AttributeValue::S("me".into()))
            .attributes("epoch", AttributeValue::N("8".into()))
            .attributes("expires_at", AttributeValue::N("31000".into()))
            .build()
    });
    let store = DynamoStateStore::new(mock_client!(aws_sdk_dynamodb, [&update]), "lane");
    let lease = store.acquire_lease("me", Duration::from_secs(30), UnixMillis(1_000)).await.unwrap();
    assert_eq!((lease.epoch, lease.expires_at), (8, UnixMillis(31_000)));
}

#[tokio::test]
async fn circuit_swaps_are_conditioned_on_the_epoch_and_map_failures_to_conflict() {
    let swap = mock!(aws_sdk_dynamodb::Client::put_item)
        .match_requests(|r| {
            r.condition_expression() == Some("epoch = :expected")
                && r.expression_attribute_values().and_then(|v| v.get(":expected")) == Some(&AttributeValue::N("3".into()))
                && r.item().and_then(|i| i.get("epoch")) == Some(&AttributeValue::N("4".into()))
        })
        .then_error(|| PutItemError::ConditionalCheckFailedException(conditional_failed()));
    let store = DynamoStateStore::new(mock_client!(aws_sdk_dynamodb, [&swap]), "lane");
    let open = Circuit { epoch: 3, ..Circuit::default() }.open(3, "HTTP 503", UnixMillis(5)).unwrap();
    assert!(matches!(store.swap_circuit(3, &open).await, Err(PortError::Conflict(_))));

    let first = mock!(aws_sdk_dynamodb::Client::put_item)
        .match_requests(|r| r.condition_expression() == Some("attribute_not_exists(epoch) OR epoch = :expected"))
        .then_output(|| PutItemOutput::builder().build());
    let store = DynamoStateStore::new(mock_client!(aws_sdk_dynamodb, [&first]), "lane");
    store.swap_circuit(0, &Circuit::default().open(0, "timeout", UnixMillis(5)).unwrap()).await.unwrap();
    assert_eq!(first.num_calls(), 1);
}

#[tokio::test]
async fn a_cool_down_that_is_already_later_is_not_an_error() {
    let update = mock!(aws_sdk_dynamodb::Client::update_item)
        .match_requests(|r| r.condition_expression() == Some("attribute_not_exists(#until) OR #until < :u"))
        .then_error(|| UpdateItemError::ConditionalCheckFailedException(conditional_failed()));
    let store = DynamoStateStore::new(mock_client!(aws_sdk_dynamodb, [&update]), "lane");
    store.extend_cool_down(UnixMillis(10)).await.unwrap();
    assert_eq!(update.num_calls(), 1);
}

#[tokio::test]
async fn invokes_are_async_events_and_throttling_is_typed() {
    let job = crate::job::Job::parse(r#"{"id":"j","request":{"method":"GET","path":"/"}}"#).unwrap();
    let payload = WorkerPayload::Job { job, attempt: 0, circuit_epoch: 0, dispatched_at: UnixMillis(1), slot: None, trip: None, report_limits: false };
    let accepted = mock!(aws_sdk_lambda::Client::invoke)
        .match_requests(|r| {
            r.function_name() == Some("worker")
                && r.invocation_type() == Some(&aws_sdk_lambda::types::InvocationType::Event)
                && r.payload().is_some_and(|p| p.as_ref().starts_with(b"{\"v\":2"))
        })
        .then_output(|| InvokeOutput::builder().status_code(202).build());
    let invoker = LambdaInvoker::new(mock_client!(aws_sdk_lambda, [&accepted]), "worker");
    invoker.invoke(&payload, None).await.unwrap();
    assert_eq!(accepted.num_calls(), 1);

    let throttled = mock!(aws_sdk_lambda::Client::invoke).then_error(|| {
        InvokeError::TooManyRequestsException(TooManyRequestsException::builder().message("Rate exceeded").meta(meta("TooManyRequestsException")).build())
    });
    let invoker = LambdaInvoker::new(mock_client!(aws_sdk_lambda, [&throttled]), "worker");
    assert!(matches!(invoker.invoke(&payload, None).await, Err(PortError::Throttled(_))));
}

#[tokio::test]
async fn expired_receipts_are_ignored_but_other_delete_failures_are_retried() {
    let failed = |code: &'static str| {
        mock!(aws_sdk_sqs::Client::delete_message_batch).then_output(move || {
            DeleteMessageBatchOutput::builder()
                .failed(BatchResultErrorEntry::builder().id("0").code(code).sender_fault(true).build().unwrap())
                .set_successful(Some(vec![]))
                .build()
                .unwrap()
        })
    };
    let expired = failed("ReceiptHandleIsInvalid");
    let queue = SqsQueue::new(mock_client!(aws_sdk_sqs, [&expired]), "https://q", "https://dlq");
    queue.delete(&["r1".into()]).await.unwrap();
    let other = failed("InternalError");
    let queue = SqsQueue::new(mock_client!(aws_sdk_sqs, [&other]), "https://q", "https://dlq");
    assert!(matches!(queue.delete(&["r1".into()]).await, Err(PortError::Transient(_))));
}

#[test]
fn error_codes_map_by_what_the_caller_can_do() {
    assert!(matches!(classify_code("x", "ThrottlingException", ""), PortError::Throttled(_)));
    assert!(matches!(classify_code("x", "ProvisionedThroughputExceededException", ""), PortError::Throttled(_)));
    assert!(matches!(classify_code("x", "TransactionCanceledException", ""), PortError::Conflict(_)));
    assert!(matches!(classify_code("x", "ServiceException", ""), PortError::Transient(_)));
    assert!(matches!(classify_code("x", "ResourceNotFoundException", "no such table"), PortError::Fatal(_)));
    assert!(matches!(classify_code("x", "RequestTooLargeException", "payload over 262144 bytes"), PortError::TooLarge(_)));
    assert!(matches!(classify_code("x", "InvalidParameterValue", "Message must be shorter than 262144 bytes."), PortError::TooLarge(_)));
}

/// A receive while the queue holds its most messages in flight (about 120,000 on a
/// standard queue) is refused with `OverLimit` until some are deleted or visible again:
/// the run waits and receives again, it does not end.
#[tokio::test]
async fn a_receive_over_the_queues_messages_in_flight_waits_and_does_not_end_the_run() {
    use aws_sdk_sqs::operation::receive_message::ReceiveMessageError;
    use aws_sdk_sqs::types::error::OverLimit;
    let over = mock!(aws_sdk_sqs::Client::receive_message).then_error(|| {
        let meta = aws_sdk_sqs::error::ErrorMetadata::builder().code("OverLimit").message("too many messages in flight").build();
        ReceiveMessageError::OverLimit(OverLimit::builder().message("too many messages in flight").meta(meta).build())
    });
    let queue = SqsQueue::new(mock_client!(aws_sdk_sqs, [&over]), "https://q", "https://dlq");
    let refused = queue.receive(10, Duration::ZERO, Duration::from_secs(60)).await;
    assert!(matches!(refused, Err(PortError::Throttled(_))), "{refused:?}");
}
