"""Plain statistics the engine produces; the server turns them into Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot after a step. Counters (preemptions, prefix cache) are totals since start-up."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by requests, 0..1
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found
    num_steps: int
    num_failed_requests: int = 0  # finished with FinishReason.ERROR since start-up
    num_paused: int = 0  # set aside until their slow reader catches up; not in num_waiting
