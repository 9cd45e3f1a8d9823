#!/usr/bin/env bash
# Instructions per request (callgrind) of short guarded requests while
# HELD streams are held open through fairgate: what the upstream pool's
# checkout costs when many of its connections are busy with answers that
# go on (the mock pauses each stream halfway for a while).
#
#   bash benches/held_streams.sh                            # this checkout's release build
#   BINS="/abs/old /abs/new" bash benches/held_streams.sh   # builds in turn
#   HELD=1000 N=2000 bash benches/held_streams.sh
#
# Per build: fairgate on its embedded defaults under callgrind with
# instrumentation off; a warm-up; N requests counted with no stream open;
# then HELD streams opened and left waiting, and N requests counted again.
# Needs oha and valgrind; loopback only. Opens HELD + 16 client
# connections and as many upstream ones: mind `ulimit -n`.
set -euo pipefail
cd "$(dirname "$0")/.."

HELD=${HELD:-1000}
N=${N:-2000}
MOCK=127.0.0.1:18121
PORT=18122
ADMIN=127.0.0.1:18123
command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind; }
source benches/common.sh
ROOT=$PWD
BINS=${BINS:-$ROOT/target/release/fairgate}
# Long enough for both counts under valgrind.
MOCK_STREAM_PAUSE_MS=600000 start_mock "$MOCK"

# Instructions per request of N requests to fairgate $1 (pid $2) whose
# callgrind output is in directory $3.
per_request() {
  local pid=$1 dir=$2
  callgrind_control -z "$pid" >/dev/null 2>&1
  callgrind_control -i on "$pid" >/dev/null 2>&1
  oha --no-tui -n "$N" -c 16 -m POST "${OHA_HEADERS[@]}" -D "$WORK/body.json" \
    "http://127.0.0.1:$PORT/v1/chat/completions" >/dev/null 2>&1
  callgrind_control -i off "$pid" >/dev/null 2>&1
  callgrind_control -d "$pid" >/dev/null 2>&1
  sleep 1
  local total
  total=$(cat "$dir"/out.* | awk '/^totals:/ {s += $2} END {print s}')
  rm -f "$dir"/out.*
  echo $((total / N))
}

printf '%-40s %22s %22s\n' build "instr/request, 0 open" "instr/request, $HELD open"
for bin in $BINS; do
  dir=$(mktemp -d -p "$WORK")
  (cd "$dir" && RUST_LOG=warn exec valgrind --tool=callgrind --instr-atstart=no \
    --callgrind-out-file="$dir/out" "$bin" serve --listen "127.0.0.1:$PORT" \
    --admin-listen "$ADMIN" --rules "$ROOT/rules" --upstream-openai "http://$MOCK" \
    >/dev/null 2>"$dir/valgrind.log") &
  pid=$!
  wait_for "http://$ADMIN/healthz" 1200
  oha --no-tui -n 300 -c 16 -m POST "${OHA_HEADERS[@]}" -D "$WORK/body.json" \
    "http://127.0.0.1:$PORT/v1/chat/completions" >/dev/null 2>&1
  idle=$(per_request "$pid" "$dir")
  oha --no-tui -n "$HELD" -c "$HELD" -m POST "${OHA_HEADERS[@]}" \
    -D "$WORK/stream.json" "http://127.0.0.1:$PORT/v1/chat/completions" >/dev/null 2>&1 &
  held=$!
  # Until every stream is open and waiting on the mock.
  for _ in $(seq 600); do
    open=$(ss -Htn state established "( dport = :${MOCK##*:} )" | wc -l)
    [ "$open" -ge "$HELD" ] && break
    sleep 0.1
  done
  sleep 2
  busy=$(per_request "$pid" "$dir")
  printf '%-40s %22s %22s\n' "$bin" "$idle" "$busy"
  kill "$held" 2>/dev/null || true
  kill -TERM "$pid"
  wait "$pid" 2>/dev/null || true
done
