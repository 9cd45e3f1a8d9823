#!/usr/bin/env bash
# fairgate's memory while a batch's input too large to hold (over
# guard.max_body_bytes, 50 MiB by default) is uploaded through it: read on
# its way up line by line, each line's record held on disk until the
# upload's answer, then sent to the side queue.
#
#   bash benches/batch_upload.sh              # a 100 MB input
#   MB=200 bash benches/batch_upload.sh       # the Batch API's own limit
#   FAIRGATE_BIN=/path/to/fairgate bash benches/batch_upload.sh
#
# Reports the upload's time and status, fairgate's RSS before it and its
# peak (VmHWM) over it, the records written (results lines) and how long
# the in-process workers took to score them all. Loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."

MB=${MB:-100}
MOCK=127.0.0.1:18121
FAIRGATE=127.0.0.1:18122
ADMIN=127.0.0.1:18123
source benches/common.sh

start_mock "$MOCK"
start_fairgate "${FAIRGATE_BIN:-$PWD/target/release/fairgate}" "$FAIRGATE" "$ADMIN" "$WORK"

python3 - "$MB" "$WORK/form" <<'EOF'
import json, sys
size, path = int(sys.argv[1]) << 20, sys.argv[2]
with open(path, "w") as form:
    form.write('--XyZ\r\ncontent-disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
               '--XyZ\r\ncontent-disposition: form-data; name="file"; filename="input.jsonl"\r\n'
               'content-type: application/octet-stream\r\n\r\n')
    written, i = 0, 0
    while written < size:
        line = json.dumps({"custom_id": f"r-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user",
                "content": f"I earn {3000 + i % 500} a month and spend 2,600. How should I start saving?"}]}}) + "\n"
        form.write(line)
        written, i = written + len(line), i + 1
    form.write('\r\n--XyZ--\r\n')
print(f"input: {i} lines, {written / 1e6:.1f} MB")
EOF
lines=$(python3 -c "import sys; print(sum(1 for l in open(sys.argv[1]) if l.startswith('{')))" "$WORK/form")

before=$(mem_mb VmRSS "$FAIRGATE_PID")
start=$(date +%s.%N)
status=$(curl -s -o /dev/null -w '%{http_code}' -H 'content-type: multipart/form-data; boundary=XyZ' \
  --data-binary "@$WORK/form" "http://$FAIRGATE/v1/files")
uploaded=$(date +%s.%N)
results() { cat "$WORK"/data/results/*.jsonl 2>/dev/null | wc -l; }
for _ in $(seq 120); do [ "$(results)" -ge "$lines" ] && break; sleep 0.5; done
scored=$(date +%s.%N)
peak=$(mem_mb VmHWM "$FAIRGATE_PID")
printf 'upload: status %s in %.1f s; all %s records scored %.1f s after it\n' \
  "$status" "$(echo "$uploaded - $start" | bc)" "$lines" "$(echo "$scored - $uploaded" | bc)"
printf 'fairgate RSS before the upload %s MB, peak over it %s MB\n' "$before" "$peak"
