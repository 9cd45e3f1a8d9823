#!/usr/bin/env bash
# Shows that the request path never waits on the side queue: the proxy's
# latency and throughput with the queue's consumer running (in-process
# workers writing JSON lines) versus stalled (no workers: the queue fills,
# then every record spills to disk), in one run against the same fast mock.
#
#   bash benches/queue.sh              # DURATION=10 s per measurement
#   DURATION=5 bash benches/queue.sh
# Needs oha (cargo install oha --locked); installs it when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-10}
CONCURRENCY=${CONCURRENCY:-64}
RATE=${RATE:-2000}
MOCK=127.0.0.1:18201
source benches/common.sh
start_mock "$MOCK"

run() {
  local name=$1 workers=$2 port=$3
  mkdir -p "$WORK/$name"
  cat >"$WORK/$name/fairgate.yaml" <<YAML
listen: 127.0.0.1:$port
admin:
  listen: 127.0.0.1:$((port + 1))
upstreams:
  openai: {url: "http://$MOCK"}
  anthropic: {url: "http://$MOCK"}
rules: {dir: $PWD/rules, watch: false}
queue: {workers: $workers, capacity: 1000, spill_dir: $WORK/$name/spill}
sinks: {jsonl: {dir: $WORK/$name/results}}
YAML
  RUST_LOG=warn FAIRGATE_CONFIG="$WORK/$name/fairgate.yaml" target/release/fairgate serve >/dev/null 2>&1 &
  local pid=$!
  PIDS+=($pid)
  wait_for "http://127.0.0.1:$((port + 1))/healthz"
  local url="http://127.0.0.1:$port/v1/chat/completions"
  local json rps p50 p99
  json=$(oha_json -z "${DURATION}s" -c "$CONCURRENCY" -m POST "${OHA_HEADERS[@]}" -D "$WORK/body.json" "$url")
  rps=$(echo "$json" | field "round(d['summary']['requestsPerSec'])")
  json=$(oha_json -z "${DURATION}s" -q "$RATE" -c "$CONCURRENCY" -m POST "${OHA_HEADERS[@]}" -D "$WORK/body.json" "$url")
  p50=$(echo "$json" | field "round(d['latencyPercentiles']['p50'] * 1000, 3)")
  p99=$(echo "$json" | field "round(d['latencyPercentiles']['p99'] * 1000, 3)")
  local page spilled processed
  page=$(curl -s "http://127.0.0.1:$((port + 1))/metrics")
  spilled=$(echo "$page" | awk '/^fairgate_queue_records_total\{event="spilled"\}/ {print $2}')
  processed=$(echo "$page" | awk '/^fairgate_queue_records_total\{event="processed"\}/ {print $2}')
  printf '%-10s %10s %10s %10s %12s %12s\n' "$name" "$rps" "$p50" "$p99" "${processed:-0}" "${spilled:-0}"
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  echo "$rps $p99" >"$WORK/$name/figures"
}

printf '\n%-10s %10s %10s %10s %12s %12s\n' consumer "req/s" "p50 ms" "p99 ms" processed spilled
run running 2 18210
run stalled 0 18220
read -r rps_run p99_run <"$WORK/running/figures"
read -r rps_stall p99_stall <"$WORK/stalled/figures"
python3 -c "print(f'\nstalled / running: throughput {$rps_stall / $rps_run:.2f}, p99 at $RATE req/s {$p99_stall / $p99_run:.2f}')"
