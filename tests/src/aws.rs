//! The AWS side of the end-to-end tests: an SDK configuration pointed at the moto server
//! (`PACELINE_TEST_MOTO_URL`, started by `scripts/test.sh`), a lane's queues and table
//! created there, and a fake Lambda Invoke endpoint that answers 202 at once, records
//! every invocation with its time, runs the worker, and can refuse invokes (429 or 500)
//! on request; also what Lambda writes to a worker's on-failure destination.
#![expect(clippy::disallowed_methods, reason = "end-to-end: waits on this machine's clock for servers, processes and moto")]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use aws_sdk_dynamodb::types::{AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType};
use aws_sdk_sqs::types::QueueAttributeName;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use paceline_shared::adapters::aws::AwsNames;
use paceline_shared::job::WorkerPayload;
use paceline_shared::ports::WorkerHandler;
use paceline_shared::time::{system_now, UnixMillis};

/// The moto server's URL.
///
/// # Panics
/// When it is not set, saying how to get one.
#[must_use]
pub fn moto_url() -> String {
    std::env::var("PACELINE_TEST_MOTO_URL").expect("PACELINE_TEST_MOTO_URL is not set: run ./scripts/test.sh, which installs and starts the moto server")
}

/// An SDK configuration for moto: fixed region, dummy credentials.
pub async fn moto_sdk_config() -> aws_config::SdkConfig {
    paceline_shared::adapters::aws::sdk_config_loader()
        .endpoint_url(moto_url())
        .region(aws_config::Region::new("us-east-1"))
        .credentials_provider(aws_sdk_sqs::config::Credentials::new("test", "test", None, None, "paceline-tests"))
        .load()
        .await
}

/// Creates a plain queue named `PREFIX-<unique>`; returns its URL.
///
/// # Panics
/// When moto refuses.
pub async fn create_queue(sdk: &aws_config::SdkConfig, prefix: &str) -> String {
    create_queue_of(sdk, prefix, QueueKind::Standard).await
}

/// A standard or a FIFO SQS queue (a FIFO queue's name ends in `.fifo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueKind {
    Standard,
    Fifo,
}

async fn create_queue_of(sdk: &aws_config::SdkConfig, prefix: &str, kind: QueueKind) -> String {
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..12];
    let sqs = aws_sdk_sqs::Client::new(sdk);
    let create = match kind {
        QueueKind::Standard => sqs.create_queue().queue_name(format!("{prefix}-{suffix}")),
        QueueKind::Fifo => sqs.create_queue().queue_name(format!("{prefix}-{suffix}.fifo")).attributes(QueueAttributeName::FifoQueue, "true"),
    };
    create.send().await.expect("create queue").queue_url().unwrap().to_owned()
}

/// The invocation record Lambda sends an async destination, in the shape the Lambda
/// documentation gives ("Adding a destination"): the event, and the function's result
/// or error.
fn invocation_record(
    payload: &WorkerPayload,
    at: &str,
    condition: &str,
    invoke_count: u32,
    function_error: Option<&str>,
    response: serde_json::Value,
) -> String {
    let mut response_context = serde_json::json!({ "statusCode": 200, "executedVersion": "$LATEST" });
    if let Some(error) = function_error {
        response_context["functionError"] = error.into();
    }
    serde_json::json!({
        "version": "1.0",
        "timestamp": at,
        "requestContext": {
            "requestId": uuid::Uuid::new_v4().to_string(),
            "functionArn": "arn:aws:lambda:us-east-1:123456789012:function:paceline-worker:$LATEST",
            "condition": condition,
            "approximateInvokeCount": invoke_count
        },
        "requestPayload": serde_json::from_str::<serde_json::Value>(&payload.to_json()).unwrap(),
        "responseContext": response_context,
        "responsePayload": response
    })
    .to_string()
}

/// The record Lambda writes to an async on-failure destination when it gives up on an
/// event (after two retries).
#[must_use]
pub fn lambda_failure_record(payload: &WorkerPayload, error_type: &str, message: &str) -> String {
    let error = serde_json::json!({ "errorType": error_type, "errorMessage": message });
    invocation_record(payload, "2026-11-22T10:00:00.000Z", "RetriesExhausted", 3, Some("Unhandled"), error)
}

