#!/usr/bin/env bash
# Gemma 3 270M (the gemma3-270m alias, Q4_K_M GGUF) served in each speed mode side by side (docs/PERFORMANCE.md,
# "Gemma 3 270M in each speed mode"): bfloat16, int8 and int4 servers up at once, driven one at a time by
# `tinyserve bench sweep` (runs interleaved): workload A (1 stream, 8 prompts of 128 tokens, 128 out) and B
# (16 streams, 64 prompts of 256, 128 out), RUNS each. Then benchmarks/quality.py's rows for the model.
# Usage: [RUNS=2] [QUALITY=0] benchmarks/gemma3_modes.sh [OUT_DIR]   (QUALITY=0: the speed runs only)
set -euo pipefail
OUT=${1:-bench-results/gemma3-modes}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$ROOT/.venv/bin/python
RUNS=${RUNS:-2}
mkdir -p "$OUT"
serve() {  # mode port [flags]
  local mode=$1 port=$2; shift 2
  (cd "$ROOT" && "$PY" -m tinyserve.cli serve --model gemma3-270m --dtype bfloat16 --port "$port" "$@" \
    > "$OUT/$mode.server.log" 2>&1) &
}
serve bf16 8121; serve int8 8122 --quantization int8; serve int4 8123 --quantization int4
trap 'pkill -f "tinyserve.cli serve --model gemma3-270m" || true' EXIT
for port in 8121 8122 8123; do
  for _ in $(seq 900); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
done
SWEEP=("$PY" -m tinyserve.cli bench sweep --base-url bf16=http://127.0.0.1:8121 --base-url int8=http://127.0.0.1:8122
       --base-url int4=http://127.0.0.1:8123 --tokenizer gemma3-270m --ignore-eos --num-runs "$RUNS" --no-progress)
"${SWEEP[@]}" --concurrency 1 --num-prompts 8 --input-len 128 --output-len 128 --result-file "$OUT/A.json" | tee "$OUT/A.log"
"${SWEEP[@]}" --concurrency 16 --num-prompts 64 --input-len 256 --output-len 128 --result-file "$OUT/B.json" | tee "$OUT/B.log"
pkill -f "tinyserve.cli serve --model gemma3-270m" || true
[ "${QUALITY:-1}" = 0 ] || "$PY" "$ROOT/benchmarks/quality.py" --model gemma3-270m --result-file "$OUT/quality.json" | tee "$OUT/quality.log"
