"""A fake OpenAI-compatible streaming server with controlled timings, to test the load generator and to
measure its own overhead without a model. Stdlib asyncio only (HTTP/1.1 keep-alive, chunked SSE).

Each completion streams exactly max_tokens tokens (" tok"), the first after `ttft_s`, then one chunk of
`tokens_per_chunk` tokens every `itl_s`, sleeping to absolute deadlines so that timings do not drift.
Failure modes: every k-th request refused with 503, load shedding above `max_concurrent`, or the
connection cut after `drop_after_tokens` tokens.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FakeServerConfig:
    ttft_s: float = 0.0
    itl_s: float = 0.0
    tokens_per_chunk: int = 1
    fail_every: int = 0  # every k-th request gets a 503 (0: never)
    max_concurrent: int | None = None  # a request arriving when this many are open gets a 503
    drop_after_tokens: int | None = None  # cut the connection mid-stream after this many tokens
    model: str = "fake-model"


@dataclass
class FakeServerStats:
    bodies: list[dict] = field(default_factory=list)  # every request body received, in arrival order
    num_in_flight: int = 0
    peak_in_flight: int = 0


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(obj: dict | str) -> bytes:
    payload = obj if isinstance(obj, str) else json.dumps(obj)
    return _chunked(f"data: {payload}\n\n".encode())


class FakeOpenAIServer:
    def __init__(self, config: FakeServerConfig | None = None, host: str = "127.0.0.1", port: int = 0):
        self.config = config or FakeServerConfig()
        self.host, self.port = host, port
        self.stats = FakeServerStats()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()  # open connections, closed on close()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:  # keep-alive: one request after another on this connection
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, path, _ = head[0].split(" ", 2)
                headers = dict(line.split(":", 1) for line in head[1:] if ":" in line)
                headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if not await self._route(method, path, body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _route(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
        if method == "GET" and path == "/v1/models":
            models = {"object": "list", "data": [{"id": self.config.model, "object": "model"}]}
            return await self._respond(writer, 200, models)
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            return await self._complete(json.loads(body), path.endswith("chat/completions"), writer)
        return await self._respond(writer, 404, {"error": {"message": f"no route {method} {path}"}})

    async def _respond(self, writer: asyncio.StreamWriter, status: int, obj: dict) -> bool:
        data = json.dumps(obj).encode()
        writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (status, len(data), data))
        await writer.drain()
        return True

    async def _complete(self, body: dict, is_chat: bool, writer: asyncio.StreamWriter) -> bool:
        stats, config = self.stats, self.config
        stats.bodies.append(body)
        overloaded = config.max_concurrent is not None and stats.num_in_flight >= config.max_concurrent
        if (config.fail_every and len(stats.bodies) % config.fail_every == 0) or overloaded:
            return await self._respond(writer, 503, {"error": {"message": "overloaded", "code": 503}})
        stats.num_in_flight += 1
        stats.peak_in_flight = max(stats.peak_in_flight, stats.num_in_flight)
        try:
            return await self._stream(body, is_chat, writer)
        finally:
            stats.num_in_flight -= 1

    async def _stream(self, body: dict, is_chat: bool, writer: asyncio.StreamWriter) -> bool:
        config = self.config
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        start, num_tokens, sent = time.perf_counter(), int(body.get("max_tokens") or 16), 0
        while sent < num_tokens:
            if config.drop_after_tokens is not None and sent >= config.drop_after_tokens:
                writer.transport.abort()
                return False
            deadline = start + config.ttft_s + (sent // config.tokens_per_chunk) * config.itl_s
            await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
            n = min(config.tokens_per_chunk, num_tokens - sent)
            sent += n
            writer.write(_event(self._chunk(" tok" * n, None, is_chat)))
            await writer.drain()
        writer.write(_event(self._chunk("", "length", is_chat)))
        if (body.get("stream_options") or {}).get("include_usage"):
            prompt_tokens = len(str(body.get("prompt") or body.get("messages")).split())
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": num_tokens,
                     "total_tokens": prompt_tokens + num_tokens}
            writer.write(_event({"object": "text_completion", "model": config.model, "choices": [], "usage": usage}))
        writer.write(_event("[DONE]") + b"0\r\n\r\n")
        await writer.drain()
        return True

    def _chunk(self, text: str, finish_reason: str | None, is_chat: bool) -> dict:
        if is_chat:
            choice = {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish_reason}
            return {"object": "chat.completion.chunk", "model": self.config.model, "choices": [choice]}
        choice = {"index": 0, "text": text, "finish_reason": finish_reason}
        return {"object": "text_completion", "model": self.config.model, "choices": [choice]}


class FakeServerThread:
    """Runs a FakeOpenAIServer on its own event loop in a daemon thread: `with FakeServerThread(cfg) as url`."""

    def __init__(self, config: FakeServerConfig | None = None, port: int = 0):
        self.server = FakeOpenAIServer(config, port=port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fake-openai-server")

    def __enter__(self) -> str:
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout=10)

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
