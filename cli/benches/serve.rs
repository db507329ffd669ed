//! `paceline serve` benchmark: prints figures, asserts nothing (run: `cargo bench -p
//! paceline-cli --bench serve`).
//!
//! The real `paceline serve` runs as a child process on one core (`taskset -c 0`, or
//! the cores `BENCH_CORES` lists); this process is its client and its API. The stack's one lane paces calls at 100/s to an
//! API on loopback. Phases of `BENCH_SECONDS` (10 unless set), quiet and streams three
//! times each, in turn, then enqueueing:
//! 1. quiet: the lane alone;
//! 2. streams: 100 clients hold `/v1/events` open and read every event;
//! 3. enqueueing: the client posts NDJSON batches of 1,000 jobs to `/v1/jobs`, one after
//!    another, as fast as `serve` takes them (jobs/s), while the lane paces (last: the
//!    queue it leaves is larger, and reading its depth costs more).
//!
//! For each: the pacing precision (how long after its slot each call went out, from the
//! outcome records `GET /v1/results` returns, in ms; the spread of the gaps between
//! calls at the API, in µs) and `serve`'s CPU time as a share of its one core (from
//! /proc/PID/stat).
#![expect(clippy::disallowed_methods, reason = "a benchmark: it measures and waits on this machine's clock")]

use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

const PACE: u64 = 100;
const BATCH: usize = 1_000;
const STREAMS: usize = 100;
const TOKEN: &str = "a-token-for-the-serve-benchmark-000000";

fn phase_length() -> Duration {
    Duration::from_secs(std::env::var("BENCH_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(10))
}

/// Process `pid`'s user and system CPU time, from /proc (in clock ticks of 10 ms, as
/// Linux reports them to user space).
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name (which may hold spaces) start after its ')'.
    let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, rest)| rest).split_whitespace().collect();
    let ticks: u64 = [11, 12].iter().filter_map(|i| fields.get(*i).and_then(|f| f.parse::<u64>().ok())).sum();
    Duration::from_millis(ticks * 10)
}

