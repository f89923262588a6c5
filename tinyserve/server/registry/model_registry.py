"""Every model a server knows, and the policy of which are loaded: on demand, within bounds.

Models come from `--model` (loaded at start-up, up to max_loaded_models) and `--models-dir` (GGUF files
and HF folders, loaded when a request first names them). A request to an unloaded model starts its load
and waits for it (bounded by the request's timeout); requests that arrive meanwhile wait on the same load.
Bounds: at most max_loaded_models loaded, and with a memory budget the loaded models' weights + KV pools
within it. Each model gets a share of the budget (budget / max_loaded_models, or all of it), and its KV
pool is what its share leaves after its weights (estimated from the size on disk):
`kv = share - weights`. To make room the least recently used model goes first, idle ones before busy
ones (a busy one is drained: its requests finish before its memory is freed). A model whose weights do
not fit its share fails with that reason, and nothing is evicted for it. Loads, evictions, unloads and
swaps run one at a time (`_lock`); `idle_unload` unloads a model nobody has used for that long.

All models share one StepLoop (engine/loop/step_loop.py): one thread steps every engine in turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from tinyserve.config import EngineConfig, ServerConfig
from tinyserve.engine.memory.fit_check import NotEnoughMemory, checkpoint_bytes
from tinyserve.engine.loop.step_loop import StepLoop
from tinyserve.server.errors import APIError, NotFound, ServiceUnavailable
from tinyserve.server.observability.memory_stats import MemorySnapshot, ModelMemory, memory_snapshot
from tinyserve.server.observability.metrics import MetricSet
from tinyserve.server.registry.model_slot import ServedModel, ModelSlot

logger = logging.getLogger(__name__)
GIB = 1 << 30


class ModelDoesNotFit(APIError):
    status, type = 507, "insufficient_storage"


def _does_not_fit(slot: ModelSlot, exc: NotEnoughMemory) -> ModelDoesNotFit:
    """The engine's memory check (engine/memory/fit_check.py) as the API's 507: its numbers and flags."""
    return ModelDoesNotFit(f"the model {slot.name!r} cannot be loaded: {exc}", param="model", code="model_too_large")


def discover_models(models_dir: str) -> list[tuple[str, str]]:
    """(name, path) of each GGUF file and each folder holding a config.json in `models_dir`, by name."""
    root = Path(models_dir)
    if not root.is_dir():
        raise ValueError(f"models_dir: {models_dir!r} is not a directory")
    found = []
    for path in sorted(root.iterdir()):
        if path.is_file() and path.suffix == ".gguf":
            found.append((path.stem, str(path)))
        elif path.is_dir() and (path / "config.json").is_file():
            found.append((path.name, str(path)))
    return found


class ModelRegistry:
    def __init__(self, engine_config: EngineConfig, config: ServerConfig,
                 engine_factory: Callable[[EngineConfig], object] | None = None):
        self.engine_config, self.config = engine_config, config
        self.metric_set = MetricSet(self._loaded_stats, get_memory=self.memory_snapshot)
        self._engine_factory = engine_factory
        self._step_loop: StepLoop | None = None  # started with the first load
        self.slots: list[ModelSlot] = []
        self._by_name: dict[str, ModelSlot] = {}
        self._add((config.served_model_names or (engine_config.model,)), engine_config.model)
        for name, path in config.models:
            self._add((name,), path)
        self.startup = list(self.slots)[: config.max_loaded_models]  # loaded before the server is ready
        if config.models_dir is not None:
            for name, path in discover_models(config.models_dir):
                if name not in self._by_name:
                    self._add((name,), path)
        self._lock: asyncio.Lock | None = None
        self._loads: dict[str, asyncio.Task] = {}  # slot name -> its load in progress
        self._reaper: asyncio.Task | None = None

    def _add(self, names: tuple[str, ...], source: str) -> None:
        clash = [n for n in names if n in self._by_name]
        if clash:
            raise ValueError(f"model name {clash[0]!r} is given twice")
        slot = ModelSlot(names, source, self.engine_config, self.config, self.metric_set.for_model(names[0]),
                         self._loop, self._engine_factory)
        self.slots.append(slot)
        self._by_name.update({name: slot for name in names})

    def memory_snapshot(self) -> MemorySnapshot:
        """/metrics' memory numbers (server/observability/memory_stats.py): the process's, and each loaded model's."""
        models = []
        for slot in self.slots:
            loaded = slot.current
            if loaded is not None:
                models.append(ModelMemory.from_stats(slot.name, loaded.weight_bytes, loaded.kv_bytes,
                                                     loaded.engine.stats, loaded.engine.is_alive))
        return memory_snapshot(models)

    def _loop(self) -> StepLoop:
        if self._step_loop is None:
            self._step_loop = StepLoop()
        return self._step_loop

    @property
    def default(self) -> ModelSlot:
        return self.slots[0]

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:  # made on the event loop that uses it
            self._lock = asyncio.Lock()
        return self._lock

    def resolve(self, name: str | None) -> ModelSlot:
        """The slot a request's `model` names (None: the first model); 404 model_not_found if none."""
        if name is None:
            return self.default
        slot = self._by_name.get(name)
        if slot is None:
            known = ", ".join(repr(s.name) for s in self.slots)
            raise NotFound(f"the model {name!r} does not exist; this server serves {known}", param="model",
                           code="model_not_found")
        return slot

    def _loaded_stats(self) -> list:
        return [(s.name, s.engine.stats, s.engine.loop_stats) for s in self.slots if s.engine is not None]

    # loading

    async def ensure_loaded(self, slot: ModelSlot, timeout: float | None) -> ServedModel:
        """Load `slot` if it is unloaded (a failed one stays failed until the admin API loads it) and
        wait up to `timeout` for it; then admission as ModelSlot.admit. The request pins the slot while it
        waits: a load that finishes cannot be evicted (`_make_room`) before its waiters are admitted, and
        once admitted they count as in flight, so an eviction drains them."""
        if slot.current is not None or slot.phase not in ("unloaded", "loading"):
            return slot.admit()  # no await between the check and the admission
        slot.num_pinned += 1
        try:
            task = self._loads.get(slot.name)
            if task is None:
                task = self._loads[slot.name] = asyncio.ensure_future(self._load_once(slot))
                task.add_done_callback(lambda _: self._loads.pop(slot.name, None))
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout)
            except asyncio.TimeoutError:
                raise ServiceUnavailable(f"the model {slot.name!r} is still loading after {timeout:.0f}s",
                                         code="loading", retry_after=5) from None
            except APIError:
                raise
            except Exception:  # noqa: BLE001 - the slot is failed and admit says why
                pass
            return slot.admit()
        finally:
            slot.num_pinned -= 1

    async def _load_once(self, slot: ModelSlot) -> None:
        async with self.lock:
            if slot.current is None and slot.phase != "failed":
                await self._load_locked(slot)

    async def load(self, slot: ModelSlot) -> None:
        """Admin load (also of a failed model: it tries again). Raises what the load raised."""
        async with self.lock:
            if slot.current is None:
                await self._load_locked(slot)

    async def _load_locked(self, slot: ModelSlot) -> None:
        share_gib = self._plan(slot)
        await self._make_room(slot, self._share_bytes())
        try:
            await slot.load(share_gib)
        except NotEnoughMemory as exc:
            raise _does_not_fit(slot, exc) from None

    def _share_bytes(self) -> int | None:
        budget = self.config.memory_budget_gib
        if budget is None:
            return None
        return int(budget * GIB / (self.config.max_loaded_models or 1))

    def _plan(self, slot: ModelSlot, source: str | None = None) -> float | None:
        """The share of the memory budget (GiB) a new load of `slot` sizes its KV pool within (CacheConfig's
        memory_share_gib, engine/memory/fit_check.py); None without a budget. Weights larger on disk than the
        share are refused here, before anything is evicted for them."""
        share = self._share_bytes()
        if share is None:
            return None
        weights = checkpoint_bytes(source or slot.source)
        if weights >= share:
            slot.phase = "failed" if slot.current is None else slot.phase
            slot.error = (f"its weights ({weights / GIB:.2f} GiB on disk) do not fit its share of the memory "
                          f"budget ({share / GIB:.2f} GiB = {self.config.memory_budget_gib:g} GiB / "
                          f"{self.config.max_loaded_models or 1} models)")
            raise ModelDoesNotFit(f"the model {slot.name!r} cannot be loaded: {slot.error}", code="model_too_large")
        logger.info("model %s: weights, KV pool and activations within a share of %.2f GiB (budget %g GiB / %d); "
                    "weights %.2f GiB on disk", slot.name, share / GIB, self.config.memory_budget_gib,
                    self.config.max_loaded_models or 1, weights / GIB)
        return share / GIB

    async def _make_room(self, slot: ModelSlot, footprint: int | None) -> None:
        """Unload least recently used models (idle ones first) until `slot` may load beside the rest."""
        while True:
            loaded = [s for s in self.slots if s is not slot and s.current is not None]
            over_count = self.config.max_loaded_models is not None and \
                len(loaded) + 1 > self.config.max_loaded_models
            used = sum(s.memory_bytes for s in loaded) + slot.memory_bytes
            over_budget = footprint is not None and used + footprint > self.config.memory_budget_gib * GIB
            if not loaded or not (over_count or over_budget):
                return
            evictable = [s for s in loaded if not s.num_pinned]
            if not evictable:  # each has requests that saw its load finish and are being admitted now
                await asyncio.sleep(0.005)
                continue
            victim = min(evictable, key=lambda s: (s.num_in_flight > 0, s.last_used))
            logger.info("model %s: evicted (least recently used) to load %s", victim.name, slot.name)
            await victim.unload("evicted")

    # the admin API

    async def unload(self, slot: ModelSlot) -> None:
        async with self.lock:
            await slot.unload("admin")

    async def swap(self, slot: ModelSlot, source: str) -> None:
        """Serve `source` under the slot's name (ModelSlot.swap); an unloaded slot simply loads it."""
        async with self.lock:
            if slot.current is None:
                previous = slot.source
                slot.source = source
                try:
                    await self._load_locked(slot)
                except BaseException:
                    slot.source = previous
                    raise
                return
            share_gib = self._plan(slot, source)
            await self._make_room(slot, self._share_bytes())
            try:
                await slot.swap(source, share_gib)
            except NotEnoughMemory as exc:
                raise _does_not_fit(slot, exc) from None

    # idle unload

    def start(self) -> None:
        if self.config.idle_unload is not None:
            self._reaper = asyncio.ensure_future(self._unload_idle(self.config.idle_unload))

    async def _unload_idle(self, idle_s: float) -> None:
        while True:
            await asyncio.sleep(min(idle_s / 4, 5.0))
            now = time.monotonic()
            for slot in self.slots:
                if slot.current is None:
                    continue
                if slot.num_in_flight:
                    slot.last_used = now  # idle counts from the last request's end
                elif now - slot.last_used > idle_s:
                    async with self.lock:
                        if slot.current is not None and not slot.num_in_flight:
                            logger.info("model %s: idle for %.0fs", slot.name, now - slot.last_used)
                            await slot.unload("idle")

    async def close(self, timeout: float, is_hurried: Callable[[], bool]) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for task in list(self._loads.values()):
            task.cancel()
        await asyncio.gather(*(slot.close(timeout, is_hurried) for slot in self.slots))
        if self._step_loop is not None:  # its engines have stopped (or were waited for): a short join
            await asyncio.to_thread(self._step_loop.stop, join_timeout=1.0)
