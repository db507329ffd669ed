//! A local Lambda Runtime API (the 2018-06-01 interface a custom runtime's `bootstrap`
//! polls), so the functions' real binaries run as Lambda runs them: `next` hands out
//! queued events with their request id and deadline, and the function's response, its
//! invocation error or its init error is recorded. Also starts a binary against it.
#![expect(clippy::disallowed_methods, reason = "end-to-end: waits on this machine's clock for servers, processes and moto")]

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use paceline_shared::time::system_now;

/// How an invocation ended, as the function reported it.
#[derive(Clone, Debug, PartialEq)]
pub enum Reported {
    /// `POST /invocation/{id}/response`: the function's result.
    Response(serde_json::Value),
    /// `POST /invocation/{id}/error`: `errorType` and `errorMessage`.
    Error(serde_json::Value),
}

#[derive(Default)]
struct RuntimeState {
    /// Events not handed out yet: (request id, deadline in ms since the epoch, body).
    queued: Mutex<VecDeque<(String, u64, String)>>,
    reported: Mutex<BTreeMap<String, Reported>>,
    init_error: Mutex<Option<serde_json::Value>>,
    /// When the function first asked for an event (its init is over).
    first_next: Mutex<Option<Instant>>,
    changed: tokio::sync::Notify,
}

/// The Runtime API on an ephemeral loopback port.
pub struct RuntimeApi {
    /// `host:port`, what `AWS_LAMBDA_RUNTIME_API` holds.
    pub address: String,
    state: Arc<RuntimeState>,
    server: tokio::task::JoinHandle<()>,
}

async fn next(State(state): State<Arc<RuntimeState>>) -> (StatusCode, HeaderMap, String) {
    state.first_next.lock().unwrap().get_or_insert_with(Instant::now);
    loop {
        let waiting = state.changed.notified();
        if let Some((id, deadline, body)) = state.queued.lock().unwrap().pop_front() {
            let mut headers = HeaderMap::new();
            headers.insert("lambda-runtime-aws-request-id", HeaderValue::from_str(&id).unwrap());
            headers.insert("lambda-runtime-deadline-ms", HeaderValue::from(deadline));
            headers.insert("lambda-runtime-invoked-function-arn", HeaderValue::from_static("arn:aws:lambda:us-east-1:123456789012:function:paceline-test"));
            headers.insert("lambda-runtime-trace-id", HeaderValue::from_static("Root=1-5759e988-bd862e3fe1be46a994272793;Sampled=1"));
            return (StatusCode::OK, headers, body);
        }
        waiting.await;
    }
}

fn json_of(body: &Bytes) -> serde_json::Value {
    serde_json::from_slice(body).unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(body).into_owned()))
}

async fn response(State(state): State<Arc<RuntimeState>>, UrlPath(id): UrlPath<String>, body: Bytes) -> StatusCode {
    state.reported.lock().unwrap().insert(id, Reported::Response(json_of(&body)));
    state.changed.notify_waiters();
    StatusCode::ACCEPTED
}

async fn error(State(state): State<Arc<RuntimeState>>, UrlPath(id): UrlPath<String>, body: Bytes) -> StatusCode {
    state.reported.lock().unwrap().insert(id, Reported::Error(json_of(&body)));
    state.changed.notify_waiters();
    StatusCode::ACCEPTED
}

async fn init_error(State(state): State<Arc<RuntimeState>>, body: Bytes) -> StatusCode {
    *state.init_error.lock().unwrap() = Some(json_of(&body));
    state.changed.notify_waiters();
    StatusCode::ACCEPTED
}

impl RuntimeApi {
    /// Starts the Runtime API.
    ///
    /// # Panics
    /// When no port can be bound.
    pub async fn start() -> Self {
        let state = Arc::new(RuntimeState::default());
        let app = axum::Router::new()
            .route("/2018-06-01/runtime/invocation/next", axum::routing::get(next))
            .route("/2018-06-01/runtime/invocation/{id}/response", axum::routing::post(response))
            .route("/2018-06-01/runtime/invocation/{id}/error", axum::routing::post(error))
            .route("/2018-06-01/runtime/init/error", axum::routing::post(init_error))
            .with_state(state.clone());
        let (address, server) = crate::serve_on_loopback(app).await;
        Self { address, state, server }
    }

