"""Tensor and pipeline parallel against one process, offline, on this machine: the same batch of prompts
through tinyserve.LLM with one process, TP=3 (SmolLM2's 9 query / 3 KV heads take 3, not 2), PP=2 (one
micro-batch per stage, the default) and PP=2 with the whole step as one micro-batch (no overlap between
stages), side by side in one run, medians of --rounds.

Each pipelined run's ranks log how much of their forwards they spent computing ("computed X s of Y s"):
the rest is the pipeline bubble (docs/PERFORMANCE.md, "Tensor and pipeline parallel").

    .venv/bin/python benchmarks/parallel_offline.py [--model smollm2-135m] [--rounds 3]
"""

import argparse
import logging
import statistics
import time

from tinyserve import LLM, SamplingParams

CASES = {  # name -> (LLM keywords, micro-batches per step on rank 0; None: the runner's own, one per stage)
    "one process": ({}, None),
    "TP=3": ({"tensor_parallel_size": 3}, None),
    "PP=2, 2 micro-batches": ({"pipeline_parallel_size": 2}, None),
    "PP=2, 1 micro-batch": ({"pipeline_parallel_size": 2}, 1),
}


def run(model: str, keywords: dict, micro_batches: int | None, prompts: list[list[int]], max_tokens: int) -> float:
    """Output tokens per second of one generate() over all prompts (start-up excluded)."""
    with LLM(model, kv_cache_memory=0.5, **keywords) as llm:
        if micro_batches is not None:  # rank 0 cuts the steps; the other ranks follow its plans
            llm.engine.runner.num_micro_batches = micro_batches
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        start = time.perf_counter()
        results = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level="INFO", format="%(message)s")
    for name in ("tinyserve.engine.memory.sizing", "tinyserve.loader.model_loader", "tinyserve.parallel.launch",
                 "tinyserve.engine.loop.generation_defaults"):
        logging.getLogger(name).setLevel("WARNING")
    prompts = [[(7 * i + 13 * j) % 20000 + 100 for j in range(args.prompt_len)] for i in range(args.num_prompts)]
    rates: dict[str, list[float]] = {name: [] for name in CASES}
    for round_index in range(args.rounds):  # interleaved: each round runs every case once
        for name, (keywords, micro_batches) in CASES.items():
            rate = run(args.model, keywords, micro_batches, prompts, args.max_tokens)
            rates[name].append(rate)
            print(f"round {round_index + 1}: {name}: {rate:.1f} output tok/s", flush=True)
    base = statistics.median(rates["one process"])
    print(f"\n{args.num_prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} output tokens each; "
          f"medians of {args.rounds}:")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"  {name:24s} {median:7.1f} output tok/s  ({median / base:.2f}x one process)")


if __name__ == "__main__":
    main()
