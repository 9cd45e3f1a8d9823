#!/usr/bin/env bash
# Builds fairgate with profile-guided optimization, for a deployment that
# wants the last CPU: an instrumented build serves the fast mock's chat
# completions and Messages API answers, whole and streamed, under closed
# loops; LLVM then lays out and inlines the release build by what that
# load ran. The binary is target/pgo/release/fairgate (the plain release
# build is left as it is). Needs the toolchain's llvm-tools component
# (`rustup component add llvm-tools`, done here if missing), and two
# fat-LTO builds: some ten minutes on two cores.
#
#   bash benches/pgo.sh
#   FAIRGATE_BIN=target/pgo/release/fairgate NO_BUILD=1 bash benches/proxy.sh
#   NEW=target/pgo/release/fairgate OLD=target/release/fairgate NO_BUILD=1 bash benches/ab.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILES=$PWD/target/pgo-profiles
PROFDATA_TOOL="$(rustc --print sysroot)/lib/rustlib/$(rustc -vV | sed -n 's/^host: //p')/bin/llvm-profdata"
[ -x "$PROFDATA_TOOL" ] || rustup component add llvm-tools
SECONDS_EACH=${SECONDS_EACH:-4}

RUSTFLAGS="-Cprofile-generate=$PROFILES" cargo build --release --quiet \
  --target-dir target/pgo-generate --bin fairgate
# The build scripts, instrumented too, wrote profiles of their own.
rm -rf "$PROFILES"
# The mock as built for the other scripts (its build relinks
# target/release/fairgate with the dev-dependencies' features).
ls target/release/deps/mock_upstream-* >/dev/null 2>&1 ||
  cargo bench --no-run --quiet --bench mock_upstream 2>/dev/null

# One dialect's load, whole answers and streams, through the instrumented
# build, which writes its profile when it exits.
train() (
  NO_BUILD=1
  source benches/common.sh
  MOCK=127.0.0.1:18141
  start_mock "$MOCK"
  start_fairgate "$PWD/target/pgo-generate/release/fairgate" 127.0.0.1:18142 127.0.0.1:18143 "$WORK/fairgate"
  for body in body stream; do
    oha_json -z "${SECONDS_EACH}s" -c 64 -m POST "${OHA_HEADERS[@]}" -D "$WORK/$body.json" \
      "http://127.0.0.1:18142$API_PATH" | field "'$DIALECT $body:', d['summary']['requestsPerSec'], 'requests/s'"
  done
  kill "$FAIRGATE_PID"
  while kill -0 "$FAIRGATE_PID" 2>/dev/null; do sleep 0.1; done
)
DIALECT=openai train
DIALECT=anthropic train

"$PROFDATA_TOOL" merge -o "$PROFILES.profdata" "$PROFILES"
# Named by its content: a new profile is new flags, so cargo rebuilds
# every crate with it rather than keep those built with the last one.
PROFILE=$PROFILES-$(sha256sum "$PROFILES.profdata" | cut -c1-16).profdata
mv "$PROFILES.profdata" "$PROFILE"
RUSTFLAGS="-Cprofile-use=$PROFILE" cargo build --release --quiet \
  --target-dir target/pgo --bin fairgate
echo "built target/pgo/release/fairgate"
