"""Threads with a large stack for work that recurses in native code: llguidance compiles grammars
recursively and a stack overflow there is a SIGSEGV that kills the process. Defence in depth only:
engine/sampling/grammar_budget.py refuses specs deep enough to need it, at a quarter of what an 8 MiB stack holds.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")
STACK_BYTES = 256 << 20  # virtual: only the pages a compile touches become resident
_stack_size_lock = threading.Lock()  # threading.stack_size is process-wide: set, start, restore


class BigStackWorker:
    """`num_threads` daemon threads with STACK_BYTES stacks, started on first use, serving `run` calls."""

    def __init__(self, num_threads: int = 2, name: str = "tinyserve-grammar"):
        self._num_threads, self._name = num_threads, name
        self._tasks: queue.SimpleQueue[tuple[Callable, tuple, Future]] = queue.SimpleQueue()
        self._started = False
        self._start_lock = threading.Lock()

    def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on one of the threads; blocks the caller until it returns (or raises its exception)."""
        self._start()
        future: Future = Future()
        self._tasks.put((fn, args, future))
        return future.result()

    def _start(self) -> None:
        with self._start_lock:
            if self._started:
                return
            with _stack_size_lock:
                previous = threading.stack_size(STACK_BYTES)
                try:
                    for i in range(self._num_threads):
                        threading.Thread(target=self._serve, name=f"{self._name}-{i}", daemon=True).start()
                finally:
                    threading.stack_size(previous)
            self._started = True

    def _serve(self) -> None:
        while True:
            fn, args, future = self._tasks.get()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller, who raises it
                future.set_exception(exc)
