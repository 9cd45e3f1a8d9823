#!/usr/bin/env bash
# What fairgate costs, measured in one run against the same fast mock
# upstream: direct to the mock, through a bare nginx reverse-proxy hop, and
# through fairgate with the shipped rules.
#
#   bash benches/proxy.sh            # about five minutes
#   DURATION=5 bash benches/proxy.sh # shorter
#   THREADS=1 bash benches/proxy.sh  # fairgate on one serving thread (default: one per core)
#
# Reports, per target: closed-loop requests/s at fixed concurrency, p50/p99
# latency at a fixed rate (non-streaming; the median of ROUNDS runs taken in
# turn across targets, default 3), CPU time per request of the proxy
# process (from /proc), the same closed loop with streams (streams/s, CPU
# per stream), time to first byte of streams (curl, sequential), and
# fairgate's peak resident memory with 256 concurrent streams. fairgate runs
# on its embedded defaults (side queue with in-process workers writing JSON
# lines) from a scratch directory.
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
ROOT=$PWD
(cd "$WORK" && RUST_LOG=warn exec "$ROOT/target/release/fairgate" serve --listen "$FAIRGATE" --admin-listen "$ADMIN" \
  --rules "$ROOT/rules" --upstream-openai "http://$MOCK" --threads "${THREADS:-0}" >/dev/null 2>&1) &
FAIRGATE_PID=$!
PIDS+=($FAIRGATE_PID)

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

for url in "http://$ADMIN/healthz" "http://$NGINX/v1/models"; do
  for _ in $(seq 100); do curl -sf -o /dev/null "$url" && break; sleep 0.1; done
done

# CPU ticks (user + system) of a process and its threads.
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
nginx_ticks() { local t=0; for p in $(pgrep -f "nginx: worker process"); do t=$((t + $(ticks "$p"))); done; echo $t; }
HZ=$(getconf CLK_TCK)

declare -A RPS P50 P99 CPU TTFB SRPS SCPU
# Closed loop with body $3 against $1, CPU ticks read by $2: prints
# "requests/s CPU-us-per-request" ("-" for the CPU when not measured).
closed_loop() {
  local url=$1 pid_ticks=$2 body=$3 before after json n
  before=$($pid_ticks)
  json=$(oha_json -z "${DURATION}s" -c "$CONCURRENCY" -m POST -H 'content-type: application/json' -D "$body" "$url")
  after=$($pid_ticks)
  n=$(echo "$json" | field "sum(d['statusCodeDistribution'].values())")
  echo "$(echo "$json" | field "round(d['summary']['requestsPerSec'])")" \
    "$(if [ "$pid_ticks" = "none" ]; then echo -; else
      python3 -c "print(round(($after - $before) / $HZ / $n * 1e6, 1))"; fi)"
}
run_target() {
  local name=$1 addr=$2 pid_ticks=$3
  local url="http://$addr/v1/chat/completions"
  read -r "RPS[$name]" "CPU[$name]" < <(closed_loop "$url" "$pid_ticks" "$WORK/body.json")
  read -r "SRPS[$name]" "SCPU[$name]" < <(closed_loop "$url" "$pid_ticks" "$WORK/stream.json")
  TTFB[$name]=$(for _ in $(seq 200); do
      curl -s -o /dev/null -w '%{time_starttransfer}\n' -H 'content-type: application/json' --data @"$WORK/stream.json" "$url"
    done | sort -n | awk '{a[NR]=$1} END {printf "%.3f/%.3f", a[int(NR*0.5)]*1000, a[int(NR*0.99)]*1000}')
}

none() { echo 0; }
fairgate_ticks() { ticks "$FAIRGATE_PID"; }
run_target direct "$MOCK" none
run_target nginx "$NGINX" nginx_ticks
run_target fairgate "$FAIRGATE" fairgate_ticks

# p50/p99 at a fixed rate: ROUNDS runs per target, taken in turn so that a
# noisy moment of this shared machine falls on every target alike; the
# median of the rounds is reported, with the range of the p99s.
declare -A ADDR=([direct]=$MOCK [nginx]=$NGINX [fairgate]=$FAIRGATE) P50S P99S
for _ in $(seq "$ROUNDS"); do
  for t in direct nginx fairgate; do
    json=$(oha_json -z "${DURATION}s" -q "$RATE" -c "$CONCURRENCY" -m POST -H 'content-type: application/json' \
      -D "$WORK/body.json" "http://${ADDR[$t]}/v1/chat/completions")
    P50S[$t]+=" $(echo "$json" | field "d['latencyPercentiles']['p50'] * 1000")"
    P99S[$t]+=" $(echo "$json" | field "d['latencyPercentiles']['p99'] * 1000")"
  done
done
median() { python3 -c "import statistics, sys; print(round(statistics.median(map(float, sys.argv[1:])), 3))" "$@"; }
for t in direct nginx fairgate; do
  # Word splitting of the lists is wanted here.
  # shellcheck disable=SC2086
  P50[$t]=$(median ${P50S[$t]})
  # shellcheck disable=SC2086
  P99[$t]=$(median ${P99S[$t]})
done

# Peak memory with 256 concurrent streams.
oha_json -n 5120 -c 256 -m POST -H 'content-type: application/json' -D "$WORK/stream.json" \
  "http://$FAIRGATE/v1/chat/completions" >/dev/null
PEAK=$(awk '/VmHWM/ {printf "%.1f", $2 / 1024}' "/proc/$FAIRGATE_PID/status")

printf '\n%-10s %12s %8s %8s %12s %14s %14s %12s\n' target "req/s (c=$CONCURRENCY)" "p50 ms" "p99 ms" "CPU us/req" "streams/s" "CPU us/stream" "TTFB p50/p99 ms"
for t in direct nginx fairgate; do
  printf '%-10s %12s %8s %8s %12s %14s %14s %12s\n' "$t" "${RPS[$t]}" "${P50[$t]}" "${P99[$t]}" "${CPU[$t]}" "${SRPS[$t]}" "${SCPU[$t]}" "${TTFB[$t]}"
done
python3 - <<EOF
rps_direct, rps_nginx, rps_fg = ${RPS[direct]}, ${RPS[nginx]}, ${RPS[fairgate]}
p99_direct, p99_nginx, p99_fg = ${P99[direct]}, ${P99[nginx]}, ${P99[fairgate]}
cpu_nginx, cpu_fg = ${CPU[nginx]}, ${CPU[fairgate]}
scpu_nginx, scpu_fg = ${SCPU[nginx]}, ${SCPU[fairgate]}
print()
print(f"throughput, fairgate / direct: {rps_fg / rps_direct:.2f}   (nginx / direct: {rps_nginx / rps_direct:.2f})")
print(f"added p99 at ${RATE} req/s (median of ${ROUNDS} rounds): fairgate {p99_fg - p99_direct:+.3f} ms, nginx {p99_nginx - p99_direct:+.3f} ms")
for t, p99s in (("direct", "${P99S[direct]}"), ("nginx", "${P99S[nginx]}"), ("fairgate", "${P99S[fairgate]}")):
    values = [float(v) for v in p99s.split()]
    print(f"  p99 of each round, {t}: " + ", ".join(f"{v:.3f}" for v in values) + " ms")
print(f"CPU per request, fairgate / nginx: {cpu_fg / cpu_nginx:.2f}   streams: {scpu_fg / scpu_nginx:.2f}")
print(f"fairgate peak RSS with 256 concurrent streams: $PEAK MB")
EOF
