//! The orchestrator's release binary as Lambda runs it, with the real AWS SDK (SigV4
//! signing, HTTP) against local endpoints: SQS and DynamoDB on the moto server, Lambda's
//! Invoke on the fake endpoint, the Runtime API on loopback. Prints, asserting nothing:
//! - cold start: process start to the first `next` request, and to the first Invoke;
//! - the hand-over: from one run's release of the lease to its relay's first hand-off,
//!   the two runs in two processes (execution environments) as Lambda runs them;
//! - CPU per job (user + system time of the process over the jobs it handed off) at
//!   100, 1,000 and 5,000 jobs/s, and at a quota above what one core hands off (where
//!   it runs out); from them the dispatch rate each Lambda memory size can sustain
//!   (Lambda gives a function CPU in proportion to its memory: a whole vCPU at 1,769 MB);
//! - 1,000 lanes against one under the same shared quota (10,000/s): CPU per job and the
//!   process's peak memory.
//!
//! `BENCH_RATES=1000,5000` picks the quotas; `BENCH_SKIP_COLD=1` skips the cold starts
//! and the hand-overs, `BENCH_SKIP_LANES=1` the lanes.
//!
//! Run with `cargo build --release -p paceline-orchestrator && cargo bench -p
//! paceline-e2e --bench lambda`; it starts moto from `.venv` (on one thread) unless
//! `PACELINE_TEST_MOTO_URL` names a server (`./scripts/test.sh` installs moto).
#![expect(clippy::disallowed_methods, reason = "a benchmark: it measures and waits on this machine's clock")]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use paceline_e2e::aws::{create_lane, moto_env, moto_sdk_config, FakeLambda};
use paceline_e2e::fake_sqs::FakeSqs;
use paceline_e2e::runtime_api::{lambda_env, start_function, template_env, Reported, RuntimeApi};
use paceline_shared::adapters::aws::{AwsAdapters, AwsNames};
use paceline_shared::ports::{JobQueue, OutgoingMessage};
use paceline_shared::time::{system_now, UnixMillis};

/// Linux's clock ticks per second in /proc (USER_HZ).
const TICKS_PER_SECOND: f64 = 100.0;
/// How much of a vCPU Lambda gives per MB of memory (a whole one at 1,769 MB).
const VCPU_PER_MB: f64 = 1.0 / 1_769.0;
const COLD_STARTS: usize = 10;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// moto's server answering one request at a time: threaded, it copies a table for a
/// transaction while another thread writes it, and fails the transaction (a Python
/// `RuntimeError`, an unknown error to the SDK), which the run of 1,000 lanes met.
const MOTO_ON_ONE_THREAD: &str = "import sys
from werkzeug.serving import run_simple
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
run_simple(sys.argv[1], int(sys.argv[2]), DomainDispatcherApplication(create_backend_app), threaded=False)";

