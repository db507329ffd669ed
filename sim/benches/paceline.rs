//! The project's benchmark (run: `cargo bench -p paceline-sim --bench paceline`). Prints
//! figures, asserts nothing:
//! 1. dispatch precision against the real clock at 1,000 jobs/s: the real orchestrator
//!    on in-memory queue and store (no latency), dispatching 50 ms ahead; each hand-off's
//!    worker waits for its slot and records when it calls. |call - slot| percentiles;
//!    Then the same over 1,000 lanes (each 2/s, all sharing 1,000/s) on an in-memory
//!    embedded store (`-- lanes` runs that part alone);
//! 2. CPU time per job and peak RSS of the orchestrator alone at that rate;
//! 3. wall time of simulations under virtual time, up to a million jobs;
//! 4. the baselines beside Paceline on the same workloads.
#![expect(clippy::disallowed_methods, reason = "a benchmark: it measures and waits on this machine's clock")]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use paceline_orchestrator::{Orchestrator, RunOptions, Settings};
use paceline_shared::adapters::embedded::EmbeddedStore;
use paceline_shared::config::{Config, OrchestratorConfig, RetryConfig, WorkerHost};
use paceline_shared::job::WorkerPayload;
use paceline_shared::ports::{Invoker, JobQueue, OutgoingMessage, PortResult};
use paceline_shared::quota::{chrono_tz, Quota};
use paceline_shared::time::{system_since_epoch, Clock, SystemClock, TokioClock};
use paceline_sim::aws::{SimQueue, SimStore, World};
use paceline_sim::profile::{Latency, LatencyProfile, Sampler};
use paceline_sim::report::{render_comparison, Percentiles};
use paceline_sim::{little_law_concurrency, simulate, Dispatcher, Plan};

/// Records, for each hand-off, how far from its slot the (in-process) worker called.
struct SlotRecorder {
    clock: Arc<SystemClock>,
    lateness_us: Arc<Mutex<Vec<i64>>>,
}

#[async_trait]
impl Invoker for SlotRecorder {
    async fn invoke(&self, payload: &WorkerPayload, _from_receipt: Option<&str>) -> PortResult<()> {
        let WorkerPayload::Job { slot: Some(slot), .. } = payload else { return Ok(()) };
        let (clock, record, slot) = (self.clock.clone(), self.lateness_us.clone(), *slot);
        tokio::spawn(async move {
            clock.sleep_until(slot.not_before).await;
            let called_us = system_since_epoch().as_micros() as i64;
            let slot_us = slot.not_before.0 as i64 * 1_000;
            record.lock().unwrap().push(called_us - slot_us);
        });
        Ok(())
    }
}

fn quota(tiers: &[&str], margin_ms: u64) -> Quota {
    Quota::new(tiers.iter().map(|t| t.parse().unwrap()).collect(), chrono_tz::UTC, Duration::from_millis(margin_ms)).unwrap()
}

fn settings(tiers: &[&str], margin_ms: u64, ahead_ms: u64) -> Settings {
    let orchestrator = OrchestratorConfig { dispatch_ahead: Some(Duration::from_millis(ahead_ms)), ..OrchestratorConfig::default() };
    Settings { orchestrator, ..Settings::defaults_for(quota(tiers, margin_ms), WorkerHost::Lambda) }
}

