#!/usr/bin/env bash
# An embedded lane at 100/s on a machine whose cores are busy with other processes:
# how much of the tier the API gets, and its busiest window (docs/benchmarks.md).
#   HOGS=2 JOBS=6000 ./scripts/bench-loaded.sh
# HOGS busy loops compete for the cores (2: both cores of a 2-core machine busy).
set -euo pipefail
cd "$(dirname "$0")/.."
HOGS=${HOGS:-2} JOBS=${JOBS:-6000} PORT=${PORT:-18099}
cargo build --release -q -p paceline-cli
dir=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$dir"' EXIT
cat > "$dir/lane.toml" <<TOML
[api]
base_url = "http://127.0.0.1:$PORT"
[quota]
tiers = ["100/s"]
[backend]
kind = "embedded"
path = "lane.db"
TOML
python3 -c "import json,sys; [print(json.dumps({'id': f'j{i}', 'request': {'method': 'GET', 'path': f'/items/{i}'}})) for i in range(int(sys.argv[1]))]" "$JOBS" > "$dir/jobs.jsonl"
python3 scripts/loaded_api.py "$PORT" 1.0 "$dir/stats.json" &
sleep 1
./target/release/paceline enqueue --config "$dir/lane.toml" "$dir/jobs.jsonl"
for _ in $(seq "$HOGS"); do sh -c 'while :; do :; done' & done
./target/release/paceline run --config "$dir/lane.toml" --drain 2>/dev/null
sleep 1.5
python3 - "$dir/stats.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
rate = s["calls"] / s["span_seconds"] if s["span_seconds"] else 0
print(f"API: {s['calls']} calls in {s['span_seconds']} s = {rate:.1f}/s, {rate:.1f}% of 100/s; busiest 1 s window {s['busiest_window']}/100")
PY
