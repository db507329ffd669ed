//! `paceline simulate`: how close to the quota a lane gets, how long a backlog takes and
//! what it costs, from the real orchestrator and worker under virtual time.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use indicatif::{ProgressBar, ProgressStyle};
use paceline_orchestrator::Settings;
use paceline_shared::config::{WorkerHost, MAX_DISPATCH_AHEAD};
use paceline_shared::keys::Shard;
use paceline_shared::order::JobOrder;
use paceline_shared::quota::Quota;
use paceline_shared::time::{system_now, Clock as _, SystemClock};
use paceline_sim::lanes::{first_come_first_served, render_lanes, round_robin, simulate_lanes, LambdaWorkers, LanesPlan, LanesQueue, Skew};
use paceline_sim::pricing::TableCapacity;
use paceline_sim::profile::{Failures, LatencyProfile, Outage};
use paceline_sim::provider::ProviderModel;
use paceline_sim::report::{render, render_comparison};
use paceline_sim::{little_law_concurrency, plot, simulate, Dispatcher, Plan, SimReport};

use crate::commands::{ConfigArg, OverQuota};
use crate::stack::load_config_for_operations;

/// Simulate draining a backlog through the lane (no AWS, no API calls, virtual time).
#[derive(Debug, clap::Args)]
pub struct SimulateArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Jobs in the backlog.
    #[arg(long, default_value_t = 10_000)]
    pub jobs: usize,
    /// Seed of every random draw: the same seed gives the same report.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Override a latency: NAME=MEDIAN/P99 (log-normal) or NAME=FIXED, NAME one of sqs,
    /// invoke, async_start, dynamodb, api, api_arrival, kick. Repeatable.
    #[arg(long = "latency", value_name = "NAME=LATENCY")]
    pub latencies: Vec<String>,
    /// The API fails every call with 503 from START for LENGTH (e.g. 10m+2m). Repeatable.
    #[arg(long = "outage", value_name = "START+LENGTH")]
    pub outages: Vec<Outage>,
    /// Share of calls the API answers 429 although within quota (0 to 1).
    #[arg(long, default_value_t = 0.0)]
    pub rate_429: f64,
    /// Share of calls the API answers 500 (0 to 1).
    #[arg(long, default_value_t = 0.0)]
    pub rate_5xx: f64,
    /// Share of the quota other clients of the same account spend at the provider (0 to
    /// 1): a steady stream of their calls at that share of the binding tier's rate.
    #[arg(long, default_value_t = 0.0, value_name = "SHARE")]
    pub foreign_load: f64,
    /// Share of worker events Lambda delivers twice, and of hand-offs whose 202 is lost
    /// and are sent again (0 to 1): `answers.duplicate_calls` counts the calls repeated.
    #[arg(long, default_value_t = 0.0, value_name = "SHARE")]
    pub rate_duplicate_delivery: f64,
    /// Share of the worker executions carrying a batch that are killed part-way (0 to
    /// 1): Lambda runs the event again a minute later; `answers.duplicate_calls` counts
    /// any call made twice.
    #[arg(long, default_value_t = 0.0, value_name = "SHARE")]
    pub rate_worker_crash: f64,
    /// Kill the orchestrator run going at this instant (e.g. 90s): no final snapshot, no
    /// release; the next run waits for the lease to expire and holds one window of the
    /// longest tier. Repeatable.
    #[arg(long = "kill-run-at", value_name = "TIME", value_parser = humantime::parse_duration)]
    pub kill_run_at: Vec<Duration>,
    /// The next orchestrator run to end after this instant fails its final snapshot
    /// write and its lease release. Repeatable.
    #[arg(long = "fail-release-at", value_name = "TIME", value_parser = humantime::parse_duration)]
    pub fail_release_at: Vec<Duration>,
    /// How the simulated provider counts each rolling tier: sliding-window (no window of
    /// the tier's length holds more than its limit), fixed-window (windows aligned on
    /// the clock) or leaky-bucket (strict, room for one call). A tier with `burst=N` is
    /// a bucket of N in every model.
    #[arg(long, default_value = "sliding-window", value_name = "MODEL")]
    pub provider: ProviderModel,
    /// The provider sends no rate-limit headers (by default every answer carries
    /// `RateLimit` and `RateLimit-Policy` for its shortest rolling tier): the lane then
    /// learns of other clients only from 429s.
    #[arg(long)]
    pub no_rate_limit_headers: bool,
    /// Override the config's `orchestrator.dispatch_ahead` (0s for none; unset, 500ms as
    /// for Lambda workers).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub dispatch_ahead: Option<Duration>,
    /// Override the config's `quota.safety_margin` (what each rolling window is widened
    /// by against the network's jitter; a per-second tier's use is at most 1 s over
    /// 1 s plus the margin).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub safety_margin: Option<Duration>,
    /// Override the config's `orchestrator.worker_batch`: the most jobs one worker
    /// invocation carries (1 hands each job to an invocation of its own, as before
    /// batches; unset, 1,000 as for Lambda workers).
    #[arg(long, value_name = "N")]
    pub worker_batch: Option<u32>,
    /// The account's concurrent Lambda executions: an event that finds them all busy is
    /// throttled, retried with back-off, and aged out past the worker's maximum event age.
    #[arg(long, value_name = "N", default_value_t = paceline_sim::aws::DEFAULT_LAMBDA_CONCURRENCY)]
    pub lambda_concurrency: u64,
    /// How the stack's state table is billed, for the cost estimate (the template's
    /// `TableCapacity`): `on-demand`, or `provisioned`, its capacity kept at 70% use by
    /// auto scaling, priced as a steady load.
    #[arg(long, value_name = "MODE", default_value = "on-demand")]
    pub table_capacity: TableCapacity,
    /// No relays: each orchestrator run is started by the schedule's next kick, not by
    /// the run before it (what a stack whose orchestrator cannot invoke itself does).
    #[arg(long)]
    pub no_relay: bool,
    /// Also run the baselines on the same workload: Paceline without dispatch-ahead, a
    /// per-second token bucket, a fixed-window counter and a concurrency cap alone.
    #[arg(long)]
    pub baselines: bool,
    /// Stop (and report "not drained") after this much simulated time.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "400days")]
    pub time_limit: Duration,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Simulate N lanes in one embedded stack, each under the config's `[lanes]` tiers
    /// and all under `[quota]`: the backlog's jobs fall on them as `--skew` says.
    /// Reports violations, the shared tier's use, Jain's fairness index and the jobs'
    /// waits; with `--baselines`, first come first served over one queue and round robin.
    /// `--latency` and `--safety-margin` apply; the faults, the provider's model,
    /// `--no-relay` and `--time-limit` are modelled for one lane only and refused with
    /// `--lanes` (`--runs` models the runs and their relays).
    #[arg(long, value_name = "N")]
    pub lanes: Option<usize>,
    /// How the jobs spread over the lanes, with `--lanes`: `zipf:S` (a few lanes with
    /// most jobs; S = 0 is even), or `heavy-first:N` (N jobs of one lane first on the
    /// queue, the rest spread over the others behind them).
    #[arg(long, value_name = "zipf:S|heavy-first:N", default_value = "zipf:1")]
    pub skew: Skew,
    /// The jobs queue, with `--lanes`: the embedded store's, SQS as a standard queue
    /// without message groups (`sqs`), or SQS as Paceline sends to it on AWS, each job
    /// in its lane's group: a fair queue (`sqs-fair`), or a FIFO queue, each lane a
    /// group (`sqs-fifo`: what ordered lanes need). SQS adds its latencies and counts
    /// its requests.
    #[arg(long, value_name = "embedded|sqs|sqs-fair|sqs-fifo", default_value = "embedded")]
    pub queue: LanesQueue,
    /// With `--lanes`: the calls are made by simulated Lambda workers, as deployed on
    /// AWS (handed off ahead of their slots, in batches, each waiting for its slot;
    /// `--lambda-concurrency` executions at most), not by workers in the orchestrator's
    /// process at each hand-off.
    #[arg(long)]
    pub lambda_workers: bool,
    /// With `--lanes`: this many shards, each with its own jobs queue, orchestrator and
    /// state, each lane on the shard its id's hash names, the shared rolling tiers divided
    /// among them where the work is (one share book, as deployed), the calendar tiers
    /// reserved by every shard from one counter.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub shards: usize,
    /// With `--shards`: every shared rolling tier divided evenly and for good, as before
    /// shares moved (to compare).
    #[arg(long, requires = "shards")]
    pub fixed_shares: bool,
    /// With `--lanes --lambda-workers`: each orchestrator's runs as deployed on AWS, kicked
    /// every minute and each relaying to the next (its lanes' pace handed over with the
    /// lease, its jobs in hand given back to the queue as it stops), not one run that
    /// drains the whole backlog.
    #[arg(long)]
    pub runs: bool,
    /// Draw each tier's use over time against its limit to this file (.png or .svg),
    /// with outages, refused calls and, with `--baselines`, the other dispatchers.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
}

