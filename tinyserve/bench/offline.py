"""The engine alone, nano-vllm's recipe: random token-id prompts of random lengths, random output lengths
with ignore_eos (so every sequence produces exactly its length), greedy, all submitted at once through the
offline LLM API, one short warm-up generate before the clock starts.

`offline_workload` is shared with benchmarks/ (the transformers static-batching baseline), so that every
engine compared gets the same token ids and the same lengths.
"""

from __future__ import annotations

import resource
import sys
import time

import numpy as np

from tinyserve.bench.config import OfflineBenchConfig

PROMPT_ID_LIMIT = 10_000  # token ids drawn from [0, 10000) as nano-vllm's bench does (all ordinary tokens)


def offline_workload(config: OfflineBenchConfig) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, fixed by the seed."""
    rng = np.random.default_rng(config.seed)
    (in_low, in_high), (out_low, out_high) = config.input_len_range, config.output_len_range
    input_lens = rng.integers(in_low, in_high + 1, size=config.num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=config.num_prompts)
    return [(rng.integers(0, PROMPT_ID_LIMIT, size=n).tolist(), int(m)) for n, m in zip(input_lens, output_lens)]


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def run_offline(config: OfflineBenchConfig) -> dict:
    """Time one generate() over the whole workload; one JSON-able record of what was measured."""
    from tinyserve.llm import LLM
    from tinyserve.types import SamplingParams

    engine = config.engine
    llm = LLM.from_config(engine)
    if config.num_warmup_tokens:
        llm.generate([list(range(1, 17))], SamplingParams(temperature=0.0, max_tokens=config.num_warmup_tokens))
    workload = offline_workload(config)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    start = time.perf_counter()
    results = llm.generate([ids for ids, _ in workload], params)
    elapsed = time.perf_counter() - start
    num_output = sum(len(r.token_ids) for r in results)
    num_input = sum(len(ids) for ids, _ in workload)
    stats = llm.engine.stats()
    return {
        "bench": "offline", "engine": "tinyserve", "model": engine.model, "dtype": engine.dtype,
        "quantization": engine.quantization, "weights": llm.engine.quantization or "float",
        "kv_cache_dtype": engine.cache.kv_cache_dtype,
        "device": str(llm.engine.runner.device), "torch_threads": _torch_threads(),
        "num_prompts": config.num_prompts, "max_num_seqs": engine.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens, "seed": config.seed,
        "input_tokens": num_input, "output_tokens": num_output,
        "expected_output_tokens": sum(n for _, n in workload),
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(num_output / elapsed, 2),
        "total_tokens_per_s": round((num_input + num_output) / elapsed, 2),
        "requests_per_s": round(len(workload) / elapsed, 3),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "num_steps": stats.num_steps, "num_preemptions": stats.num_preemptions,
    }
