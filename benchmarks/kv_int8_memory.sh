#!/usr/bin/env bash
# Peak resident memory of the server over workloads B, D and C (issue 19's memory bar), for the default
# server (bfloat16, the 1 GiB pool) and for the same number of pool tokens in an 8-bit pool
# (`--kv-cache-dtype int8 --kv-cache-memory 0.516`: 2,914 blocks against 2,912), one server at a time.
# The peak is the kernel's own high-water mark (VmHWM in /proc/PID/status). docs/PERFORMANCE.md,
# "8-bit KV cache".
#   benchmarks/kv_int8_memory.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-results/kv-int8-memory}
PY=.venv/bin/python
PORT=8190
mkdir -p "$OUT"
BENCH=("$PY" -m tinyserve.cli bench serve --base-url "http://127.0.0.1:$PORT" --ignore-eos --no-progress)
run_case() {  # name, server args...
  local name=$1; shift
  $PY -m tinyserve.cli serve --port "$PORT" "$@" > "$OUT/server-$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 900); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
  local idle; idle=$(awk '/VmRSS/ {print int($2 / 1024)}' "/proc/$pid/status")
  "${BENCH[@]}" --max-concurrency 16 --num-prompts 64 --input-len 256 --output-len 128 > "$OUT/$name-B.log"
  "${BENCH[@]}" --dataset prefix-repetition --num-prefixes 8 --prefix-len 512 --input-len 32 --output-len 64 \
    --num-prompts 32 --max-concurrency 16 --temperature 0 > "$OUT/$name-D.log"
  "${BENCH[@]}" --max-concurrency 64 --num-prompts 128 --input-len 272 --output-len 144 --range-ratio 0.8 \
    > "$OUT/$name-C.log"
  local peak; peak=$(awk '/VmHWM/ {print int($2 / 1024)}' "/proc/$pid/status")
  echo "| $name | $* | $idle | $peak |" | tee -a "$OUT/table.md"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}
echo "| server | flags | idle RSS MiB | peak RSS over B, D, C MiB |" | tee "$OUT/table.md"
echo "|---|---|---:|---:|" | tee -a "$OUT/table.md"
run_case default --kv-cache-memory 1  # the 1 GiB bf16 pool (2,912 blocks) the int8 cases match
run_case int8-kv --kv-cache-dtype int8 --kv-cache-memory 0.516
run_case int4-int8-kv --quantization int4 --kv-cache-dtype int8 --kv-cache-memory 0.516
