#!/usr/bin/env bash
# The one-command GPU check (make gpu-check; docs/GPU.md), run on a machine with CUDA, PyTorch and Triton
# and no network, with .whl/ and .gpu-check/ from `make gpu-check-prepare` beside the working tree.
# Installs nothing from the network. Writes $OUT/gpu-check.log, $OUT/gpu-check.json (the summary),
# $OUT/gpu-tests.xml and $OUT/gpu-bench.json; aims to end within 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-check.log") 2>&1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # tinyserve from this working tree, not installed
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
$PY -m tinyserve.layers.kernels.cpu_kernels >/dev/null 2>&1 &  # the CPU reference's kernels, built while the model is made
MODEL=/tmp/random-smollm2
tokenizer=()
[ -d .gpu-check/tokenizer ] && tokenizer=(--tokenizer .gpu-check/tokenizer)
$PY benchmarks/random_smollm2.py "$MODEL" "${tokenizer[@]}" || exit 1
wait
export TINYSERVE_GPU_MODEL=$MODEL
timeout 330 $PY -m pytest -q -rs -s -p no:cacheprovider tests/test_cuda.py --junitxml="$OUT/gpu-tests.xml"
tests_rc=$?
timeout 200 $PY benchmarks/gpu_offline.py --model "$MODEL" --json "$OUT/gpu-bench.json"
bench_rc=$?
$PY - "$OUT" "$tests_rc" "$bench_rc" <<'PYTHON'
import json, os, sys
import xml.etree.ElementTree as ET
out, tests_rc, bench_rc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
summary = {"tests_rc": tests_rc, "bench_rc": bench_rc, "tests": {}}
if os.path.exists(f"{out}/gpu-tests.xml"):
    for case in ET.parse(f"{out}/gpu-tests.xml").iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        summary["tests"][case.get("name")] = outcome
if os.path.exists(f"{out}/gpu-bench.json"):
    summary["bench"] = json.load(open(f"{out}/gpu-bench.json"))
    bench = summary["bench"]
    summary["bars"] = {"256 seqs >= 5x transformers static (batches of 16)":
                           bench.get("speedup_vs_hf_static_batch_16", 0) >= 5,
                       "TPOT with graphs <= 0.5x eager": bench.get("tpot_graphs_over_eager", 1) <= 0.5}
json.dump(summary, open(f"{out}/gpu-check.json", "w"), indent=1)
print(json.dumps(summary, indent=1))
PYTHON
exit $(( tests_rc || bench_rc ))