impl SimulateArgs {
    fn plan(&self) -> anyhow::Result<Plan> {
        anyhow::ensure!(!self.lambda_workers, "--lambda-workers goes with --lanes: without it, the simulated workers are Lambda functions already");
        anyhow::ensure!(self.shards == 1, "--shards goes with --lanes: shards divide a stack's lanes");
        let config = load_config_for_operations(&self.config.config)?;
        anyhow::ensure!(self.jobs > 0, "--jobs: need at least one job");
        let mut orchestrator = config.orchestrator;
        if let Some(ahead) = self.dispatch_ahead {
            anyhow::ensure!(ahead <= MAX_DISPATCH_AHEAD, "--dispatch-ahead: at most {}", humantime::format_duration(MAX_DISPATCH_AHEAD));
            orchestrator.dispatch_ahead = Some(ahead);
        }
        if let Some(batch) = self.worker_batch {
            orchestrator.worker_batch = Some(batch);
        }
        orchestrator.check().map_err(|e| anyhow::anyhow!("--{}: {}", e.field.replace('_', "-"), e.problem))?;
        anyhow::ensure!(self.lambda_concurrency > 0, "--lambda-concurrency: need at least one execution");
        let profile = self.latency_profile()?;
        let failures = Failures {
            outages: self.outages.clone(),
            rate_429: self.rate_429,
            rate_5xx: self.rate_5xx,
            foreign_load: self.foreign_load,
            rate_duplicate_delivery: self.rate_duplicate_delivery,
            rate_worker_crash: self.rate_worker_crash,
            kill_run_at: self.kill_run_at.clone(),
            fail_release_at: self.fail_release_at.clone(),
        };
        failures.check().map_err(|e| anyhow::anyhow!("--rate-429/--rate-5xx/--foreign-load/--rate-duplicate-delivery/--rate-worker-crash: {e}"))?;
        // The simulated Lambda stack paces one lane, as the AWS backend does today.
        anyhow::ensure!(
            config.lanes.is_none(),
            "simulate paces one lane on AWS (the AWS backend's): leave [lanes] out of this config, or simulate the lanes in one embedded stack with --lanes N"
        );
        let quota = self.with_margin(config.quota)?;
        anyhow::ensure!(
            !config.quota_ordering.is_ordered(),
            "[quota] ordering = \"fifo\": the simulator of one lane on AWS does not model ordered lanes yet (simulate --lanes does, on the embedded queue)"
        );
        let settings = Settings {
            quota,
            orchestrator,
            circuit: config.circuit,
            workers: WorkerHost::Lambda,
            lanes: None,
            ordering: JobOrder::None,
            shard: Shard::WHOLE,
            share_most: None,
        };
        let mut plan = Plan::new(self.jobs, self.seed, settings, config.retry);
        plan.profile = profile;
        plan.failures = failures;
        plan.provider = self.provider;
        plan.rate_limit_headers = !self.no_rate_limit_headers;
        plan.time_limit = self.time_limit;
        plan.lambda_concurrency = self.lambda_concurrency;
        plan.relay = !self.no_relay;
        plan.table = self.table_capacity;
        Ok(plan)
    }

