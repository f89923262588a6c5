"""The compiled-grammar cache: least recently used first out, bounded by count and by estimated memory.

Why both: a compiled matcher's memory ranges from kilobytes to hundreds of MiB (a lexer built for a
regex of large repetitions, issue 44), so a count alone let 256 entries exhaust the host. Each entry's
cost is the heap its compile kept (engine/memory/host_heap.py); on eviction the freed pages go back to the
kernel (engine/memory/malloc_tuning.py), which the serving malloc settings would otherwise keep resident.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

from tinyserve.engine.memory.malloc_tuning import return_freed_host_memory

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class GrammarCache(Generic[K, V]):
    """Thread-safe. Invariant: len <= max_entries and total_bytes <= max_bytes after every put (one entry
    over max_bytes alone is not kept)."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.total_bytes = 0
        self.num_evicted = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def cost(self, key: K) -> int | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def put(self, key: K, value: V, cost_bytes: int) -> None:
        """Keep value (unless it alone is over the budget), dropping the least recently used past either
        bound; freed memory is handed back to the kernel when anything was dropped."""
        with self._lock:
            old = self._entries.pop(key, None)
            self.total_bytes -= old[1] if old is not None else 0
            if cost_bytes <= self.max_bytes:
                self._entries[key] = (value, cost_bytes)
                self.total_bytes += cost_bytes
            evicted = []
            while len(self._entries) > self.max_entries or self.total_bytes > self.max_bytes:
                _, (dropped, dropped_cost) = self._entries.popitem(last=False)
                self.total_bytes -= dropped_cost
                evicted.append(dropped)
            self.num_evicted += len(evicted)
        if evicted or cost_bytes > self.max_bytes:
            del evicted  # the last references: their memory is free before the trim
            return_freed_host_memory()
