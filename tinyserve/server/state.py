"""The server's life: loading -> ready -> draining -> stopped (or failed), and admission control.

One ServerState per app; the models it serves are a ModelRegistry of ModelSlots (one slot for a
one-model server: the same path). The start-up models load in the background after the socket is
bound, so /health can say 503 while they load; each runs a short warm-up generation before it counts as
loaded. The server is ready once every start-up model has loaded or failed, and fails (exit 1) only if
all of them failed. Draining (on SIGTERM / SIGINT) refuses new work with 503, lets in-flight requests
finish for up to shutdown_timeout seconds, then aborts the rest: their streams end with finish_reason
"abort" and `[DONE]`, from the engine if it applies the aborts within ABORT_GRACE_S, else ended on the
event loop (a hung step). `hurry()` (a second signal) cuts the wait short. Closing stops the engines
with a bounded join, so a hung step delays the exit by at most ENGINE_JOIN_TIMEOUT_S after the drain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Literal

from tinyserve.config import EngineConfig, ServerConfig
from tinyserve.engine.loop.async_engine import AsyncEngine
from tinyserve.server.errors import ServiceUnavailable
from tinyserve.server.registry.model_registry import ModelRegistry
from tinyserve.server.registry.model_slot import ServedModel, ModelSlot, drain

logger = logging.getLogger(__name__)
Phase = Literal["loading", "ready", "draining", "stopped", "failed"]
RANK_LOSS_EXIT_S = 3.0  # /health says 503 this long before a server that lost a rank exits


class ServerState:
    def __init__(self, engine_config: EngineConfig, config: ServerConfig,
                 engine_factory: Callable[[EngineConfig], object] | None = None):
        if engine_config.parallel.world_size > 1 and (config.models or config.models_dir):
            raise ValueError("tensor and pipeline parallel serve one model: without --models-dir, one --model")
        self.engine_config = engine_config
        self.config = config
        self.registry = ModelRegistry(engine_config, config, engine_factory)
        self.created = int(time.time())
        self.phase: Phase = "loading"
        self.load_error: BaseException | None = None  # the first start-up model's, when every one failed
        self.on_fatal: Callable[[], None] | None = None  # set by the launcher: exit when loading fails
        self._load_task: asyncio.Task | None = None
        self._rank_watch: asyncio.Task | None = None  # tensor / pipeline parallel: exit once a rank is lost
        self._is_hurried = False  # a second signal: abort in-flight requests now instead of waiting
        self._is_closed = False

    # the first model's view, for a one-model server and the routes that take no model

    @property
    def default(self) -> ModelSlot:
        return self.registry.default

    @property
    def engine(self) -> AsyncEngine | None:
        return self.default.engine

    @property
    def model_name(self) -> str:
        return self.default.name

    @property
    def metrics(self):
        return self.registry.metric_set

    # loading

    def start_loading(self) -> None:
        self._load_task = asyncio.create_task(self._load())
        self.registry.start()

    async def _load(self) -> None:
        errors = []
        for slot in self.registry.startup:
            try:
                await self.registry.load(slot)
            except Exception as exc:  # noqa: BLE001 - a bad model or setting: the slot says failed
                errors.append(exc)
        if errors and len(errors) == len(self.registry.startup):
            self.load_error, self.phase = errors[0], "failed"
            if self.on_fatal is not None:
                self.on_fatal()
        elif self.phase == "loading":
            self.phase = "ready"
            for slot in self.registry.startup:
                if slot.current is not None:
                    logger.info("ready: serving %s (context %d tokens)", slot.name, slot.current.max_model_len)
            if self.engine_config.parallel.world_size > 1 and self.engine is not None:
                self._rank_watch = asyncio.create_task(self._exit_when_engine_dies(self.engine))

    async def _exit_when_engine_dies(self, engine: AsyncEngine) -> None:
        """Tensor / pipeline parallel: an engine that died (a rank lost) cannot be rebuilt under a running
        server (its group is gone), so the server exits with status 1 for its supervisor to restart, after
        /health has said 503 for RANK_LOSS_EXIT_S (its streams have already ended with an error)."""
        while engine.is_alive:
            await asyncio.sleep(0.25)
        if self.phase != "ready":  # a shutdown stopped it
            return
        logger.error("the engine died (%s): exiting in %.0fs", engine.error, RANK_LOSS_EXIT_S)
        self.phase = "failed"
        await asyncio.sleep(RANK_LOSS_EXIT_S)
        if self.on_fatal is not None:
            self.on_fatal()

    async def wait_ready(self) -> None:
        if self._load_task is not None:
            await asyncio.shield(self._load_task)

    # admission

    def check_phase(self) -> None:
        if self.phase == "loading":
            raise ServiceUnavailable("the model is still loading", code="loading", retry_after=5)
        if self.phase in ("draining", "stopped"):
            raise ServiceUnavailable("the server is shutting down", code="shutting_down", retry_after=5)
        if self.phase == "failed":
            raise ServiceUnavailable("the engine is not running", code="engine_dead", retry_after=None)

    def admit(self, num_samples: int = 1) -> ServedModel | None:
        """Called before any parsing or tokenization: refuses at once when the server cannot take work,
        or, serving one model, when its queue is full (ModelSlot.admit: 503 when the request's samples
        would push the waiting ones past max_queue, 400 when they alone exceed it)."""
        try:
            self.check_phase()
        except ServiceUnavailable as exc:
            self.default.metrics.rejected(exc.code)
            raise
        if len(self.registry.slots) == 1 and self.default.current is not None:  # else loaded on demand
            return self.default.admit(num_samples)
        return None

    def request_timeout(self, requested: float | None) -> float | None:
        """A request's deadline in seconds from arrival: its own `timeout`, capped by --request-timeout."""
        limits = [t for t in (requested, self.config.request_timeout) if t is not None]
        return min(limits) if limits else None

    async def acquire(self, name: str | None, arrival: float, timeout: float | None) -> ServedModel:
        """After parsing: the load a request's `model` names (404 if none), as `acquire_slot`."""
        return await self.acquire_slot(self.registry.resolve(name), arrival, timeout)

    async def acquire_slot(self, slot: ModelSlot, arrival: float, timeout: float | None) -> ServedModel:
        """The load now serving `slot`, loaded on demand within the request's timeout (`request_timeout`),
        and admitted. Wrap the work up to Generation.start in its `pending()`."""
        self.check_phase()
        remaining = None if timeout is None else max(0.0, arrival + timeout - time.monotonic())
        return await self.registry.ensure_loaded(slot, remaining)

    def is_healthy(self, name: str | None = None) -> tuple[bool, str]:
        """The server's (ok while any model can serve: loaded and running, or unloaded) or one model's."""
        if self.phase != "ready":
            return False, self.phase
        if name is not None:
            return self.registry.resolve(name).health()
        statuses = [slot.health() for slot in self.registry.slots]
        return next((s for s in statuses if s[0]), statuses[0])

    # shutdown

    async def drain(self) -> None:
        """Refuse new work; wait for in-flight requests up to shutdown_timeout (or until `hurry()`);
        abort what is left and give its final outputs ABORT_GRACE_S to reach the clients."""
        if self.phase in ("draining", "stopped"):
            return
        self.phase = "draining"
        loads = [slot.current for slot in self.registry.slots if slot.current is not None]
        if not loads:
            return
        logger.info("draining: %d requests in flight, up to %.0fs", sum(m.num_in_flight for m in loads),
                    self.config.shutdown_timeout)
        await asyncio.gather(*(drain(m, self.config.shutdown_timeout, lambda: self._is_hurried) for m in loads))

    def hurry(self) -> None:
        """Stop waiting for in-flight requests: a running drain aborts them at once."""
        self._is_hurried = True

    async def close(self) -> None:
        """Drain, then stop the engines (idempotent); a hung step is abandoned after ENGINE_JOIN_TIMEOUT_S."""
        await self.drain()
        if self._is_closed:
            return
        self._is_closed = True
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        await self.registry.close(0.0, lambda: True)
        self.phase = "stopped"
