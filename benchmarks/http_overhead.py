"""What does the HTTP layer cost? One workload (N prompts, greedy, ignore_eos, fixed output length)
through the offline engine (max_num_seqs = C, all queued at once) and through `tinyserve serve` in a
subprocess driven by C concurrent streaming clients, in interleaved rounds. Prints one JSON line: output
tokens/s of both, their ratio, and the engine thread's mean step time in both runs (a step loop starved
by HTTP work shows up as longer steps, or as overhead around them).

The offline engine steps in a worker thread by default, as the server's engine does: on an oversubscribed
CPU, torch's intra-op threads called from the main thread were measured 3-10x slower per step than the
same steps from a worker thread, which would make the ratio measure threading rather than HTTP.

    .venv/bin/python benchmarks/http_overhead.py [--concurrency 16] [--num-prompts 32] [--output-len 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.types import SamplingParams

WORDS = "river stone cloud paper light garden winter music table window forest signal".split()


def _prompts(n: int) -> list[str]:
    return [f"Request {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(24)) for i in range(n)]


def offline_engine(args) -> LLMEngine:
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                          cache=CacheConfig(kv_cache_memory_gib=args.kv_cache_memory),
                          scheduler=SchedulerConfig(max_num_seqs=args.concurrency, max_model_len=args.max_model_len))
    engine = LLMEngine(config)
    engine.add_request("warmup", "Hello", SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def run_offline(engine: LLMEngine, args, prompts: list[str], round_index: int) -> dict:
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{round_index}-{i}", prompt, params)
    num_tokens = num_steps = 0
    step_s = 0.0
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outputs = engine.step()
        step_s += time.perf_counter() - t
        num_steps += 1
        num_tokens += sum(len(o.new_token_ids) for o in outputs)
    wall = time.perf_counter() - start
    return {"tokens": num_tokens, "seconds": wall, "mean_step_ms": 1000 * step_s / num_steps}


def _loop_counters(base: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        for name in ("engine_steps_total", "engine_step_seconds_total", "engine_loop_overhead_seconds_total"):
            if line.startswith(f"tinyserve:{name}{{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


async def _drive(base: str, prompts: list[str], args) -> int:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    total = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal total
        while not queue.empty():
            body = {"prompt": queue.get_nowait(), "max_tokens": args.output_len, "temperature": 0, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"usage":{' in line:
                        total += json.loads(line[6:])["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
    return total


@contextlib.contextmanager
def http_server(args):
    """`tinyserve serve` in a subprocess (its own GIL, as in production); yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tinyserve.cli", "serve", "--port", str(port), "--model", args.model,
           "--dtype", args.dtype, "--device", args.device, "--kv-cache-memory", str(args.kv_cache_memory),
           "--max-model-len", str(args.max_model_len), "--log-level", "warning"]
    server = subprocess.Popen(cmd)
    try:
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None:
                raise SystemExit("the server exited while loading")
            time.sleep(0.1)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=60)


def run_http(base: str, args, prompts: list[str]) -> dict:
    before = _loop_counters(base)
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    tokens = asyncio.run(_drive(base, prompts, args))
    wall = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    after = _loop_counters(base)
    steps = after["engine_steps_total"] - before["engine_steps_total"]
    step_s = after["engine_step_seconds_total"] - before["engine_step_seconds_total"]
    overhead_s = after["engine_loop_overhead_seconds_total"] - before["engine_loop_overhead_seconds_total"]
    client_cpu = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
    return {"tokens": tokens, "seconds": wall, "mean_step_ms": 1000 * step_s / steps,
            "loop_overhead_ms_per_step": 1000 * overhead_s / steps, "client_cpu_share": client_cpu / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--offline-in-main-thread", action="store_true",
                        help="step the offline engine in the main thread instead of a worker thread")
    args = parser.parse_args()
    prompts = _prompts(args.num_prompts)
    engine = offline_engine(args)
    offline, http = [], []
    with http_server(args) as base:
        for r in range(args.rounds):  # interleaved, so a noisy neighbour hits both modes alike
            if args.offline_in_main_thread:
                offline.append(run_offline(engine, args, prompts, r))
            else:  # like the server's engine thread (see the module docstring)
                with ThreadPoolExecutor(1) as pool:
                    offline.append(pool.submit(run_offline, engine, args, prompts, r).result())
            http.append(run_http(base, args, prompts))

    def tps(run: dict) -> float:
        return run["tokens"] / run["seconds"]

    def median(values: list[float]) -> float:
        return statistics.median(values)

    ratios = [tps(h) / tps(o) for o, h in zip(offline, http, strict=True)]
    print(json.dumps({
        "benchmark": "http_overhead", "model": args.model, "dtype": args.dtype, "device": args.device,
        "concurrency": args.concurrency, "num_prompts": args.num_prompts, "output_len": args.output_len,
        "rounds": args.rounds, "offline_thread": "main" if args.offline_in_main_thread else "worker",
        "offline_tokens_per_s": round(median([tps(o) for o in offline]), 1),
        "http_tokens_per_s": round(median([tps(h) for h in http]), 1),
        "http_over_offline": round(median(ratios), 3), "per_round_ratio": [round(x, 3) for x in ratios],
        "offline_mean_step_ms": round(median([o["mean_step_ms"] for o in offline]), 2),
        "http_mean_step_ms": round(median([h["mean_step_ms"] for h in http]), 2),
        "http_loop_overhead_ms_per_step": round(median([h["loop_overhead_ms_per_step"] for h in http]), 3),
        "client_cpu_share_of_one_core": round(median([h["client_cpu_share"] for h in http]), 2),
    }))


if __name__ == "__main__":
    main()
