#!/usr/bin/env bash
# The batch shape (issue 19): three servers with --max-num-batched-tokens 512, 1024 and 2048 up at once,
# workloads B (16 streams, 64 x 256 in / 128 out) and C (64 streams, 128 prompts, 55-489 in / 29-259 out),
# runs interleaved by `tinyserve bench sweep`; compares throughput, TTFT, TPOT and the inter-token tail (ITL
# p99: what a running stream feels when a prefill shares its step). docs/PERFORMANCE.md, "Batch shape".
#   benchmarks/prefill_budget.sh [OUT_DIR] [NUM_RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-results/prefill-budget}; RUNS=${2:-2}
PY=.venv/bin/python
mkdir -p "$OUT"
trap 'pkill -f "tinyserve.cli serve --port 81(08|16|32) " || true' EXIT
urls=()
for budget in 512 1024 2048; do
  port=$((8100 + budget / 64))  # 8108, 8116, 8132
  $PY -m tinyserve.cli serve --port "$port" --max-num-batched-tokens "$budget" > "$OUT/server-$budget.log" 2>&1 &
  urls+=(--base-url "b$budget=http://127.0.0.1:$port")
done
for port in 8108 8116 8132; do
  for _ in $(seq 900); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
done
SWEEP=("$PY" -m tinyserve.cli bench sweep "${urls[@]}" --ignore-eos --num-runs "$RUNS" --no-progress)
"${SWEEP[@]}" --concurrency 16 --num-prompts 64 --input-len 256 --output-len 128 --result-file "$OUT/B.json" | tee "$OUT/B.log"
"${SWEEP[@]}" --concurrency 64 --num-prompts 128 --input-len 272 --output-len 144 --range-ratio 0.8 \
  --result-file "$OUT/C.json" | tee "$OUT/C.log"
