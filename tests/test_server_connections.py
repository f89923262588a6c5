"""Slow and idle peers against a live server, over raw sockets: a body trickled at a few bytes a second
gets 408 and its connection is closed, so do a trickled request head, a fresh connection that sends
nothing and one idle after its response; a body sent after an early answer is not read forever;
connections past max_connections get an OpenAI-shaped 503; normal requests keep working meanwhile."""

import json
import socket
import threading
import time

import httpx
import pytest

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from tinyserve.request_limits import RequestLimits
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.server.launcher import MAX_HEADER_BYTES, BackgroundServer, _GuardedH11Protocol, _uvicorn_config

BODY_READ_TIMEOUT = 3.0
KEEP_ALIVE_TIMEOUT = 1.0
MAX_CONNECTIONS = 8
MAX_BODY = 64 * 1024
TRICKLE_S = 0.25  # seconds between two bytes of a slow peer
POST_HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\n\r\n")


@pytest.fixture(scope="module")
def server(smollm2_loaded):
    engine = EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory_gib=0.05),
                          scheduler=SchedulerConfig(max_model_len=512))
    config = ServerConfig(port=0, warmup=False, body_read_timeout=BODY_READ_TIMEOUT,
                          keep_alive_timeout=KEEP_ALIVE_TIMEOUT, max_connections=MAX_CONNECTIONS,
                          limits=RequestLimits(max_body_bytes=MAX_BODY))
    srv = BackgroundServer(engine, config, lambda cfg: LLMEngine(cfg, loaded=smollm2_loaded)).start()
    yield srv
    srv.stop()


def _connect(srv) -> socket.socket:
    host, port = srv.server.servers[0].sockets[0].getsockname()[:2]
    return socket.create_connection((host, port), timeout=TRICKLE_S)


def _trickle(sock: socket.socket, payload: bytes, limit_s: float) -> tuple[bytes, float]:
    """Send `payload` a byte at a time, reading whatever comes back, until the server closes the
    connection or `limit_s` passes. Returns what was read and the seconds until the close (inf: open)."""
    start, received = time.monotonic(), b""
    for i in range(10**9):
        if time.monotonic() - start > limit_s:
            return received, float("inf")
        try:
            if i < len(payload):
                sock.send(payload[i:i + 1])
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except OSError:  # reset, or the write side already shut
            return received, time.monotonic() - start
        if not chunk:
            return received, time.monotonic() - start
        received += chunk


def _closed_after(sock: socket.socket, limit_s: float) -> float:
    """Seconds until the server closes an idle connection (inf: still open after limit_s)."""
    return _trickle(sock, b"", limit_s)[1]


