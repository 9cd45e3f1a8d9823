#!/usr/bin/env bash
# CPU time per request of two fairgate builds in one run: both serve the
# same fast mock on their embedded defaults (shipped rules, side queue with
# in-process workers), and 64-connection closed loops of guarded chat
# completions (KIND=stream: streams; DIALECT=anthropic: the Messages API,
# DIALECT=responses: the Responses API)
# alternate between them, in the order ABBA so that a drift of
# this shared machine falls on both alike. Prints each round's CPU per
# request (user + system, from /proc) and the new / old ratio, then the
# median ratio. Instruction counts (benches/instructions.sh) are steadier;
# this is what they come to in CPU time.
#
#   OLD=/path/to/old/fairgate bash benches/ab.sh         # against this checkout's release build
#   NEW=/path/to/fairgate OLD=... ROUNDS=14 DURATION=4 bash benches/ab.sh
#   KIND=stream DIALECT=anthropic OLD=... bash benches/ab.sh   # Messages API streams instead
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-14}
DURATION=${DURATION:-4}
MOCK=127.0.0.1:18121
: "${OLD:?OLD=<path to the fairgate binary to compare with>}"
source benches/common.sh
NEW=${NEW:-$PWD/target/release/fairgate}
HZ=$(getconf CLK_TCK)
start_mock "$MOCK"

# Each build from a scratch directory of its own.
start_fairgate "$OLD" 127.0.0.1:18122 127.0.0.1:18123 "$WORK/old"
OLD_PID=$FAIRGATE_PID
start_fairgate "$NEW" 127.0.0.1:18124 127.0.0.1:18125 "$WORK/new"
NEW_PID=$FAIRGATE_PID

# CPU microseconds per request of process $1 over a closed loop on port $2.
cpu_per_request() {
  local t0 t1 n
  t0=$(awk '{print $14 + $15}' "/proc/$1/stat")
  n=$(oha_json -z "${DURATION}s" -c 64 -m POST "${OHA_HEADERS[@]}" -D "$WORK/${KIND:-body}.json" \
    "http://127.0.0.1:$2$API_PATH" | field "sum(d['statusCodeDistribution'].values())")
  t1=$(awk '{print $14 + $15}' "/proc/$1/stat")
  python3 -c "print(round(($t1 - $t0) / $HZ / $n * 1e6, 2))"
}

# Warm-up, not counted.
cpu_per_request "$OLD_PID" 18122 >/dev/null
cpu_per_request "$NEW_PID" 18124 >/dev/null
RATIOS=()
for round in $(seq "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then
    old=$(cpu_per_request "$OLD_PID" 18122)
    new=$(cpu_per_request "$NEW_PID" 18124)
  else
    new=$(cpu_per_request "$NEW_PID" 18124)
    old=$(cpu_per_request "$OLD_PID" 18122)
  fi
  ratio=$(python3 -c "print(round($new / $old, 3))")
  RATIOS+=("$ratio")
  echo "round $round: old $old us, new $new us, new / old $ratio"
done
python3 -c "import statistics, sys; r = [float(x) for x in sys.argv[1:]]; \
print(f'new / old CPU per request: median {statistics.median(r):.3f}, {sum(x < 1 for x in r)} of {len(r)} rounds below 1')" "${RATIOS[@]}"
