//! `paceline demo`: the whole story in about a minute, with nothing to set up. A fake
//! API on loopback enforces a strict quota and has an outage; a stack with a real config
//! file and an embedded store paces a few hundred jobs (some deliberately bad) for three
//! tenants at it, each under its own quota and all under the API's; the report shows
//! zero quota rejections, tier utilization, each tenant's share (the light ones not held
//! behind the heavy one's backlog), the circuits opening and closing, and what went to
//! the dead-letter queue and why.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use paceline_shared::check::peak_in_any_window;
use paceline_shared::ports::{JobQueue, OutgoingMessage};
use paceline_shared::quota::{Period, Tier};
use serde::Serialize;

use crate::access::OperatorStack;
use crate::fake_api::{FakeApi, FakeApiLog, FakeApiSpec};
use crate::serve::{stop_signal, Serving};
use crate::stack::{load_config, EmbeddedStack};
use crate::summary::Summary;
use paceline_shared::table::text_table;

/// Quota of the demo's fake API.
const TIERS: [&str; 3] = ["10/s", "500/min", "20000/day"];

/// What the stack shares: the API's rolling tiers (its day tier is divided among the
/// tenants, whose own day tiers add up to less).
const SHARED_TIERS: [&str; 2] = ["10/s", "500/min"];

/// Each tenant's own quota (its key's, at the API).
const TENANT_TIERS: [&str; 2] = ["8/s", "6000/day"];

/// The heavy tenant, whose jobs go on the queue first, and the light ones after it.
const HEAVY: &str = "acme";
const LIGHT: [&str; 2] = ["globex", "initech"];

/// Run a self-contained demo against a built-in, strictly rate-limited fake API.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Good jobs to enqueue, two thirds for the heavy tenant (5 more get a 404 and 4 are
    /// malformed).
    #[arg(long, default_value_t = 300)]
    pub jobs: usize,
    /// When the fake API's outage starts, after its first call.
    #[arg(long, default_value = "12s", value_parser = humantime::parse_duration)]
    pub outage_after: Duration,
    /// How long the outage lasts (0s for none).
    #[arg(long, default_value = "6s", value_parser = humantime::parse_duration)]
    pub outage_for: Duration,
    /// Folder for the demo's config and database (default: a new temporary folder).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Serve the web console on the demo while it runs, and keep it open after the
    /// report until Ctrl-C (on 127.0.0.1:8080, or the address given).
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:8080", conflicts_with = "json")]
    pub serve: Option<SocketAddr>,
}

#[derive(Serialize)]
struct ApiTierCheck {
    tier: String,
    limit: u64,
    peak_window: u64,
    within_limit: bool,
}

#[derive(Serialize)]
struct DemoReport {
    api_calls: usize,
    /// Of `api_calls`, the lane's health checks (the rest are jobs' calls).
    api_health_checks: u64,
    api_ok: u64,
    quota_rejections: u64,
    outage_failures: u64,
    not_found: u64,
    /// When the API answered 503, in seconds from the start of the run.
    api_outage_seconds: Option<(f64, f64)>,
    api_tiers: Vec<ApiTierCheck>,
    stack: Summary,
    /// The heavy tenant's jobs ahead of the light ones' on the queue, and how long one
    /// queue in order would have held the light ones behind them at the shared pace.
    heavy_jobs_first: usize,
    one_queue_wait_seconds: f64,
    dead_letters_by_cause: BTreeMap<String, u64>,
    config: PathBuf,
}

/// The tenant of good job `i` of `good`: the heavy one's come first.
fn tenant_of(i: usize, good: usize) -> &'static str {
    if i < good * 2 / 3 {
        HEAVY
    } else {
        LIGHT[i % 2]
    }
}

