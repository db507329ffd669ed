#!/usr/bin/env bash
# The whole test suite: lints, unit, property, paused-time and end-to-end tests, the
# AWS adapters against the moto server. Installs what the tests need into ./.venv
# (Python tools from PyPI) on first use.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/moto_server ]; then
    echo "== installing the moto server into .venv (first run only)"
    python3 -m venv .venv
    .venv/bin/pip install --quiet --disable-pip-version-check 'moto[server]'
fi

echo "== clippy"
cargo clippy --workspace --all-targets --all-features --quiet -- -D warnings

echo "== build the paceline binary (the end-to-end tests run it)"
cargo build --quiet -p paceline-cli

echo "== start the moto server on loopback"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p target
.venv/bin/moto_server -H 127.0.0.1 -p "$port" > target/moto.log 2>&1 &
moto_pid=$!
trap 'kill $moto_pid 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/moto-api/')" 2>/dev/null && break
    sleep 0.2
done
export PACELINE_TEST_MOTO_URL="http://127.0.0.1:$port"

echo "== tests"
cargo test --workspace --all-features