/// An API on loopback that answers at once and notes when each call arrived.
async fn api() -> (String, Arc<Mutex<Vec<Instant>>>) {
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let seen = arrivals.clone();
    let app = axum::Router::new().fallback(move || {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push(Instant::now());
            "{}"
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{address}"), arrivals)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// What one phase measured.
struct Phase {
    name: &'static str,
    calls: usize,
    late_ms_p99: f64,
    late_ms_max: f64,
    gap_spread_us_p99: f64,
    cpu_share: f64,
    jobs_per_second: Option<f64>,
}

fn lines(from: usize) -> String {
    (from..from + BATCH).map(|n| format!("{{\"id\":\"bench-{n}\",\"request\":{{\"method\":\"GET\",\"path\":\"/items/{n}\"}}}}\n")).collect()
}

/// The outcome records kept after row `after`, and the last row.
async fn records_after(client: &reqwest::Client, base: &str, mut after: i64) -> (Vec<Value>, i64) {
    let mut records = Vec::new();
    loop {
        let text = client.get(format!("{base}/v1/results?after={after}&limit=1000")).bearer_auth(TOKEN).send().await.unwrap().text().await.unwrap();
        let page: Value = serde_json::from_str(&text).unwrap();
        let found = page["records"].as_array().cloned().unwrap_or_default();
        after = page["next_after"].as_i64().unwrap();
        if found.is_empty() {
            return (records, after);
        }
        records.extend(found);
    }
}

fn millis(time: &Value) -> Option<f64> {
    let text = time.as_str()?;
    Some(paceline_shared::time::UnixMillis::parse_rfc3339(text).ok()?.0 as f64)
}

/// The cores `serve` may run on: `BENCH_CORES` (a `taskset -c` list), core 0 unless set.
fn cores() -> String {
    std::env::var("BENCH_CORES").unwrap_or_else(|_| "0".to_owned())
}

/// `paceline serve` for `config`, on [`cores`] alone.
fn serve(config: &std::path::Path, port: u16) -> Child {
    Command::new("taskset")
        .args(["-c", &cores(), env!("CARGO_BIN_EXE_paceline"), "serve", "--config", config.to_str().unwrap(), "--listen", &format!("127.0.0.1:{port}")])
        .env("PACELINE_BENCH_SERVE_TOKEN", TOKEN)
        .stdout(Stdio::null())
        .spawn()
        .expect("taskset (util-linux) and the paceline binary")
}

#[tokio::main]
async fn main() {
    let (base_url, arrivals) = api().await;
    let dir = std::env::temp_dir().join(format!("paceline-serve-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config_path = dir.join("paceline.toml");
    std::fs::write(
        &config_path,
        format!("[api]\nbase_url = \"{base_url}\"\n[quota]\ntiers = [\"{PACE}/s\"]\n[outcomes]\nretention = \"1h\"\n[serve]\ntoken = {{ env = \"PACELINE_BENCH_SERVE_TOKEN\" }}\n"),
    )
    .unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = serve(&config_path, port);
    let pid = child.id();
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    while client.get(format!("{base}/v1/status")).bearer_auth(TOKEN).send().await.is_err() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let post = |body: String| client.post(format!("{base}/v1/jobs")).bearer_auth(TOKEN).header("content-type", "application/x-ndjson").body(body).send();
    // A backlog the lane cannot finish in the whole run.
    let backlog = (PACE as usize) * phase_length().as_secs() as usize * 8;
    let mut next_id = 0;
    while next_id < backlog {
        assert!(post(lines(next_id)).await.unwrap().status().is_success());
        next_id += BATCH;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (_, mut after_row) = records_after(&client, &base, 0).await;

    let mut results = Vec::new();
    // Quiet and streams alternate, three times each: the machine's noise falls on both.
    let order = ["quiet", "100 event streams", "quiet", "100 event streams", "quiet", "100 event streams", "enqueueing"];
    for name in order {
        let arrivals_before = arrivals.lock().unwrap().len();
        let (cpu_before, started) = (cpu_time(pid), Instant::now());
        let until = started + phase_length();
        let mut jobs_per_second = None;
        let mut streams = Vec::new();
        match name {
            "enqueueing" => {
                // Bodies made before the clock starts: what is measured is `serve` taking them.
                let bodies: Vec<String> = (0..400).map(|k| lines(next_id + k * BATCH)).collect();
                let mut sent = 0;
                for body in bodies {
                    if Instant::now() >= until {
                        break;
                    }
                    assert!(post(body).await.unwrap().status().is_success());
                    sent += BATCH;
                }
                next_id += sent;
                jobs_per_second = Some(sent as f64 / started.elapsed().as_secs_f64());
            }
            "100 event streams" => {
                for _ in 0..STREAMS {
                    let mut stream = client.get(format!("{base}/v1/events")).bearer_auth(TOKEN).send().await.unwrap();
                    assert!(stream.status().is_success());
                    streams.push(tokio::spawn(async move { while let Ok(Some(_)) = stream.chunk().await {} }));
                }
            }
            _ => {}
        }
        tokio::time::sleep(until.saturating_duration_since(Instant::now())).await;
        let elapsed = started.elapsed();
        let cpu_share = (cpu_time(pid) - cpu_before).as_secs_f64() / elapsed.as_secs_f64();
        for stream in streams {
            stream.abort();
        }
        let (records, last_row) = records_after(&client, &base, after_row).await;
        after_row = last_row;
        let mut late: Vec<f64> = records.iter().filter_map(|record| Some(millis(&record["times"]["called"])? - millis(&record["times"]["slotted"])?)).collect();
        late.sort_by(f64::total_cmp);
        if std::env::var_os("BENCH_LATE").is_some() {
            let mut counts = std::collections::BTreeMap::new();
            for ms in &late {
                *counts.entry(*ms as i64).or_insert(0) += 1;
            }
            eprintln!("{name}: calls by ms late {counts:?}");
            let leads: Vec<(f64, f64)> = records
                .iter()
                .filter_map(|record| {
                    let times = &record["times"];
                    let late = millis(&times["called"])? - millis(&times["slotted"])?;
                    Some((late, millis(&times["slotted"])? - millis(&times["dispatched"])?))
                })
                .filter(|(late, _)| *late >= 2.0)
                .collect();
            eprintln!("{name}: (late, hand-off lead) of the calls 2 ms late or more: {leads:?}");
        }
        let seen = arrivals.lock().unwrap()[arrivals_before..].to_vec();
        let interval_us = 1e6 / PACE as f64;
        let mut spread: Vec<f64> = seen.windows(2).map(|pair| ((pair[1] - pair[0]).as_secs_f64() * 1e6 - interval_us).abs()).collect();
        spread.sort_by(f64::total_cmp);
        results.push(Phase {
            name,
            calls: late.len(),
            late_ms_p99: percentile(&late, 0.99),
            late_ms_max: late.last().copied().unwrap_or(f64::NAN),
            gap_spread_us_p99: percentile(&spread, 0.99),
            cpu_share,
            jobs_per_second,
        });
    }
    let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);

    println!("serve on cores {}: one lane at {PACE}/s; {} s a phase", cores(), phase_length().as_secs());
    println!("| phase | jobs/s enqueued | calls | late p99 / max (ms) | gap spread p99 (µs) | serve's CPU (share of its core) |");
    println!("|---|---:|---:|---:|---:|---:|");
    for phase in &results {
        let enqueued = phase.jobs_per_second.map_or_else(|| "–".to_owned(), |rate| format!("{rate:.0}"));
        println!(
            "| {} | {enqueued} | {} | {:.0} / {:.0} | {:.0} | {:.1}% |",
            phase.name,
            phase.calls,
            phase.late_ms_p99,
            phase.late_ms_max,
            phase.gap_spread_us_p99,
            phase.cpu_share * 100.0
        );
    }
    let median_cpu = |name: &str| {
        let mut shares: Vec<f64> = results.iter().filter(|phase| phase.name == name).map(|phase| phase.cpu_share).collect();
        shares.sort_by(f64::total_cmp);
        percentile(&shares, 0.5)
    };
    let (quiet, streams) = (median_cpu("quiet"), median_cpu("100 event streams"));
    println!(
        "100 event streams cost {:.1}% of a core over the quiet lane (medians: {:.1}% against {:.1}%)",
        (streams - quiet) * 100.0,
        streams * 100.0,
        quiet * 100.0
    );
}
