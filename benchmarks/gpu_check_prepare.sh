#!/usr/bin/env bash
# Prepares the GPU check here, where the package index is reachable (make gpu-check-prepare): the wheels
# the GPU machine's image lacks (it has torch, Triton, transformers, tokenizers, safetensors, numpy, jinja2,
# httpx, prometheus-client; KINDS.md of the device tool lists it) into .whl/, for Python 3.12 on x86-64
# Linux, at the versions this venv runs; and SmolLM2's tokenizer into .gpu-check/tokenizer (the GGUF it
# comes from is too large to travel). Both folders are git-ignored and travel as `carry` paths.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WHEELS="fastapi starlette uvicorn pydantic pydantic_core annotated-types annotated-doc typing-inspection
typing_extensions anyio h11 gguf llguidance msgspec grpcio grpcio-health-checking grpcio-reflection protobuf"
rm -rf .whl && mkdir -p .whl .gpu-check
for name in $WHEELS; do
    version=$($PY -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$version" ] || { echo "$name is not installed here: run make setup first" >&2; exit 1; }
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$name==$version"
done
$PY - <<'PYTHON'
import sys
sys.path.insert(0, "benchmarks")
from random_smollm2 import load_tokenizer
load_tokenizer(None).save_pretrained(".gpu-check/tokenizer")
PYTHON
du -sh .whl .gpu-check
