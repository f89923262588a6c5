"""Running the app under uvicorn: `serve()` in the foreground with graceful SIGTERM / SIGINT handling,
and `BackgroundServer` in a thread (tests, benchmarks, notebooks)."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from types import FrameType

import uvicorn

from tinyserve.config import EngineConfig, ServerConfig
from tinyserve.loader.model_loader import resolve_model_path
from tinyserve.server.app import build_app
from tinyserve.server.state import ServerState

logger = logging.getLogger(__name__)


class _DrainingServer(uvicorn.Server):
    """The first SIGTERM / SIGINT drains (new requests get 503 while the socket stays open, in-flight
    ones finish or are aborted after shutdown_timeout) and then exits 0; a second one exits at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.exit_code = 0
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
        if self._drain_task is not None or self._loop is None:
            super().handle_exit(sig, frame)  # second signal, or not started yet: uvicorn's own exit
            return
        logger.info("received %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.state.drain()
        self.should_exit = True


def _uvicorn_config(app, config: ServerConfig, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=5, lifespan="on")


def serve(engine_config: EngineConfig, config: ServerConfig, log_level: str = "info") -> int:
    """Blocks until shutdown; returns the process exit code (0 after a graceful drain, 1 if loading failed)."""
    resolve_model_path(engine_config.model)  # a wrong path fails here, in one line, before binding
    app = build_app(engine_config, config)
    server = _DrainingServer(_uvicorn_config(app, config, log_level), app.state.server)
    server.run()
    return server.exit_code


class BackgroundServer:
    """Runs the app in a daemon thread on host:port; `start()` blocks until it is ready (or failed)."""

    def __init__(self, engine_config: EngineConfig, config: ServerConfig, engine_factory=None):
        self.app = build_app(engine_config, config, engine_factory)
        self.state: ServerState = self.app.state.server
        self.server = uvicorn.Server(_uvicorn_config(self.app, config, "warning"))
        self.thread = threading.Thread(target=self.server.run, name="tinyserve-http", daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self, timeout: float = 120.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while self.state.phase == "loading" or not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"server did not start: {self.state.load_error!r}")
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
