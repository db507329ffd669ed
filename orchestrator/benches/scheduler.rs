//! Scheduler benchmark: prints figures, asserts nothing (run: `cargo bench -p
//! paceline-orchestrator --bench scheduler`). A stack's decision step drains a backlog
//! spread evenly over N lanes, every port answered at once from memory under virtual
//! time, so only the decisions are measured: decisions per second of one core, and the
//! CPU per dispatched job, for 10 to 10,000 backlogged lanes (or the counts given
//! after `--`). Each lane is limited to
//! 5/s, all of them share 1,000/s; a decision's cost should grow with log(lanes).
//!
//! Then the orchestrator's memory per idle lane: one job on each of 1,000 and 10,000
//! lanes, drained, and the bytes the machine still holds for them (counted by the
//! global allocator) divided by the lanes.

use std::path::Path;
use std::time::Duration;

use paceline_orchestrator::decision_bench::{drain, QueuedJob};
use paceline_orchestrator::Settings;
use paceline_shared::config::{Config, WorkerHost};
use paceline_shared::testing::alloc::CountingAllocator;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator::new();

/// The longest a backlog may take to drain (virtual time).
const DAY: Duration = Duration::from_secs(86_400);

/// Jobs in each backlog, whatever the lanes.
const JOBS: usize = 50_000;

fn main() {
    let text = "[api]\nbase_url = \"https://api.example.com\"\n[quota]\ntiers = [\"1000/s\"]\n[lanes]\ntiers = [\"5/s\"]\n";
    let config = Config::parse(text, Path::new("/bench"), &|_| None).expect("the bench's config");
    let settings = Settings::from_config(&config, WorkerHost::InProcess);
    println!("| backlogged lanes | decisions | jobs | decisions/s (one core) | CPU per job | drained in (virtual) |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: |");
    // Lane counts may be given as arguments (`-- 1000`); cargo's own flags are skipped.
    let asked: Vec<usize> = std::env::args().skip(1).filter_map(|arg| arg.parse().ok()).collect();
    let counts = if asked.is_empty() { vec![10, 100, 1_000, 10_000] } else { asked };
    for lanes in counts {
        // Round robin over the lanes on the queue: every lane backlogged from the start.
        let jobs: Vec<QueuedJob> = (0..JOBS).map(|i| QueuedJob::of(format!("t{}", i % lanes))).collect();
        let best = (0..3).map(|_| drain(&settings, &jobs, DAY, |_, _| {}, || {})).min_by_key(|figures| figures.took).expect("three runs");
        assert_eq!(best.dispatched, JOBS as u64, "every job dispatched");
        println!(
            "| {lanes} | {} | {} | {:.0} | {:.2} us | {:.1} s |",
            best.decisions,
            best.dispatched,
            best.decisions as f64 / best.took.as_secs_f64(),
            best.took.as_secs_f64() * 1e6 / best.dispatched as f64,
            best.drained_in.as_secs_f64()
        );
    }
    println!();
    println!("| idle lanes | orchestrator memory held for them | per idle lane |");
    println!("| ---: | ---: | ---: |");
    for lanes in [1_000, 10_000] {
        let jobs: Vec<QueuedJob> = (0..lanes).map(|i| QueuedJob::of(format!("t{i}"))).collect();
        let before = ALLOCATOR.live();
        let mut held = 0;
        drain(&settings, &jobs, DAY, |_, _| {}, || held = ALLOCATOR.live().saturating_sub(before));
        println!("| {lanes} | {:.1} MB | {:.0} bytes |", held as f64 / 1e6, held as f64 / lanes as f64);
    }
}
