"""The HTTP server with tensor / pipeline parallel ranks (SmolLM2's 9 heads split 3 ways, its 30 layers 2
ways): the single-process server's greedy, streaming, overload and drain cases, a rank killed mid-stream,
and two torchrun "nodes" on loopback.

In-process servers (BackgroundServer) start their other ranks as subprocesses, as `tinyserve serve` does;
the drain, kill and torchrun cases run `tinyserve serve` itself.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from test_server import MODEL, PROMPT, _wait_idle
from test_server_lifecycle import (SERVE, _exit_code_within, _free_port, _serving, _Stream, _wait_ready,
                                   short_and_long_streams)
from tinyserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, ServerConfig
from tinyserve.server.launcher import BackgroundServer


def _engine(tp: int = 1, pp: int = 1, **scheduler) -> EngineConfig:
    return EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory_gib=0.25),
                        scheduler=SchedulerConfig(max_model_len=2048, **scheduler), parallel=ParallelConfig(tp, pp))


# NOTE: one server at a time in this process (a process belongs to one torch.distributed group): class- and
# function-scoped fixtures, each server stopped (its ranks sent home) before the next starts

@pytest.fixture(scope="class")
def tp3_server():
    srv = BackgroundServer(_engine(tp=3), ServerConfig(port=0, warmup=False)).start(timeout=300)
    yield srv
    srv.stop()


@pytest.fixture
def small_pp2_server():
    """Two sequences at a time, two waiting at most (test_server's small_server), over two stages."""
    srv = BackgroundServer(_engine(pp=2, max_num_seqs=2), ServerConfig(port=0, warmup=False, max_queue=2))
    srv.start(timeout=300)
    yield srv
    srv.stop()


class TestTensorParallel3:
    def test_greedy_and_stop_string(self, tp3_server):
        client = openai.OpenAI(base_url=tp3_server.base_url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
        assert r.choices[0].text.startswith(" Paris") and r.choices[0].finish_reason == "length"
        stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=["."])
        assert stopped.choices[0].text == " Paris" and stopped.choices[0].finish_reason == "stop"

    def test_streaming_counts_tokens_and_frees_blocks(self, tp3_server):
        client = openai.OpenAI(base_url=tp3_server.base_url + "/v1", api_key="none", max_retries=0)
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0, logprobs=0,
                                                stream=True, stream_options={"include_usage": True}))
        tokens = [t for c in chunks[:-1] for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
        assert chunks[-1].usage.completion_tokens == len(tokens) == 7
        assert "".join(ch.text for c in chunks[:-1] for ch in c.choices) == "".join(tokens)
        _wait_idle(tp3_server, 5)


def test_pp2_overload_burst_gets_503_then_recovers(small_pp2_server):
    client = openai.AsyncOpenAI(base_url=small_pp2_server.base_url + "/v1", api_key="none", max_retries=0)

    async def one(i):
        try:
            r = await client.completions.create(model=MODEL, prompt=f"Request {i}:", max_tokens=8,
                                                extra_body={"ignore_eos": True})
            return "ok", r.choices[0].finish_reason
        except openai.InternalServerError as exc:
            assert exc.status_code == 503 and exc.body["code"] == "overloaded"
            return "503", None

    async def burst():
        return await asyncio.gather(*(one(i) for i in range(6)))  # 3 x max_queue

    results = asyncio.run(burst())
    assert sum(r == ("ok", "length") for r in results) >= 2 and sum(r[0] == "503" for r in results) >= 2, results
    _wait_idle(small_pp2_server, 5)
    after = httpx.post(small_pp2_server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert after.status_code == 200


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (the ranks `tinyserve serve` started)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited: its parent has not reaped it yet
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_drains_with_pp2_and_leaves_no_rank_behind():
    with _serving("--shutdown-timeout", "8", "--pipeline-parallel-size", "2") as (proc, base):
        _wait_ready(base, proc)
        ranks = _children(proc.pid)
        assert len(ranks) == 1
        short, long = short_and_long_streams(base, 60)
        proc.send_signal(signal.SIGTERM)
        short.join(30)
        assert short.events[-1] == "[DONE]" and short.finish_reason() == "length"
        long.join(30)
        assert long.events[-1] == "[DONE]" and long.finish_reason() == "abort"
        assert _exit_code_within(proc, 30) == 0
        assert not any(_alive(pid) for pid in ranks)


def test_a_killed_rank_ends_the_stream_with_an_error_and_the_server_exits():
    """Tensor parallel over 3 ranks, one killed mid-stream: the other one exits as well as the server."""
    with _serving("--tensor-parallel-size", "3") as (proc, base):
        _wait_ready(base, proc)
        ranks = _children(proc.pid)
        assert len(ranks) == 2
        stream = _Stream(base, 1500)
        stream.start()
        assert stream.first_token.wait(60)
        os.kill(ranks[0], signal.SIGKILL)
        killed = time.monotonic()
        stream.join(30)
        assert stream.events[-1] == "[DONE]" and "error" in json.loads(stream.events[-2])
        statuses = []
        while time.monotonic() - killed < 10:
            try:
                statuses.append(httpx.get(base + "/health", timeout=2).status_code)
            except httpx.TransportError:
                break  # already exited
            if statuses[-1] == 503:
                break
            time.sleep(0.2)
        assert statuses and statuses[-1] == 503, statuses
        assert _exit_code_within(proc, 20) == 1
        assert "the engine died" in proc.stdout.read()
        deadline = time.monotonic() + 10
        while _alive(ranks[1]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(ranks[1])


def test_two_torchrun_nodes_on_loopback_serve_one_model():
    """`torchrun --nnodes 2`, one process each, ranks 0 and 1 on 127.0.0.1: a pipeline stage each."""
    port, rendezvous = _free_port(), _free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(rendezvous)]
    serve = ["-m", "tinyserve.cli", *SERVE[3:], "--pipeline-parallel-size", "2", "--port", str(port)]
    nodes = [subprocess.Popen([*torchrun, "--node-rank", str(n), *serve], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for n in (0, 1)]
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, nodes[0])
        r = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(" Paris")
        # rank 0's server (torchrun's child) drains, exits 0 and sends rank 1 home; each torchrun then ends
        # with its worker's status (a signal to torchrun itself would end it with its own status 1)
        (server,) = _children(nodes[0].pid)
        os.kill(server, signal.SIGTERM)
        assert _exit_code_within(nodes[0], 60) == 0
        assert _exit_code_within(nodes[1], 60) == 0
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
