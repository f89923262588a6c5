"""One served model name and its life: unloaded -> loading -> loaded (-> unloaded, or swapped), or failed.

A ModelSlot owns what is per model: its names, its source (file or folder), its metrics series, and the
ServedModel now serving it. A ServedModel is one load of the weights (engine, token texts, defaults);
a request keeps the one it was admitted to until it ends, so a swap (`ModelSlot.swap`) is a double
buffer with delayed release: the new load is built beside the old, one assignment sends new requests to
it, and the old one is released only after its requests have finished (or, past the drain timeout,
ended with finish_reason abort), never while one still waits on it. What to load and evict, and when, is
the registry's (server/registry/model_registry.py); a slot only carries it out.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Literal

from tinyserve.config import EngineConfig, SamplingDefaults, ServerConfig
from tinyserve.engine.loop.async_engine import AsyncEngine
from tinyserve.engine.spec_decode.draft_model import DraftModelProposer
from tinyserve.engine.memory.malloc_tuning import return_freed_host_memory
from tinyserve.engine.memory.sizing import describe_weight_bytes, weight_bytes_by_format
from tinyserve.engine.loop.step_loop import StepLoop
from tinyserve.server.intake.admission import AdaptiveAdmission, AdmissionTicket
from tinyserve.server.errors import BadRequest, ServiceUnavailable
from tinyserve.server.openai_api.logprobs import TokenTexts
from tinyserve.server.observability.metrics import ServerMetrics
from tinyserve.types import Job, SamplingParams, as_job

logger = logging.getLogger(__name__)
SlotPhase = Literal["unloaded", "loading", "loaded", "failed"]
WARMUP_PROMPT = "Hello"
ABORT_GRACE_S = 2.0  # after abort_all, time for the final outputs and [DONE] to reach the clients
ENGINE_JOIN_TIMEOUT_S = 5.0  # a hung step is abandoned (daemon thread) after this long


@dataclass
class ServedModel:
    """One load of a model. `num_pending` counts requests admitted to it whose stream is not open yet
    (tokenizing): a drain waits for them too, so none is left to submit to a stopped engine."""

    source: str
    engine: AsyncEngine
    token_texts: TokenTexts
    max_model_len: int
    sampling_defaults: SamplingDefaults
    weight_bytes: int
    kv_bytes: int
    num_pending: int = 0

    @property
    def num_in_flight(self) -> int:
        return self.engine.num_in_flight + self.num_pending

    @property
    def memory_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @contextmanager
    def pending(self) -> Iterator[None]:
        """Around a request's work from admission to its stream's opening (Generation.start)."""
        self.num_pending += 1
        try:
            yield
        finally:
            self.num_pending -= 1


class ModelSlot:
    def __init__(self, names: tuple[str, ...], source: str, engine_config: EngineConfig, config: ServerConfig,
                 metrics: ServerMetrics, step_loop: Callable[[], StepLoop],
                 engine_factory: Callable[[EngineConfig], object] | None = None):
        self.names, self.name, self.source = names, names[0], source
        self.engine_config, self.config, self.metrics = engine_config, config, metrics
        self.step_loop = step_loop  # the registry's, shared by every model (started on first use)
        self.phase: SlotPhase = "unloaded"
        self.current: ServedModel | None = None
        self.error: str | None = None  # why the last load failed, as /v1/models and the admin API say
        self.last_used = time.monotonic()
        self.load_seconds: float | None = None
        self.num_pinned = 0  # requests waiting for this slot's load (ModelRegistry.ensure_loaded): not evictable
        self._engine_factory = engine_factory
        self._draining: list[ServedModel] = []  # swapped out, finishing their requests
        self.admission = (AdaptiveAdmission(config.target_ttft, config.max_queue, metrics.set_admission_limit)
                          if config.admission == "adaptive" else None)
        if self.admission is None and config.max_queue is not None:
            metrics.set_admission_limit(config.max_queue)

    # admission

    @property
    def engine(self) -> AsyncEngine | None:
        return self.current.engine if self.current is not None else None

    def check_ready(self) -> ServedModel:
        if self.phase == "loading":
            raise ServiceUnavailable(f"the model {self.name!r} is still loading", code="loading", retry_after=5)
        if self.phase == "failed":
            raise ServiceUnavailable(f"the model {self.name!r} failed to load: {self.error}", code="model_failed",
                                     retry_after=None)
        loaded = self.current
        if loaded is None:
            raise ServiceUnavailable(f"the model {self.name!r} is not loaded", code="model_unloaded", retry_after=1)
        if not loaded.engine.is_alive:
            raise ServiceUnavailable("the engine is not running", code="engine_dead", retry_after=None)
        return loaded

    def admit(self, num_samples: int = 1, loaded: ServedModel | None = None, priority: int | None = None,
              n: int = 1) -> ServedModel:
        """The ServedModel new work goes to (or `loaded`, the one a request was admitted to before: its
        queue is checked again once the request's samples and `priority` are known); 503 when its queue is
        full, 400 when the request alone exceeds it (see ServerState.admit). With adaptive admission, a
        request whose priority is known must also find a seat now, or a running request of a worse priority
        to preempt: a wait for a seat lasts until running requests finish, which no TTFT seen so far
        foretells (docs/PERFORMANCE.md, "Admission under overload"). A request's `n` is capped by max_n (by
        default half the running batch's seats), so that one request cannot take every seat."""
        try:
            max_n = self.config.limits.max_n or max(1, self.engine_config.scheduler.max_num_seqs // 2)
            if n > max_n:
                raise BadRequest(f"n: the request asks for {n} samples of each prompt, more than this server "
                                 f"gives one request ({max_n}, --max-n)", param="n", code="too_many_samples")
            if loaded is None:
                loaded = self.check_ready()
            elif not loaded.engine.is_alive:
                raise ServiceUnavailable("the engine is not running", code="engine_dead", retry_after=None)
            limit, engine = self.config.max_queue, loaded.engine
            if limit is not None and num_samples > limit:
                raise BadRequest(f"n: the request asks for {num_samples} samples (prompts x n), more than "
                                 f"this server queues ({limit}); send fewer prompts or a smaller n",
                                 param="n", code="too_many_samples")
            free_slots = max(0, self.engine_config.scheduler.max_num_seqs - engine.stats.num_running)
            num_waiting = engine.num_waiting - free_slots  # beyond the seats a step would fill now
            if self.admission is not None:
                stats = engine.stats
                if (priority is not None and num_waiting + num_samples > 0
                        and (stats.worst_running_priority is None or priority >= stats.worst_running_priority)):
                    raise ServiceUnavailable(
                        f"the server is over its latency target (every seat is taken: {stats.num_running} "
                        f"sequences running, {max(0, num_waiting)} waiting for a seat); retry later",
                        code="overloaded", retry_after=self.admission.retry_after())
                if not self.admission.admits(num_samples):
                    raise ServiceUnavailable(
                        f"the server is over its latency target ({self.admission.num_pending} sequences "
                        f"without a first token, adaptive limit {self.admission.limit:.1f}); retry later",
                        code="overloaded", retry_after=self.admission.retry_after())
            elif limit is not None and num_waiting + num_samples > limit:
                raise ServiceUnavailable(
                    f"the server is overloaded ({engine.num_waiting} sequences waiting, limit {limit}); "
                    "retry later", code="overloaded")
        except (ServiceUnavailable, BadRequest) as exc:
            self.metrics.rejected(exc.code)
            raise
        self.last_used = time.monotonic()
        return loaded

    def ticket(self, num_samples: int) -> AdmissionTicket | None:
        """Adaptive admission: counts a just-admitted request as pending until its first token."""
        return self.admission.ticket(num_samples) if self.admission is not None else None

    def health(self) -> tuple[bool, str]:
        if self.phase == "unloaded":
            return True, "unloaded"  # loads on the next request
        if self.phase != "loaded" or self.current is None:
            return False, self.phase
        engine = self.current.engine
        if not engine.is_alive:
            return False, "engine_dead"
        if engine.is_stalled(self.config.stall_timeout):
            return False, "engine_stalled"
        return True, "ok"

    @property
    def num_in_flight(self) -> int:
        loads = ([self.current] if self.current is not None else []) + self._draining
        return sum(m.num_in_flight for m in loads)

    @property
    def memory_bytes(self) -> int:
        loads = ([self.current] if self.current is not None else []) + self._draining
        return sum(m.memory_bytes for m in loads)

    # lifecycle (the registry calls these under its lock)

    async def load(self, memory_share_gib: float | None = None) -> None:
        """Load `source` (within memory_share_gib: its share of --memory-budget); on failure the slot is failed
        with the reason and raises it."""
        self.phase, self.error = "loading", None
        try:
            self.current = await self._build(self.source, memory_share_gib)
        except Exception as exc:
            self.phase, self.error = "failed", _reason(exc)
            self.metrics.metric_set.loads.labels(self.name, "failed").inc()
            logger.error("model %s: loading %s failed: %s", self.name, self.source, self.error)
            raise
        self.phase = "loaded"
        self.last_used = time.monotonic()

    async def swap(self, source: str, memory_share_gib: float | None = None) -> None:
        """Serve `source` under this name: build it beside the current load (which keeps serving, and
        keeps serving if the build fails), switch, then drain and free the old one."""
        start = time.perf_counter()
        counter = self.metrics.metric_set.swaps
        try:
            new = await self._build(source, memory_share_gib)
        except Exception as exc:
            counter.labels(self.name, "failed").inc()
            logger.error("model %s: swap to %s failed, %s keeps serving: %s", self.name, source, self.source,
                         _reason(exc))
            raise
        if self.current is not None:
            self._draining.append(self.current)
        self.current, self.source = new, source  # the switch: new requests go to `new`
        self.phase, self.error, self.last_used = "loaded", None, time.monotonic()
        logger.info("model %s: switched to %s; %d requests finish on the old weights", self.name, source,
                    sum(m.num_in_flight for m in self._draining))
        await self._release_draining("swap")
        self.metrics.metric_set.swap_seconds.labels(self.name).observe(time.perf_counter() - start)
        counter.labels(self.name, "ok").inc()
        logger.info("model %s: swap to %s done in %.2fs", self.name, source, time.perf_counter() - start)

    async def unload(self, reason: str) -> None:
        """Refuse new requests, let in-flight ones finish (up to drain_timeout), free the memory."""
        if self.current is not None:
            self._draining.append(self.current)
        self.current = None
        if self.phase != "failed":
            self.phase = "unloaded"
        await self._release_draining(reason)

    async def close(self, timeout: float, is_hurried: Callable[[], bool]) -> None:
        """Shutdown: drain every load of this slot (up to `timeout`), then stop their engines."""
        loads = ([self.current] if self.current is not None else []) + self._draining
        await asyncio.gather(*(drain(m, timeout, is_hurried) for m in loads))
        await asyncio.gather(*(asyncio.to_thread(m.engine.stop, join_timeout=ENGINE_JOIN_TIMEOUT_S)
                               for m in loads))

    async def _release_draining(self, reason: str) -> None:
        """Drain and free the load just moved to `_draining`. It is held only there (no caller keeps a
        reference), so that once it leaves the list its memory is freed before the heap is trimmed."""
        if not self._draining:
            return
        old = self._draining[-1]
        try:
            await drain(old, self.config.drain_timeout, lambda: False)
            await asyncio.to_thread(old.engine.stop, join_timeout=ENGINE_JOIN_TIMEOUT_S)
        finally:
            self._draining.remove(old)
        freed = old.memory_bytes
        del old
        await asyncio.to_thread(_return_freed_memory)
        self.metrics.metric_set.unloads.labels(self.name, reason).inc()
        logger.info("model %s: unloaded (%s), %.0f MiB freed", self.name, reason, freed / 2**20)

    async def _build(self, source: str, memory_share_gib: float | None) -> ServedModel:
        start = time.perf_counter()
        cache = replace(self.engine_config.cache, memory_share_gib=memory_share_gib)
        engine_config = replace(self.engine_config, model=source, cache=cache, limits=self.config.limits)
        engine = await AsyncEngine.launch(self._engine_job(engine_config), stall_timeout=self.config.stall_timeout,
                                          step_loop=self.step_loop())
        try:
            llm_engine = engine.engine
            if self.config.warmup:
                await _warm_up(engine)
            engine.step_listeners.append(self.metrics.on_step)
            weights = _weight_bytes_by_format(llm_engine)
            loaded = ServedModel(source, engine, TokenTexts(llm_engine.tokenizer), llm_engine.max_model_len,
                                 llm_engine.sampling_defaults, sum(weights.values()), _kv_bytes(llm_engine))
        except BaseException:
            await asyncio.to_thread(engine.stop, join_timeout=ENGINE_JOIN_TIMEOUT_S)
            raise
        self.load_seconds = time.perf_counter() - start
        self.metrics.metric_set.loads.labels(self.name, "ok").inc()
        self.metrics.metric_set.load_seconds.labels(self.name).observe(self.load_seconds)
        logger.info("model %s: loaded %s in %.2fs (context %d tokens, weights %s, KV pool %.0f MiB)",
                    self.name, source, self.load_seconds, loaded.max_model_len, describe_weight_bytes(weights),
                    loaded.kv_bytes / 2**20)
        return loaded

    def _engine_job(self, engine_config: EngineConfig) -> Job:
        """The engine's build, in pieces that the step loop runs between the other models' steps."""
        if self._engine_factory is not None:
            return as_job(lambda: self._engine_factory(engine_config))
        from tinyserve.engine.loop.llm_engine import LLMEngine

        return LLMEngine.build_in_pieces(engine_config)


async def drain(loaded: ServedModel, timeout: float, is_hurried: Callable[[], bool]) -> None:
    """Wait for the requests of `loaded` up to `timeout` (or until `is_hurried()`); abort what is left
    and give its final outputs ABORT_GRACE_S to reach the clients; past that, end their streams here."""
    engine = loaded.engine
    deadline = time.monotonic() + timeout
    while loaded.num_in_flight and time.monotonic() < deadline and engine.is_alive and not is_hurried():
        await asyncio.sleep(0.05)
    if loaded.num_pending:  # admitted, not yet queued: give them a moment to open their streams
        end = time.monotonic() + ABORT_GRACE_S
        while loaded.num_pending and time.monotonic() < end:
            await asyncio.sleep(0.01)
    if engine.num_in_flight:
        why = "on a second signal" if is_hurried() else "after the drain timeout"
        logger.warning("aborting %d requests still in flight %s", engine.num_in_flight, why)
        engine.abort_all()  # a working engine applies these at its next step, final outputs and all
        end = time.monotonic() + ABORT_GRACE_S
        while (engine.num_in_flight and time.monotonic() < end and engine.is_alive
               and not engine.is_stalled(ABORT_GRACE_S / 2)):  # a hung step will never get there
            await asyncio.sleep(0.02)
    if engine.num_in_flight:
        engine.cancel_all()  # ends the streams here with finish_reason abort, whatever the engine does


async def _warm_up(engine: AsyncEngine) -> None:
    start = time.perf_counter()
    ids = engine.tokenizer.encode(WARMUP_PROMPT)
    # two tokens: one prefill step and one decode step, each path run once before the first request
    async for _ in engine.generate("warmup", ids, SamplingParams(max_tokens=2, temperature=0.0)):
        pass
    logger.info("warm-up generation took %.2fs", time.perf_counter() - start)


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _weight_bytes_by_format(llm_engine) -> dict[str, int]:
    """Bytes of the tensors the model holds, by weight format (engine/memory/sizing.py), a draft model's
    (speculative method "draft") included."""
    draft = _draft(llm_engine)
    return weight_bytes_by_format(llm_engine.runner.model, *([draft.model] if draft else []))


def _kv_bytes(llm_engine) -> int:
    """The KV pools, the draft model's included: one (key, value) pair of tensors per slot, and an int8 pool's
    two scale tensors (layers of one slot share theirs: layers/kv_cache.py, KVLayout); rank 0's alone with
    tensor / pipeline parallel."""
    pools = [llm_engine.runner.kv_cache]
    if draft := _draft(llm_engine):
        pools.append(draft.kv_cache)
    tensors = {id(t): t for pool in pools for layer in pool if layer is not None
               for t in (layer.key, layer.value, layer.key_scale, layer.value_scale) if t is not None}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _draft(llm_engine) -> DraftModelProposer | None:
    """The engine's draft-model proposer, if it has one (it holds a second model and pool)."""
    return llm_engine.proposer if isinstance(llm_engine.proposer, DraftModelProposer) else None


def _return_freed_memory() -> None:
    """Collect what the old load left (reference cycles), then trim the heap (engine/memory/malloc_tuning.py)."""
    gc.collect()
    return_freed_host_memory()