def _status_and_json(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_a_slow_body_gets_408_and_then_the_connection_closes(server):
    with _connect(server) as sock:
        sock.sendall(POST_HEAD % 200)
        response, closed_s = _trickle(sock, b'{"prompt": "' + b"x" * 200, limit_s=3 * BODY_READ_TIMEOUT)
    status, body = _status_and_json(response)
    assert status == 408 and body["error"]["code"] == "body_timeout", response
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert b"connection: close" in response.lower()
    assert BODY_READ_TIMEOUT - 0.5 < closed_s < BODY_READ_TIMEOUT + 2


def test_a_slow_request_head_is_closed_within_the_read_timeout(server):
    # each byte would reset uvicorn's own idle timer: only the head deadline closes this one
    with _connect(server) as sock:
        response, closed_s = _trickle(sock, b"GET /version HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 100,
                                      limit_s=3 * BODY_READ_TIMEOUT)
    assert response == b"" and closed_s < BODY_READ_TIMEOUT + 2


def test_idle_connections_are_closed_after_the_keep_alive_timeout(server):
    with _connect(server) as fresh:  # never sends a byte
        assert _closed_after(fresh, limit_s=3 * BODY_READ_TIMEOUT) < KEEP_ALIVE_TIMEOUT + 1
    with _connect(server) as used:
        used.sendall(b"GET /version HTTP/1.1\r\nHost: t\r\n\r\n")
        response, _ = _trickle(used, b"", limit_s=0.5)  # the response; the connection stays open
        assert response.startswith(b"HTTP/1.1 200")
        assert _closed_after(used, limit_s=3 * BODY_READ_TIMEOUT) < KEEP_ALIVE_TIMEOUT + 1


def test_a_body_trickled_after_an_early_answer_is_cut_off(server):
    with _connect(server) as sock:  # 413 at once from Content-Length; the client keeps sending anyway
        sock.sendall(POST_HEAD % (4 * MAX_BODY))
        response, closed_s = _trickle(sock, b"x" * 1000, limit_s=3 * BODY_READ_TIMEOUT)
    assert response.startswith(b"HTTP/1.1 413")
    assert closed_s < BODY_READ_TIMEOUT + 2


@pytest.mark.parametrize("in_pieces", [False, True])
def test_an_oversized_request_head_gets_431_and_the_connection_closes(server, in_pieces):
    head = b"GET /version HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1024) + b"\r\n\r\n"
    with _connect(server) as sock:
        for start in range(0, len(head), 4096 if in_pieces else len(head)):
            sock.sendall(head[start:start + (4096 if in_pieces else len(head))])
            time.sleep(0.05 if in_pieces else 0)
        response, closed_s = _trickle(sock, b"", limit_s=3)
    status, body = _status_and_json(response)
    assert status == 431 and body["error"]["code"] == "headers_too_large" and closed_s < 3
    assert set(body["error"]) == {"message", "type", "param", "code"}
    with _connect(server) as sock:  # a head just under the limit is served, in one read or several
        sock.sendall(b"GET /version HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES - 200) + b"\r\n\r\n")
        assert _trickle(sock, b"", limit_s=0.5)[0].startswith(b"HTTP/1.1 200")


def test_a_malformed_request_gets_an_openai_shaped_400(server):
    with _connect(server) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        response, closed_s = _trickle(sock, b"", limit_s=3)
    status, body = _status_and_json(response)
    assert status == 400 and body["error"]["code"] == "invalid_http" and closed_s < 3
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_connections_past_the_limit_get_an_openai_shaped_503(server):
    idle = [_connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.1)  # all accepted; each stays open for KEEP_ALIVE_TIMEOUT
        r = httpx.get(server.base_url + "/version", timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["code"] == "too_many_connections" and set(error) == {"message", "type", "param", "code"}
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.1)
    assert httpx.get(server.base_url + "/version", timeout=5).status_code == 200


def test_normal_requests_are_served_while_slow_peers_trickle(server):
    results: list[bytes] = []

    def slow_peer() -> None:
        with _connect(server) as sock:
            sock.sendall(POST_HEAD % 200)
            results.append(_trickle(sock, b"x" * 200, limit_s=3 * BODY_READ_TIMEOUT)[0])

    peers = [threading.Thread(target=slow_peer) for _ in range(4)]
    for peer in peers:
        peer.start()
    time.sleep(0.3)
    start = time.monotonic()
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert time.monotonic() - start < BODY_READ_TIMEOUT  # not queued behind the slow peers
    for peer in peers:
        peer.join()
    assert len(results) == 4 and all(res.startswith(b"HTTP/1.1 408") for res in results)
    stats = server.state.engine.stats
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks


def test_uvicorn_is_configured_from_the_server_config():
    config = ServerConfig(max_connections=100, keep_alive_timeout=7.0, body_read_timeout=11.0)
    uv = _uvicorn_config(None, config, "warning")
    assert uv.http is _GuardedH11Protocol and uv.head_timeout == 11.0
    assert uv.limit_concurrency == 100 and uv.backlog == 100 and uv.timeout_keep_alive == 7.0
    assert uv.h11_max_incomplete_event_size == MAX_HEADER_BYTES
