#!/usr/bin/env bash
# Two commits side by side over HTTP: workload A (1 stream, 8 prompts of 128 tokens, 128 out) and B (16 streams,
# 64 prompts of 256, 128 out), both servers up at once, runs interleaved by `tinyserve bench sweep`, 3 each.
# Usage: benchmarks/ab_http.sh OLD_CHECKOUT NEW_CHECKOUT [OUT_DIR]   (e.g. a `git worktree add` of the old commit)
# Each checkout's code runs from the project venv with PYTHONPATH set to it and its own kernel build cache.
# --kv-cache-memory 1: the fixed 1 GiB pool of the recorded runs (auto would give each server half of what is
# free: two such servers do not fit this 24 GiB machine, and the first was OOM-killed).
set -euo pipefail
OLD=$1; NEW=$2; OUT=${3:-bench-results/ab}
PY=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python
mkdir -p "$OUT"
serve() {  # label checkout port
  (cd "$2" && PYTHONPATH="$2" TORCH_EXTENSIONS_DIR="/tmp/torch_ext/ab-$1" "$PY" -m tinyserve.cli serve --port "$3" --kv-cache-memory 1 \
    > "$OUT/$1.server.log" 2>&1) &
}
serve old "$OLD" 8101; serve new "$NEW" 8102
trap 'pkill -f "tinyserve.cli serve --port 810[12]" || true' EXIT
for port in 8101 8102; do
  for _ in $(seq 900); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
done
SWEEP=("$PY" -m tinyserve.cli bench sweep --base-url old=http://127.0.0.1:8101 --base-url new=http://127.0.0.1:8102
       --ignore-eos --num-runs 3 --no-progress)
"${SWEEP[@]}" --concurrency 1 --num-prompts 8 --input-len 128 --output-len 128 --result-file "$OUT/A.json" | tee "$OUT/A.log"
"${SWEEP[@]}" --concurrency 16 --num-prompts 64 --input-len 256 --output-len 128 --result-file "$OUT/B.json" | tee "$OUT/B.log"