/// CPU time (user + system) of this process so far.
#[expect(unsafe_code, reason = "getrusage is C's: the one way to read the process's CPU time")]
fn cpu_time() -> Duration {
    // SAFETY: getrusage only writes the struct it is given.
    let usage = unsafe {
        let mut usage = std::mem::zeroed::<libc::rusage>();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let time = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    time(usage.ru_utime) + time(usage.ru_stime)
}

/// Peak resident memory of this process in MB (`VmHWM`; `ru_maxrss` would include what
/// cargo used before it exec'd the benchmark).
fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = status.lines().find_map(|l| l.strip_prefix("VmHWM:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok());
    kb.unwrap_or(f64::NAN) / 1024.0
}

/// Drains `jobs` jobs at 1000/s, 50 ms ahead, through the real orchestrator on the
/// real clock, with in-memory queue and store, on one thread as the orchestrator Lambda
/// runs; returns the wall time.
fn drain_at_1000_per_second(jobs: usize, invoker: Arc<dyn Invoker>) -> Duration {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let zero = Latency::Fixed(Duration::ZERO);
        let profile = LatencyProfile { sqs: zero, invoke: zero, async_start: zero, dynamodb: zero, api: zero, api_arrival: zero, kick: zero };
        let world = Arc::new(World::new(Arc::new(TokioClock::new()), Sampler::new(1, profile)));
        let queue = Arc::new(SimQueue::new(world.clone()));
        queue.preload((0..jobs).map(|n| format!(r#"{{"id":"job-{n}","request":{{"method":"GET","path":"/jobs/{n}"}}}}"#)));
        let clock = Arc::new(SystemClock);
        let orchestrator = Orchestrator::new(queue, Arc::new(SimStore::new(world)), invoker, clock.clone(), settings(&["1000/s"], 0, 50));
        timed_drain(&orchestrator, jobs).await
    })
}

/// Drains the backlog of `jobs` jobs on the real clock: the wall time, once the workers
/// waiting for the last slots have called.
async fn timed_drain(orchestrator: &Orchestrator, jobs: usize) -> Duration {
    let started = Instant::now();
    let opts = RunOptions { holder: "bench".into(), deadline: SystemClock.now().plus(Duration::from_secs(600)), drain: true, stop: None };
    let report = orchestrator.run(&opts).await.unwrap();
    assert_eq!(report.dispatched, jobs as u64);
    let wall = started.elapsed();
    tokio::time::sleep(Duration::from_millis(100)).await;
    wall
}

/// Hands off and forgets, as Lambda's `Event` invoke does.
struct NoWorker;

#[async_trait]
impl Invoker for NoWorker {
    async fn invoke(&self, _payload: &WorkerPayload, _from_receipt: Option<&str>) -> PortResult<()> {
        Ok(())
    }
}

fn precision(jobs: usize) {
    let lateness_us = Arc::new(Mutex::new(Vec::with_capacity(jobs)));
    let wall = drain_at_1000_per_second(jobs, Arc::new(SlotRecorder { clock: Arc::new(SystemClock), lateness_us: lateness_us.clone() }));
    let title = format!("Dispatch precision, real clock, 1000 jobs/s ({jobs} jobs, dispatch ahead 50 ms)");
    print_precision(&title, jobs, wall, &lateness_us.lock().unwrap());
}

/// Drains `jobs` jobs spread evenly over `lanes` lanes (each 2/s, all sharing 1,000/s),
/// 50 ms ahead, through the real orchestrator on the real clock and an in-memory
/// embedded store, on a runtime like `paceline run`'s; each worker waits for its slot.
fn precision_over_lanes(jobs: usize, lanes: usize) {
    let text = "[api]\nbase_url = \"https://api.example.com\"\n[quota]\ntiers = [\"1000/s\"]\nsafety_margin = \"0ms\"\n[lanes]\ntiers = [\"2/s\"]\n[orchestrator]\ndispatch_ahead = \"50ms\"\n";
    let config = Config::parse(text, std::path::Path::new("/bench"), &|_| None).unwrap();
    let lateness_us = Arc::new(Mutex::new(Vec::with_capacity(jobs)));
    // Multi-threaded, as `paceline run`'s runtime is: the store's work moves the
    // waiting workers to the other thread (see `blocking` in the embedded store).
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let wall = runtime.block_on(async {
        let clock = Arc::new(SystemClock);
        let store = Arc::new(EmbeddedStore::in_memory(clock.clone()).unwrap());
        let messages: Vec<OutgoingMessage> = (0..jobs)
            .map(|n| OutgoingMessage::fresh(format!(r#"{{"id":"job-{n}","lane":"t{}","request":{{"method":"GET","path":"/jobs/{n}"}}}}"#, n % lanes)))
            .collect();
        store.send(&messages).await.unwrap();
        let recorder = Arc::new(SlotRecorder { clock: clock.clone(), lateness_us: lateness_us.clone() });
        let settings = Settings::from_config(&config, WorkerHost::Lambda);
        let orchestrator = Orchestrator::new(store.clone(), store.clone(), recorder, clock, settings).with_scoped_stores(store.clone());
        timed_drain(&orchestrator, jobs).await
    });
    let title = format!("Dispatch precision over {lanes} lanes, real clock, 1000 jobs/s shared ({jobs} jobs, each lane 2/s, embedded store in memory)");
    print_precision(&title, jobs, wall, &lateness_us.lock().unwrap());
}

/// Prints |call - slot| percentiles of `lateness` (microseconds, late positive).
fn print_precision(title: &str, jobs: usize, wall: Duration, lateness: &[i64]) {
    let early = lateness.iter().filter(|l| **l < 0).count();
    let p = Percentiles::of(lateness.iter().map(|l| u32::try_from(l.unsigned_abs()).unwrap_or(u32::MAX)).collect());
    println!("## {title}\n");
    println!("|call - slot|, where each in-process worker waits for its slot and records when it calls.\n");
    println!("| calls | achieved rate | p50 | p99 | p99.9 | max | early calls |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    println!(
        "| {} | {:.0}/s | {:.3} ms | {:.3} ms | {:.3} ms | {:.3} ms | {early} |\n",
        p.count,
        jobs as f64 / wall.as_secs_f64(),
        f64::from(p.p50) / 1e3,
        f64::from(p.p99) / 1e3,
        f64::from(p.p999) / 1e3,
        f64::from(p.max) / 1e3
    );
}

fn orchestrator_cost(jobs: usize) {
    let cpu_before = cpu_time();
    let wall = drain_at_1000_per_second(jobs, Arc::new(NoWorker));
    let cpu = cpu_time().saturating_sub(cpu_before);
    println!("## One orchestrator at 1000 jobs/s ({jobs} jobs; workers are Lambda's, not in this process)\n");
    println!("| wall | CPU per job (user + system) | peak RSS of the process |");
    println!("| ---: | ---: | ---: |");
    println!("| {:.1} s | {:.1} us | {:.1} MB |\n", wall.as_secs_f64(), cpu.as_secs_f64() * 1e6 / jobs as f64, peak_rss_mb());
}

fn plan(tiers: &[&str], margin_ms: u64, ahead_ms: u64, jobs: usize) -> Plan {
    Plan::new(jobs, 1, settings(tiers, margin_ms, ahead_ms), RetryConfig::default())
}

fn simulation_speed() {
    println!("## Simulation speed (virtual time, default latency profile)\n");
    println!("| quota | jobs | simulated time | wall time | wall per job | violations |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for (tiers, jobs) in [(&["100/s"][..], 100_000), (&["1000/s"][..], 1_000_000), (&["10/s", "500000/day"][..], 100_000)] {
        let report = simulate(&plan(tiers, 20, 400, jobs), &Dispatcher::Paceline);
        println!(
            "| {} | {jobs} | {} | {:.1} s | {:.1} us | {} |",
            tiers.join(", "),
            humantime::format_duration(Duration::from_secs(report.time_to_drain_s as u64)),
            report.wall_seconds,
            report.wall_seconds * 1e6 / jobs as f64,
            report.violations()
        );
    }
    println!();
}

fn baselines() {
    for (tiers, jobs) in [(&["1/s"][..], 1_500), (&["10/s", "300/min"][..], 6_000), (&["100/s"][..], 30_000)] {
        println!("## Dispatchers side by side: quota {}, {jobs} jobs, margin 20 ms\n", tiers.join(", "));
        let ahead = plan(tiers, 20, 400, jobs);
        let mut reports = vec![simulate(&ahead, &Dispatcher::Paceline), simulate(&plan(tiers, 20, 0, jobs), &Dispatcher::Paceline)];
        let cap = little_law_concurrency(&ahead);
        for dispatcher in [Dispatcher::TokenBucket, Dispatcher::FixedWindow, Dispatcher::ConcurrencyOnly { limit: cap }] {
            reports.push(simulate(&ahead, &dispatcher));
        }
        println!("{}", render_comparison(&reports, true));
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    if args.iter().any(|a| a == "lanes") {
        precision_over_lanes(20_000, 1_000);
        return;
    }
    // `-- precision` runs the first parts alone.
    orchestrator_cost(20_000);
    precision(20_000);
    precision_over_lanes(20_000, 1_000);
    if !args.iter().any(|a| a == "precision") {
        simulation_speed();
        baselines();
    }
}
