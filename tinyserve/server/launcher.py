"""Running the app under uvicorn: `serve()` in the foreground with graceful SIGTERM / SIGINT handling,
and `BackgroundServer` in a thread (tests, benchmarks, notebooks).

Connections are bounded so that slow or idle peers cannot hold the server's sockets or memory.
uvicorn's h11 protocol closes a connection only when it sends nothing for timeout_keep_alive after a
response, and any byte resets that timer, so `_GuardedH11Protocol` adds: the same idle timer on a fresh
connection; a head deadline (body_read_timeout from the moment a connection starts waiting for a request)
that closes it if the request line and headers are not all in by then, or if a response went out before
its body (413, 503) and the body is still trickling in; and an OpenAI-shaped 503 for requests past
max_connections. A request head is capped at MAX_HEADER_BYTES (431), a body buffers at most uvicorn's
64 KiB before reading pauses, and the middleware gives the body its own deadline (408). A connection's
kernel send buffer is capped at SEND_BUFFER_BYTES: Linux grows it to 4 MiB for a peer that reads
nothing, which would let a stalled stream run hundreds of tokens per sample (and hold that memory)
before its writes wait and its request pauses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
import gc
import json
import logging
import re
import resource
import signal
import socket
import threading
import time
from http import HTTPStatus
from types import FrameType

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tinyserve.config import EngineConfig, ServerConfig
from tinyserve.loader.model_loader import resolve_model_path
from tinyserve.server.app import build_app
from tinyserve.server.errors import APIError, BadRequest, HeadersTooLarge, ServiceUnavailable
from tinyserve.server.state import ServerState

logger = logging.getLogger(__name__)
MAX_HEADER_BYTES = 16 * 1024  # request line + headers; a longer head gets 431 and the connection closes
# the kernel doubles it: 128 KiB in flight, 1.3 MB/s to a client 100 ms away, ~200 SSE chunks with logprobs
SEND_BUFFER_BYTES = 64 * 1024
WRITE_BUFFER_BYTES = 16 * 1024  # the transport's own buffer above the kernel's
GRACEFUL_CLOSE_S = 2  # after the drain, for responses already ending to flush before connections close
_HEAD_END = re.compile(rb"\n\r?\n")  # the blank line after the headers (h11 accepts bare \n too)


def _raw_response(error: APIError) -> bytes:
    """A whole response for a connection that has no request to answer through the app."""
    body = json.dumps(error.body()).encode()
    return (f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


_HEADERS_TOO_LARGE = _raw_response(HeadersTooLarge(f"the request line and headers exceed {MAX_HEADER_BYTES} bytes",
                                                   code="headers_too_large"))
_MALFORMED_REQUEST = _raw_response(BadRequest("malformed HTTP request", code="invalid_http"))
_TOO_MANY_CONNECTIONS = json.dumps(ServiceUnavailable("the server has too many connections; retry later",
                                                      code="too_many_connections").body()).encode()


class _GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines uvicorn lacks (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.head_timeout: float = config.head_timeout
        self.max_connections, self.limit_concurrency = self.limit_concurrency, None  # checked in _limited
        self.app = self._limited(self.app)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)  # then uvicorn's send waits (asyncio: 64 KiB)
        # uvicorn arms its idle timer only after a response; a fresh connection gets one too
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and not _head_fits(self.conn.trailing_data[0] + data):
            self.transport.write(_HEADERS_TOO_LARGE)
            self.transport.close()
            return
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        # uvicorn's own answer to a malformed request is plain text; every error body is OpenAI-shaped
        self.transport.write(_MALFORMED_REQUEST)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_head()

    def _await_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout, self._on_head_timeout)

    def _on_head_timeout(self) -> None:
        """Close when still waiting for a request head, or when the response went out before its body
        arrived (413, 503) and the body is still trickling in; a request in progress is the app's."""
        their, ours = self.conn.their_state, self.conn.our_state
        is_late_body = their is h11.SEND_BODY and ours in (h11.DONE, h11.MUST_CLOSE)
        if (their is h11.IDLE or is_late_body) and not self.transport.is_closing():
            logger.debug("closing a connection that sent no complete request within %gs", self.head_timeout)
            self.transport.close()

    def _limited(self, app):
        async def limited(scope, receive, send) -> None:
            # uvicorn's own check runs before this request's task exists; here the task already counts
            limit = self.max_connections
            if limit is not None and (len(self.connections) > limit or len(self.tasks) > limit):
                await send({"type": "http.response.start", "status": 503, "headers": [
                    (b"content-type", b"application/json"), (b"retry-after", b"1"), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": _TOO_MANY_CONNECTIONS})
                return
            await app(scope, receive, send)

        return limited


def _head_fits(pending: bytes) -> bool:
    """The request head in `pending` (bytes received while waiting for one) ends within
    MAX_HEADER_BYTES, or could still. h11's own limit holds only for a head that is still incomplete:
    one sent whole in a single read would pass it at any size."""
    return len(pending) <= MAX_HEADER_BYTES or _HEAD_END.search(pending, 0, MAX_HEADER_BYTES + 2) is not None


class _UvicornConfig(uvicorn.Config):
    def __init__(self, app, head_timeout: float, **kwargs):
        super().__init__(app, **kwargs)
        self.head_timeout = head_timeout  # read by _GuardedH11Protocol


class _DrainingServer(uvicorn.Server):
    """The first SIGTERM / SIGINT drains (new requests get 503 while the socket stays open, in-flight
    ones finish or are aborted after shutdown_timeout), stops the engine and exits 0. A second signal
    aborts what is still in flight at once (the streams still end with finish_reason abort and [DONE])
    and exits 128 + its number; a third stops waiting for connections to close."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self._num_signals = 0
        self._drain_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        self.state.on_fatal = self._fatal
        await super().startup(sockets)

    def _fatal(self) -> None:
        self.exit_code = 1
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: never uvicorn's handle_exit: it records the signal and re-raises it once serve() returns,
        # which would replace our exit code with a death by that signal
        self._num_signals += 1
        name = signal.Signals(sig).name
        if self._loop is None:  # not started: nothing to drain
            self.should_exit = True
        elif self._num_signals == 1:
            logger.info("received %s: draining (a second signal aborts the requests in flight)", name)
            self._loop.call_soon_threadsafe(self._start_drain)
        elif self._num_signals == 2:
            logger.warning("received %s again: aborting the requests in flight", name)
            self.exit_code = 128 + sig
            self._loop.call_soon_threadsafe(self.state.hurry)
        else:
            self.force_exit = True

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.state.close()  # drain, then stop the engine: uvicorn then only closes connections
        self.should_exit = True


def _uvicorn_config(app, config: ServerConfig, log_level: str) -> uvicorn.Config:
    return _UvicornConfig(
        app, head_timeout=config.body_read_timeout, host=config.host, port=config.port, log_level=log_level,
        access_log=False, lifespan="on", http=_GuardedH11Protocol, timeout_graceful_shutdown=GRACEFUL_CLOSE_S,
        limit_concurrency=config.max_connections, backlog=config.max_connections,
        timeout_keep_alive=config.keep_alive_timeout, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )


def _raise_open_file_limit(max_connections: int) -> None:
    """One descriptor per connection, plus the model's files and some slack."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new_soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
        if new_soft < wanted:
            logger.warning("open-file limit %d is below --max-connections %d + 256", new_soft, max_connections)


def serve(engine_config: EngineConfig, config: ServerConfig, log_level: str = "info",
          engine_factory: Callable[[EngineConfig], object] | None = None) -> int:
    """Blocks until shutdown; returns the process exit code: 0 after a drain (SIGTERM / SIGINT, also
    while the model is still loading), 1 if loading failed, 128 + N when a second signal N cut the drain
    short. (uvicorn exits 3 itself when the port cannot be bound.) `engine_factory` as in `build_app`."""
    if engine_factory is None:  # a wrong path fails here, in one line, before binding
        for source in (engine_config.model, *(path for _, path in config.models)):
            resolve_model_path(source)
    _raise_open_file_limit(config.max_connections)
    app = build_app(engine_config, config, engine_factory)
    server = _DrainingServer(_uvicorn_config(app, config, log_level), app.state.server)
    _freeze_startup_objects()
    server.run()
    return server.exit_code


def _freeze_startup_objects() -> None:
    """Move what the imports made (torch alone is ~165k objects) out of the collector's reach: a full
    collection walks every tracked object holding the GIL, so without this one pass stalled the event loop
    and every stream for 100-250 ms whenever a request allocated enough to trigger it. Objects made later
    (models, requests) stay collectable, so an unload still frees its reference cycles."""
    gc.collect()
    gc.freeze()


class BackgroundServer:
    """Runs the app in a daemon thread on host:port; `start()` blocks until it is ready (or failed)."""

    def __init__(self, engine_config: EngineConfig, config: ServerConfig, engine_factory=None):
        self.app = build_app(engine_config, config, engine_factory)
        self.state: ServerState = self.app.state.server
        self.server = uvicorn.Server(_uvicorn_config(self.app, config, "warning"))
        self.thread = threading.Thread(target=self._run, name="tinyserve-http", daemon=True)
        self.thread_error: BaseException | None = None  # what ended the thread (uvicorn exits on a bind error)

    def _run(self) -> None:
        try:
            self.server.run()
        except BaseException as exc:  # noqa: BLE001 - SystemExit included: start() reports it
            self.thread_error = exc

    @property
    def base_url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    @property
    def grpc_target(self) -> str:
        """host:port of the gRPC API (ServerConfig.grpc_port set)."""
        host = self.server.servers[0].sockets[0].getsockname()[0]
        return f"{host}:{self.app.state.grpc.port}"

    def start(self, timeout: float = 120.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while self.state.phase == "loading" or not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"server thread ended before it was ready: {self.thread_error!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {timeout:.0f} s (phase {self.state.phase})")
            time.sleep(0.05)
        if self.state.phase != "ready":
            raise RuntimeError(f"server failed to load: {self.state.load_error!r}")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