/// The record Lambda sends an async on-success destination: the function's result (the
/// job's outcome record, or null).
#[must_use]
pub fn lambda_success_record(payload: &WorkerPayload, result: serde_json::Value) -> String {
    invocation_record(payload, &system_now().to_rfc3339(), "Success", 1, None, result)
}

/// The `PACELINE_*` environment of a lane's Lambda functions: its resource names and
/// `extra` settings.
#[must_use]
pub fn lane_env(names: &AwsNames, extra: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
    [("PACELINE_QUEUE_URL", names.queue_url.as_str()), ("PACELINE_DLQ_URL", names.dlq_url.as_str()), ("PACELINE_TABLE", names.table.as_str())]
        .iter()
        .chain(extra)
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// The environment a `paceline` child needs to reach moto: dummy credentials, a region
/// and the endpoint.
#[must_use]
pub fn moto_env() -> Vec<(String, String)> {
    [
        ("AWS_ACCESS_KEY_ID", "test".to_owned()),
        ("AWS_SECRET_ACCESS_KEY", "test".to_owned()),
        ("AWS_REGION", "us-east-1".to_owned()),
        ("AWS_ENDPOINT_URL", moto_url()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// Creates a jobs queue with a DLQ (redrive after 5 receives) and a state table, with
/// names unique to this call.
///
/// # Panics
/// When moto refuses.
pub async fn create_lane(sdk: &aws_config::SdkConfig, worker_function: &str) -> AwsNames {
    create_lane_of(sdk, worker_function, QueueKind::Standard).await
}

/// Like [`create_lane`], with a jobs queue (and DLQ) of `kind`.
///
/// # Panics
/// When moto refuses.
pub async fn create_lane_of(sdk: &aws_config::SdkConfig, worker_function: &str, kind: QueueKind) -> AwsNames {
    let sqs = aws_sdk_sqs::Client::new(sdk);
    let dlq_url = create_queue_of(sdk, "paceline-dlq", kind).await;
    let dlq_arn = sqs
        .get_queue_attributes()
        .queue_url(&dlq_url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .expect("DLQ arn")
        .attributes()
        .and_then(|a| a.get(&QueueAttributeName::QueueArn).cloned())
        .unwrap();
    let redrive = serde_json::json!({ "deadLetterTargetArn": dlq_arn, "maxReceiveCount": "5" }).to_string();
    let queue_url = create_queue_of(sdk, "paceline-jobs", kind).await;
    sqs.set_queue_attributes().queue_url(&queue_url).attributes(QueueAttributeName::RedrivePolicy, redrive).send().await.expect("redrive policy");
    let table = format!("paceline-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    aws_sdk_dynamodb::Client::new(sdk)
        .create_table()
        .table_name(&table)
        .attribute_definitions(AttributeDefinition::builder().attribute_name("pk").attribute_type(ScalarAttributeType::S).build().unwrap())
        .key_schema(KeySchemaElement::builder().attribute_name("pk").key_type(KeyType::Hash).build().unwrap())
        .billing_mode(BillingMode::PayPerRequest)
        .send()
        .await
        .expect("create table");
    AwsNames { queue_url, dlq_url, table, worker_function: worker_function.to_owned(), worker_dlq_url: None }
}

/// One recorded invocation.
#[derive(Clone, Debug)]
pub struct Invocation {
    pub at: UnixMillis,
    pub function: String,
    pub invocation_type: String,
    pub payload: WorkerPayload,
}

#[derive(Default)]
struct FakeLambdaState {
    invocations: Mutex<Vec<Invocation>>,
    /// Events sent to an orchestrator function (any JSON), by function.
    kicks: Mutex<Vec<(String, serde_json::Value)>>,
    refuse_next: AtomicU32,
    refuse_with: AtomicU32,
    worker: Mutex<Option<Arc<dyn WorkerHandler>>>,
    in_flight: AtomicU32,
    /// The async `OnSuccess` destination: a queue that gets each successful
    /// invocation's record.
    on_success: Mutex<Option<(aws_sdk_sqs::Client, String)>>,
}

/// A fake Lambda Invoke endpoint on loopback.
pub struct FakeLambda {
    pub url: String,
    state: Arc<FakeLambdaState>,
    server: tokio::task::JoinHandle<()>,
}

async fn invoke(State(state): State<Arc<FakeLambdaState>>, Path(function): Path<String>, headers: HeaderMap, body: Bytes) -> (StatusCode, HeaderMap, String) {
    let mut reply = HeaderMap::new();
    if state.refuse_next.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
        return match state.refuse_with.load(Ordering::SeqCst) {
            429 => {
                reply.insert("x-amzn-errortype", "TooManyRequestsException".parse().unwrap());
                (StatusCode::TOO_MANY_REQUESTS, reply, r#"{"Type":"User","message":"Rate Exceeded."}"#.into())
            }
            _ => {
                reply.insert("x-amzn-errortype", "ServiceException".parse().unwrap());
                (StatusCode::INTERNAL_SERVER_ERROR, reply, r#"{"Type":"Service","message":"Internal error."}"#.into())
            }
        };
    }
    if function.to_ascii_lowercase().contains("orchestrator") {
        let Ok(event) = serde_json::from_slice(&body) else {
            return (StatusCode::BAD_REQUEST, reply, r#"{"message":"not JSON"}"#.into());
        };
        state.kicks.lock().unwrap().push((function, event));
        return (StatusCode::ACCEPTED, reply, String::new());
    }
    let Ok(payload) = WorkerPayload::from_json(&String::from_utf8_lossy(&body)) else {
        return (StatusCode::BAD_REQUEST, reply, r#"{"message":"not a paceline payload"}"#.into());
    };
    let invocation_type = headers.get("x-amz-invocation-type").and_then(|v| v.to_str().ok()).unwrap_or("RequestResponse").to_owned();
    state.invocations.lock().unwrap().push(Invocation { at: system_now(), function, invocation_type, payload: payload.clone() });
    let worker = state.worker.lock().unwrap().clone();
    if let Some(worker) = worker {
        state.in_flight.fetch_add(1, Ordering::SeqCst);
        let state = state.clone();
        tokio::spawn(async move {
            if let Ok(record) = worker.handle(payload.clone()).await {
                let destination = state.on_success.lock().unwrap().clone();
                if let Some((sqs, queue_url)) = destination {
                    let result = paceline_worker::lambda::function_result(record);
                    let body = lambda_success_record(&payload, result);
                    sqs.send_message().queue_url(queue_url).message_body(body).send().await.expect("the OnSuccess destination");
                }
            }
            state.in_flight.fetch_sub(1, Ordering::SeqCst);
        });
    }
    (StatusCode::ACCEPTED, reply, String::new())
}

impl FakeLambda {
    /// Starts the endpoint on an ephemeral port.
    ///
    /// # Panics
    /// When no port can be bound.
    pub async fn start() -> Self {
        let state = Arc::new(FakeLambdaState::default());
        let app = axum::Router::new().route("/2015-03-31/functions/{name}/invocations", axum::routing::post(invoke)).with_state(state.clone());
        let (address, server) = crate::serve_on_loopback(app).await;
        Self { url: format!("http://{address}"), state, server }
    }

    /// Runs every accepted payload on `worker`, in the background, as Lambda would.
    pub fn run_worker(&self, worker: Arc<dyn WorkerHandler>) {
        *self.state.worker.lock().unwrap() = Some(worker);
    }

    /// Sends each successful worker invocation's record to `queue_url`, as an async
    /// `OnSuccess` destination does.
    pub fn deliver_results_to(&self, sqs: aws_sdk_sqs::Client, queue_url: String) {
        *self.state.on_success.lock().unwrap() = Some((sqs, queue_url));
    }

    /// The next `n` invokes are refused: `429` TooManyRequestsException, or `500`
    /// ServiceException.
    pub fn refuse_next(&self, n: u32, status: u16) {
        self.state.refuse_with.store(u32::from(status), Ordering::SeqCst);
        self.state.refuse_next.store(n, Ordering::SeqCst);
    }

    /// Every accepted invocation so far.
    #[must_use]
    pub fn invocations(&self) -> Vec<Invocation> {
        self.state.invocations.lock().unwrap().clone()
    }

    /// Every event an orchestrator function (a name containing `orchestrator`) was sent.
    #[must_use]
    pub fn kicks(&self) -> Vec<(String, serde_json::Value)> {
        self.state.kicks.lock().unwrap().clone()
    }

    /// Waits until no worker run is in flight (at most `limit`).
    pub async fn settle(&self, limit: std::time::Duration) {
        let until = tokio::time::Instant::now() + limit;
        while self.state.in_flight.load(Ordering::SeqCst) > 0 && tokio::time::Instant::now() < until {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
}

impl Drop for FakeLambda {
    fn drop(&mut self) {
        self.server.abort();
    }
}
