#!/usr/bin/env bash
# Speculative decoding's bars (docs/PERFORMANCE.md, "Speculative decoding"): the same checkout served three
# times, without speculation, with --speculative-method ngram, and with --speculative-method draft (the same
# model in int4 as the draft: $DRAFT_FLAGS), all up at once, runs interleaved by `tinyserve bench sweep`,
# 3 each, greedy (the servers emit the same tokens):
#   copy   1 stream, 4 prompts that ask to repeat or lightly edit a shipped passage (--dataset copy)
#   A      1 stream, 4 random prompts of 128 tokens, 64 out
#   B      16 streams, 32 random prompts of 256 tokens, 64 out
# Usage: benchmarks/speculative_cost.sh [OUT_DIR] [extra serve flags, e.g. --quantization int4]
set -euo pipefail
OUT=${1:-bench-results/speculative}; shift || true
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$ROOT/.venv/bin/python
mkdir -p "$OUT"
serve() {  # label port flags...
  local label=$1 port=$2; shift 2
  (cd "$ROOT" && "$PY" -m tinyserve.cli serve --port "$port" "$@" > "$OUT/$label.server.log" 2>&1) &
}
DRAFT_FLAGS=${DRAFT_FLAGS:---draft-model smollm2-135m --draft-quantization int4}
serve plain 8111 "$@"; serve ngram 8112 --speculative-method ngram "$@"
# shellcheck disable=SC2086  # DRAFT_FLAGS is a list of flags
serve draft 8113 --speculative-method draft $DRAFT_FLAGS "$@"
trap 'pkill -f "tinyserve.cli serve --port 811[123]" || true' EXIT
for port in 8111 8112 8113; do
  for _ in $(seq 900); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
done
SWEEP=("$PY" -m tinyserve.cli bench sweep --base-url plain=http://127.0.0.1:8111 --base-url ngram=http://127.0.0.1:8112
       --base-url draft=http://127.0.0.1:8113 --temperature 0 --num-runs 3 --no-progress)
"${SWEEP[@]}" --dataset copy --concurrency 1 --num-prompts 4 --result-file "$OUT/copy.json" | tee "$OUT/copy.log"
"${SWEEP[@]}" --ignore-eos --concurrency 1 --num-prompts 4 --input-len 128 --output-len 64 --result-file "$OUT/A.json" \
  | tee "$OUT/A.log"
"${SWEEP[@]}" --ignore-eos --concurrency 16 --num-prompts 32 --input-len 256 --output-len 64 --result-file "$OUT/B.json" \
  | tee "$OUT/B.log"
for port in 8111 8112 8113; do curl -s "localhost:$port/metrics" | grep "spec_decode" > "$OUT/metrics-$port.txt" || true; done
