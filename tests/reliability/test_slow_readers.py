"""Slow and idle peers: 200 streams (n=16, max_tokens 1,000, logprobs 5) whose clients read nothing
for 60 s, 2,000 idle connections and 200 request bodies sent at 1 byte/s, all at once, with the
server's default limits. What must hold (issue 14's slow-reader bar): the server's RSS grows by
< 500 MiB, a normal client beside them keeps its TTFT p99 under 2 s, and every slow peer is closed by the
server with its blocks freed."""

from __future__ import annotations

import asyncio
import json
import math
import resource
import socket
import statistics
import threading
import time

import httpx
import pytest

from .conftest import TINY_ENGINE, tiny_server

NUM_SLOW_STREAMS = 200
NUM_IDLE = 2000
NUM_SLOW_BODIES = 200
HOLD_S = 60.0
MAX_LEN = 1100  # max_tokens 1,000 must fit the context


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    return s


def _request(path: str, body: bytes, content_length: int | None = None) -> bytes:
    length = len(body) if content_length is None else content_length
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _is_closed_by_server(s: socket.socket, timeout: float = 5.0) -> bool:
    """Drain what the server sent; True once it has closed its end (EOF or reset)."""
    s.settimeout(timeout)
    try:
        while s.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except (socket.timeout, OSError):
        return False


def _trickle(sockets: list[socket.socket], stop: threading.Event) -> None:
    """1 byte per second per body, until the server closes them or `stop`."""
    while not stop.wait(1.0):
        for s in sockets:
            try:
                s.send(b" ")
            except OSError:
                pass


