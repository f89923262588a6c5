"""The memory numbers /metrics exports, gathered in one plain snapshot per scrape (server/observability/metrics.py turns
it into series): the process's resident set and limit, CUDA device memory, and per loaded model its
weight and KV-pool bytes, its KV blocks and whether its engine runs. Reads only what is already
published (sizes measured at load, the engine's newest EngineStats), so a scrape costs the step loop
nothing, and answers while models load (with what it knows). The models' rows come from the registry
that holds them (ModelRegistry.memory_snapshot), so this module, which metrics.py reads, knows no slot."""

from __future__ import annotations

from dataclasses import dataclass

from tinyserve.engine.memory.process_memory import DeviceMemory, device_memory, memory_limit_bytes, process_rss_bytes
from tinyserve.engine.observability.stats import EngineStats


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

    @classmethod
    def from_stats(cls, model_name: str, weight_bytes: int, kv_bytes: int, stats: EngineStats,
                   is_alive: bool) -> ModelMemory:
        return cls(model_name, weight_bytes, kv_bytes, stats.num_blocks, stats.num_blocks - stats.num_free_blocks,
                   stats.num_free_blocks, stats.num_cached_blocks, is_alive)


@dataclass(frozen=True)
class MemorySnapshot:
    process_rss_bytes: int | None
    memory_limit_bytes: int | None
    devices: list[DeviceMemory]
    models: list[ModelMemory]


def memory_snapshot(models: list[ModelMemory]) -> MemorySnapshot:
    """The process's and the devices' numbers now, with the loaded models' rows."""
    return MemorySnapshot(process_rss_bytes(), memory_limit_bytes(), device_memory(), models)
