//! `paceline serve`: the stack's lanes run as `paceline run` runs them, and one port
//! serves a JSON API for producers and operators (`/v1`), Prometheus metrics
//! (`/metrics`) and a web console (`/`), over the same functions as the CLI's commands;
//! with `--no-run`, over a stack that runs elsewhere (an AWS stack).

pub mod api;
mod auth;
mod console;
mod events;
mod metrics;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use axum::extract::{DefaultBodyLimit, State};
use axum::response::{IntoResponse as _, Response};
use axum::routing::{get, post};
use axum::Router;
use paceline_shared::config::{Backend, ServeConfig};
use paceline_shared::time::system_now;
use tokio::sync::{broadcast, watch, Semaphore};

use crate::access::{OperatorStack, StackArgs};
use crate::commands::dlq::{summarize, Selection};
use crate::commands::status::read_status;
use crate::stack::{load_config, load_config_for_operations, EmbeddedStack};
use crate::summary::Summary;
pub use auth::{Access, Tokens};
use events::{Published, ServedEvent};
use metrics::{Metrics, Scraped};

/// Events a slow stream may fall behind by before it is told it missed some.
const EVENTS_BUFFERED: usize = 4_096;

/// Run the lanes and serve the HTTP API, metrics and web console on one port.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub stack: StackArgs,
    /// The address to listen on: loopback by default; any other needs `[serve] token`
    /// (and TLS in front, see docs/serve.md).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Serve only, run no lane: the API and console over a stack that runs elsewhere
    /// (an AWS stack, or an embedded one that `paceline run` runs).
    #[arg(long)]
    pub no_run: bool,
    /// Replace the generated tokens with new ones (shown once); the old ones stop working.
    #[arg(long)]
    pub new_tokens: bool,
}

/// What every request handler shares.
pub struct Served {
    pub stack: OperatorStack,
    pub limits: ServeConfig,
    tokens: Tokens,
    metrics: Metrics,
    events: broadcast::Sender<Arc<Published>>,
    /// Event streams that may still open.
    streams: Arc<Semaphore>,
    /// Turns true when `serve` stops: streams end, so the server can.
    stopping: watch::Receiver<bool>,
}

impl Served {
    /// Ready to serve `stack`, letting in `tokens`' bearers; `stopping` ends the streams.
    #[must_use]
    pub fn new(stack: OperatorStack, tokens: Tokens, stopping: watch::Receiver<bool>) -> Arc<Self> {
        let limits = stack.config.as_ref().map(|config| config.serve.clone()).unwrap_or_default();
        let limits = ServeConfig { token: None, read_token: None, ..limits };
        let (events, _) = broadcast::channel(EVENTS_BUFFERED);
        let streams = Arc::new(Semaphore::new(limits.max_streams));
        Arc::new(Self { stack, limits, tokens, metrics: Metrics::default(), events, streams, stopping })
    }

    fn publish(&self, event: ServedEvent) {
        // No stream open: nobody to tell.
        let _ = self.events.send(Arc::new(Published::from(event)));
    }
}

/// The whole HTTP surface: the console's files (no token: they hold no data), the
/// OpenAPI document, and behind a bearer token `/v1` and `/metrics`.
pub fn router(served: Arc<Served>) -> Router {
    let guarded = Router::new()
        .route("/v1/jobs", post(api::post_jobs))
        .route("/v1/status", get(api::get_status))
        .route("/v1/lanes", get(api::get_lanes))
        .route("/v1/results", get(api::get_results))
        .route("/v1/dlq", get(api::get_dlq))
        .route("/v1/dlq/redrive", post(api::post_redrive))
        .route("/v1/circuit/open", post(api::post_circuit_open))
        .route("/v1/circuit/close", post(api::post_circuit_close))
        .route("/v1/events", get(api::get_events))
        .route("/metrics", get(get_metrics))
        .fallback(api::not_found)
        .layer(axum::middleware::from_fn_with_state(served.clone(), auth::require_token));
    let mut open = Router::new().route("/v1/openapi.json", get(api::get_openapi));
    for path in console::paths() {
        open = open.route(path, get(move || async move { console::file(path) }));
    }
    open.merge(guarded).layer(DefaultBodyLimit::max(served.limits.max_request)).layer(axum::middleware::from_fn(console::security_headers)).with_state(served)
}

