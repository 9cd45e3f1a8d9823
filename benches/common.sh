# Shared by the benchmark scripts (sourced, run from the repository root):
# a scratch directory removed on exit with every process in PIDS, oha, the
# release build, the fast mock upstream and the stream load generator
# (benches/stream_ttfb.rs), and the request bodies.
#
#   source benches/common.sh
#   start_mock 127.0.0.1:18101   # then $WORK/body.json, $WORK/stream.json

WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  [ -f "$WORK/nginx.pid" ] && kill "$(cat "$WORK/nginx.pid")" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

command -v oha >/dev/null || cargo install oha --locked
# The bench binaries first: building them links target/release/fairgate
# too, with the dev-dependencies' features unified in, and the release
# build after it puts back the binary that `cargo run --release` runs.
# NO_BUILD=1 skips both (each is a fat-LTO link of some minutes on two
# cores) when the binaries in target/release are the ones to measure.
if [ -z "${NO_BUILD:-}" ]; then
  cargo bench --no-run --quiet --bench mock_upstream --bench stream_ttfb 2>/dev/null
  cargo build --release --quiet --bin fairgate
fi

# SYSTEM_WORDS=N: a system prompt of N words of plain instructions instead
# of the one-line default (apps send some hundreds), the same in every request.
SYSTEM="You are a careful personal-finance assistant."
if [ -n "${SYSTEM_WORDS:-}" ]; then
  SYSTEM=$(python3 -c "import itertools, sys; w = 'Answer in plain words and explain each step of a budget before you suggest any product'.split(); print('You are a careful personal-finance assistant. ' + ' '.join(itertools.islice(itertools.cycle(w), int(sys.argv[1]))) + '.')" "$SYSTEM_WORDS")
fi
# DIALECT=anthropic: Messages API requests (API_PATH /v1/messages), which
# the mock answers in Anthropic's dialect; DIALECT=responses: the Responses
# API's (/v1/responses, streams of 33 numbered events); OpenAI's chat
# completions else.
QUESTION="I earn 3,000 a month and spend 2,600. How should I start saving and investing?"
if [ "${DIALECT:-openai}" = anthropic ]; then
  API_PATH=/v1/messages
  BODY='{"model":"claude-bench","max_tokens":1024,"system":"'"$SYSTEM"'","messages":[{"role":"user","content":"'"$QUESTION"'"}]}'
elif [ "${DIALECT:-openai}" = responses ]; then
  API_PATH=/v1/responses
  BODY='{"model":"gpt-4o-mini","instructions":"'"$SYSTEM"'","input":"'"$QUESTION"'"}'
else
  API_PATH=/v1/chat/completions
  BODY='{"model":"gpt-4o-mini","messages":[{"role":"system","content":"'"$SYSTEM"'"},{"role":"user","content":"'"$QUESTION"'"}]}'
fi
# TOOLS=N: N tool definitions in every request (a description and a
# schema of three described parameters each, some 570 bytes a tool), as
# agents send them: the same in every request, in the dialect's shape.
if [ -n "${TOOLS:-}" ]; then
  BODY=$(python3 -c "
import json, sys
body, n, anthropic = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == 'anthropic'
def tool(i):
    schema = {'type': 'object', 'required': ['account_id'], 'properties': {
        'account_id': {'type': 'string', 'description': 'The id of the account, as the accounts tool lists it.'},
        'from_date': {'type': 'string', 'format': 'date', 'description': 'The first day to include, in ISO 8601.'},
        'category': {'type': 'string', 'enum': ['groceries', 'rent', 'travel', 'savings'], 'description': 'Only spending of this category.'}}}
    name, text = f'tool_{i}', f'Lists the transactions of an account (tool {i}) between two dates, newest first, with their amounts and categories.'
    if anthropic:
        return {'name': name, 'description': text, 'input_schema': schema}
    return {'type': 'function', 'function': {'name': name, 'description': text, 'parameters': schema}}
body['tools'] = [tool(i) for i in range(n)]
print(json.dumps(body, separators=(',', ':')))" "$BODY" "$TOOLS" "${DIALECT:-openai}")
fi
echo "$BODY" >"$WORK/body.json"
echo "${BODY%\}}"',"stream":true}' >"$WORK/stream.json"

# SDK_HEADERS=1: requests carry the headers the official OpenAI Python SDK
# sends (OHA_HEADERS, which every oha load here sends; not the streams of
# benches/stream_ttfb.rs) and the mock answers with OpenAI's (MOCK_HEADERS):
# some 40 headers an exchange, as in production, against a few by default.
OHA_HEADERS=(-H 'content-type: application/json')
if [ -n "${SDK_HEADERS:-}" ]; then
  export MOCK_HEADERS=1
  OHA_HEADERS+=(-H 'accept: application/json' -H 'accept-encoding: gzip, deflate'
    -H 'authorization: Bearer sk-bench-0000000000000000000000000000000000000000'
    -H 'user-agent: OpenAI/Python 1.82.0' -H 'x-stainless-lang: python'
    -H 'x-stainless-package-version: 1.82.0' -H 'x-stainless-os: Linux'
    -H 'x-stainless-arch: x64' -H 'x-stainless-runtime: CPython'
    -H 'x-stainless-runtime-version: 3.11.7' -H 'x-stainless-async: false'
    -H 'x-stainless-retry-count: 0' -H 'x-stainless-read-timeout: 600')
fi

oha_json() { oha --no-tui --output-format json "$@" 2>/dev/null; }
field() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

# The newest build of bench binary $1.
bench_bin() { ls -t target/release/deps/"$1"-* | grep -v '\.d$' | head -n 1; }

# Waits until URL $1 answers, for up to $2 tenths of a second (default
# 100); fails, saying so, if it never does (a server that did not start).
wait_for() {
  for _ in $(seq "${2:-100}"); do curl -sf -o /dev/null "$1" && return; sleep 0.1; done
  echo "$1 did not answer" >&2
  return 1
}

# Memory figure $1 of process $2 (VmRSS, VmHWM, ...) from /proc, in MB.
mem_mb() { awk "/^$1:/ {printf \"%.1f\", \$2 / 1024}" "/proc/$2/status"; }

# Starts fairgate build $1 serving on $2, its admin listener on $3, from
# directory $4 (whose ./data takes its results and spills), on the shipped
# rules with the mock ($MOCK) as its OpenAI and Anthropic upstream, and any further
# arguments; waits until it answers and sets FAIRGATE_PID.
start_fairgate() {
  local bin=$1 listen=$2 admin=$3 dir=$4 rules=$PWD/rules
  shift 4
  mkdir -p "$dir"
  (cd "$dir" && RUST_LOG=warn exec "$bin" serve --listen "$listen" --admin-listen "$admin" \
    --rules "$rules" --upstream-openai "http://$MOCK" --upstream-anthropic "http://$MOCK" "$@" >/dev/null 2>&1) &
  FAIRGATE_PID=$!
  PIDS+=("$FAIRGATE_PID")
  wait_for "http://$admin/healthz"
}

# Starts the mock upstream on $1 and waits until it answers.
start_mock() {
  "$(bench_bin mock_upstream)" "$1" 2>/dev/null &
  PIDS+=($!)
  wait_for "http://$1/v1/models"
}
