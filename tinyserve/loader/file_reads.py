"""A load's I/O thread: every read of a checkpoint's files (headers, tokenizer, tensor bytes) runs there,
and the job that loads the model (on the step thread of every engine, engine/loop/step_loop.py) waits for each
read by yielding its Future, never by blocking and never by a page fault of a memory-mapped file.

Why: a read that stalls (a file on a hung network mount, a device, a pipe swapped in after the checks of
loader/model_files.py) would otherwise hold the step thread, and every model served beside the one that
loads would stop. Here it stalls only this thread: the job gives up after `timeout_s` without a reply
(ModelLoadError), the load fails, the models already serving never noticed. A thread stuck in a read
cannot be killed; it is a daemon, left to end with the process.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from tinyserve.loader.errors import ModelLoadError
from tinyserve.types import Job

T = TypeVar("T")


class FileReads:
    """One daemon thread that runs reads in the order submitted. Owned by one load, closed by it."""

    def __init__(self, timeout_s: float, name: str = "tinyserve-load-io"):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, read: Callable[[], T]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((read, future))
        return future

    def wait(self, future: concurrent.futures.Future, what: str) -> Job[T]:
        """The read's result, yielding its Future while it runs; ModelLoadError naming `what` once it has
        run for timeout_s (counted from this call) without a result."""
        deadline = time.monotonic() + self.timeout_s
        while not future.done():
            if time.monotonic() >= deadline:
                future.cancel()
                raise ModelLoadError(f"reading {what} stalled: no data within {self.timeout_s:g}s "
                                     "(a file on a hung mount, a device or a pipe?)")
            yield future
        return future.result()

    def read(self, read: Callable[[], T], what: str) -> Job[T]:
        """submit, then wait."""
        return (yield from self.wait(self.submit(read), what))

    def close(self) -> None:
        """Ends the thread once the reads queued before have run (at once, if none is stalled)."""
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            read, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(read())
            except BaseException as exc:  # noqa: BLE001 - the job waiting for it raises it
                future.set_exception(exc)
            item = read = future = None  # NOTE: no reference to a tensor outlives its read
