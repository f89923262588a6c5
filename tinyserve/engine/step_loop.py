"""One thread that runs all of torch's work for the engines attached to it: it builds them, and steps
each engine that has work in turn, one step each per round.

Why one thread for several engines: each thread that runs a parallel op gets its own OpenMP team, and
once libgomp manages more threads than there are cores it stops spinning between parallel regions and
every step gets slower (docs/PERFORMANCE.md, "Numbers behind the code's comments"). Two models stepped
from two threads would also run their steps at once and oversubscribe the cores. Round-robin on one
thread keeps one team, never runs two steps at once, and lets every busy engine progress.

Isolation: a step that raises marks only its engine dead (AsyncEngine._fail) and the loop goes on with
the others; a step that hangs holds the thread, so every engine on it waits (the watchdog of the hung
one fails its streams). A build runs between rounds: the other engines pause while a model loads.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinyserve.engine.async_engine import AsyncEngine


class StepLoop:
    """Invariant: only this loop's thread touches the LLMEngines of `engines`; other threads reach it
    through `wake` (a Condition shared with every attached AsyncEngine's inbox) or `call`. A private
    loop (one engine, the default of AsyncEngine.launch) ends its thread when that engine detaches."""

    def __init__(self, name: str = "tinyserve-engine", is_private: bool = False):
        self.wake = threading.Condition()
        self.is_private = is_private
        self._engines: list[AsyncEngine] = []
        self._calls: list[tuple[Callable[[], object], concurrent.futures.Future]] = []
        self._is_stopping = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` on the loop's thread between rounds (building an engine); its result or exception
        comes back through the returned future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.wake:
            if self._is_stopping:
                raise RuntimeError("the step loop has stopped")
            self._calls.append((fn, future))
            self.wake.notify()
        return future

    def attach(self, engine: AsyncEngine) -> None:
        with self.wake:
            self._engines.append(engine)
            self.wake.notify()

    def stop(self, join_timeout: float = 5.0) -> None:
        with self.wake:
            self._is_stopping = True
            self.wake.notify()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=join_timeout)

    @property
    def num_engines(self) -> int:
        return len(self._engines)

    def _run(self) -> None:
        while True:
            with self.wake:
                while not self._calls and not self._is_stopping and not any(e.has_work() for e in self._engines):
                    now = time.monotonic()
                    for engine in self._engines:
                        engine.mark_idle(now)
                    self.wake.wait()
                if self._is_stopping:
                    engines, self._engines = self._engines, []
                    break
                calls, self._calls = self._calls, []
                engines = list(self._engines)
            for fn, future in calls:
                self._call(fn, future)
            for engine in engines:
                if not engine.run_once():  # stopped or failed: it leaves the loop
                    self._detach(engine)
            # NOTE: no reference may outlive the round: a detached engine (a model unloaded) is freed
            # only once nothing holds it, and this thread may next wait for a long time
            calls = engines = engine = fn = future = None
        for engine in engines:
            engine.detached.set()
        for _, future in self._calls:
            future.set_exception(RuntimeError("the step loop has stopped"))

    @staticmethod
    def _call(fn: Callable[[], object], future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - the caller gets it, whatever it is
            future.set_exception(exc)

    def _detach(self, engine: AsyncEngine) -> None:
        with self.wake:
            if engine in self._engines:
                self._engines.remove(engine)
            if self.is_private and not self._engines:
                self._is_stopping = True
        engine.detached.set()
