#!/usr/bin/env bash
# fairgate's resident memory with many streams open at the same moment:
# the mock upstream sends each stream's first half at once and the rest
# PAUSE_MS later, so that all STREAMS streams are held open while the RSS is
# read. A steadier figure than the peak over a run (benches/proxy.sh),
# where how many streams overlap depends on timing.
#
#   bash benches/memory.sh                   # this checkout's release build
#   BINS="/abs/old /abs/new" bash benches/memory.sh  # builds in turn, ROUNDS each
#
# Per build and round: the RSS after a warm-up (a 3 s closed loop of
# requests at 64 connections), the RSS with STREAMS streams open, what one
# open stream adds, and the peak RSS (VmHWM). Needs oha (cargo install
# oha); loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."

STREAMS=${STREAMS:-256}
PAUSE_MS=${PAUSE_MS:-3000}
ROUNDS=${ROUNDS:-3}
MOCK=127.0.0.1:18111
FAIRGATE=127.0.0.1:18112
ADMIN=127.0.0.1:18113
source benches/common.sh
ROOT=$PWD
BINS=${BINS:-$ROOT/target/release/fairgate}

MOCK_STREAM_PAUSE_MS=$PAUSE_MS start_mock "$MOCK"
streams() {
  oha_json -n "$STREAMS" -c "$STREAMS" -m POST "${OHA_HEADERS[@]}" \
    -D "$WORK/stream.json" "http://$FAIRGATE/v1/chat/completions"
}

printf '%-40s %5s %10s %10s %14s %8s\n' build round "idle MB" "open MB" "KB per stream" "peak MB"
for round in $(seq "$ROUNDS"); do
  for bin in $BINS; do
    rm -rf "$WORK/data"
    start_fairgate "$bin" "$FAIRGATE" "$ADMIN" "$WORK"
    pid=$FAIRGATE_PID
    oha_json -z 3s -c 64 -m POST "${OHA_HEADERS[@]}" -D "$WORK/body.json" \
      "http://$FAIRGATE/v1/chat/completions" >/dev/null
    sleep 1
    idle=$(mem_mb VmRSS "$pid")
    streams >"$WORK/streams.json" &
    load=$!
    # Half the pause: every stream has sent its first half and waits.
    sleep "$(python3 -c "print($PAUSE_MS / 2000)")"
    open=$(mem_mb VmRSS "$pid")
    wait "$load"
    ok=$(field "d['statusCodeDistribution'].get('200', 0)" <"$WORK/streams.json")
    [ "$ok" = "$STREAMS" ] || echo "$bin: $ok of $STREAMS streams succeeded" >&2
    peak=$(mem_mb VmHWM "$pid")
    per=$(python3 -c "print(round(($open - $idle) * 1024 / $STREAMS, 1))")
    printf '%-40s %5s %10s %10s %14s %8s\n' "$bin" "$round" "$idle" "$open" "$per" "$peak"
    kill -TERM "$pid"
    wait "$pid" 2>/dev/null || true
  done
done