    /// Queues `event` for the function with `timeout` to its deadline; returns its request id.
    pub fn invoke(&self, event: &serde_json::Value, timeout: Duration) -> String {
        let id = uuid::Uuid::new_v4().to_string();
        let deadline = system_now().plus(timeout).0;
        self.state.queued.lock().unwrap().push_back((id.clone(), deadline, event.to_string()));
        self.state.changed.notify_waiters();
        id
    }

    /// What the function reported for `id`, waiting at most `limit`.
    pub async fn reported(&self, id: &str, limit: Duration) -> Option<Reported> {
        self.wait_for(limit, || self.state.reported.lock().unwrap().get(id).cloned()).await
    }

    /// The init error the function reported, waiting at most `limit`.
    pub async fn init_error(&self, limit: Duration) -> Option<serde_json::Value> {
        self.wait_for(limit, || self.state.init_error.lock().unwrap().clone()).await
    }

    /// When the function first asked for an event.
    #[must_use]
    pub fn first_next(&self) -> Option<Instant> {
        *self.state.first_next.lock().unwrap()
    }

    async fn wait_for<T>(&self, limit: Duration, found: impl Fn() -> Option<T>) -> Option<T> {
        let until = tokio::time::Instant::now() + limit;
        loop {
            let changed = self.state.changed.notified();
            if let Some(value) = found() {
                return Some(value);
            }
            if tokio::time::timeout_at(until, changed).await.is_err() {
                return found();
            }
        }
    }
}

