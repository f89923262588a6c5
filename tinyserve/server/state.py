"""The server's life: loading -> ready -> draining -> stopped (or failed), and admission control.

One ServerState per app. The model loads in a worker thread after the socket is bound, so /health can
say 503 while it loads; a short warm-up generation runs before the phase becomes ready. Draining (on
SIGTERM / SIGINT) refuses new work with 503, lets in-flight requests finish for up to shutdown_timeout
seconds, then aborts the rest: their streams end with finish_reason "abort" and `[DONE]`, from the
engine if it applies the aborts within ABORT_GRACE_S, else ended on the event loop (a hung step).
`hurry()` (a second signal) cuts the wait short. Closing stops the engine thread with a bounded join, so
a hung step delays the exit by at most ENGINE_JOIN_TIMEOUT_S after the drain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Literal

from tinyserve.config import EngineConfig, SamplingDefaults, ServerConfig
from tinyserve.engine.async_engine import AsyncEngine
from tinyserve.engine.stats import EngineStats
from tinyserve.server.errors import BadRequest, ServiceUnavailable
from tinyserve.server.logprobs import TokenTexts
from tinyserve.server.metrics import ServerMetrics
from tinyserve.types import SamplingParams

logger = logging.getLogger(__name__)
Phase = Literal["loading", "ready", "draining", "stopped", "failed"]
WARMUP_PROMPT = "Hello"
ABORT_GRACE_S = 2.0  # after abort_all, time for the final outputs and [DONE] to reach the clients
ENGINE_JOIN_TIMEOUT_S = 5.0  # a hung step is abandoned (daemon thread) after this long


class ServerState:
    def __init__(self, engine_config: EngineConfig, config: ServerConfig,
                 engine_factory: Callable[[EngineConfig], object] | None = None):
        self.engine_config = engine_config
        self.config = config
        self.served_model_names = config.served_model_names or (engine_config.model,)
        self.model_name = self.served_model_names[0]
        self.created = int(time.time())
        self.phase: Phase = "loading"
        self.load_error: BaseException | None = None
        self.engine: AsyncEngine | None = None
        self.metrics: ServerMetrics | None = None
        self.token_texts: TokenTexts | None = None  # logprobs' token strings, memoised for the app's life
        self.max_model_len: int | None = None  # known once the engine is built
        self.sampling_defaults: SamplingDefaults | None = None  # the engine's, for fields requests leave out
        self.on_fatal: Callable[[], None] | None = None  # set by the launcher: exit when loading fails
        self._engine_factory = engine_factory
        self._load_task: asyncio.Task | None = None
        self._is_hurried = False  # a second signal: abort in-flight requests now instead of waiting
        self._is_closed = False

    # loading

    def start_loading(self) -> None:
        self._load_task = asyncio.create_task(self._load())

    async def _load(self) -> None:
        try:
            # built on the thread that steps it
            engine = await AsyncEngine.launch(self._build_engine, stall_timeout=self.config.stall_timeout)
            llm_engine = engine.engine
            self.max_model_len = llm_engine.max_model_len
            self.sampling_defaults = llm_engine.sampling_defaults
            self.engine = engine
            if self.config.warmup:
                await self._warm_up()
            self.token_texts = TokenTexts(llm_engine.tokenizer)
            self.metrics = ServerMetrics(self.model_name, self.max_model_len, self._stats, lambda: engine.loop_stats)
            engine.step_listeners.append(self.metrics.on_step)
            if self.phase == "loading":
                self.phase = "ready"
                logger.info("ready: serving %s (context %d tokens)", self.model_name, self.max_model_len)
        except Exception as exc:  # noqa: BLE001 - a bad model or setting: report it, /health says 503
            logger.error("loading %s failed: %s", self.engine_config.model, exc)
            self.load_error, self.phase = exc, "failed"
            if self.on_fatal is not None:
                self.on_fatal()

    def _build_engine(self):
        if self._engine_factory is not None:
            return self._engine_factory(self.engine_config)
        from tinyserve.engine.llm_engine import LLMEngine

        return LLMEngine(self.engine_config)

    async def _warm_up(self) -> None:
        start = time.perf_counter()
        ids = self.engine.tokenizer.encode(WARMUP_PROMPT)
        async for _ in self.engine.generate("warmup", ids, SamplingParams(max_tokens=4, temperature=0.0)):
            pass
        logger.info("warm-up generation took %.2fs", time.perf_counter() - start)

    def _stats(self) -> EngineStats | None:
        return self.engine.stats if self.engine is not None else None

    async def wait_ready(self) -> None:
        if self._load_task is not None:
            await asyncio.shield(self._load_task)

    # admission

    def check_ready(self) -> AsyncEngine:
        """The engine if new work may start; else ServiceUnavailable with the reason."""
        if self.phase == "loading":
            raise ServiceUnavailable("the model is still loading", code="loading", retry_after=5)
        if self.phase in ("draining", "stopped"):
            raise ServiceUnavailable("the server is shutting down", code="shutting_down", retry_after=5)
        if self.phase == "failed" or self.engine is None or not self.engine.is_alive:
            raise ServiceUnavailable("the engine is not running", code="engine_dead", retry_after=None)
        return self.engine

    def admit(self, num_samples: int = 1) -> AsyncEngine:
        """Called before any parsing or tokenization: refuses at once when the queue is full. A request
        counts all its samples (prompts x n): 503 when they would push the waiting samples past max_queue
        (samples that free batch slots will take at the next step do not count as waiting), 400 when
        they alone exceed it, since such a request could never be admitted."""
        try:
            engine = self.check_ready()
            limit = self.config.max_queue
            if limit is not None:
                if num_samples > limit:
                    raise BadRequest(f"n: the request asks for {num_samples} samples (prompts x n), more than "
                                     f"this server queues ({limit}); send fewer prompts or a smaller n",
                                     param="n", code="too_many_samples")
                free_slots = max(0, self.engine_config.scheduler.max_num_seqs - engine.stats.num_running)
                if engine.num_waiting - free_slots + num_samples > limit:
                    raise ServiceUnavailable(
                        f"the server is overloaded ({engine.num_waiting} sequences waiting, limit {limit}); "
                        "retry later", code="overloaded")
        except (ServiceUnavailable, BadRequest) as exc:
            if self.metrics is not None:
                self.metrics.rejected(exc.code)
            raise
        return engine

    def is_healthy(self) -> tuple[bool, str]:
        if self.phase != "ready":
            return False, self.phase
        if self.engine is None or not self.engine.is_alive:
            return False, "engine_dead"
        if self.engine.is_stalled(self.config.stall_timeout):
            return False, "engine_stalled"
        return True, "ok"

    # shutdown

    async def drain(self) -> None:
        """Refuse new work; wait for in-flight requests up to shutdown_timeout (or until `hurry()`);
        abort what is left and give its final outputs ABORT_GRACE_S to reach the clients."""
        if self.phase in ("draining", "stopped"):
            return
        self.phase = "draining"
        engine = self.engine
        if engine is None:
            return
        deadline = time.monotonic() + self.config.shutdown_timeout
        logger.info("draining: %d requests in flight, up to %.0fs", engine.num_in_flight, self.config.shutdown_timeout)
        while engine.num_in_flight and time.monotonic() < deadline and engine.is_alive and not self._is_hurried:
            await asyncio.sleep(0.05)
        if engine.num_in_flight:
            why = "on a second signal" if self._is_hurried else "after the shutdown timeout"
            logger.warning("aborting %d requests still in flight %s", engine.num_in_flight, why)
            engine.abort_all()  # a working engine applies these at its next step, final outputs and all
            end = time.monotonic() + ABORT_GRACE_S
            while (engine.num_in_flight and time.monotonic() < end and engine.is_alive
                   and not engine.is_stalled(ABORT_GRACE_S / 2)):  # a hung step will never get there
                await asyncio.sleep(0.02)
        if engine.num_in_flight:
            engine.cancel_all()  # ends the streams here with finish_reason abort, whatever the engine does

    def hurry(self) -> None:
        """Stop waiting for in-flight requests: a running drain aborts them at once."""
        self._is_hurried = True

    async def close(self) -> None:
        """Drain, then stop the engine (idempotent); a hung step is abandoned after ENGINE_JOIN_TIMEOUT_S."""
        await self.drain()
        if self._is_closed:
            return
        self._is_closed = True
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop, join_timeout=ENGINE_JOIN_TIMEOUT_S)
        self.phase = "stopped"
