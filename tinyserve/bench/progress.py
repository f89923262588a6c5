"""A progress line on stderr for a running benchmark, redrawn at most a few times a second so that
drawing it costs the load generator nothing measurable. Without a terminal it prints a line per 10%."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tinyserve.bench.metrics import RequestResult

BAR_WIDTH = 30


class ProgressBar:
    def __init__(self, total: int, label: str = "bench", stream: TextIO | None = None, enabled: bool = True,
                 min_interval_s: float = 0.25):
        self.total, self.label = total, label
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0
        self.is_tty = self.stream.isatty()
        self.min_interval_s = min_interval_s
        self.num_done = self.num_failed = self.num_chunks = 0
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = 0

    def update(self, result: RequestResult) -> None:
        self.num_done += 1
        self.num_failed += not result.success
        self.num_chunks += len(result.chunk_times)
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.is_tty and (now - self._last_draw >= self.min_interval_s or self.num_done == self.total):
            self._last_draw = now
            self.stream.write("\r" + self.line(now))
            self.stream.flush()
        elif not self.is_tty and self.num_done * 10 // self.total > self._last_decile:
            self._last_decile = self.num_done * 10 // self.total
            print(self.line(now), file=self.stream, flush=True)

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        filled = BAR_WIDTH * self.num_done // self.total
        bar = "=" * filled + " " * (BAR_WIDTH - filled)
        return (f"{self.label} [{bar}] {self.num_done}/{self.total} {elapsed:6.1f}s "
                f"{self.num_done / elapsed:6.2f} req/s {self.num_chunks / elapsed:7.1f} chunks/s "
                f"failed {self.num_failed}")

    def close(self) -> None:
        if self.enabled and self.is_tty:
            self.stream.write("\n")
            self.stream.flush()
