#!/usr/bin/env bash
# Instructions fairgate executes per exchange, counted by valgrind's
# callgrind: the same figure for the same binary and inputs whatever else
# the machine is doing, so two builds can be compared on a shared machine
# (wall-clock CPU time there moves by ±20% between runs).
#
#   bash benches/instructions.sh                      # this checkout's release build
#   OLD=/path/to/old/fairgate bash benches/instructions.sh   # and an older binary, same run
#   NEW=/path/to/fairgate OLD=... NO_BUILD=1 bash benches/instructions.sh  # two saved builds, no rebuild
#   N=1000 bash benches/instructions.sh               # exchanges per measurement
#   MOCK_OBFUSCATION=1 bash benches/instructions.sh   # stream chunks padded as OpenAI's are
#   MOCK_ANSWER_REPEAT=30 bash benches/instructions.sh  # streams of a long answer (about 4 KB)
#   SYSTEM_WORDS=500 bash benches/instructions.sh     # a system prompt of 500 words (about 3 KB) in every request
#   SDK_HEADERS=1 bash benches/instructions.sh        # the OpenAI SDK's request headers and the API's answer headers
#   DIALECT=anthropic bash benches/instructions.sh    # Anthropic's Messages API (POST /v1/messages) instead
#   DIALECT=responses bash benches/instructions.sh    # the Responses API (POST /v1/responses) instead
#
# For each binary and each kind of exchange (non-streaming, streaming with
# the mock's 27 events): fairgate serves on its embedded defaults (side
# queue with in-process workers writing JSON lines) from a scratch directory
# under callgrind; oha sends N exchanges; the count of a run with none is
# subtracted and the rest divided by N. User-space instructions only: the
# kernel's share (socket I/O) is not counted.
set -euo pipefail
cd "$(dirname "$0")/.."

N=${N:-2000}
MOCK=127.0.0.1:18111
PORT=18112
ADMIN=127.0.0.1:18113
command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind; }
source benches/common.sh
start_mock "$MOCK"

# Total instructions of one fairgate run that serves $2 exchanges of body $3.
count() {
  local bin=$1 n=$2 body=$3 dir
  dir=$(mktemp -d -p "$WORK")
  (cd "$dir" && RUST_LOG=warn exec valgrind --tool=callgrind --callgrind-out-file="$dir/out" "$bin" serve \
    --listen "127.0.0.1:$PORT" --admin-listen "$ADMIN" --rules "$OLDPWD/rules" --upstream-openai "http://$MOCK" \
    --upstream-anthropic "http://$MOCK" >/dev/null 2>"$dir/valgrind.log") &
  local pid=$!
  # Under valgrind the start takes a while.
  wait_for "http://$ADMIN/healthz" 1200
  if [ "$n" -gt 0 ]; then
    oha --no-tui -n "$n" -c 16 -m POST "${OHA_HEADERS[@]}" -D "$body" \
      "http://127.0.0.1:$PORT$API_PATH" >/dev/null 2>&1
  fi
  sleep 1
  kill -TERM "$pid"
  wait "$pid" 2>/dev/null || true
  awk '/^totals:/ {print $2}' "$dir/out"
}

printf '%-40s %16s %16s\n' binary "instr/request" "instr/stream"
for bin in "${NEW:-$PWD/target/release/fairgate}" ${OLD:+"$OLD"}; do
  base=$(count "$bin" 0 "$WORK/body.json")
  plain=$(count "$bin" "$N" "$WORK/body.json")
  streams=$(count "$bin" "$N" "$WORK/stream.json")
  printf '%-40s %16s %16s\n' "$bin" $(((plain - base) / N)) $(((streams - base) / N))
done
