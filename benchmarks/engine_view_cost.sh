#!/usr/bin/env bash
# What the web page's engine view costs the server (docs/PERFORMANCE.md, "The engine view's cost"): one
# server, workloads A (1 stream, 8 prompts of 128, 128 out) and B (16 streams, 64 prompts of 256, 128 out),
# each run with the page closed and with it "open": a poller fetching /engine/stats every POLL_S seconds
# and parsing the JSON, as the page's poll() does, over one kept-alive connection as a browser keeps it (a
# browser's own rendering is the client's cost, not the server's; so is a new client per poll, whose TLS
# context alone costs ~20 ms of CPU a poll here). The two modes alternate, ROUNDS rounds (first mode swapped each round); medians at the end.
# Usage: benchmarks/engine_view_cost.sh [OUT_DIR] [extra serve flags]
set -euo pipefail
OUT=${1:-bench-results/engine-view}; shift || true
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$ROOT/.venv/bin/python
ROUNDS=${ROUNDS:-3}
POLL_S=${POLL_S:-1}
PORT=${PORT:-8131}
mkdir -p "$OUT"
(cd "$ROOT" && "$PY" -m tinyserve.cli serve --port "$PORT" "$@" > "$OUT/server.log" 2>&1) &
trap 'pkill -f "tinyserve.cli serve --port $PORT" || true; pkill -f "engine_view_poller $PORT" || true' EXIT
for _ in $(seq 900); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
BENCH=("$PY" -m tinyserve.cli bench serve --base-url "http://127.0.0.1:$PORT" --ignore-eos --temperature 0 --no-progress)
run() {  # mode round; each run draws its own prompts (a repeat would hit the prefix cache)
  local poller="" seed=$(($2 * 2))
  [ "$1" = polling ] && seed=$((seed + 1))
  if [ "$1" = polling ]; then
    "$PY" -c "import sys, time, httpx  # engine_view_poller $PORT
n, client = 0, httpx.Client(timeout=10)
while True:
    client.get('http://127.0.0.1:$PORT/engine/stats').json(); n += 1
    print(n, flush=True); time.sleep($POLL_S)" > "$OUT/poller-$2.log" 2>&1 &
    poller=$!
  fi
  "${BENCH[@]}" --max-concurrency 1 --num-prompts 8 --input-len 128 --output-len 128 --seed "$seed" \
    --result-file "$OUT/A-$1-$2.json" > "$OUT/A-$1-$2.log"
  "${BENCH[@]}" --max-concurrency 16 --num-prompts 64 --input-len 256 --output-len 128 --seed "$seed" \
    --result-file "$OUT/B-$1-$2.json" > "$OUT/B-$1-$2.log"
  if [ -n "$poller" ]; then kill "$poller"; echo "round $2: $(tail -n 1 "$OUT/poller-$2.log") polls"; fi
}
for round in $(seq "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then run closed "$round"; run polling "$round"; else run polling "$round"; run closed "$round"; fi
done
"$PY" - "$OUT" "$ROUNDS" <<'PYEOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
for workload in ("A", "B"):
    row = {}
    for mode in ("closed", "polling"):
        runs = [json.load(open(f"{out}/{workload}-{mode}-{r}.json"))["metrics"] for r in range(1, rounds + 1)]
        tps = [m["output_throughput"] for m in runs]
        row[mode] = statistics.median(tps)
        print(f"{workload} {mode:8s} out tok/s median {row[mode]:.1f} [{min(tps):.1f}-{max(tps):.1f}], "
              f"TPOT p50 {statistics.median(m['tpot_ms']['median'] for m in runs):.1f} ms, "
              f"TTFT p99 {statistics.median(m['ttft_ms']['p99'] for m in runs):.0f} ms")
    print(f"{workload} polling / closed: {row['polling'] / row['closed']:.3f}")
PYEOF
