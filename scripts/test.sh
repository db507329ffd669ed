#!/usr/bin/env bash
# The whole test suite: lints, unit, property, paused-time and end-to-end tests.
# Installs what the tests need into ./.venv (Python tools from PyPI) on first use.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings

echo "== build the paceline binary (the end-to-end tests run it)"
cargo build --quiet -p paceline-cli

echo "== tests"
cargo test --workspace