/// The moto server to use: `PACELINE_TEST_MOTO_URL`, or one started here (on one
/// thread).
fn moto() -> Option<std::process::Child> {
    if std::env::var_os("PACELINE_TEST_MOTO_URL").is_some() {
        return None;
    }
    let python = workspace().join(".venv/bin/python");
    assert!(python.exists(), "{} not found: run ./scripts/test.sh once (it installs moto), or set PACELINE_TEST_MOTO_URL", python.display());
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = std::process::Command::new(python)
        .args(["-c", MOTO_ON_ONE_THREAD, "127.0.0.1", &port.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start moto");
    let url = format!("http://127.0.0.1:{port}");
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    std::env::set_var("PACELINE_TEST_MOTO_URL", url);
    Some(child)
}

/// CPU seconds (user + system) the process `pid` has used.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/PID/stat");
    // Fields after the command's closing parenthesis: state is the 3rd field, utime the
    // 14th and stime the 15th of the whole line.
    let after = &stat[stat.rfind(')').expect("(comm)") + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / TICKS_PER_SECOND
}

async fn enqueue(names: &AwsNames, jobs: usize) {
    let adapters = AwsAdapters::new(&moto_sdk_config().await, names, None);
    let messages: Vec<OutgoingMessage> =
        (0..jobs).map(|n| OutgoingMessage::fresh(format!(r#"{{"id":"bench-{n}","request":{{"method":"GET","path":"/items/{n}"}}}}"#))).collect();
    for batch in messages.chunks(10) {
        adapters.queue.send(batch).await.unwrap();
    }
}

fn orchestrator_env(names: &AwsNames, tiers: &str, lambda: &FakeLambda) -> BTreeMap<String, String> {
    let given = BTreeMap::from([
        ("AWS::StackName", "bench".to_owned()),
        ("JobsQueue", names.queue_url.clone()),
        ("JobsDlq", names.dlq_url.clone()),
        ("StateTable", names.table.clone()),
        ("WorkerFunction", names.worker_function.clone()),
        ("QuotaTiers", tiers.to_owned()),
    ]);
    let mut env = lambda_env("OrchestratorFunction", 128);
    env.insert("AWS_LAMBDA_LOG_LEVEL".into(), std::env::var("BENCH_LOG_LEVEL").unwrap_or_else(|_| "WARN".into()));
    env.extend(moto_env());
    env.insert("AWS_ENDPOINT_URL_LAMBDA".into(), lambda.url.clone());
    env.extend(template_env("OrchestratorFunction", &given));
    env
}

fn scheduled_event() -> serde_json::Value {
    serde_json::json!({ "detail-type": "Scheduled Event", "source": "aws.events", "time": system_now().to_rfc3339(), "detail": {} })
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

async fn cold_starts(binary: &Path) {
    let sdk = moto_sdk_config().await;
    let (mut to_next, mut to_invoke) = (Vec::new(), Vec::new());
    for _ in 0..COLD_STARTS {
        let lambda = FakeLambda::start().await;
        let names = create_lane(&sdk, "bench-worker").await;
        enqueue(&names, 5).await;
        let runtime = RuntimeApi::start().await;
        let env = orchestrator_env(&names, "10/s", &lambda);
        let (started, started_at) = (Instant::now(), system_now());
        let function = start_function(binary, &runtime, &env);
        // The event is queued before the process asks: it gets it on its first `next`.
        let request = runtime.invoke(&scheduled_event(), Duration::from_secs(7));
        while lambda.invocations().is_empty() && started.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let first_invoke = lambda.invocations().first().map(|i| i.at.since(started_at).as_secs_f64() * 1e3).expect("a hand-off");
        let first_next = runtime.first_next().expect("a next request").duration_since(started).as_secs_f64() * 1e3;
        to_next.push(first_next);
        to_invoke.push(first_invoke);
        let _ = runtime.reported(&request, Duration::from_secs(10)).await;
        function.stop().await;
    }
    println!("### Cold start of the orchestrator's release binary ({COLD_STARTS} starts; SQS and DynamoDB on moto, loopback)\n");
    println!("| | median | max |\n| --- | ---: | ---: |");
    println!(
        "| process start to the first `next` request (init) | {:.1} ms | {:.1} ms |",
        median(to_next.clone()),
        to_next.iter().copied().fold(0.0, f64::max)
    );
    println!(
        "| process start to the first Invoke (init, lease, state reads, first receive) | {:.1} ms | {:.1} ms |\n",
        median(to_invoke.clone()),
        to_invoke.iter().copied().fold(0.0, f64::max)
    );
}

/// Hand-overs measured.
const HAND_OVERS: usize = 10;

/// When the log line `message` of a JSON log says it happened (its `at` field).
fn logged_at(output: &str, message: &str) -> Option<UnixMillis> {
    output.lines().filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok()).find_map(|line| {
        let fields = line.get("fields").unwrap_or(&line);
        (fields["message"].as_str() == Some(message)).then(|| fields["at"].as_str().and_then(|at| UnixMillis::parse_rfc3339(at).ok()))?
    })
}

/// A run (a scheduled event, 3 s of dispatch at 100/s) and its relay, in two processes
/// on two Runtime APIs: the relay is served as soon as the run sends it, waits for the
/// lease and hands off. Measures the release (the run's log) to the relay's first
/// hand-off (the relay's log), both at the millisecond.
async fn hand_overs(binary: &Path) {
    let sdk = moto_sdk_config().await;
    let mut gaps = Vec::new();
    for _ in 0..HAND_OVERS {
        let lambda = FakeLambda::start().await;
        let jobs = (0..2_000).map(|n| format!(r#"{{"id":"bench-{n}","request":{{"method":"GET","path":"/items/{n}"}}}}"#));
        let sqs = FakeSqs::start(jobs).await;
        let mut names = create_lane(&sdk, "bench-worker").await;
        (names.queue_url, names.dlq_url) = (sqs.queue_url(), format!("{}-dlq", sqs.queue_url()));
        let mut env = orchestrator_env(&names, "100/s", &lambda);
        env.insert("AWS_ENDPOINT_URL_SQS".into(), sqs.url.clone());
        env.insert("AWS_LAMBDA_LOG_LEVEL".into(), "INFO".into());
        let (first, second) = (RuntimeApi::start().await, RuntimeApi::start().await);
        let (run, relay) = (start_function(binary, &first, &env), start_function(binary, &second, &env));
        let request = first.invoke(&scheduled_event(), Duration::from_secs(8));
        let started = Instant::now();
        let relay_event = loop {
            if let Some((_, event)) = lambda.kicks().into_iter().find(|(_, event)| event.get("relay").is_some()) {
                break event;
            }
            assert!(started.elapsed() < Duration::from_secs(10), "the run sent no relay");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        // Invoked before the run stops, with as long ahead of it as the run had.
        let relayed = second.invoke(&relay_event, Duration::from_secs(15));
        let _ = first.reported(&request, Duration::from_secs(20)).await;
        let _ = second.reported(&relayed, Duration::from_secs(20)).await;
        let (run, relay) = (run.stop().await, relay.stop().await);
        let released = logged_at(&run, "lease released").expect("the run's release in its log");
        let first_hand_off = logged_at(&relay, "the run's first hand-off").unwrap_or_else(|| panic!("the relay's first hand-off in its log: {relay}"));
        gaps.push(first_hand_off.0.saturating_sub(released.0) as f64);
    }
    println!("### The hand-over: a run's release of the lease to its relay's first hand-off ({HAND_OVERS} hand-overs; DynamoDB on moto, SQS on the fake, loopback)\n");
    println!("| | median | max |\n| --- | ---: | ---: |");
    println!("| release to the relay's first hand-off | {:.0} ms | {:.0} ms |\n", median(gaps.clone()), gaps.iter().copied().fold(0.0, f64::max));
}

/// What a saturated run dispatches: the shared quota's tiers, and with lanes the
/// template's `Lanes` parameter and how many lanes the jobs are spread over, evenly.
struct Workload {
    tiers: String,
    lanes: Option<(&'static str, usize)>,
}

/// What a saturated run measured.
struct Measured {
    jobs: u64,
    cpu_seconds: f64,
    wall_seconds: f64,
    peak_rss_mb: f64,
}

/// The most memory the process `pid` has had resident (`VmHWM`), in MB.
fn peak_rss_mb(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/PID/status");
    let line = status.lines().find(|line| line.starts_with("VmHWM:")).expect("VmHWM");
    line.split_whitespace().nth(1).and_then(|kb| kb.parse::<f64>().ok()).expect("VmHWM in kB") / 1024.0
}

/// One run of `workload` at `rate` jobs/s for `seconds` of dispatch.
async fn saturated_run(binary: &Path, workload: &Workload, rate: u32, seconds: u64) -> Measured {
    let sdk = moto_sdk_config().await;
    let lambda = FakeLambda::start().await;
    // The jobs queue on the fast fake (moto's receives would cap the lane near 20 jobs/s);
    // the state table on moto.
    let lane_of = |n: usize| workload.lanes.map_or(String::new(), |(_, lanes)| format!(r#","lane":"tenant-{}""#, n % lanes));
    let jobs =
        (0..rate as usize * (seconds as usize + 2)).map(|n| format!(r#"{{"id":"bench-{n}"{},"request":{{"method":"GET","path":"/items/{n}"}}}}"#, lane_of(n)));
    let sqs = FakeSqs::start(jobs).await;
    let mut names = create_lane(&sdk, "bench-worker").await;
    (names.queue_url, names.dlq_url) = (sqs.queue_url(), format!("{}-dlq", sqs.queue_url()));
    let mut env = orchestrator_env(&names, &workload.tiers, &lambda);
    if let Some((lanes, _)) = workload.lanes {
        // As the template's `Lanes` parameter sets it.
        env.insert("PACELINE_LANES".into(), lanes.to_owned());
    }
    env.insert("AWS_ENDPOINT_URL_SQS".into(), sqs.url.clone());
    let runtime = RuntimeApi::start().await;
    let function = start_function(binary, &runtime, &env);
    while runtime.first_next().is_none() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let pid = function.child.id().expect("running");
    let (cpu_before, started) = (cpu_seconds(pid), Instant::now());
    // The run stops the template's 5 s deadline margin before the deadline.
    let request = runtime.invoke(&scheduled_event(), Duration::from_secs(seconds + 5));
    let reported = runtime.reported(&request, Duration::from_secs(seconds + 30)).await;
    let (cpu_seconds, wall_seconds, peak_rss_mb) = (cpu_seconds(pid) - cpu_before, started.elapsed().as_secs_f64(), peak_rss_mb(pid));
    let output = function.stop().await;
    if let Ok(path) = std::env::var("BENCH_OUTPUT") {
        std::fs::write(path, output).unwrap();
    }
    let Some(Reported::Response(report)) = reported else { panic!("the run failed: {reported:?}") };
    Measured { jobs: report["dispatched"].as_u64().unwrap_or(0), cpu_seconds, wall_seconds, peak_rss_mb }
}

/// A measured run: its quota, the rate it achieved and the share of a core it used.
#[derive(Clone, Copy)]
struct Load {
    quota: f64,
    jobs_per_second: f64,
    cores: f64,
}

impl Load {
    /// The run fell well short of its quota: the core ran out.
    fn ran_out(&self) -> bool {
        self.jobs_per_second < 0.95 * self.quota
    }
}

/// The dispatch rate a CPU share sustains, as a table cell: the rate at which the
/// measured loads reach the share, linear between measured rates (CPU per job falls as
/// the rate grows, so the line between two runs is on the safe side). Above the busiest
/// run's share: that run's rate where the core ran out, else only "more than" it.
fn sustainable_rate(loads: &[Load], share: f64) -> String {
    let busiest = loads.last().expect("a run");
    if share >= busiest.cores {
        let rate = busiest.jobs_per_second;
        return if busiest.ran_out() { format!("{rate:.0} jobs/s") } else { format!("more than {rate:.0} jobs/s (not measured)") };
    }
    let origin = Load { quota: 0.0, jobs_per_second: 0.0, cores: 0.0 };
    let above = loads.iter().position(|l| l.cores > share).expect("a run above the share");
    let (low, high) = (if above == 0 { origin } else { loads[above - 1] }, loads[above]);
    let rate = low.jobs_per_second + (share - low.cores) / (high.cores - low.cores) * (high.jobs_per_second - low.jobs_per_second);
    format!("{rate:.0} jobs/s")
}

/// Quotas to run at: `BENCH_RATES` (comma-separated jobs/s), or 100 to 5,000/s and one
/// above what one core can hand off, to find where it runs out.
fn rates() -> Vec<u32> {
    std::env::var("BENCH_RATES")
        .map_or(vec![100, 1_000, 5_000, 20_000], |rates| rates.split(',').map(|n| n.trim().parse().expect("BENCH_RATES: jobs/s, comma-separated")).collect())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let binary = workspace().join("target/release/orchestrator");
    assert!(binary.exists(), "{} not found: cargo build --release -p paceline-orchestrator", binary.display());
    let _moto = moto();
    if std::env::var_os("BENCH_SKIP_COLD").is_none() {
        cold_starts(&binary).await;
        hand_overs(&binary).await;
    }

    println!("### CPU per job with the real SDK (orchestrator release binary, current-thread runtime)\n");
    println!(
        "| quota | jobs handed off | run | achieved | CPU (user + system) | share of a core | CPU per job |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    let mut loads = Vec::new();
    for rate in rates() {
        let Measured { jobs, cpu_seconds: cpu, wall_seconds: wall, .. } =
            saturated_run(&binary, &Workload { tiers: format!("{rate}/s"), lanes: None }, rate, 10).await;
        let load = Load { quota: f64::from(rate), jobs_per_second: jobs as f64 / wall, cores: cpu / wall };
        println!(
            "| {rate}/s | {jobs} | {wall:.1} s | {:.0}/s | {cpu:.2} s | {:.0}% | {:.0} us |",
            load.jobs_per_second,
            load.cores * 100.0,
            cpu / jobs.max(1) as f64 * 1e6
        );
        loads.push(load);
    }
    loads.sort_by(|a, b| a.jobs_per_second.total_cmp(&b.jobs_per_second));
    println!("\n### Dispatch rate a Lambda memory size sustains (where the runs above use its share of a vCPU)\n");
    println!("| memory | share of a vCPU | sustainable dispatch rate |\n| ---: | ---: | ---: |");
    for memory in [128_u32, 256, 512, 1_024, 1_769] {
        let share = (f64::from(memory) * VCPU_PER_MB).min(1.0);
        println!("| {memory} MB | {:.0}% | {} |", share * 100.0, sustainable_rate(&loads, share));
    }
    if std::env::var_os("BENCH_SKIP_LANES").is_none() {
        many_lanes(&binary).await;
    }
}

/// Lanes the stack of many lanes spreads its jobs over, and the shared quota's pace.
const MANY_LANES: usize = 1_000;
const MANY_LANES_RATE: u32 = 10_000;
/// Each lane's own tier: the lanes together could use ten times the shared quota.
const MANY_LANES_CONFIG: &str = r#"{"tiers": ["100/s"]}"#;
/// A run of many lanes: long enough that reading every lane's state on moto at the
/// start (one request at a time) is a small part of it.
const MANY_LANES_SECONDS: u64 = 30;

/// One lane against 1,000 lanes, each of its own 100/s, evenly under the same shared
/// quota: CPU per job and the process's peak memory.
async fn many_lanes(binary: &Path) {
    println!("\n### {MANY_LANES} lanes through one orchestrator (a shared {MANY_LANES_RATE}/s, each lane 100/s, jobs spread evenly; {MANY_LANES_SECONDS} s)\n");
    // A run hands off until 5 s before its deadline, then saves its lanes' pacers (one
    // request at a time on moto): the rate is over the seconds of dispatch, the CPU over
    // the whole run, its start and end included.
    println!(
        "| lanes | jobs handed off | run, start to end | handed off a second of dispatch | CPU (user + system) | share of a core | CPU per job | peak memory (RSS) |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    let tiers = format!("{MANY_LANES_RATE}/s");
    for lanes in [None, Some((MANY_LANES_CONFIG, MANY_LANES))] {
        let run = saturated_run(binary, &Workload { tiers: tiers.clone(), lanes }, MANY_LANES_RATE, MANY_LANES_SECONDS).await;
        println!(
            "| {} | {} | {:.1} s | {:.0}/s | {:.2} s | {:.0}% | {:.0} us | {:.1} MB |",
            lanes.map_or(1, |(_, n)| n),
            run.jobs,
            run.wall_seconds,
            run.jobs as f64 / MANY_LANES_SECONDS as f64,
            run.cpu_seconds,
            run.cpu_seconds / run.wall_seconds * 100.0,
            run.cpu_seconds / run.jobs.max(1) as f64 * 1e6,
            run.peak_rss_mb
        );
    }
}
