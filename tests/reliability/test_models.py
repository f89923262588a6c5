"""Several models under load, on the default model (SmolLM2-135M Q4_1 GGUF) and a random qwen2 checkpoint
(tests/conftest.py): 16 streams split between the two each get their own model's greedy text; a swap
under 32 streams fails none of them, finishes each on the weights it started on, and hands the old
model's memory back to the kernel (process RSS)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

import httpx
import pytest

from tinyserve import LLM
from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from tinyserve.server.launcher import BackgroundServer
from tinyserve.types import SamplingParams

pytestmark = pytest.mark.reliability
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]
MAX_TOKENS = 24
ENGINE = EngineConfig(model="smollm2-135m", dtype="float32", device="cpu", cache=CacheConfig(kv_cache_memory_gib=0.25),
                      scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=32))


def _greedy(model: str) -> dict[str, str]:
    llm = LLM(model, dtype="float32", device="cpu", kv_cache_memory=0.05, max_model_len=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return {p: r.text for p, r in zip(PROMPTS, llm.generate(PROMPTS, params))}


@pytest.fixture(scope="module")
def alone(random_hf_folders) -> dict[str, dict[str, str]]:
    return {"smol": _greedy("smollm2-135m"), "qwen": _greedy(random_hf_folders["qwen"])}


async def _stream(client: httpx.AsyncClient, model: str, prompt: str) -> tuple[str, str | None, float]:
    """(text, finish reason, seconds to the first token)."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start, first, text, reason = time.perf_counter(), None, [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                first = first or time.perf_counter()
                text.append(choice["text"])
                reason = choice["finish_reason"] or reason
    return "".join(text), reason, (first or time.perf_counter()) - start


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_two_models_sixteen_streams_each_from_its_own(random_hf_folders, alone):
    config = ServerConfig(port=0, warmup=False, served_model_names=("smol",),
                          models=(("qwen", random_hf_folders["qwen"]),))
    with BackgroundServer(ENGINE, config) as srv:
        async def go():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=300) as client:
                jobs = [(m, p) for _ in range(2) for m in ("smol", "qwen") for p in PROMPTS]
                return jobs, await asyncio.gather(*(_stream(client, m, p) for m, p in jobs))

        jobs, results = asyncio.run(go())
    assert len(jobs) == 16
    assert [(text, reason) for text, reason, _ in results] == [(alone[m][p], "length") for m, p in jobs]


def test_swap_under_load_fails_nothing_and_returns_the_memory(random_hf_folders, alone):
    config = replace(ServerConfig(port=0, warmup=False, served_model_names=("a",), enable_admin_api=True),
                     drain_timeout=120)
    with BackgroundServer(ENGINE, config) as srv:
        slot = srv.state.registry.default

        async def go():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=300,
                                         limits=httpx.Limits(max_connections=64)) as client:
                before = [asyncio.ensure_future(_stream(client, "a", PROMPTS[i % 4])) for i in range(32)]
                while slot.engine.stats.num_running < 32:  # every one has started generating
                    await asyncio.sleep(0.01)
                old_memory, rss_loaded = slot.memory_bytes, _rss_bytes()
                start = time.perf_counter()
                swapped = await client.post("/admin/models/swap", json={"model": "a", "path": random_hf_folders["qwen"]})
                swap_s = time.perf_counter() - start
                old = await asyncio.gather(*before)
                new = await asyncio.gather(*(_stream(client, "a", p) for p in PROMPTS))
                return old, new, swapped, swap_s, old_memory, rss_loaded

        old, new, swapped, swap_s, old_memory, rss_loaded = asyncio.run(go())
        assert swapped.status_code == 200, swapped.text
        rss_after, new_memory = _rss_bytes(), slot.memory_bytes
    assert [(t, r) for t, r, _ in old] == [(alone["smol"][PROMPTS[i % 4]], "length") for i in range(32)]
    assert [t for t, _, _ in new] == [alone["qwen"][p] for p in PROMPTS]
    dropped = rss_loaded - rss_after
    print(f"\nswap under 32 streams: {swap_s:.2f}s; old weights + pool {old_memory / 2**20:.0f} MiB, RSS dropped "
          f"{dropped / 2**20:.0f} MiB (new model {new_memory / 2**20:.0f} MiB)")
    assert dropped + new_memory >= 0.8 * old_memory