/// `GET /metrics`: Prometheus's text format.
async fn get_metrics(State(served): State<Arc<Served>>) -> Result<Response, api::ApiError> {
    let status = read_status(&served.stack, None, system_now()).await?;
    // Counting by cause reads the whole DLQ: only where that hides nothing from others.
    let dead_by_cause = match &served.stack.embedded {
        Some(_) => Some(summarize(served.stack.queues.as_ref(), &Selection::default(), Duration::ZERO).await?.groups()),
        None => None,
    };
    let oldest = served.stack.embedded.as_ref().and_then(|store| store.oldest_enqueued().ok().flatten());
    let scraped =
        Scraped { status: &status, dead_by_cause: dead_by_cause.as_deref(), oldest_job_age_seconds: oldest.map(|at| system_now().since(at).as_secs()) };
    let text = served.metrics.render(&scraped);
    Ok(([(axum::http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text).into_response())
}

impl ServeArgs {
    /// # Errors
    /// A bad config, a refused address, a held database, a port in use, or a failed run.
    pub async fn run(self) -> anyhow::Result<()> {
        // Serving alone calls no API: its secrets need not be in this environment.
        let load = if self.no_run { load_config_for_operations } else { load_config };
        let config = if self.stack.config.exists() { Some(load(&self.stack.config)?) } else { None };
        let embedded = config.as_ref().is_some_and(|config| matches!(config.backend, Backend::Embedded { .. }));
        let lanes = match (&config, self.no_run) {
            (Some(config), false) if embedded => Some(EmbeddedStack::open(config)?),
            (_, true) => None,
            (Some(_), false) => bail!("on AWS the Lambda functions run the lanes: serve the stack with --no-run"),
            (None, false) => bail!(
                "config {} not found: pass --config FILE to run its lanes and serve them (or --no-run with an AWS stack's names)",
                self.stack.config.display()
            ),
        };
        // Served through the run's own store: one connection, so requests never wait on
        // SQLite's lock (whose busy handler sleeps whole milliseconds) behind the run.
        let stack = match (&lanes, config) {
            (Some(lanes), Some(config)) => OperatorStack::embedded(config, lanes.store.clone()),
            _ => self.stack.open_to_enqueue().await?,
        };
        let serving = Serving::start(stack, self.listen, self.new_tokens).await?;
        let outcome = match &lanes {
            Some(lanes) => Some(lanes.run(false, None, false).await),
            None => {
                stop_signal().await?;
                None
            }
        };
        serving.stop().await?;
        if let Some(outcome) = outcome {
            print!("{}", Summary::new(&outcome?).render());
        }
        Ok(())
    }
}

/// The server, running, and what stops it.
pub struct Serving {
    /// Where it listens (the port the OS chose for `:0`).
    pub address: SocketAddr,
    stop: watch::Sender<bool>,
    stopped: tokio::sync::oneshot::Receiver<std::io::Result<()>>,
}

/// The server's own threads: requests (parsing a thousand jobs, writing to a hundred
/// event streams) never queue ahead of the lanes' timers on the run's threads.
const SERVER_THREADS: usize = 2;

impl Serving {
    /// Serves `stack` on `listen`, on a runtime of its own, with the tokens of its
    /// config's `[serve]` (or generated ones, printed once; new ones with `new_tokens`).
    ///
    /// # Errors
    /// A non-loopback address without `[serve] token`, no token to be had, or an address
    /// that cannot be listened on.
    pub async fn start(stack: OperatorStack, listen: SocketAddr, new_tokens: bool) -> anyhow::Result<Self> {
        let serve = stack.config.as_ref().map(|config| config.serve.clone()).unwrap_or_default();
        if !listen.ip().is_loopback() && serve.token.is_none() {
            bail!(
                "--listen {listen} is not loopback: set [serve] token = {{ env = \"VARIABLE\" }} first (and put TLS in front: a reverse proxy such as Caddy or nginx, see docs/serve.md)"
            );
        }
        let (tokens, generated) = Tokens::resolve(&serve, stack.embedded.as_deref(), new_tokens)?;
        if let Some(generated) = generated {
            println!("generated tokens (shown once; only their hashes are kept, `--new-tokens` replaces them):");
            println!("  may act:    {}", generated.act);
            println!("  read only:  {}", generated.read);
        }
        let listener = std::net::TcpListener::bind(listen).with_context(|| format!("listening on {listen}"))?;
        listener.set_nonblocking(true)?;
        let address = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(SERVER_THREADS)
            .thread_name("paceline-serve")
            .on_thread_start(paceline_shared::priority::yield_to_the_lanes)
            .enable_all()
            .build()?;
        let (stop, stopping) = watch::channel(false);
        let (said_stopped, stopped) = tokio::sync::oneshot::channel();
        let served = Served::new(stack, tokens, stopping.clone());
        let seen = events::Seen::as_of_now(&served);
        std::thread::Builder::new().name("paceline-serve".into()).spawn(move || {
            // This thread polls the accept loop; the runtime's own threads the rest.
            paceline_shared::priority::yield_to_the_lanes();
            let served = runtime.block_on(async move {
                let watcher = tokio::spawn(events::watch(served.clone(), seen));
                let mut until_stopped = stopping;
                let serving = async move {
                    let listener = tokio::net::TcpListener::from_std(listener)?;
                    axum::serve(listener, router(served))
                        .with_graceful_shutdown(async move {
                            let _ = until_stopped.wait_for(|stop| *stop).await;
                        })
                        .await
                };
                let result = serving.await;
                crate::tasks::end_all([watcher]).await;
                result
            });
            let _ = said_stopped.send(served);
        })?;
        println!("serving on http://{address}: the console at /, the API at /v1 (/v1/openapi.json), metrics at /metrics");
        Ok(Self { address, stop, stopped })
    }

    /// Ends the event streams, lets requests under way finish, and stops.
    ///
    /// # Errors
    /// The server failed.
    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        self.stopped.await.context("the server's thread ended")?.context("serving")
    }
}

/// Waits for Ctrl-C or SIGTERM, as `paceline run` stops on.
///
/// # Errors
/// The signals cannot be listened for.
pub async fn stop_signal() -> anyhow::Result<()> {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).context("listening for SIGTERM")?;
    tokio::select! {
        result = tokio::signal::ctrl_c() => result.context("listening for Ctrl-C")?,
        _ = terminate.recv() => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests;
