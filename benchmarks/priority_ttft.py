"""Priorities that preempt (docs/PERFORMANCE.md, "Priorities"): the TTFT of a high-priority request on an
idle server, and with the sequence cap full of low-priority streams, in-process on the default GGUF.

Rounds alternate three cases side by side: idle; the cap (--max-num-seqs) full of streams at priority 5
while the probe comes at priority 0 (it preempts one); and the same full cap with the probe at priority 5
(it waits for a seat: what a server without preemption gives). Prints one JSON line with the medians.

    .venv/bin/python benchmarks/priority_ttft.py [--max-num-seqs 8] [--rounds 5]

(Run it as a server runs: not under OMP_NUM_THREADS=1, which the test suite sets.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from tinyserve.server.launcher import BackgroundServer

# ~250 tokens (workload B's prompt size); each request's starts with its own number: no prefix-cache hits
PROMPT = " ".join(["Write a short story about a robot who learns to paint, in the style of a fairy tale."] * 14)
LOW, HIGH = 5, 0
_numbers = iter(range(10**9))


async def _ttft(client: httpx.AsyncClient, priority: int, max_tokens: int) -> float:
    """Seconds to the first token of a stream read to its end (leaving early would abort it)."""
    body = {"prompt": f"{next(_numbers)}. {PROMPT}", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "priority": priority}
    start, first = time.perf_counter(), None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter() - start
    assert first is not None, "no token"
    return first


async def _round(base_url: str, max_num_seqs: int, engine) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        idle = await _ttft(client, HIGH, 4)  # a fresh prompt of B's size, alone
        out = {"idle": idle}
        for case, priority in (("full_cap_preempting", HIGH), ("full_cap_equal_priority", LOW)):
            fill = [asyncio.create_task(_ttft(client, LOW, 256)) for _ in range(max_num_seqs)]
            while engine.stats is None or engine.stats.num_running < max_num_seqs:
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # every seat is decoding
            out[case] = await _ttft(client, priority, 4)
            for task in fill:
                task.cancel()
            await asyncio.gather(*fill, return_exceptions=True)
            while engine.stats.num_running or engine.stats.num_waiting:
                await asyncio.sleep(0.05)
        return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    engine_config = EngineConfig(cache=CacheConfig(kv_cache_memory_gib=1.0),
                                 scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs))
    server = BackgroundServer(engine_config, ServerConfig(port=0)).start()
    try:
        rounds = [asyncio.run(_round(server.base_url, args.max_num_seqs, server.state.engine))
                  for _ in range(args.rounds)]
    finally:
        server.stop()
    medians = {case: statistics.median(r[case] for r in rounds) for case in rounds[0]}
    print(json.dumps({"max_num_seqs": args.max_num_seqs, "rounds": args.rounds,
                      "ttft_median_s": {k: round(v, 4) for k, v in medians.items()},
                      "preempting_vs_idle": round(medians["full_cap_preempting"] / medians["idle"], 2),
                      "all_ttft_s": [{k: round(v, 4) for k, v in r.items()} for r in rounds]}))


if __name__ == "__main__":
    main()
