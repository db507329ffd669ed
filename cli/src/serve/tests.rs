//! `serve`'s API over real HTTP on loopback: tokens, each endpoint, its bad input (a 4xx
//! JSON error naming the problem, never a 500), limits and the event stream.

use std::path::PathBuf;
use std::time::Duration;

use paceline_shared::job::{DeadLetterCause, DeadLetterReason, Job};
use paceline_shared::outcome::{Answer, Ending, OutcomeRecord, OutcomeTimes};
use paceline_shared::ports::OutcomeSink as _;
use paceline_shared::time::system_now;
use reqwest::StatusCode;
use serde_json::{json, Value};

use super::Serving;
use crate::access::StackArgs;

const ACT: &str = "act-token-for-the-serve-tests-0123456789";
const READ: &str = "read-token-for-the-serve-tests-012345678";

/// A stack served on a free loopback port, its folder removed at the end.
struct Served {
    serving: Option<Serving>,
    base: String,
    stack: crate::access::OperatorStack,
    dir: PathBuf,
    client: reqwest::Client,
}

impl Served {
    /// An embedded stack with `serve` (its `[serve]` lines beyond the tokens, and any
    /// sections after), served with no run.
    async fn start(name: &str, serve: &str) -> Self {
        Self::start_after(name, serve, &[]).await
    }