async def _normal_ttfts(base_url: str, until: float, refusals: list[str]) -> list[float]:
    ttfts, began = [], time.monotonic()
    body = {"prompt": "a normal client", "max_tokens": 4, "stream": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        while time.monotonic() < until:
            start = time.monotonic()
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code == 503:  # past --max-connections until the idle peers time out: retry
                    refusals.append(json.loads(await r.aread())["error"]["code"])
                    await asyncio.sleep(0.5)
                    continue
                assert r.status_code == 200, await r.aread()
                first_token_at = None
                async for line in r.aiter_lines():  # read to the end: the next request reuses the connection
                    if (first_token_at is None and line.startswith("data: {")
                            and json.loads(line[6:])["choices"][0]["text"]):
                        first_token_at = time.monotonic()
                assert first_token_at is not None, "a normal stream ended without any text"
                ttfts.append(first_token_at - start)
                if ttfts[-1] > 0.5:
                    print(f"normal request at +{start - began:.1f} s: TTFT {ttfts[-1]:.2f} s")
            await asyncio.sleep(0.5)
    return ttfts


def _nearest_rank_p99(values: list[float]) -> float:
    """The smallest value at or above 99% of the samples: of 100+ requests, one may be slow (a p99, not a
    max; statistics.quantiles interpolates toward the largest sample, so one 2 s hiccup of the host in
    100 requests failed a bar that 99 fast requests met)."""
    ordered = sorted(values)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


def _poll(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_a_stalled_reader_is_paused_holds_nothing_and_is_closed_after_its_write_timeout(default_tokenizer):
    """One stream (n=4) whose client reads nothing: its writes block, its samples are paused within a
    few steps with every block free, the engine thread sleeps instead of stepping, a normal request is
    served meanwhile, and after stream_write_timeout the server closes the stream."""
    with tiny_server(default_tokenizer, stream_write_timeout=4.0) as server:
        port = int(server.base_url.rsplit(":", 1)[1])
        body = json.dumps({"prompt": "stalled", "n": 4, "max_tokens": 120, "logprobs": 5,
                           "ignore_eos": True, "stream": True}).encode()
        stalled = _connect(port, rcvbuf=4096)
        stalled.sendall(_request("/v1/completions", body) + body)
        scheduler = server.llm_engine.scheduler
        assert _poll(lambda: scheduler.num_paused == 4, 10), "the stalled request was not paused"
        assert server.num_free_blocks == server.num_blocks
        before = server.state.engine.loop_stats  # the engine thread's busy time grows only while it loops
        time.sleep(0.5)
        after = server.state.engine.loop_stats
        busy = after.step_seconds + after.overhead_seconds - before.step_seconds - before.overhead_seconds
        assert busy < 0.05, f"the engine thread spun on paused work ({busy:.2f} s busy of 0.5 s)"
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "a normal client", "max_tokens": 4},
                       timeout=10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert scheduler.num_paused == 4  # the normal request went past it, and it stays paused
        assert _is_closed_by_server(stalled, timeout=10.0)
        assert _poll(lambda: server.state.engine.num_in_flight == 0 and not scheduler.has_unfinished_requests(), 5)
        assert server.num_free_blocks == server.num_blocks
        stalled.close()


@pytest.mark.reliability  # ~70 s: CI runs it after the default suite
def test_slow_readers_idle_connections_and_slow_bodies(default_tokenizer):
    from dataclasses import replace

    # both ends of 2,400 connections live in this process (conftest raised the soft descriptor limit)
    needed = 2 * (NUM_SLOW_STREAMS + NUM_IDLE + NUM_SLOW_BODIES) + 512
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        pytest.skip(f"needs {needed} open files, this machine allows {soft}")

    engine_config = replace(TINY_ENGINE, scheduler=replace(TINY_ENGINE.scheduler, max_model_len=MAX_LEN))
    with tiny_server(default_tokenizer, engine_config=engine_config, max_position_embeddings=MAX_LEN) as server:
        port = int(server.base_url.rsplit(":", 1)[1])
        rss_before = _rss_mib()
        stream_body = json.dumps({"prompt": "slow reader", "n": 16, "max_tokens": 1000, "logprobs": 5,
                                  "ignore_eos": True, "stream": True}).encode()
        slow_streams = []
        for _ in range(NUM_SLOW_STREAMS):
            s = _connect(port, rcvbuf=4096)
            s.sendall(_request("/v1/completions", stream_body) + stream_body)
            slow_streams.append(s)
        idle = [_connect(port) for _ in range(NUM_IDLE)]
        slow_bodies = []
        for _ in range(NUM_SLOW_BODIES):
            s = _connect(port)
            s.sendall(_request("/v1/completions", b"", content_length=1000))
            slow_bodies.append(s)
        stop = threading.Event()
        trickler = threading.Thread(target=_trickle, args=(slow_bodies, stop), daemon=True)
        trickler.start()
        peak_rss = [rss_before]

        def sample_rss():
            while not stop.wait(0.5):
                peak_rss.append(_rss_mib())

        threading.Thread(target=sample_rss, daemon=True).start()
        refusals: list[str] = []
        ttfts = asyncio.run(_normal_ttfts(server.base_url, time.monotonic() + HOLD_S, refusals))
        stop.set()
        trickler.join()
        growth = max(peak_rss) - rss_before
        p99 = _nearest_rank_p99(ttfts)
        print(f"slow readers: RSS {rss_before:.0f} MiB -> peak +{growth:.0f} MiB; normal TTFT p50 "
              f"{statistics.median(ttfts) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms over {len(ttfts)} requests; "
              f"refused first: {refusals}")
        closed = {name: sum(_is_closed_by_server(s, 2.0) for s in group)
                  for name, group in (("slow streams", slow_streams), ("idle", idle), ("slow bodies", slow_bodies))}
        for group in (slow_streams, idle, slow_bodies):
            for s in group:
                s.close()
        print(f"closed by the server: {closed}")
        assert growth < 500, growth
        assert len(ttfts) >= 100, f"too few normal requests for a p99: {len(ttfts)}"
        assert p99 < 2.0, sorted(ttfts)[-5:]
        assert closed == {"slow streams": NUM_SLOW_STREAMS, "idle": NUM_IDLE, "slow bodies": NUM_SLOW_BODIES}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (server.state.engine.num_in_flight
                                                or server.num_free_blocks != server.num_blocks):
            time.sleep(0.1)
        assert server.state.engine.num_in_flight == 0
        assert server.num_free_blocks == server.num_blocks
        assert server.state.engine.is_alive
