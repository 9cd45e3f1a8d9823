#!/usr/bin/env bash
# How long a user waits before a streamed answer starts to appear, with an
# upstream that writes at a model's pace: the mock sends each event
# TOKEN_MS apart (about 5 bytes of text each). Measured from sending the
# request to the first byte of the answer's text, at RATE streams a second
# for SECONDS, directly against the mock and through each fairgate build,
# in one run.
#
#   bash benches/first_text.sh                       # this checkout's release build
#   BINS="/abs/old /abs/new" bash benches/first_text.sh  # several builds, same run
#
# Holdback sends text only where no match can be under way; the time it
# adds here is how long it waits for the model to write past that point.
set -euo pipefail
cd "$(dirname "$0")/.."

TOKEN_MS=${TOKEN_MS:-20}
REPEAT=${REPEAT:-6}
RATE=${RATE:-20}
SECONDS_EACH=${SECONDS_EACH:-5}
MOCK=127.0.0.1:18111
FAIRGATE=127.0.0.1:18112
ADMIN=127.0.0.1:18113
source benches/common.sh
BINS=${BINS:-$PWD/target/release/fairgate}

MOCK_TOKEN_MS=$TOKEN_MS MOCK_ANSWER_REPEAT=$REPEAT start_mock "$MOCK"
first_text() {
  TTFB_TEXT=1 "$(bench_bin stream_ttfb)" "http://$1/v1/chat/completions" "$WORK/stream.json" \
    "$RATE" "$SECONDS_EACH"
}

printf '%-40s %12s %12s %8s %9s\n' target "p50 ms" "p99 ms" streams failures
read -r p50 p99 n failures < <(first_text "$MOCK")
printf '%-40s %12s %12s %8s %9s\n' direct "$p50" "$p99" "$n" "$failures"
for bin in $BINS; do
  start_fairgate "$bin" "$FAIRGATE" "$ADMIN" "$WORK/run"
  read -r p50 p99 n failures < <(first_text "$FAIRGATE")
  printf '%-40s %12s %12s %8s %9s\n' "$bin" "$p50" "$p99" "$n" "$failures"
  kill -TERM "$FAIRGATE_PID"
  wait "$FAIRGATE_PID" 2>/dev/null || true
done
