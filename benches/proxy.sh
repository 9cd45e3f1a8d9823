#!/usr/bin/env bash
# What fairgate costs, measured in one run against the same fast mock
# upstream: direct to the mock, through a bare nginx reverse-proxy hop,
# through fairgate on a route it passes through unguarded (POST
# /v1/embeddings, which the mock answers as it does chat completions: the
# cost of fairgate's HTTP hop alone), and through fairgate with the shipped
# rules.
#
#   bash benches/proxy.sh            # about thirteen minutes
#   DURATION=5 bash benches/proxy.sh # shorter
#   THREADS=1 bash benches/proxy.sh  # fairgate on one serving thread (default: one per core)
#   FAIRGATE_BIN=/path/to/fairgate bash benches/proxy.sh  # another build (default: this checkout's release build)
#   DIALECT=anthropic bash benches/proxy.sh  # Messages API exchanges (POST /v1/messages) instead of chat completions
#
# Reports, per target, the median of ROUNDS rounds (default 3) taken in
# turn across the targets: closed-loop requests/s at fixed concurrency and
# the CPU time per request of the proxy process (user and system, from
# /proc; also the share of the side queue's thread, whose in-process
# workers compute the quality metrics), the same with streams, and p50/p99
# latency at a fixed rate (non-streaming) and time to first byte of
# streams at the same rate (benches/stream_ttfb.rs); with each round's
# ratios. Then fairgate's own
# time per exchange at the fixed rate (from its records: total minus
# upstream), and its peak resident memory over the run, which ends with 256
# concurrent streams. fairgate runs on its
# embedded defaults (side queue with in-process workers writing JSON lines)
# from a scratch directory. The report is benches/proxy_report.py's.
# Needs oha (cargo install oha) and nginx (apt-get install nginx); installs
# them when missing. Only loopback addresses are used.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-10}
CONCURRENCY=${CONCURRENCY:-64}
RATE=${RATE:-2000}
ROUNDS=${ROUNDS:-3}
MOCK=127.0.0.1:18101
FAIRGATE=127.0.0.1:18102
ADMIN=127.0.0.1:18103
NGINX=127.0.0.1:18104
source benches/common.sh
command -v nginx >/dev/null || { apt-get update -qq && apt-get install -y -qq nginx; }
NGINX_BIN=$(command -v nginx || echo /usr/sbin/nginx)

start_mock "$MOCK"
# From a scratch directory, so that results and spills (./data) start empty.
start_fairgate "${FAIRGATE_BIN:-$PWD/target/release/fairgate}" "$FAIRGATE" "$ADMIN" "$WORK" --threads "${THREADS:-0}"

