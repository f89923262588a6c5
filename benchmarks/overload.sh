#!/usr/bin/env bash
# Adaptive admission's bars (docs/PERFORMANCE.md, "Admission under overload"): the same checkout served
# twice, the fixed queue (--max-queue 256, the default) and --admission adaptive --target-ttft $TARGET_MS,
# both up at once, driven one at a time:
#   capacity  B-sized requests (256 in, 128 out, ignore_eos) at 16 streams on the fixed server: its
#             unloaded throughput, output tokens/s and requests/s
#   overload  Poisson arrivals at 3x that request rate for 60 s, B-sized, on each server in turn: TTFT p99 of
#             the admitted requests, output tokens/s, refusals by reason
# then each server's /metrics: nothing running or waiting and every KV block free (no leak), alive.
# Usage: benchmarks/overload.sh [OUT_DIR] [extra serve flags]
set -euo pipefail
OUT=${1:-bench-results/overload}; shift || true
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$ROOT/.venv/bin/python
TARGET_MS=${TARGET_MS:-2000}
mkdir -p "$OUT"
serve() {  # label port flags...
  local label=$1 port=$2; shift 2
  (cd "$ROOT" && "$PY" -m tinyserve.cli serve --port "$port" "$@" > "$OUT/$label.server.log" 2>&1) &
}
serve fixed 8121 "$@"; serve adaptive 8122 --admission adaptive --target-ttft "$TARGET_MS" "$@"
trap 'pkill -f "tinyserve.cli serve --port 812[12]" || true' EXIT
for port in 8121 8122; do
  for _ in $(seq 900); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
done
BENCH=("$PY" -m tinyserve.cli bench serve --ignore-eos --input-len 256 --output-len 128 --temperature 0 --no-progress)
"${BENCH[@]}" --base-url http://127.0.0.1:8121 --max-concurrency 16 --num-prompts 48 --result-file "$OUT/capacity.json" \
  > "$OUT/capacity.log"
RATE=$("$PY" -c "import json; print(round(3 * json.load(open('$OUT/capacity.json'))['metrics']['request_throughput'], 3))")
NUM=$("$PY" -c "print(max(1, round($RATE * 60)))")
echo "capacity: $(grep -E 'Output token throughput|Request throughput' "$OUT/capacity.log" | tr -s ' ' | tr '\n' ';')"
echo "overload: $NUM requests at $RATE/s (3x capacity) for 60 s"
for label in fixed adaptive; do
  port=$([ "$label" = fixed ] && echo 8121 || echo 8122)
  "${BENCH[@]}" --base-url "http://127.0.0.1:$port" --request-rate "$RATE" --num-prompts "$NUM" --seed 1 \
    --result-file "$OUT/overload-$label.json" > "$OUT/overload-$label.log"
  sleep 2
  curl -s "localhost:$port/metrics" | grep -E "^tinyserve:(num_requests_running|num_requests_waiting|kv_cache_usage_perc|admission_limit|request_rejected_total|num_preemptions_total)" \
    > "$OUT/metrics-$label.txt" || true
  echo "$label: health $(curl -s -o /dev/null -w '%{http_code}' "localhost:$port/health")"
done
"$PY" - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
cap = json.load(open(f"{out}/capacity.json"))["metrics"]
print(f"capacity: {cap['output_throughput']:.1f} tok/s, {cap['request_throughput']:.3f} req/s, TTFT p99 {cap['ttft_ms']['p99']:.0f} ms")
for label in ("fixed", "adaptive"):
    m = json.load(open(f"{out}/overload-{label}.json"))["metrics"]
    print(f"{label}: admitted {m['num_completed']}, refused {m['failures']}, TTFT p50/p99 "
          f"{m['ttft_ms']['median']:.0f}/{m['ttft_ms']['p99']:.0f} ms, {m['output_throughput']:.1f} tok/s "
          f"({m['output_throughput'] / cap['output_throughput']:.2f}x capacity) over {m['duration_s']:.0f} s")
PYEOF