    /// As [`Served::start`], with the outcome records `before` kept before it starts.
    async fn start_after(name: &str, serve: &str, before: &[OutcomeRecord]) -> Self {
        // Both tests' values are the same: setting them from several threads is harmless.
        std::env::set_var("PACELINE_TEST_SERVE_ACT", ACT);
        std::env::set_var("PACELINE_TEST_SERVE_READ", READ);
        let dir = std::env::temp_dir().join(format!("paceline-serve-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("paceline.toml");
        let text = format!(
            "[api]\nbase_url = \"http://127.0.0.1:9\"\n[quota]\ntiers = [\"5/s\", \"100/min\"]\n[serve]\ntoken = {{ env = \"PACELINE_TEST_SERVE_ACT\" }}\nread_token = {{ env = \"PACELINE_TEST_SERVE_READ\" }}\n{serve}"
        );
        std::fs::write(&config, text).unwrap();
        let args = StackArgs { config, ..StackArgs::default() };
        let stack = args.open_to_enqueue().await.unwrap();
        for record in before {
            stack.embedded.as_ref().unwrap().record_outcome(record).await.unwrap();
        }
        let serving = Serving::start(stack, "127.0.0.1:0".parse().unwrap(), false).await.unwrap();
        let base = format!("http://{}", serving.address);
        let stack = args.open().await.unwrap();
        Self { serving: Some(serving), base, stack, dir, client: reqwest::Client::new() }
    }

    async fn send(&self, method: reqwest::Method, path: &str, token: Option<&str>, body: Option<(&str, String)>) -> (StatusCode, Value) {
        let mut request = self.client.request(method, format!("{}{path}", self.base));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some((content_type, body)) = body {
            request = request.header("content-type", content_type).body(body);
        }
        let response = request.send().await.unwrap();
        let status = response.status();
        let text = response.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.send(reqwest::Method::GET, path, Some(ACT), None).await
    }

    async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        self.send(reqwest::Method::POST, path, Some(ACT), Some(("application/json", body.to_string()))).await
    }

    async fn post_lines(&self, path: &str, lines: &str) -> (StatusCode, Value) {
        self.send(reqwest::Method::POST, path, Some(ACT), Some(("application/x-ndjson", lines.to_owned()))).await
    }

    async fn ready(&self) -> u64 {
        self.get("/v1/status").await.1["queue"]["visible"].as_u64().unwrap()
    }

    async fn stop(mut self) {
        self.serving.take().unwrap().stop().await.unwrap();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn job_line(id: &str) -> String {
    json!({ "id": id, "request": { "method": "GET", "path": format!("/items/{id}") } }).to_string()
}

#[tokio::test]
async fn every_path_needs_a_token_and_a_read_only_token_may_read_but_not_act() {
    let served = Served::start("tokens", "").await;
    use reqwest::Method;
    for (method, path) in [(Method::GET, "/v1/status"), (Method::GET, "/metrics"), (Method::POST, "/v1/jobs"), (Method::GET, "/v1/dlq")] {
        let (status, body) = served.send(method.clone(), path, None, None).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {path} without a token");
        assert!(body["error"].as_str().unwrap().contains("bearer token"), "{body}");
        let (status, _) = served.send(method.clone(), path, Some("pl_not-the-token-at-all-000000000"), None).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {path} with a wrong token");
    }
    assert_eq!(served.send(Method::GET, "/v1/status", Some(READ), None).await.0, StatusCode::OK);
    assert_eq!(served.send(Method::GET, "/metrics", Some(READ), None).await.0, StatusCode::OK);
    for path in ["/v1/jobs", "/v1/dlq/redrive", "/v1/circuit/open", "/v1/circuit/close"] {
        let (status, body) = served.send(Method::POST, path, Some(READ), Some(("application/json", "{}".into()))).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{path} with the read-only token: {body}");
    }
    assert_eq!(served.ready().await, 0, "nothing was enqueued by a refused request");
    let (status, page) = served.send(Method::GET, "/", None, None).await;
    assert_eq!(status, StatusCode::OK, "the console's page holds no data and needs no token");
    assert!(page.as_str().unwrap().contains("<title>Paceline</title>"));
    served.stop().await;
}

#[tokio::test]
async fn jobs_go_in_as_json_lines_each_bad_line_named_and_the_answer_lists_what_went_in() {
    let served = Served::start("jobs", "").await;
    let lines = format!("{}\nnot json\n{}\n\n{}\n", job_line("a"), job_line("b"), r#"{"request":{"method":"GET","path":"https://elsewhere.example/"}}"#);
    let (status, answer) = served.post_lines("/v1/jobs", &lines).await;
    assert_eq!(status, StatusCode::MULTI_STATUS, "{answer}");
    assert_eq!(answer["job_ids"], json!(["a", "b"]));
    let rejected: Vec<&str> = answer["rejected"].as_array().unwrap().iter().map(|line| line.as_str().unwrap()).collect();
    assert!(rejected[0].starts_with("line 2: not a job"), "{rejected:?}");
    assert!(rejected[1].starts_with("line 5: request.path"), "{rejected:?}");

    let pretty =
        serde_json::to_string_pretty(&json!({ "id": "c", "lane": "default", "request": { "method": "POST", "path": "/c", "body": { "x": 1 } } })).unwrap();
    let (status, answer) = served.send(reqwest::Method::POST, "/v1/jobs", Some(ACT), Some(("application/json", pretty))).await;
    assert_eq!((status, &answer["job_ids"]), (StatusCode::ACCEPTED, &json!(["c"])), "one job as (pretty) JSON: {answer}");

    let (status, answer) = served.post_lines("/v1/jobs?lane=no/slash", &job_line("d")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(answer["error"].as_str().unwrap().starts_with("lane: "), "{answer}");
    let (status, answer) = served.post_lines("/v1/jobs", "nope\n").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!((answer["enqueued"].as_u64(), answer["rejected"][0].as_str().map(|r| r.starts_with("line 1"))), (Some(0), Some(true)), "{answer}");
    assert_eq!(served.post_lines("/v1/jobs", "").await.0, StatusCode::BAD_REQUEST);
    assert_eq!(served.ready().await, 3, "a, b and c, nothing else");
    served.stop().await;
}

#[tokio::test]
async fn a_body_over_max_request_or_lines_over_max_lines_get_413_and_enqueue_nothing() {
    let served = Served::start("limits", "max_request = \"1KiB\"\nmax_lines = 3\n").await;
    let four: String = (0..4).map(|n| job_line(&format!("j{n}")) + "\n").collect();
    let (status, answer) = served.post_lines("/v1/jobs", &four).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{answer}");
    assert!(answer["error"].as_str().unwrap().contains("over [serve] max_lines (3)"), "{answer}");
    let big = json!({ "request": { "method": "POST", "path": "/a", "body": "x".repeat(2_000) } }).to_string();
    let (status, answer) = served.post_lines("/v1/jobs", &big).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{answer}");
    assert!(answer["error"].is_string(), "a JSON error: {answer}");
    assert_eq!(served.ready().await, 0);
    served.stop().await;
}

#[tokio::test]
async fn malformed_requests_get_a_json_4xx_naming_the_problem_never_a_500() {
    let served = Served::start("malformed", "").await;
    let gets = [
        ("/v1/status?lane=a/b", "lane: "),
        ("/v1/status?colour=red", "unknown field `colour`"),
        ("/v1/results?status=teapot", "status: "),
        ("/v1/results?since=last+tuesday", "since: "),
        ("/v1/results?limit=-1", "limit"),
        ("/v1/dlq?dlq=attic", "dlq: "),
        ("/v1/dlq?older_than=soon", "older_than: "),
        ("/v1/nowhere", "no such path"),
        ("/v1/status?lane=gold", "no [lanes]"),
    ];
    for (path, names) in gets {
        let (status, answer) = served.get(path).await;
        assert!(status.is_client_error(), "{path}: {status} {answer}");
        assert!(answer["error"].as_str().is_some_and(|error| error.contains(names)), "{path}: {answer}");
    }
    let posts = [
        ("/v1/dlq/redrive", json!({}), "say which dead letters"),
        ("/v1/dlq/redrive", json!({ "cause": "http_404" }), "request body: invalid type"),
        ("/v1/dlq/redrive", json!({ "all": true, "colour": "red" }), "unknown field `colour`"),
        ("/v1/circuit/close", json!({ "hold": true }), "hold: only an open circuit"),
        ("/v1/circuit/open", json!({ "epoch": "seven" }), "request body: invalid type"),
        ("/v1/circuit/open", json!({ "epoch": 7 }), "epoch 0, not 7"),
    ];
    for (path, body, names) in posts {
        let (status, answer) = served.post(path, body.clone()).await;
        assert!(status.is_client_error(), "{path} {body}: {status} {answer}");
        assert!(answer["error"].as_str().is_some_and(|error| error.contains(names)), "{path} {body}: {answer}");
    }
    let (status, answer) = served.send(reqwest::Method::POST, "/v1/circuit/open", Some(ACT), Some(("application/json", "{not json".into()))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    served.stop().await;
}

/// Dead-letters `count` jobs of `cause`, as a worker would.
async fn dead_letters(served: &Served, ids: &[&str], cause: DeadLetterCause) {
    for id in ids {
        let reason = DeadLetterReason { cause: cause.clone(), detail: format!("the API answered for {id}"), outcome: None };
        served.stack.queues.dead_letter(&format!("m-{id}"), &job_line(id), 1, &reason).await.unwrap();
    }
}

#[tokio::test]
async fn dead_letters_are_shown_by_cause_and_a_redrive_puts_the_chosen_cause_back_on_the_queue() {
    let served = Served::start("dlq", "").await;
    dead_letters(&served, &["a", "b", "c"], DeadLetterCause::Rejected { status: 404 }).await;
    dead_letters(&served, &["d"], DeadLetterCause::AttemptsExhausted { last_failure: Some("http_503".into()) }).await;
    let (status, dlq) = served.get("/v1/dlq?cause=http_404&limit=2").await;
    assert_eq!(status, StatusCode::OK, "{dlq}");
    assert_eq!(dlq["total"], json!(4));
    let causes: Vec<(&str, u64)> = dlq["summary"].as_array().unwrap().iter().map(|g| (g["cause"].as_str().unwrap(), g["count"].as_u64().unwrap())).collect();
    assert_eq!(causes, vec![("http_404", 3), ("attempts_exhausted:http_503", 1)]);
    assert_eq!(dlq["records"].as_array().unwrap().len(), 2, "the limit");
    assert_eq!(dlq["records"][0]["job_id"], json!("a"));

    let (_, dry) = served.post("/v1/dlq/redrive", json!({ "cause": ["http_404"], "dry_run": true })).await;
    assert_eq!((dry["matched"].as_u64(), dry["done"].as_u64()), (Some(3), Some(0)), "{dry}");
    let (status, done) = served.post("/v1/dlq/redrive", json!({ "cause": ["http_404"] })).await;
    assert_eq!((status, done["done"].as_u64()), (StatusCode::OK, Some(3)), "{done}");
    assert_eq!(served.ready().await, 3, "back on the jobs queue, to be paced like any job");
    assert_eq!(served.get("/v1/dlq").await.1["total"], json!(1), "the 503 one stays");
    served.stop().await;
}

#[tokio::test]
async fn the_circuit_is_held_open_and_closed_through_the_api_and_metrics_show_it() {
    let served = Served::start("circuit", "").await;
    let (status, held) = served.post("/v1/circuit/open", json!({ "hold": true, "reason": "maintenance" })).await;
    assert_eq!(status, StatusCode::OK, "{held}");
    assert_eq!((held["circuit"]["status"].as_str(), held["circuit"]["held"].as_bool()), (Some("open"), Some(true)), "{held}");
    assert_eq!(served.get("/v1/status").await.1["circuit"]["reason"], json!("operator: maintenance"));
    let (_, metrics) = served.get("/metrics").await;
    let metrics = metrics.as_str().unwrap();
    assert!(metrics.contains("paceline_circuit_state{lane=\"default\",state=\"open\"} 1"), "{metrics}");
    assert!(metrics.contains("paceline_tier_limit{lane=\"default\",tier=\"5/s\"} 5"), "{metrics}");
    let (_, again) = served.post("/v1/circuit/open", json!({})).await;
    assert_eq!(again["circuit"]["changed"], json!(false), "{again}");
    let (_, closed) = served.post("/v1/circuit/close", json!({})).await;
    assert_eq!(closed["circuit"]["status"], json!("closed"), "{closed}");
    served.stop().await;
}

fn record(id: &str, status: u16, body: &str) -> OutcomeRecord {
    let job = Job::parse(&job_line(id)).unwrap();
    let ending = if status < 300 { Ending::Succeeded } else { Ending::DeadLettered };
    let now = system_now();
    let times = OutcomeTimes {
        dispatched: Some(now),
        called: Some(now.plus(Duration::from_millis(3))),
        answered: Some(now.plus(Duration::from_millis(9))),
        ..OutcomeTimes::default()
    };
    let mut record = OutcomeRecord::new(&job, ending, 1, &Answer { status: Some(status), headers: &[], body: None }, &[], times);
    record.body = Some(Value::String(body.to_owned()));
    record
}

#[tokio::test]
async fn results_are_filtered_as_the_cli_filters_them_and_each_new_call_is_an_event_and_a_metric() {
    let served = Served::start_after("results", "max_streams = 1\n", &[record("old", 200, "before serve")]).await;
    let store = served.stack.embedded.clone().unwrap();
    let mut stream = served.client.get(format!("{}/v1/events", served.base)).bearer_auth(READ).send().await.unwrap();
    assert_eq!(stream.status(), StatusCode::OK);
    let (status, refused) = served.send(reqwest::Method::GET, "/v1/events", Some(READ), None).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "over max_streams: {refused}");

    store.record_outcome(&record("ok", 200, "fine")).await.unwrap();
    store.record_outcome(&record("gone", 404, "<img src=x onerror=alert(1)>")).await.unwrap();
    let (_, page) = served.get("/v1/results?status=4xx").await;
    let ids: Vec<&str> = page["records"].as_array().unwrap().iter().map(|r| r["job_id"].as_str().unwrap()).collect();
    assert_eq!(ids, vec!["gone"]);
    assert_eq!(page["records"][0]["body"], json!("<img src=x onerror=alert(1)>"), "kept as the API sent it");
    let (_, after) = served.get(&format!("/v1/results?after={}", page["next_after"])).await;
    assert_eq!(after["records"].as_array().unwrap().len(), 0);

    let mut seen = String::new();
    while !(seen.contains("\"job_id\":\"gone\"") && seen.contains("event: dead_letters")) {
        let chunk = tokio::time::timeout(Duration::from_secs(10), stream.chunk()).await.expect("the events came within 10 s").unwrap().unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(seen.contains("event: calls\ndata: {\"type\":\"calls\",\"calls\":[{\"job_id\":\"ok\""), "{seen}");
    assert!(seen.contains("event: dead_letters\ndata: {\"type\":\"dead_letters\",\"dead_letters\":[{\"job_id\":\"gone\""), "{seen}");
    assert!(!seen.contains("\"old\""), "what came before serve started is not news: {seen}");
    let (_, metrics) = served.get("/metrics").await;
    let metrics = metrics.as_str().unwrap();
    assert!(metrics.contains("paceline_calls_total{lane=\"default\",status=\"2xx\",outcome=\"succeeded\"} 1"), "{metrics}");
    assert!(metrics.contains("paceline_calls_total{lane=\"default\",status=\"4xx\",outcome=\"dead_lettered\"} 1"), "{metrics}");
    assert!(metrics.contains("paceline_dispatch_to_call_delay_seconds_bucket{le=\"0.005\"} 2"), "{metrics}");
    drop(stream);
    served.stop().await;
}

#[tokio::test]
async fn a_stack_of_lanes_lists_them_and_jobs_go_in_the_lane_named_by_the_line_or_the_query() {
    let served = Served::start("lanes", "[lanes]\ntiers = [\"2/s\"]\n[lanes.gold]\ntiers = [\"3/s\"]\n").await;
    let lines = format!("{}\n{}\n", job_line("plain"), json!({ "id": "own", "lane": "gold", "request": { "method": "GET", "path": "/own" } }));
    let (status, answer) = served.post_lines("/v1/jobs?lane=acme", &lines).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
    let (status, lanes) = served.get("/v1/lanes").await;
    assert_eq!(status, StatusCode::OK, "{lanes}");
    let backlog: Vec<(&str, u64)> =
        lanes.as_array().unwrap().iter().map(|lane| (lane["lane"].as_str().unwrap(), lane["backlog"]["visible"].as_u64().unwrap())).collect();
    assert_eq!(backlog, vec![("acme", 1), ("gold", 1)], "{lanes}");
    let (_, gold) = served.get("/v1/status?lane=gold").await;
    assert_eq!(gold["tiers"][0]["tier"], json!("3/s"), "{gold}");
    let (_, shared) = served.get("/v1/status").await;
    assert_eq!(shared["lanes"].as_array().map(Vec::len), Some(2), "{shared}");
    served.stop().await;
}

/// With no config file, `serve` said the lanes run on AWS's Lambda functions.
#[tokio::test]
async fn serve_without_a_config_file_says_it_is_not_found() {
    let missing = std::env::temp_dir().join(format!("paceline-serve-none-{}/paceline.toml", std::process::id()));
    let args = super::ServeArgs {
        stack: StackArgs { config: missing, ..StackArgs::default() },
        listen: "127.0.0.1:0".parse().unwrap(),
        no_run: false,
        new_tokens: false,
    };
    let refused = args.run().await.unwrap_err().to_string();
    assert!(refused.contains("paceline.toml not found: pass --config FILE"), "{refused}");
}