cat >"$WORK/nginx.conf" <<EOF
worker_processes 1;
pid $WORK/nginx.pid;
error_log $WORK/nginx-error.log;
events { worker_connections 4096; }
http {
  access_log off;
  upstream mock { server $MOCK; keepalive 256; }
  server {
    listen $NGINX;
    location / {
      proxy_pass http://mock;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
EOF
"$NGINX_BIN" -c "$WORK/nginx.conf"

wait_for "http://$NGINX/v1/models"

# CPU ticks of a process and its threads: "user system".
ticks() { awk '{print $14, $15}' "/proc/$1/stat"; }
nginx_ticks() {
  local u=0 s=0 pu ps
  for p in $(pgrep -f "nginx: worker process"); do
    read -r pu ps < <(ticks "$p")
    u=$((u + pu)) s=$((s + ps))
  done
  echo "$u $s"
}
none() { echo "0 0"; }
fairgate_ticks() { ticks "$FAIRGATE_PID"; }
# The side queue's thread alone: its in-process workers compute the
# quality metrics and write the results. It starts before fairgate
# listens and lives as long as the process.
QUEUE_TASK=$(grep -lx fairgate-queue /proc/"$FAIRGATE_PID"/task/*/comm | cut -d/ -f5)
[ -n "$QUEUE_TASK" ] || { echo "fairgate has no fairgate-queue thread" >&2; exit 1; }
queue_ticks() { ticks "$FAIRGATE_PID/task/$QUEUE_TASK"; }
HZ=$(getconf CLK_TCK)
now_ms() { date +%s%3N; }

# Closed loop with body $3 against $1, CPU ticks of the process read by
# $2 and of its side queue's thread by $4: prints "requests/s
# user-us-per-request system-us-per-request queue-us-per-request".
closed_loop() {
  local url=$1 pid_ticks=$2 body=$3 queue=$4 u0 s0 u1 s1 qu0 qs0 qu1 qs1 json n
  read -r u0 s0 < <($pid_ticks)
  read -r qu0 qs0 < <($queue)
  json=$(oha_json -z "${DURATION}s" -c "$CONCURRENCY" -m POST "${OHA_HEADERS[@]}" -D "$body" "$url")
  read -r u1 s1 < <($pid_ticks)
  read -r qu1 qs1 < <($queue)
  n=$(echo "$json" | field "sum(d['statusCodeDistribution'].values())")
  echo "$(echo "$json" | field "round(d['summary']['requestsPerSec'])")" \
    "$(python3 -c "print(*(round(t / $HZ / $n * 1e6, 2) for t in ($u1 - $u0, $s1 - $s0, $qu1 + $qs1 - $qu0 - $qs0)))")"
}

# Every figure is taken ROUNDS times, in turn across the targets, so that a
# noisy moment of this shared machine falls on every target alike; the
# median of the rounds is reported (and the ratios of each round). Each
# round appends one value per figure to a space-separated list.
TARGETS=(direct nginx passthrough fairgate)
declare -A URL=([direct]=http://$MOCK$API_PATH [nginx]=http://$NGINX$API_PATH
  [passthrough]=http://$FAIRGATE/v1/embeddings [fairgate]=http://$FAIRGATE$API_PATH)
declare -A TICKS=([direct]=none [nginx]=nginx_ticks [passthrough]=fairgate_ticks [fairgate]=fairgate_ticks)
declare -A QUEUE=([direct]=none [nginx]=none [passthrough]=none [fairgate]=queue_ticks)
declare -A RPS USR SYS QCPU SRPS SUSR SSYS SQCPU P50S P99S T50S T99S
WINDOWS=()
for _ in $(seq "$ROUNDS"); do
  for t in "${TARGETS[@]}"; do
    url=${URL[$t]}
    read -r rps usr sys queue < <(closed_loop "$url" "${TICKS[$t]}" "$WORK/body.json" "${QUEUE[$t]}")
    RPS[$t]+=" $rps" USR[$t]+=" $usr" SYS[$t]+=" $sys" QCPU[$t]+=" $queue"
    read -r rps usr sys queue < <(closed_loop "$url" "${TICKS[$t]}" "$WORK/stream.json" "${QUEUE[$t]}")
    SRPS[$t]+=" $rps" SUSR[$t]+=" $usr" SSYS[$t]+=" $sys" SQCPU[$t]+=" $queue"
  done
  # p50/p99 at a fixed rate. fairgate's own records of these runs give its
  # share of each exchange (proxy_ms: total minus upstream).
  for t in "${TARGETS[@]}"; do
    from=$(now_ms)
    json=$(oha_json -z "${DURATION}s" -q "$RATE" -c "$CONCURRENCY" -m POST "${OHA_HEADERS[@]}" \
      -D "$WORK/body.json" "${URL[$t]}")
    if [ "$t" = fairgate ]; then WINDOWS+=("$from-$(now_ms)"); fi
    P50S[$t]+=" $(echo "$json" | field "d['latencyPercentiles']['p50'] * 1000")"
    P99S[$t]+=" $(echo "$json" | field "d['latencyPercentiles']['p99'] * 1000")"
  done
  # Streams at the same fixed rate: time to first byte.
  for t in "${TARGETS[@]}"; do
    read -r p50 p99 _ failures < <("$(bench_bin stream_ttfb)" "${URL[$t]}" \
      "$WORK/stream.json" "$RATE" "$DURATION")
    [ "$failures" = 0 ] || echo "$t: $failures streams failed" >&2
    T50S[$t]+=" $p50" T99S[$t]+=" $p99"
  done
done

# The run ends with 256 concurrent streams; the peak memory is the
# process's over the whole run (VmHWM).
oha_json -n 5120 -c 256 -m POST "${OHA_HEADERS[@]}" -D "$WORK/stream.json" \
  "http://$FAIRGATE$API_PATH" >/dev/null
PEAK=$(mem_mb VmHWM "$FAIRGATE_PID")

# On SIGTERM fairgate writes out the results it holds.
kill -TERM "$FAIRGATE_PID"
wait "$FAIRGATE_PID" 2>/dev/null || true

export ROUNDS RATE CONCURRENCY PEAK WORK
export WINDOW_LIST="${WINDOWS[*]}"
# Exports figure $1 of every target as $1_<target>.
export_figure() {
  local -n figure=$1
  for t in "${TARGETS[@]}"; do export "$1_$t=${figure[$t]}"; done
}
for v in RPS USR SYS QCPU SRPS SUSR SSYS SQCPU P50S P99S T50S T99S; do export_figure "$v"; done
python3 benches/proxy_report.py