    /// The services' latencies: the defaults, with `--latency` over them.
    fn latency_profile(&self) -> anyhow::Result<LatencyProfile> {
        let mut profile = LatencyProfile::default();
        for assignment in &self.latencies {
            profile.set(assignment).map_err(|e| anyhow::anyhow!("--latency {e}"))?;
        }
        Ok(profile)
    }

    /// `quota` with `--safety-margin`'s margin, if given.
    fn with_margin(&self, quota: Quota) -> anyhow::Result<Quota> {
        match self.safety_margin {
            Some(margin) => quota.with_safety_margin(margin).map_err(|e| anyhow::anyhow!("--safety-margin: {e}")),
            None => Ok(quota),
        }
    }

    /// The options given that only the simulation of one lane models (faults, the
    /// provider's model, relays, a time limit), each as it is spelled.
    fn options_of_one_lane(&self) -> Vec<&'static str> {
        let given = [
            ("--outage", !self.outages.is_empty()),
            ("--rate-429", self.rate_429 != 0.0),
            ("--rate-5xx", self.rate_5xx != 0.0),
            ("--foreign-load", self.foreign_load != 0.0),
            ("--rate-duplicate-delivery", self.rate_duplicate_delivery != 0.0),
            ("--rate-worker-crash", self.rate_worker_crash != 0.0),
            ("--kill-run-at", !self.kill_run_at.is_empty()),
            ("--fail-release-at", !self.fail_release_at.is_empty()),
            ("--provider", self.provider != ProviderModel::SlidingWindow),
            ("--no-rate-limit-headers", self.no_rate_limit_headers),
            ("--no-relay", self.no_relay),
            ("--time-limit", self.time_limit != Plan::DEFAULT_TIME_LIMIT),
        ];
        given.into_iter().filter(|(_, given)| *given).map(|(option, _)| option).collect()
    }

    /// `--lanes`: the plan of many lanes in one embedded stack.
    fn lanes_plan(&self, lanes: usize) -> anyhow::Result<LanesPlan> {
        let one_lane_only = self.options_of_one_lane();
        let them = if one_lane_only.len() == 1 { "it" } else { "them" };
        anyhow::ensure!(
            one_lane_only.is_empty(),
            "{}: the simulation of many lanes does not model {them}; leave {them} out with --lanes",
            one_lane_only.join(", ")
        );
        if !self.lambda_workers {
            let given = [
                ("--dispatch-ahead", self.dispatch_ahead.is_some()),
                ("--worker-batch", self.worker_batch.is_some()),
                ("--lambda-concurrency", self.lambda_concurrency != paceline_sim::aws::DEFAULT_LAMBDA_CONCURRENCY),
            ];
            if let Some((option, _)) = given.into_iter().find(|(_, given)| *given) {
                anyhow::bail!("{option} goes with --lambda-workers: without them, the lanes' workers are in the orchestrator's process and call at their slot");
            }
        }
        let config = load_config_for_operations(&self.config.config)?;
        anyhow::ensure!(self.jobs > 0, "--jobs: need at least one job");
        anyhow::ensure!(lanes > 0, "--lanes: need at least one lane");
        anyhow::ensure!(
            self.table_capacity == TableCapacity::OnDemand,
            "--table-capacity: the lanes' report prices an on-demand table; leave it out with --lanes"
        );
        anyhow::ensure!(
            !self.lambda_workers || self.queue != LanesQueue::Embedded,
            "--lambda-workers: Lambda workers run on AWS, with an SQS jobs queue: add --queue sqs, sqs-fair or sqs-fifo"
        );
        anyhow::ensure!(self.lambda_workers || !self.runs, "--runs: the orchestrator's runs are modelled as deployed on AWS: add --lambda-workers");
        anyhow::ensure!(config.lanes.is_some(), "--lanes needs a [lanes] table in {} (each lane's own tiers and weight)", self.config.config.display());
        if self.plot.is_some() {
            anyhow::ensure!(!config.quota.tiers().is_empty(), "--plot: the lanes share no quota ([quota] left out), so there is no shared tier to draw");
        }
        let mut orchestrator = config.orchestrator;
        let (workers, lambda) = if self.lambda_workers {
            orchestrator.dispatch_ahead = self.dispatch_ahead.or(orchestrator.dispatch_ahead);
            orchestrator.worker_batch = self.worker_batch.or(orchestrator.worker_batch);
            let lambda = LambdaWorkers { concurrency: self.lambda_concurrency, max_event_age: paceline_sim::aws::DEFAULT_MAX_EVENT_AGE };
            (WorkerHost::Lambda, Some(lambda))
        } else {
            // Workers in one process call at their slot.
            orchestrator.dispatch_ahead = Some(Duration::ZERO);
            (WorkerHost::InProcess, None)
        };
        anyhow::ensure!(self.shards > 0, "--shards: need at least one shard");
        if let Err(problem) = config.quota.share(0, self.shards) {
            anyhow::bail!("--shards {}: the shared [quota] {problem}", self.shards);
        }
        let settings = Settings {
            quota: self.with_margin(config.quota)?,
            orchestrator,
            circuit: config.circuit,
            workers,
            lanes: match (config.lanes, self.safety_margin) {
                (Some(lanes), Some(margin)) => Some(lanes.with_safety_margin(margin).map_err(|e| anyhow::anyhow!("--safety-margin: {e}"))?),
                (lanes, _) => lanes,
            },
            ordering: config.quota_ordering,
            shard: Shard::WHOLE,
            share_most: None,
        };
        Ok(LanesPlan {
            lanes,
            skew: self.skew,
            jobs: self.jobs,
            seed: self.seed,
            settings,
            queue: self.queue,
            lambda,
            shards: self.shards,
            fixed_shares: self.fixed_shares,
            profile: self.latency_profile()?,
            runs: self.runs,
        })
    }

    /// `--lanes`: runs the lanes' simulation (and its baselines) and reports.
    async fn run_lanes(&self, lanes: usize) -> anyhow::Result<()> {
        let plan = self.lanes_plan(lanes)?;
        if let Some(path) = &self.plot {
            plot::check_path(path)?;
        }
        let shared = plan.settings.quota.clone();
        let baselines = self.baselines;
        let reports = tokio::task::spawn_blocking(move || {
            let mut reports = vec![simulate_lanes(&plan)];
            if baselines {
                reports.extend([first_come_first_served(&plan), round_robin(&plan)]);
            }
            reports
        })
        .await
        .context("the simulation failed")?;
        if self.json {
            let (main, others) = reports.split_first().context("the simulation made no report")?;
            let mut value = serde_json::to_value(main)?;
            value["baselines"] = serde_json::to_value(others)?;
            println!("{}", serde_json::to_string_pretty(&value)?);
        } else {
            print!("{}", render_lanes(&reports));
        }
        if let Some(path) = &self.plot {
            plot::write(path, &plot::lanes_figure(&reports[0], &shared))?;
            if !self.json {
                println!("\nPlot written to {}", path.display());
            }
        }
        match reports[0].lane_violations + reports[0].shared_violations {
            0 => Ok(()),
            violations => Err(OverQuota { violations }.into()),
        }
    }

    /// # Errors
    /// Bad config or flags, or an unwritable plot file; [`OverQuota`] (after the report)
    /// when the provider refused any of the lane's calls as over quota.
    pub async fn run(self) -> anyhow::Result<()> {
        if let Some(lanes) = self.lanes {
            return self.run_lanes(lanes).await;
        }
        let mut plan = self.plan()?;
        if let Some(path) = &self.plot {
            plot::check_path(path)?;
        }
        let settled = Arc::new(AtomicU64::new(0));
        plan.progress = Some(settled.clone());
        let simulations = if self.baselines { with_baselines(&plan) } else { vec![(plan.clone(), Dispatcher::Paceline)] };
        let progress = Progress::start(settled, plan.jobs as u64 * simulations.len() as u64);
        // The simulations run their own paused runtime, on a thread of their own.
        let reports = tokio::task::spawn_blocking(move || simulations.iter().map(|(plan, dispatcher)| simulate(plan, dispatcher)).collect::<Vec<_>>()).await;
        progress.finish().await;
        let reports = reports.context("the simulation failed")?;
        let (main, others) = reports.split_first().context("the simulation made no report")?;
        if let Some(path) = &self.plot {
            plot::write(path, &plot::figure(main, others, &plan.settings.quota))?;
        }
        if self.json {
            let mut value = json_with_violations(main)?;
            value["baselines"] = others.iter().map(json_with_violations).collect::<anyhow::Result<Vec<_>>>()?.into();
            println!("{}", serde_json::to_string_pretty(&value)?);
        } else {
            print!("{}", render(main));
            if !others.is_empty() {
                println!("\nSame workload, other dispatchers:\n");
                println!("{}", render_comparison(&reports, false));
            }
            if let Some(path) = &self.plot {
                println!("\nPlot written to {}", path.display());
            }
        }
        match main.violations() {
            0 => Ok(()),
            violations => Err(OverQuota { violations }.into()),
        }
    }
}

