#!/usr/bin/env bash
# The standard check before a change lands (`make bench`, docs/PERFORMANCE.md "The standard benchmark"): this
# checkout's working tree (uncommitted changes included) against a baseline commit, workloads A and B over
# HTTP, both servers up at once and their runs interleaved (benchmarks/ab_http.sh), then the ratios new / old.
# Usage: benchmarks/ab_baseline.sh [BASE_REF (default HEAD)] [OUT_DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BASE=${1:-HEAD}
OUT=${2:-$ROOT/bench-results/ab-$(date +%Y%m%d-%H%M%S)}
PY=$ROOT/.venv/bin/python
mkdir -p "$(dirname "$OUT")"
WORKTREE=$(mktemp -d /tmp/tinyserve-baseline.XXXXXX)
git -C "$ROOT" worktree add --detach --quiet "$WORKTREE" "$BASE"
trap 'git -C "$ROOT" worktree remove --force "$WORKTREE"' EXIT
echo "baseline: $BASE = $(git -C "$WORKTREE" log -1 --format='%h %s' | cut -c1-80); new: this working tree"
"$ROOT/benchmarks/ab_http.sh" "$WORKTREE" "$ROOT" "$OUT" > "$OUT.log" 2>&1 || { tail -n 20 "$OUT.log"; exit 1; }
"$PY" - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
print(f"{'workload':8s} {'metric':12s} {'old':>9s} {'new':>9s} {'new/old':>8s}   (medians of the runs; higher tok/s, lower ms is better)")
for workload in ("A", "B"):
    rows = {row["server"]: row for row in json.load(open(f"{out}/{workload}.json"))["rows"]}
    for metric in ("out tok/s", "TPOT p50 ms", "TTFT p99 ms"):
        old, new = rows["old"][metric]["median"], rows["new"][metric]["median"]
        print(f"{workload:8s} {metric:12s} {old:9.1f} {new:9.1f} {new / old:8.3f}")
PYEOF
echo "results: $OUT"
