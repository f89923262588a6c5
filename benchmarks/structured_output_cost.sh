#!/usr/bin/env bash
# What a JSON schema costs per output token: TPOT with and without one, at 1 and 16 concurrent streams,
# against one server, the two modes alternated three times (docs/PERFORMANCE.md, "Structured output").
# The schema (an array of at least 50 small objects) cannot close within 128 tokens, so every request
# runs its full 128 tokens in both modes. Usage: benchmarks/structured_output_cost.sh [BASE_URL] [OUT_DIR]
set -euo pipefail
URL=${1:-http://127.0.0.1:8000}
OUT=${2:-bench-results/structured-output}
mkdir -p "$OUT"
SCHEMA='{"guided_json": {"type": "array", "minItems": 50, "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}}}'
for rep in 1 2 3; do
  for mode in plain json; do
    extra='{}'; [ "$mode" = json ] && extra=$SCHEMA
    for c in 1 16; do
      n=$(( c == 1 ? 4 : 32 ))
      tinyserve bench serve --base-url "$URL" --max-concurrency "$c" --num-prompts "$n" --input-len 128 \
        --output-len 128 --ignore-eos --no-progress --extra-body "$extra" \
        --result-file "$OUT/${mode}_c${c}_${rep}.json" > "$OUT/${mode}_c${c}_${rep}.log" 2>&1
      echo "$mode c=$c rep $rep: $(grep -i 'tpot' "$OUT/${mode}_c${c}_${rep}.log" | head -1)"
    done
  done
done