/// A report as JSON, with its violations summed at the top level.
fn json_with_violations(report: &SimReport) -> anyhow::Result<serde_json::Value> {
    let mut value = serde_json::to_value(report)?;
    value["violations"] = report.violations().into();
    Ok(value)
}

/// The configured lane and the baselines to compare it with, each with its plan:
/// Paceline at the slot (when the lane dispatches ahead), a per-second token bucket, a
/// fixed-window counter and a concurrency cap alone.
fn with_baselines(plan: &Plan) -> Vec<(Plan, Dispatcher)> {
    let mut all = vec![(plan.clone(), Dispatcher::Paceline)];
    if !plan.settings.dispatch_ahead().is_zero() {
        let mut at_slot = plan.clone();
        at_slot.settings.orchestrator.dispatch_ahead = Some(Duration::ZERO);
        all.push((at_slot, Dispatcher::Paceline));
    }
    let concurrency = little_law_concurrency(plan);
    all.extend([Dispatcher::TokenBucket, Dispatcher::FixedWindow, Dispatcher::ConcurrencyOnly { limit: concurrency }].map(|d| (plan.clone(), d)));
    all
}

/// A progress bar on standard error (drawn only on a terminal) that follows `settled`,
/// the jobs settled in simulated time, for simulations that take a while of wall time.
struct Progress {
    bar: ProgressBar,
    ticker: tokio::task::JoinHandle<()>,
}

impl Progress {
    fn start(settled: Arc<AtomicU64>, total: u64) -> Self {
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template("simulating {wide_bar} {pos}/{len} jobs settled ({elapsed})").unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        let (seen, shown) = (settled, bar.clone());
        let ticker = tokio::spawn(async move {
            loop {
                shown.set_position(seen.load(Ordering::Relaxed));
                SystemClock.sleep_until_coarse(system_now().plus(Duration::from_millis(200))).await;
            }
        });
        Self { bar, ticker }
    }

    async fn finish(self) {
        crate::tasks::end_all([self.ticker]).await;
        self.bar.finish_and_clear();
    }
}