fn demo_jobs(good: usize) -> Vec<String> {
    let mut bodies: Vec<String> = (0..good)
        .map(|i| {
            let lane = tenant_of(i, good);
            format!(r#"{{"id":"job-{i:04}","lane":"{lane}","request":{{"method":"POST","path":"/items/job-{i:04}","body":{{"n":{i}}}}}}}"#)
        })
        .collect();
    for i in 0..5 {
        let at = (i + 1) * good / 6;
        bodies.insert(at.min(bodies.len()), format!(r#"{{"id":"gone-{i}","lane":"{HEAVY}","request":{{"method":"GET","path":"/missing/{i}"}}}}"#));
    }
    let malformed = [
        "this is not JSON".to_owned(),
        r#"{"request":{"method":"GET","path":"https://elsewhere.example/steal"}}"#.to_owned(),
        r#"{"id":"no-request"}"#.to_owned(),
        r#"{"request":{"method":"GET","path":"/items/x"},"cost":0}"#.to_owned(),
    ];
    for (i, bad) in malformed.into_iter().enumerate() {
        bodies.insert(((i * 2 + 1) * good / 8).min(bodies.len()), bad);
    }
    bodies
}

fn write_config(dir: &std::path::Path, base_url: &str) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("paceline.toml");
    let quoted = |tiers: &[&str]| tiers.iter().map(|t| format!("\"{t}\"")).collect::<Vec<_>>().join(", ");
    let (shared, tenant) = (quoted(&SHARED_TIERS), quoted(&TENANT_TIERS));
    let text = format!(
        r#"# The demo stack: a strict fake API on loopback, called for three tenants.
[api]
base_url = "{base_url}"
timeout = "5s"
headers = {{ "User-Agent" = {{ value = "paceline-demo" }} }}
health_check = {{ method = "GET", path = "/health" }}

# The API's quota for all of them together.
[quota]
tiers = [{shared}]
safety_margin = "20ms"

# Each tenant's own quota and header; a job names its tenant ("lane": "acme").
[lanes]
tiers = [{tenant}]
headers = {{ "X-Tenant" = {{ value = "{{lane}}" }} }}

[circuit]
health_check_interval = "2s"

[retry]
max_attempts = 5

[orchestrator]
visibility_timeout = "30s"

[backend]
kind = "embedded"
path = "paceline.db"
"#
    );
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

fn check_api_tiers(log: &FakeApiLog) -> Vec<ApiTierCheck> {
    let arrivals: Vec<_> = log.arrivals.iter().map(|t| (*t, 1)).collect();
    TIERS
        .iter()
        .filter_map(|t| t.parse::<Tier>().ok())
        .map(|tier| {
            let peak = match tier.period {
                Period::Rolling(window) => peak_in_any_window(&arrivals, window),
                Period::Day | Period::Month => arrivals.len() as u64,
            };
            ApiTierCheck { tier: tier.to_string(), limit: tier.limit, peak_window: peak, within_limit: peak <= tier.limit }
        })
        .collect()
}

impl DemoArgs {
    /// # Errors
    /// When the fake API, the lane or the run cannot be set up.
    pub async fn run(self) -> anyhow::Result<()> {
        let tiers: Vec<Tier> = TIERS.iter().map(|t| t.parse()).collect::<Result<_, _>>()?;
        let outage = (!self.outage_for.is_zero()).then_some((self.outage_after, self.outage_for));
        let api = FakeApi::start(FakeApiSpec {
            tiers,
            latency: (Duration::from_millis(200), Duration::from_millis(1_500)),
            outage,
            server_error_every: None,
            max_concurrent: None,
            others_per_second: 0.0,
        })
        .await?;
        let dir = self.dir.clone().unwrap_or_else(|| std::env::temp_dir().join(format!("paceline-demo-{}", std::process::id())));
        let config_path = write_config(&dir, &api.base_url)?;
        let config = load_config(&config_path)?;
        let stack = EmbeddedStack::open(&config)?;
        let bodies = demo_jobs(self.jobs);
        let heavy = (0..self.jobs).filter(|i| tenant_of(*i, self.jobs) == HEAVY).count() + 5;
        let shared_pace = config.quota.pace_per_second();
        let messages: Vec<OutgoingMessage> = bodies.iter().map(|b| OutgoingMessage::fresh(b.clone())).collect();
        for batch in messages.chunks(10) {
            stack.store.send(batch).await?;
        }
        let serving = match self.serve {
            Some(listen) => {
                let serving = Serving::start(OperatorStack::embedded(config.clone(), stack.store.clone()), listen, false).await?;
                println!("  (open http://{} and paste the token that may act to watch the demo live)", serving.address);
                Some(serving)
            }
            None => None,
        };
        if !self.json {
            println!("Paceline demo");
            println!("  fake API   {} (strict quota {}; calls take 0.2-1.5 s)", api.base_url, TIERS.join(" + "));
            println!(
                "  tenants    {HEAVY} (two thirds of the jobs, on the queue first), {} and {}: each {} of its own, all under {}",
                LIGHT[0],
                LIGHT[1],
                TENANT_TIERS.join(" + "),
                SHARED_TIERS.join(" + ")
            );
            match outage {
                Some((after, length)) => {
                    println!("  outage     503s from {} after its first call, for {}", humantime::format_duration(after), humantime::format_duration(length))
                }
                None => println!("  outage     none"),
            }
            println!("  stack      {} ({} jobs enqueued: {} good, 5 for missing items, 4 malformed)", config_path.display(), bodies.len(), self.jobs);
            println!();
        }
        let outcome = stack.run(true, None, !self.json).await?;
        let log = api.log();
        let mut by_cause = BTreeMap::new();
        for dead in stack.store.dead_letters()? {
            *by_cause.entry(dead.reason.cause.label()).or_insert(0) += 1;
        }
        let started = outcome.report.started_at;
        let api_outage_seconds = outage.zip(log.first_call).map(|((after, length), first)| {
            let from = first.plus(after).since(started).as_secs_f64();
            (from, from + length.as_secs_f64())
        });
        let report = DemoReport {
            api_calls: log.arrivals.len(),
            api_health_checks: log.health_checks,
            api_ok: log.ok,
            quota_rejections: log.quota_rejections,
            outage_failures: log.outage_failures,
            not_found: log.not_found,
            api_outage_seconds,
            api_tiers: check_api_tiers(&log),
            stack: Summary::new(&outcome),
            heavy_jobs_first: heavy,
            one_queue_wait_seconds: heavy as f64 / shared_pace,
            dead_letters_by_cause: by_cause,
            config: config_path,
        };
        if self.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            print_report(&report);
        }
        if let Some(serving) = serving {
            println!();
            println!("The console stays open at http://{} (the demo's API is still up); Ctrl-C ends it.", serving.address);
            stop_signal().await?;
            serving.stop().await?;
        }
        Ok(())
    }
}

fn print_report(r: &DemoReport) {
    println!("What the API saw");
    let job_calls = r.api_calls as u64 - r.api_health_checks;
    println!("  {} calls: {job_calls} for jobs (a job the outage failed is called again) and {} health checks", r.api_calls, r.api_health_checks);
    println!(
        "  answers: {} ok, {} over quota (429), {} failed in the outage (503), {} not found (404)",
        r.api_ok, r.quota_rejections, r.outage_failures, r.not_found
    );
    let mut tiers = text_table(&["tier", "busiest window", "verdict"], &[1]);
    for t in &r.api_tiers {
        tiers.add_row(vec![t.tier.clone(), format!("{} of {} calls", t.peak_window, t.limit), if t.within_limit { "within" } else { "OVER QUOTA" }.to_owned()]);
    }
    println!("{tiers}");
    println!();
    if let Some((from, to)) = r.api_outage_seconds {
        println!("The outage");
        println!("  the API answered 503 from {from:.1} s to {to:.1} s into the run");
        let whose = if r.stack.lanes.is_empty() { "the circuit" } else { "each tenant's circuit:" };
        println!("  {whose} {}", r.stack.circuit_story());
        println!();
    }
    println!("What the stack did");
    print!("{}", r.stack.render());
    println!();
    println!("The tenants");
    let longest_wait = |lane: &str| r.stack.lanes.iter().find(|l| l.lane == lane).map_or(0.0, |l| l.longest_wait_seconds);
    println!(
        "  {HEAVY}'s {} jobs were on the queue first; {} and {} waited at most {:.1} s and {:.1} s for their slots, not behind them:",
        r.heavy_jobs_first,
        LIGHT[0],
        LIGHT[1],
        longest_wait(LIGHT[0]),
        longest_wait(LIGHT[1])
    );
    println!("  one queue in order would have held them at least {:.0} s (all of {HEAVY}'s at the shared {}).", r.one_queue_wait_seconds, SHARED_TIERS[0]);
    println!();
    println!("Dead-letter queue");
    for (cause, count) in &r.dead_letters_by_cause {
        println!("  {cause:<20} {count}");
    }
    println!();
    let config = r.config.display();
    println!("Config and database kept at {config}. Look around:");
    println!("  paceline status --config {config}");
    println!("  paceline results --config {config} --status 4xx     (each job's outcome: the API's status and body)");
    println!("  paceline dlq summary --config {config}");
    println!(
        "(`paceline` comes with `cargo install --path cli`; without it, run `cargo run -p paceline-cli --no-default-features -- status --config {config}`.)"
    );
}
