//! Helpers for the end-to-end tests: find the `paceline` binary, lay out a lane's config
//! next to a fake API, run commands and read their JSON; and, for the AWS tests, the
//! moto server's resources and a fake Lambda Invoke endpoint.

pub mod aws;
pub mod fake_sqs;
pub mod runtime_api;

use std::path::{Path, PathBuf};
use std::process::Output;

/// The `paceline` binary built from this workspace (`cargo build -p paceline-cli`,
/// which the README's test command runs first), or `PACELINE_BIN`.
///
/// # Panics
/// When it is missing, saying how to build it.
#[must_use]
pub fn paceline_bin() -> PathBuf {
    let path = std::env::var_os("PACELINE_BIN").map_or_else(
        || {
            let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"), PathBuf::from);
            target.join("debug/paceline")
        },
        PathBuf::from,
    );
    assert!(path.exists(), "{} not found: run `cargo build -p paceline-cli` first (the README's test command does)", path.display());
    path
}

/// Held by a test that runs lanes against a strict API for its whole length, so two such
/// tests never share the machine's two cores: a strict API measures arrival times, and
/// a starved scheduler bunches calls up on their way to it.
pub async fn one_lane_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    static LANES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LANES.lock().await
}

/// A fresh folder for one test's lane, removed when the test ends: its stores grow to tens
/// of megabytes, and a suite run leaves dozens. A test that fails keeps its folder, to be
/// read.
#[must_use]
pub fn lane_dir(name: &str) -> LaneDir {
    let dir = std::env::temp_dir().join(format!("paceline-e2e-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create lane dir");
    LaneDir(dir)
}

/// A test's folder (see [`lane_dir`]); it reads as the [`Path`] it holds.
#[derive(Debug)]
pub struct LaneDir(PathBuf);

impl std::ops::Deref for LaneDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for LaneDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for LaneDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Writes a lane config for `base_url` with `tiers` into `dir`; returns its path. The
/// safety margin is wider than the default: the strict fake API measures arrivals on a
/// CI machine busy with several tests at once, where a hand-off can be late by more
/// than 10 ms.
#[must_use]
pub fn write_config(dir: &Path, base_url: &str, tiers: &[&str], extra: &str) -> PathBuf {
    let tiers = tiers.iter().map(|t| format!("\"{t}\"")).collect::<Vec<_>>().join(", ");
    let text = format!(
        "[api]\nbase_url = \"{base_url}\"\ntimeout = \"5s\"\nhealth_check = {{ method = \"GET\", path = \"/health\" }}\n\
         [quota]\ntiers = [{tiers}]\nsafety_margin = \"25ms\"\n\
         [circuit]\nhealth_check_interval = \"1s\"\n\
         [orchestrator]\nvisibility_timeout = \"20s\"\n\
         [backend]\nkind = \"embedded\"\npath = \"lane.db\"\n{extra}"
    );
    let path = dir.join("paceline.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

/// The API an ordered lane's tests call: 1000/s, answering in 1 to 3 ms, every 50th
/// call a 500 (2% of calls fail, and their jobs are retried).
#[must_use]
pub fn two_percent_failing_api() -> paceline_cli::fake_api::FakeApiSpec {
    paceline_cli::fake_api::FakeApiSpec {
        tiers: vec!["1000/s".parse().expect("a tier")],
        latency: (std::time::Duration::from_millis(1), std::time::Duration::from_millis(3)),
        server_error_every: Some(50),
        ..paceline_cli::fake_api::FakeApiSpec::default()
    }
}

/// One job per id, each calling `/items/ID` (or `/missing/ID` for ids starting `gone`).
#[must_use]
pub fn job_lines(ids: &[String]) -> String {
    ids.iter()
        .map(|id| {
            let path = if id.starts_with("gone") { format!("/missing/{id}") } else { format!("/items/{id}") };
            format!("{{\"id\":\"{id}\",\"request\":{{\"method\":\"POST\",\"path\":\"{path}\",\"body\":{{\"id\":\"{id}\"}}}}}}\n")
        })
        .collect()
}

/// Runs `paceline ARGS` with `stdin`, returning its output.
pub async fn paceline(args: &[&str], stdin: &str) -> Output {
    paceline_with_env(args, stdin, &[]).await
}

/// Runs `paceline ARGS` with `stdin` and extra environment variables.
pub async fn paceline_with_env(args: &[&str], stdin: &str, env: &[(String, String)]) -> Output {
    paceline_stopped_after(args, stdin, env, None).await
}

/// Runs `paceline ARGS` with `stdin`, sending it SIGTERM (a clean stop) if it runs
/// longer than `limit`: a run that hangs ends with its summary and log for the test to
/// show.
pub async fn paceline_within(args: &[&str], stdin: &str, limit: std::time::Duration) -> Output {
    paceline_stopped_after(args, stdin, &[], Some(limit)).await
}

#[expect(clippy::disallowed_methods, reason = "end-to-end: a real process stopped after real time")]
async fn paceline_stopped_after(args: &[&str], stdin: &str, env: &[(String, String)], limit: Option<std::time::Duration>) -> Output {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new(paceline_bin())
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn paceline");
    let mut input = child.stdin.take().expect("stdin");
    if let Err(e) = input.write_all(stdin.as_bytes()).await {
        // A command that refuses its arguments exits before it reads its input.
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "write stdin: {e}");
    }
    drop(input);
    let stop = limit.zip(child.id()).map(|(limit, pid)| {
        tokio::spawn(async move {
            tokio::time::sleep(limit).await;
            let _ = tokio::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status().await;
        })
    });
    let output = child.wait_with_output().await.expect("paceline output");
    if let Some(stop) = stop {
        stop.abort();
    }
    output
}

/// Parses a command's standard output as JSON, showing its error output if it is not.
///
/// # Panics
/// When the output is not JSON.
#[must_use]
pub fn json_of(output: &Output) -> serde_json::Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): status {}\nstdout: {}\nstderr: {}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// Asserts that every time in `value` (a key `since`, `until`, `as_of`, or ending in
/// `_at`, `_seen` or `_until`) is an RFC 3339 string, not epoch milliseconds; returns how
/// many it checked.
///
/// # Panics
/// On a time that is a number or does not parse.
#[must_use]
pub fn assert_times_are_rfc3339(value: &serde_json::Value) -> usize {
    let is_time = |key: &str| matches!(key, "since" | "until" | "as_of") || ["_at", "_seen", "_until"].iter().any(|end| key.ends_with(end));
    match value {
        serde_json::Value::Object(map) => map
            .iter()
            .map(|(key, v)| match v {
                serde_json::Value::String(text) if is_time(key) => {
                    assert!(paceline_shared::time::UnixMillis::parse_rfc3339(text).is_ok(), "{key}: {text} is not RFC 3339");
                    1
                }
                serde_json::Value::Number(n) if is_time(key) => panic!("{key}: {n} is a number, not an RFC 3339 time"),
                other => assert_times_are_rfc3339(other),
            })
            .sum(),
        serde_json::Value::Array(items) => items.iter().map(assert_times_are_rfc3339).sum(),
        _ => 0,
    }
}

/// Serves `app` on an ephemeral loopback port: its `host:port`, and the server's task
/// (abort it to stop).
///
/// # Panics
/// When no port can be bound.
pub async fn serve_on_loopback(app: axum::Router) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (address, server)
}

#[cfg(test)]
mod tests {
    use super::lane_dir;

    #[test]
    fn a_lane_dir_is_removed_when_its_test_ends() {
        let dir = lane_dir("removed-after");
        std::fs::write(dir.join("lane.db"), b"a lane's store").expect("write into the lane dir");
        let path = dir.to_path_buf();
        drop(dir);
        assert!(!path.exists(), "{} is left behind: every run of the suite filled the disk a little more", path.display());
    }
}