impl Drop for RuntimeApi {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A function's process, its standard output and error read as they come (so a chatty
/// function never blocks on a full pipe).
pub struct FunctionProcess {
    pub child: tokio::process::Child,
    output: Arc<Mutex<Vec<u8>>>,
    readers: Vec<tokio::task::JoinHandle<()>>,
}

impl FunctionProcess {
    /// Stops the process and returns everything it wrote (standard output, then error).
    pub async fn stop(mut self) -> String {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
        for reader in self.readers.drain(..) {
            let _ = reader.await;
        }
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }
}

/// Starts a function's binary (`target/debug/orchestrator` or `worker`, as `cargo
/// lambda` builds the `bootstrap`) against `api` with `env` alone (and `PATH`).
///
/// # Panics
/// When the binary is missing or does not start.
#[must_use]
pub fn start_function(binary: &Path, api: &RuntimeApi, env: &BTreeMap<String, String>) -> FunctionProcess {
    use tokio::io::AsyncReadExt as _;
    assert!(binary.exists(), "{} not found: run `cargo build --workspace` first (the README's test command does)", binary.display());
    let mut child = tokio::process::Command::new(binary)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("AWS_LAMBDA_RUNTIME_API", &api.address)
        .envs(env)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the function's binary");
    let output = Arc::new(Mutex::new(Vec::new()));
    let mut readers = Vec::new();
    let streams: [Option<Box<dyn tokio::io::AsyncRead + Unpin + Send>>; 2] =
        [child.stdout.take().map(|s| Box::new(s) as _), child.stderr.take().map(|s| Box::new(s) as _)];
    for mut stream in streams.into_iter().flatten() {
        let output = output.clone();
        readers.push(tokio::spawn(async move {
            let mut buffer = [0_u8; 8192];
            while let Ok(read) = stream.read(&mut buffer).await {
                if read == 0 {
                    break;
                }
                output.lock().unwrap().extend_from_slice(&buffer[..read]);
            }
        }));
    }
    FunctionProcess { child, output, readers }
}

/// The environment Lambda gives every function (`AWS_LAMBDA_*`), for a function named
/// `name` with `memory_mb`, logging JSON at `info`.
#[must_use]
pub fn lambda_env(name: &str, memory_mb: u32) -> BTreeMap<String, String> {
    [
        ("AWS_LAMBDA_FUNCTION_NAME", name.to_owned()),
        ("AWS_LAMBDA_FUNCTION_VERSION", "$LATEST".to_owned()),
        ("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", memory_mb.to_string()),
        ("AWS_LAMBDA_LOG_GROUP_NAME", format!("/aws/lambda/{name}")),
        ("AWS_LAMBDA_LOG_STREAM_NAME", "2026/11/24/[$LATEST]test".to_owned()),
        ("AWS_LAMBDA_LOG_FORMAT", "JSON".to_owned()),
        ("AWS_LAMBDA_LOG_LEVEL", "INFO".to_owned()),
        ("AWS_REGION", "us-east-1".to_owned()),
        ("AWS_DEFAULT_REGION", "us-east-1".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// The target directory's binary `name` (debug build).
#[must_use]
pub fn function_binary(name: &str) -> std::path::PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"), std::path::PathBuf::from);
    target.join("debug").join(name)
}

/// The `PACELINE_*` environment `infra/template.yaml` gives `function` (its logical id,
/// e.g. `OrchestratorFunction`), read from the template itself: each `!Ref` to a
/// parameter takes the parameter's default, `!Sub` fills parameters in, and `given`
/// supplies the rest (resources, `AWS::StackName`, parameters without a default). A
/// conditional variable (`!If`) is left out, as with its condition false.
///
/// # Panics
/// When the template cannot be read or names something `given` lacks.
#[must_use]
pub fn template_env(function: &str, given: &BTreeMap<&str, String>) -> BTreeMap<String, String> {
    let template = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../infra/template.yaml")).expect("infra/template.yaml");
    let defaults = parameter_defaults(&template);
    let value_of = |name: &str| given.get(name).cloned().or_else(|| defaults.get(name).cloned()).unwrap_or_else(|| panic!("the template refers to {name}"));
    let block = template.split(&format!("\n  {function}:\n")).nth(1).unwrap_or_else(|| panic!("no {function} in the template"));
    let variables = block.split("\n        Variables:\n").nth(1).expect("the function's environment");
    let mut env = BTreeMap::new();
    for line in variables.lines().take_while(|l| l.starts_with("          ")) {
        // A variable's own line; deeper ones continue a multi-line `!If`.
        let own_line = !line[10..].starts_with([' ', '#']);
        let Some((name, expression)) = line.trim().split_once(": ").filter(|_| own_line) else { continue };
        let value = if let Some(reference) = expression.strip_prefix("!Ref ") {
            value_of(reference)
        } else if let Some(text) = expression.strip_prefix("!Sub ") {
            let mut text = text.trim_matches('"').to_owned();
            while let Some(start) = text.find("${") {
                let end = start + text[start..].find('}').expect("a closed ${...}");
                text.replace_range(start..=end, &value_of(&text[start + 2..end]));
            }
            text
        } else if expression.starts_with("!If") {
            continue;
        } else {
            panic!("{name}: {expression} is not understood here");
        };
        env.insert(name.to_owned(), value);
    }
    env
}

/// Each template parameter's `Default`, unquoted.
fn parameter_defaults(template: &str) -> BTreeMap<String, String> {
    let section = template.split("\nParameters:\n").nth(1).and_then(|rest| rest.split("\nConditions:").next()).expect("the template's parameters");
    let mut defaults = BTreeMap::new();
    let mut current = None;
    for line in section.lines() {
        if let Some(name) = line.strip_prefix("  ").and_then(|l| l.strip_suffix(':')).filter(|n| !n.starts_with(' ')) {
            current = Some(name.to_owned());
        } else if let (Some(name), Some(default)) = (&current, line.trim().strip_prefix("Default: ")) {
            let unquoted =
                default.strip_prefix('\'').and_then(|d| d.strip_suffix('\'')).or_else(|| default.strip_prefix('"').and_then(|d| d.strip_suffix('"')));
            defaults.insert(name.clone(), unquoted.unwrap_or(default).to_owned());
        }
    }
    defaults
}
