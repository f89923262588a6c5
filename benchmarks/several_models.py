"""Several models in one server (docs/PERFORMANCE.md, "Several models"), in-process on the default GGUF:

1. throughput: one model busy with C streams, then two models (the same file under two names, two engines
   on the one step thread) busy with C streams each: output tokens/s of each and in total, and the ratio
   two / one of each round (the rounds interleave the two, so a round's ratio sees one machine state);
2. load time of the model (build + warm-up) and RSS returned by an admin unload;
3. swap under load: C clients send requests back to back to model `a`, and a prober sends a short one
   every 0.5 s; after --before-s the model is swapped to the same file (a new load of the same size):
   TTFT p50/p99 of the probes that arrived before the swap vs during it, the swap's duration (build,
   switch, drain of the old load, free), and the failed requests (must be 0).

Prints one JSON line.

    .venv/bin/python benchmarks/several_models.py [--concurrency 8] [--output-len 48] [--before-s 15] [--rounds 2]
        [--only-swap]

(Run it as a server runs: not under OMP_NUM_THREADS=1, which the test suite sets.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import httpx

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from tinyserve.loader.model_loader import resolve_model_path
from tinyserve.server.launcher import BackgroundServer

PROMPT = "Write a short story about a robot who learns to paint."


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _request(client: httpx.AsyncClient, model: str, output_len: int) -> tuple[float, float, int, bool]:
    """(arrival, ttft, tokens, ok) of one streaming request."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start, first, chunks, reason = time.perf_counter(), None, 0, None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return start, 0.0, 0, False
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    first = first or time.perf_counter()
                    chunks += 1
                    reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
    except httpx.HTTPError:
        return start, 0.0, 0, False
    return start, (first or start) - start, chunks, reason == "length"


async def _throughput(base_url: str, models: list[str], concurrency: int, output_len: int) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        start = time.perf_counter()
        jobs = [(m, _request(client, m, output_len)) for m in models for _ in range(concurrency)]
        results = await asyncio.gather(*(job for _, job in jobs))
        elapsed = time.perf_counter() - start
    per_model = {m: sum(r[2] for (name, _), r in zip(jobs, results) if name == m) / elapsed for m in models}
    return {"tok_s": round(sum(per_model.values()), 1), "per_model_tok_s": {m: round(v, 1) for m, v in per_model.items()}}


async def _swap_under_load(base_url: str, concurrency: int, output_len: int, before_s: float, path: str,
                           probe_every_s: float = 0.5) -> dict:
    records, probes, swap_window = [], [], [float("inf"), float("inf")]
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        async def worker():
            while not stop.is_set():
                records.append(await _request(client, "a", output_len))

        async def prober():  # open-loop arrivals, so that some land inside the swap
            tasks = []
            while not stop.is_set():
                tasks.append(asyncio.ensure_future(_request(client, "a", 4)))
                await asyncio.sleep(probe_every_s)
            probes.extend(await asyncio.gather(*tasks))

        workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)] + [asyncio.ensure_future(prober())]
        await asyncio.sleep(before_s)
        swap_window[0] = time.perf_counter()
        r = await client.post("/admin/models/swap", json={"model": "a", "path": path})
        swap_window[1] = time.perf_counter()
        assert r.status_code == 200, r.text
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.gather(*workers)
    records += probes
    start = min(rec[0] for rec in records) + 3.0  # the first wave's TTFT is a queue
    before = [rec[1] for rec in probes if start < rec[0] < swap_window[0] and rec[3]]
    during = [rec[1] for rec in probes if swap_window[0] <= rec[0] <= swap_window[1] and rec[3]]

    def pct(values, q):
        return round(statistics.quantiles(values, n=100)[q - 1], 3) if len(values) >= 2 else None

    return {"swap_s": round(swap_window[1] - swap_window[0], 2), "failed": sum(not rec[3] for rec in records),
            "requests": len(records), "ttft_before_p50": pct(before, 50), "ttft_before_p99": pct(before, 99),
            "ttft_during_p50": pct(during, 50), "ttft_during_p99": pct(during, 99),
            "n_before": len(before), "n_during": len(during)}


async def _unload(base_url: str, model: str) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        r = await client.post("/admin/models/unload", json={"model": model})
        assert r.status_code == 200, r.text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--before-s", type=float, default=15.0)
    path = str(resolve_model_path("smollm2-135m"))
    engine = EngineConfig(model=path, cache=CacheConfig(kv_cache_memory_gib=0.25),
                          scheduler=SchedulerConfig(max_model_len=1024, max_num_seqs=32))
    parser.add_argument("--only-swap", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    result = {"load1": os.getloadavg()[0]}
    config = ServerConfig(port=0, served_model_names=("a",), models=(("b", path),), max_queue=None)
    with BackgroundServer(engine, config) as srv:
        registry = srv.state.registry
        result["load_s"] = round(registry.default.load_seconds, 2)
        if args.only_swap:  # and one model's throughput before and after it (a build's thread left behind?)
            asyncio.run(_unload(srv.base_url, "b"))
            result["before_swap"] = asyncio.run(_throughput(srv.base_url, ["a"], args.concurrency, args.output_len))
            result["swap"] = asyncio.run(_swap_under_load(srv.base_url, args.concurrency, args.output_len,
                                                          args.before_s, path))
            result["after_swap"] = asyncio.run(_throughput(srv.base_url, ["a"], args.concurrency, args.output_len))
            print(json.dumps(result))
            return
        for name in ("two_models", "one_model", "one_model_2c"):
            result[name] = []
        for _ in range(args.rounds):  # interleaved, so that a shared machine's load falls on each alike
            for name, models, concurrency in (("two_models", ["a", "b"], args.concurrency),
                                              ("one_model", ["a"], args.concurrency),
                                              ("one_model_2c", ["a"], 2 * args.concurrency)):
                result[name].append(asyncio.run(_throughput(srv.base_url, models, concurrency, args.output_len)))
        ratios = [two["tok_s"] / one["tok_s"] for two, one in zip(result["two_models"], result["one_model"])]
        result["two_vs_one"] = {"per_round": [round(r, 3) for r in ratios], "median": round(statistics.median(ratios), 3)}
        memory, rss = registry.resolve("b").memory_bytes, _rss()
        asyncio.run(_unload(srv.base_url, "b"))
        result["unload_model_mib"], result["unload_rss_drop_mib"] = memory >> 20, (rss - _rss()) >> 20
        result["swap"] = asyncio.run(_swap_under_load(srv.base_url, args.concurrency, args.output_len, args.before_s,
                                                      path))
    result["load2"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
