#!/usr/bin/env bash
# Start a tinyserve server on a free port, sweep it at concurrencies 1 4 16 64 (and, side by side, any
# server named in COMPARE), write the table, the JSON and the plot to benchmarks/results/, stop the server.
#
#   benchmarks/run_serve_sweep.sh
#   COMPARE="vllm=http://127.0.0.1:8001 llamacpp=http://127.0.0.1:8080" NUM_RUNS=3 benchmarks/run_serve_sweep.sh
#
# Other servers must serve a model with the same tokenizer for the prompt lengths to mean the same thing
# (vllm serve HuggingFaceTB/SmolLM2-135M-Instruct; llama-server -m SmolLM2-135M-Instruct.Q4_1.gguf).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NUM_PROMPTS=${NUM_PROMPTS:-64}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-128}
NUM_RUNS=${NUM_RUNS:-3}
CONCURRENCY=${CONCURRENCY:-"1 4 16 64"}
PORT=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
STAMP=$(date +%Y%m%d-%H%M%S)
mkdir -p benchmarks/results

$PY -m tinyserve.cli serve --port "$PORT" --log-level warning ${SERVER_ARGS:-} &
SERVER_PID=$!
trap 'kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null || true' EXIT
$PY - "$PORT" <<'EOF'
import sys, time, httpx
url = f"http://127.0.0.1:{sys.argv[1]}/health"
for _ in range(600):
    try:
        if httpx.get(url, timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(1)
sys.exit("tinyserve server did not become healthy in 10 minutes")
EOF

TARGETS=(--base-url "tinyserve=http://127.0.0.1:$PORT")
for target in ${COMPARE:-}; do TARGETS+=(--base-url "$target"); done
# shellcheck disable=SC2086
$PY -m tinyserve.cli bench sweep "${TARGETS[@]}" --concurrency $CONCURRENCY --num-runs "$NUM_RUNS" \
    --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --ignore-eos \
    --result-file "benchmarks/results/sweep-$STAMP.json" --plot | tee "benchmarks/results/sweep-$STAMP.md"
