"""Resident memory after distinct pathological regexes through the engine (issue 44's grammar cache bar:
50 in a row, RSS growth < 300 MiB after the trim, each request answered or refused).

Each regex is distinct (its own compile and cache entry), half of the issue's shape `(a{1000}){1000}X`
(each left ~150-230 MiB resident before the budgets), half the heaviest the budget lets through,
`(a{100}){200}X` (a lexer of ~10 MiB each, so 50 of them would pass the cache's memory budget). Every one
is a real request on the default model: compiled, queued, its masks computed for each token, stepped to
its end. RSS is read from /proc after a warm-up constrained request and again after the last request and a
malloc trim, with the engine's serving malloc settings in force (they keep freed memory resident).

    python benchmarks/grammar_cache_memory.py [--count 50] [--max-tokens 4]

Prints one JSON line: {"count", "ok", "refused", "rss_start_mib", "rss_end_mib", "growth_mib",
"cache_entries", "cache_mib", "evicted", "seconds"}.
"""

from __future__ import annotations

import argparse
import json
import time

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.engine.memory.malloc_tuning import return_freed_host_memory
from tinyserve.types import InvalidRequest, SamplingParams, StructuredOutput


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def pathological(i: int) -> str:
    return f"(a{{1000}}){{1000}}X{i}" if i % 2 == 0 else f"(a{{100}}){{200}}X{i}"


def run_one(engine: LLMEngine, request_id: str, regex: str, max_tokens: int) -> bool:
    """True when the request ran to its end, False when it was refused (InvalidRequest)."""
    params = engine.default_sampling_params(max_tokens=max_tokens, temperature=0.0,
                                            structured_output=StructuredOutput("regex", regex))
    try:
        engine.add_request(request_id, "Write the letter a many times:", params)
    except InvalidRequest:
        return False
    while engine.has_unfinished_requests():
        engine.step()
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=64),
                                    scheduler=SchedulerConfig(max_model_len=512)))
    run_one(engine, "warm-up", r"[0-9]{4}-[0-9]{2}", args.max_tokens)
    return_freed_host_memory()
    start_rss, start = rss_mib(), time.perf_counter()
    outcomes = [run_one(engine, f"r{i}", pathological(i), args.max_tokens) for i in range(args.count)]
    seconds = time.perf_counter() - start
    return_freed_host_memory()
    end_rss = rss_mib()
    cache = engine.structured_outputs._compiled
    print(json.dumps({"count": args.count, "ok": sum(outcomes), "refused": outcomes.count(False),
                      "rss_start_mib": round(start_rss), "rss_end_mib": round(end_rss),
                      "growth_mib": round(end_rss - start_rss), "cache_entries": len(cache),
                      "cache_mib": round(cache.total_bytes / 2**20, 1), "evicted": cache.num_evicted,
                      "seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()
