#!/usr/bin/env bash
# Imports the real NRC Emotion Lexicon from the nrclex wheel (it may not be
# redistributed, so it is fetched here, never committed) and checks a few
# known values: entries of the table and an entropy computed by `eval`.
#   bash tests/lexicon/check_nrc.sh target/debug/fairgate
set -euo pipefail
FAIRGATE=${1:-target/debug/fairgate}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

python3 -m pip download --quiet --disable-pip-version-check --no-deps --dest "$WORK" nrclex==4.1.0
"$FAIRGATE" lexicon import "$WORK"/nrclex-4.1.0-*.whl --out "$WORK/emotions.json"
echo '{"input": "q", "output": "I abandon it, happy and angry."}' >"$WORK/row.jsonl"
"$FAIRGATE" eval "$WORK/row.jsonl" --lexicon "$WORK/emotions.json" --out "$WORK/result.jsonl" >/dev/null
python3 - "$WORK" <<'PY'
import json, math, sys
work = sys.argv[1]
words = json.load(open(f"{work}/emotions.json"))["words"]
expected = {
    "abandon": ["fear", "sadness"],
    "happy": ["anticipation", "joy", "trust"],
    "angry": ["anger", "disgust"],
}
for word, emotions in expected.items():
    assert words[word] == emotions, (word, words.get(word))
assert len(words) > 4000, len(words)
entropy = json.loads(open(f"{work}/result.jsonl").readline())["metrics"]["emotional_entropy"]
# Seven emotions once each: log2(7) bits.
assert abs(entropy["score"] - math.log2(7)) < 1e-12, entropy
assert entropy["details"]["surprise"] == 0, entropy
print(f"nrc lexicon: {len(words)} words, known entries and entropy check out")
PY
