"""The sampler's cost per step on SmolLM2's 49,152-token vocabulary, by batch and sampling parameters
(docs/PERFORMANCE.md, "Sampling: a row with top-k draws among its k best"). Random logits, 2 threads,
median of 15 calls. With a second sampler module given, both run interleaved in one process (A/B):

    .venv/bin/python benchmarks/sampler_cost.py
    git show OLD:tinyserve/engine/sampling/sampler.py > /tmp/old_sampler.py
    .venv/bin/python benchmarks/sampler_cost.py /tmp/old_sampler.py
"""
import importlib.util
import statistics
import sys
import time

import torch

from tinyserve.engine.loop.request import Request
from tinyserve.engine.sampling.sampler import Sampler
from tinyserve.types import SamplingParams

VOCAB = 49_152
CASES = {
    "GGUF defaults (t 0.8, top-k 40, top-p 0.95, min-p 0.05)": dict(temperature=0.8, top_k=40, top_p=0.95,
                                                                   min_p=0.05),
    "temperature 1 only": dict(temperature=1.0),
    "top-p 0.9 without top-k": dict(temperature=1.0, top_p=0.9),
    "greedy with repetition penalty 1.1": dict(temperature=0.0, repetition_penalty=1.1),
}


def time_one_call(sampler, logits, requests, runs: list[float]) -> None:
    start = time.perf_counter()
    sampler(logits, requests)
    runs.append((time.perf_counter() - start) * 1000)


def main() -> None:
    torch.set_num_threads(2)
    samplers = {"this tree": Sampler}
    if len(sys.argv) > 1:
        spec = importlib.util.spec_from_file_location("other_sampler", sys.argv[1])
        other = importlib.util.module_from_spec(spec)
        sys.modules["other_sampler"] = other  # dataclasses look their module up
        spec.loader.exec_module(other)
        samplers = {"other": other.Sampler, "this tree": Sampler}
    for batch in (16, 64):
        logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)) * 3
        for name, fields in CASES.items():
            requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8, **fields)) for i in range(batch)]
            instances = {label: cls(seed=0) for label, cls in samplers.items()}
            runs = {label: [] for label in samplers}
            for _ in range(15):
                for label, sampler in instances.items():
                    time_one_call(sampler, logits, requests, runs[label])
            medians = {label: statistics.median(r) for label, r in runs.items()}
            cells = "  ".join(f"{label} {ms:7.2f} ms" for label, ms in medians.items())
            ratio = f"  other / this {medians['other'] / medians['this tree']:5.2f}x" if "other" in medians else ""
            print(f"batch {batch:3d}  {name:58s} {cells}{ratio}")


if __name__ == "__main__":
    main()
