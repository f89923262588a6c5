"""The memory series of /metrics (server/observability/memory_stats.py, engine/memory/process_memory.py): process RSS and
limit, weight and KV-pool bytes, KV blocks by state, engine alive; and /metrics before the model is ready."""

import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import start_default_model_server
from tinyserve.config import CacheConfig, EngineConfig, ServerConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.engine.memory.process_memory import device_memory, memory_limit_bytes, process_rss_bytes
from tinyserve.server.launcher import BackgroundServer

MODEL = "smollm2-135m"


def _series(text: str) -> dict[str, float]:
    """{'name{labels}': value} of an exposition."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([^#\s]\S*) (\S+)$", text, re.M)}


def test_process_rss_matches_proc_status_and_grows_with_an_allocation():
    status_kib = int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text())[1])
    assert abs(process_rss_bytes() - status_kib * 1024) < 32 << 20  # read at nearly the same moment
    before = process_rss_bytes()
    block = bytearray(b"\x01" * (256 << 20))  # written, so resident
    assert process_rss_bytes() - before > 200 << 20
    del block
    assert memory_limit_bytes() >= process_rss_bytes()
    assert device_memory() == []  # this CPU process never initialized CUDA


@pytest.fixture(scope="module")
def server(smollm2_loaded):
    srv = start_default_model_server(smollm2_loaded)
    yield srv
    srv.stop()


def test_memory_series_of_a_loaded_model(server, smollm2_loaded):
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hello there", "max_tokens": 3})
    assert r.status_code == 200
    series = _series(httpx.get(server.base_url + "/metrics").text)
    label = f'{{model_name="{MODEL}"}}'
    config = smollm2_loaded.config
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    engine = server.state.default.current.engine.engine
    num_blocks, block_size = engine.config.cache.num_blocks, engine.config.cache.block_size
    # float32 K and V of every layer, for every slot of every block
    assert series[f"tinyserve:kv_cache_bytes{label}"] == 2 * config.num_hidden_layers * config.num_key_value_heads \
        * head_dim * 4 * num_blocks * block_size
    params = sum(p.numel() * 4 for p in smollm2_loaded.model.parameters())
    assert 0.9 * params <= series[f"tinyserve:model_weight_bytes{label}"] <= 1.1 * params
    used = series[f'tinyserve:kv_cache_blocks{{model_name="{MODEL}",state="used"}}']
    free = series[f'tinyserve:kv_cache_blocks{{model_name="{MODEL}",state="free"}}']
    assert (used, free) == (0, num_blocks)  # the request ended: every block back in the pool
    assert series[f"tinyserve:kv_cache_cached_blocks{label}"] == engine.block_manager.num_cached_blocks
    assert series[f"tinyserve:engine_alive{label}"] == 1
    assert series["tinyserve:process_resident_memory_bytes"] > series[f"tinyserve:model_weight_bytes{label}"]
    assert series["tinyserve:memory_limit_bytes"] >= series["tinyserve:process_resident_memory_bytes"]


def test_metrics_answer_while_the_model_loads(smollm2_loaded):
    """The engine's build waits on an event: /metrics is 200 with the process's series, /health 503."""
    may_load = threading.Event()

    def slow_engine(cfg):
        assert may_load.wait(60)
        return LLMEngine(cfg, loaded=smollm2_loaded)

    srv = BackgroundServer(EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory_gib=0.05)),
                           ServerConfig(port=0, warmup=False), slow_engine)
    srv.thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.server.started:
            assert time.monotonic() < deadline, "the server never bound its socket"
            time.sleep(0.05)
        assert srv.state.phase == "loading"
        metrics = httpx.get(srv.base_url + "/metrics")
        assert metrics.status_code == 200
        series = _series(metrics.text)
        assert series["tinyserve:process_resident_memory_bytes"] > 0
        assert not any(name.startswith("tinyserve:engine_alive") for name in series)  # nothing loaded yet
        assert httpx.get(srv.base_url + "/health").status_code == 503
        assert httpx.get(srv.base_url + "/engine/stats").json()["phase"] == "loading"
    finally:
        may_load.set()
        srv.stop()


def _boom():
    raise AssertionError("simulated broken invariant")


def test_engine_alive_drops_to_zero_when_the_engine_dies(smollm2_loaded):
    """What the TinyserveEngineDead alert reads: 1 while the engine steps, 0 once a step raised."""
    srv = start_default_model_server(smollm2_loaded)
    try:
        alive = f'tinyserve:engine_alive{{model_name="{MODEL}"}}'
        assert _series(httpx.get(srv.base_url + "/metrics").text)[alive] == 1
        srv.state.engine.engine.step = _boom
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code >= 500
        assert _series(httpx.get(srv.base_url + "/metrics").text)[alive] == 0
        assert httpx.get(srv.base_url + "/engine/stats").json()["models"][0]["is_alive"] is False
    finally:
        srv.stop()
