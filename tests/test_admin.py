"""server/registry/admin.py against files that are not models and reads that stall: a swap to a pipe, a device, a
folder, a socket, a file or folder that is no model, or a missing path answers 400 within 1 s with one body
(no oracle of the server's files),
and a swap whose reads stall fails after --load-read-timeout while the old weights keep serving, the
other requests' latency untouched (the step thread never waits on a read: loader/file_reads.py)."""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import threading
import time
from dataclasses import replace
from functools import partial

import httpx
import pytest

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from tinyserve.loader import model_loader
from tinyserve.loader.weights import TensorSource
from tinyserve.server.launcher import BackgroundServer

PROMPT, MAX_TOKENS = "The capital of France is", 8


def _server(folder: str, load_read_timeout: float = 30.0, engine_factory=None) -> BackgroundServer:
    engine_config = EngineConfig(model=folder, dtype="float32", device="cpu", cache=CacheConfig(num_blocks=64),
                                 scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=8),
                                 load_read_timeout=load_read_timeout)
    return BackgroundServer(engine_config, ServerConfig(port=0, warmup=False, served_model_names=("llama",),
                                                        enable_admin_api=True), engine_factory)


def _complete(base_url: str) -> str:
    body = {"model": "llama", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _swap(base_url: str, path: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(base_url + "/admin/models/swap", json={"model": "llama", "path": path}, timeout=timeout)


@pytest.fixture
def not_models(tmp_path) -> dict[str, str]:
    fifo = tmp_path / "f.gguf"
    os.mkfifo(fifo)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "s.gguf"))
    (tmp_path / "dir").mkdir()
    paths = {"fifo": str(fifo), "socket": str(tmp_path / "s.gguf"), "directory": str(tmp_path / "dir"),
             "missing": str(tmp_path / "missing.gguf")}
    if os.path.exists("/dev/zero"):
        paths["device"] = "/dev/zero"
    (tmp_path / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")  # a regular file, no model
    (tmp_path / "config_only").mkdir()  # a folder with a config.json and no weights
    (tmp_path / "config_only" / "config.json").write_text('{"auths": {"registry": "secret"}}')
    paths.update({"text file": str(tmp_path / "passwd"), "folder without weights": str(tmp_path / "config_only")})
    yield paths
    listener.close()


def test_a_swap_to_a_pipe_device_folder_socket_or_no_model_is_one_400_within_a_second(random_hf_folders,
                                                                                        not_models):
    with _server(random_hf_folders["llama"]) as srv:
        before = _complete(srv.base_url)
        bodies = {}
        for kind, path in not_models.items():
            start = time.monotonic()
            r = _swap(srv.base_url, path, timeout=5)
            assert time.monotonic() - start < 1.0, kind
            assert r.status_code == 400, (kind, r.text)
            error = r.json()["error"]
            bodies[kind] = {**error, "message": error["message"].replace(repr(path), "PATH")}
        assert all(body == bodies["missing"] for body in bodies.values()), bodies  # one answer: no oracle
        assert bodies["missing"]["code"] == "model_not_found" and bodies["missing"]["param"] == "path"
        assert _complete(srv.base_url) == before  # the old weights serve, the engine thread is free
        assert httpx.get(srv.base_url + "/v1/models").json()["data"][0]["state"] == "loaded"


def test_a_swap_that_does_not_fit_in_memory_is_a_507_naming_the_numbers(random_hf_folders):
    """The engine's memory check (engine/memory/fit_check.py) refuses the new model before its KV pool is
    allocated: 507 model_too_large with weights + KV pool + activations in MiB and the flags; the old weights
    keep serving."""
    from tinyserve.engine.loop.llm_engine import LLMEngine

    big = random_hf_folders["qwen"]

    def build(config: EngineConfig) -> LLMEngine:  # the new model asks for a pool larger than any machine's
        if config.model == big:
            config = replace(config, cache=replace(config.cache, num_blocks=None, kv_cache_memory_gib=1e6))
        return LLMEngine(config)

    with _server(random_hf_folders["llama"], engine_factory=build) as srv:
        before = _complete(srv.base_url)
        r = _swap(srv.base_url, big)
        assert r.status_code == 507, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"], error["type"]) == ("model_too_large", "model", "insufficient_storage")
        assert "does not fit in memory: weights" in error["message"]
        assert "KV pool 1024000000 MiB" in error["message"] and "--kv-cache-memory" in error["message"]
        assert _complete(srv.base_url) == before


class _StalledReads:
    """Makes the tensors of one checkpoint read as a hung mount does: each read blocks until released
    (then fails). `arm()` before each swap that should stall."""

    def __init__(self, monkeypatch, stalled_folder: str):
        self.arm()
        real = model_loader._read_checkpoint

        def read_checkpoint(path, model):
            checkpoint = real(path, model)
            if str(path) == stalled_folder:
                checkpoint.tensors = [(name, TensorSource(source.shape, partial(self._read, self.release)))
                                      for name, source in checkpoint.tensors]
            return checkpoint

        monkeypatch.setattr(model_loader, "_read_checkpoint", read_checkpoint)

    def arm(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def _read(self, release: threading.Event):
        self.entered.set()
        release.wait(120)
        raise OSError("released")


def test_a_swap_whose_reads_stall_fails_and_the_old_weights_keep_serving(random_hf_folders, monkeypatch):
    stall = _StalledReads(monkeypatch, random_hf_folders["qwen"])
    try:
        with _server(random_hf_folders["llama"], load_read_timeout=3.0) as srv:
            before = _complete(srv.base_url)
            start = time.monotonic()
            r = _swap(srv.base_url, random_hf_folders["qwen"])
            assert stall.entered.is_set()
            assert r.status_code == 422 and r.json()["error"]["code"] == "model_load_failed", r.text
            assert "stalled: no data within 3s" in r.json()["error"]["message"]
            assert time.monotonic() - start < 10
            assert _complete(srv.base_url) == before
            card = httpx.get(srv.base_url + "/v1/models").json()["data"][0]
            assert card["state"] == "loaded" and card["error"] is None
    finally:
        stall.release.set()


def _latencies(base_url: str, num_requests: int) -> list[float]:
    times = []
    for _ in range(num_requests):
        start = time.perf_counter()
        _complete(base_url)
        times.append(time.perf_counter() - start)
    return times


@pytest.mark.slow
def test_a_stalled_swap_leaves_other_requests_latency_alone(random_hf_folders, monkeypatch):
    """p50 of sequential requests while a swap is stalled in its reads, against the same run without it;
    the two alternate in rounds, so that the drift of a shared machine falls on both. The issue's bar:
    within 1.25x."""
    stall = _StalledReads(monkeypatch, random_hf_folders["qwen"])
    num_rounds, num_requests = 6, 8
    without, during = [], []
    try:
        with _server(random_hf_folders["llama"], load_read_timeout=120.0) as srv:
            _latencies(srv.base_url, 3)  # warm

            async def swap():
                async with httpx.AsyncClient(base_url=srv.base_url, timeout=180) as client:
                    return await client.post("/admin/models/swap",
                                             json={"model": "llama", "path": random_hf_folders["qwen"]})

            for _ in range(num_rounds):
                without += _latencies(srv.base_url, num_requests)
                stall.arm()
                result: list = []
                thread = threading.Thread(target=lambda: result.append(asyncio.run(swap())), daemon=True)
                thread.start()
                assert stall.entered.wait(60)
                during += _latencies(srv.base_url, num_requests)
                assert thread.is_alive()  # the whole window was inside the stall
                stall.release.set()  # the read fails: the swap fails, the old weights stay
                thread.join(60)
                assert result and result[0].status_code == 422, result
            ratio = statistics.median(during) / statistics.median(without)
            print(f"p50 latency: {statistics.median(without) * 1e3:.1f} ms without a swap, "
                  f"{statistics.median(during) * 1e3:.1f} ms with one stalled; ratio {ratio:.3f}")
            assert ratio <= 1.25
    finally:
        stall.release.set()
