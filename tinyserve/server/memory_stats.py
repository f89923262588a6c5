"""The memory numbers /metrics exports, gathered in one plain snapshot per scrape (server/metrics.py turns
it into series): the process's resident set and limit, CUDA device memory, and per loaded model its
weight and KV-pool bytes, its KV blocks and whether its engine runs. Reads only what is already
published (sizes measured at load, the engine's newest EngineStats), so a scrape costs the step loop
nothing, and answers while models load (with what it knows)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tinyserve.engine.process_memory import DeviceMemory, device_memory, memory_limit_bytes, process_rss_bytes
from tinyserve.server.model_slot import ModelSlot


@dataclass(frozen=True)
class ModelMemory:
    model_name: str
    weight_bytes: int
    kv_bytes: int
    num_blocks: int
    num_used_blocks: int  # held by requests
    num_free_blocks: int  # no request holds them (cached ones included)
    num_cached_blocks: int  # hold a prefix-cache hash (used or free): reusable without recompute
    is_alive: bool  # the engine steps (not dead, not stopped)


@dataclass(frozen=True)
class MemorySnapshot:
    process_rss_bytes: int | None
    memory_limit_bytes: int | None
    devices: list[DeviceMemory]
    models: list[ModelMemory]


def memory_snapshot(slots: Iterable[ModelSlot]) -> MemorySnapshot:
    models = []
    for slot in slots:
        loaded = slot.current
        if loaded is None:
            continue
        stats = loaded.engine.stats
        models.append(ModelMemory(slot.name, loaded.weight_bytes, loaded.kv_bytes, stats.num_blocks,
                                  stats.num_blocks - stats.num_free_blocks, stats.num_free_blocks,
                                  stats.num_cached_blocks, loaded.engine.is_alive))
    return MemorySnapshot(process_rss_bytes(), memory_limit_bytes(), device_memory(), models)
