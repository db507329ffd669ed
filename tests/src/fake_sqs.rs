//! A fast in-memory SQS for the Lambda benchmark: one queue of jobs, the JSON protocol
//! the SDK speaks (`X-Amz-Target: AmazonSQS.*`), and only what the orchestrator uses
//! (receive, delete and visibility batches, attributes). moto's `ReceiveMessage` takes
//! about 100 ms and moto serves one request at a time, which caps a lane near 20 jobs/s;
//! real SQS answers in milliseconds.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use paceline_shared::time::system_now;
use serde_json::{json, Value};

#[derive(Default)]
struct Queue {
    visible: VecDeque<(String, String)>,
    /// Received and not deleted yet: by receipt handle.
    in_flight: BTreeMap<String, (String, String)>,
    next_receipt: u64,
}

/// The queue on an ephemeral loopback port.
pub struct FakeSqs {
    pub url: String,
    queue: Arc<Mutex<Queue>>,
    server: tokio::task::JoinHandle<()>,
}

fn entries(request: &Value) -> impl Iterator<Item = &Value> {
    request["Entries"].as_array().into_iter().flatten()
}

async fn serve(State(queue): State<Arc<Mutex<Queue>>>, headers: HeaderMap, body: Bytes) -> (StatusCode, HeaderMap, String) {
    let mut reply = HeaderMap::new();
    reply.insert("content-type", HeaderValue::from_static("application/x-amz-json-1.0"));
    let target = headers.get("x-amz-target").and_then(|v| v.to_str().ok()).unwrap_or_default().trim_start_matches("AmazonSQS.").to_owned();
    let request: Value = serde_json::from_slice(&body).unwrap_or_default();
    let mut queue = queue.lock().unwrap();
    let answer = match target.as_str() {
        "ReceiveMessage" => {
            let max = request["MaxNumberOfMessages"].as_u64().unwrap_or(1).clamp(1, 10) as usize;
            let sent = system_now().0.to_string();
            let mut messages = Vec::new();
            while messages.len() < max {
                let Some((id, body)) = queue.visible.pop_front() else { break };
                queue.next_receipt += 1;
                let receipt = format!("r-{}", queue.next_receipt);
                messages.push(json!({ "MessageId": id, "ReceiptHandle": receipt, "Body": body, "Attributes": { "SentTimestamp": sent } }));
                queue.in_flight.insert(receipt, (id, body));
            }
            json!({ "Messages": messages })
        }
        "DeleteMessageBatch" => {
            let ids: Vec<Value> = entries(&request)
                .map(|e| {
                    if let Some(receipt) = e["ReceiptHandle"].as_str() {
                        queue.in_flight.remove(receipt);
                    }
                    json!({ "Id": e["Id"] })
                })
                .collect();
            json!({ "Successful": ids, "Failed": [] })
        }
        "ChangeMessageVisibilityBatch" => {
            let ids: Vec<Value> = entries(&request)
                .map(|e| {
                    // Visibility 0 puts the message back at once; anything else keeps it hidden.
                    if e["VisibilityTimeout"].as_i64() == Some(0) {
                        if let Some(message) = e["ReceiptHandle"].as_str().and_then(|r| queue.in_flight.remove(r)) {
                            queue.visible.push_front(message);
                        }
                    }
                    json!({ "Id": e["Id"] })
                })
                .collect();
            json!({ "Successful": ids, "Failed": [] })
        }
        "GetQueueAttributes" => json!({ "Attributes": {
            "ApproximateNumberOfMessages": queue.visible.len().to_string(),
            "ApproximateNumberOfMessagesNotVisible": queue.in_flight.len().to_string(),
            "ApproximateNumberOfMessagesDelayed": "0",
        }}),
        other => {
            return (
                StatusCode::BAD_REQUEST,
                reply,
                json!({ "__type": "com.amazonaws.sqs#InvalidAction", "message": format!("{other} is not served here") }).to_string(),
            );
        }
    };
    (StatusCode::OK, reply, answer.to_string())
}

impl FakeSqs {
    /// Starts the queue holding `bodies`.
    ///
    /// # Panics
    /// When no port can be bound.
    pub async fn start(bodies: impl IntoIterator<Item = String>) -> Self {
        let queue = Arc::new(Mutex::new(Queue { visible: bodies.into_iter().enumerate().map(|(i, b)| (format!("m-{i}"), b)).collect(), ..Queue::default() }));
        let app = axum::Router::new().route("/", axum::routing::post(serve)).with_state(queue.clone());
        let (address, server) = crate::serve_on_loopback(app).await;
        Self { url: format!("http://{address}"), queue, server }
    }

    /// The queue's URL, as a lane names it.
    #[must_use]
    pub fn queue_url(&self) -> String {
        format!("{}/123456789012/paceline-jobs", self.url)
    }

    /// Messages neither received nor deleted.
    #[must_use]
    pub fn visible(&self) -> usize {
        self.queue.lock().unwrap().visible.len()
    }
}

impl Drop for FakeSqs {
    fn drop(&mut self) {
        self.server.abort();
    }
}
