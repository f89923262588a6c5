"""One thread that runs all of torch's work for the engines attached to it: it builds them, and steps
each engine that has work in turn, one step each per round.

Why one thread for several engines: each thread that runs a parallel op gets its own OpenMP team, and
once libgomp manages more threads than there are cores it stops spinning between parallel regions and
every step gets slower (docs/PERFORMANCE.md, "Numbers behind the code's comments"). Two models stepped
from two threads would also run their steps at once and oversubscribe the cores. Round-robin on one
thread keeps one team, never runs two steps at once, and lets every busy engine progress.

Jobs: building an engine (loading a model) runs on this thread too, as a Job (tinyserve/types.py) of
small pieces, one tensor's work or less each. Between rounds the loop runs pieces for JOB_SLICE_S (at
least one) while any engine has work, so that a step waits at most that long plus one piece; while none
has, it runs them back to back. A load beside busy models takes longer; their requests barely notice.
A piece that waits for a read on the load's I/O thread (loader/file_reads.py) yields its Future: the loop
then steps the engines (or, with none busy, sleeps until the read ends or work comes) instead of spending
its slice on the wait, so a read that stalls costs the other models nothing.

Isolation: a step that raises marks only its engine dead (AsyncEngine.run_once) and the loop goes on with
the others; a job that raises fails its own future; a step that hangs holds the thread, so every engine
on it waits (the watchdog of the hung one fails its streams).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Protocol

from tinyserve.types import Job

if TYPE_CHECKING:
    from tinyserve.engine.loop.llm_engine import LLMEngine

# A job's time per round while engines have work: what it adds to their step interval (docs/PERFORMANCE.md,
# "Several models": the time-to-first-token of requests during a swap, and how long the swap takes).
JOB_SLICE_S = 0.05
# While idle, an engine with tensor / pipeline parallel ranks checks on them this often, so that a lost rank
# fails the engine (and /health) within about this long even when no request is running.
KEEP_ALIVE_S = 1.0


class SteppedEngine(Protocol):
    """An engine attached to a StepLoop (AsyncEngine), as the loop sees it. The loop calls `has_work` and
    `mark_idle` holding `wake`, `run_once` on its thread (False: the engine stopped or failed, and leaves
    the loop), and sets `detached` once it no longer steps the engine."""

    engine: LLMEngine  # its has_ranks: an idle engine with other ranks is still checked on
    detached: threading.Event

    def has_work(self) -> bool: ...

    def mark_idle(self, now: float) -> None: ...

    def run_once(self) -> bool: ...


class StepLoop:
    """Invariant: only this loop's thread touches the LLMEngines of `engines` and runs jobs; other threads
    reach it through `wake` (a Condition shared with every attached AsyncEngine's inbox) or `run`. Jobs
    run one after another, in the order given. A private loop (one engine, the default of
    AsyncEngine.launch) ends its thread when that engine detaches."""

    def __init__(self, name: str = "tinyserve-engine", is_private: bool = False):
        self.wake = threading.Condition()
        self.is_private = is_private
        self._engines: list[SteppedEngine] = []
        self._jobs: deque[tuple[Job, concurrent.futures.Future]] = deque()  # the first one is in progress
        self._is_stopping = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def run(self, job: Job) -> concurrent.futures.Future:
        """Run `job` on the loop's thread, piece by piece between rounds (building an engine); its result
        or exception comes back through the returned future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.wake:
            if self._is_stopping:
                raise RuntimeError("the step loop has stopped")
            self._jobs.append((job, future))
            self.wake.notify()
        return future

    def attach(self, engine: SteppedEngine) -> None:
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
                while not self._jobs and not self._is_stopping and not self._has_engine_work():
                    self._mark_idle()
                    if not self.wake.wait(self._idle_wait_s()):
                        break  # an engine with other ranks checks on them (AsyncEngine.run_once)
                if self._is_stopping:
                    engines, self._engines = self._engines, []
                    break
                engines = list(self._engines)
            self._run_jobs()
            for engine in engines:
                if not engine.run_once():  # stopped or failed: it leaves the loop
                    self._detach(engine)
            # NOTE: no reference may outlive the round: a detached engine (a model unloaded) is freed
            # only once nothing holds it, and this thread may next wait for a long time
            engines = engine = None
        for engine in engines:
            engine.detached.set()
        for job, future in self._jobs:
            job.close()
            if not future.done():
                future.set_exception(RuntimeError("the step loop has stopped"))

    def _idle_wait_s(self) -> float | None:
        """Called holding `wake`: how long to sleep without work (for ever, unless an engine has other
        ranks, which wait for its steps and are checked on every KEEP_ALIVE_S)."""
        return KEEP_ALIVE_S if any(engine.engine.has_ranks for engine in self._engines) else None

    def _has_engine_work(self) -> bool:
        """Called holding `wake`."""
        return any(engine.has_work() for engine in self._engines)

    def _mark_idle(self) -> None:
        """Called holding `wake`, with no engine that has work."""
        now = time.monotonic()
        for engine in self._engines:
            engine.mark_idle(now)

    def _run_jobs(self) -> None:
        """Pieces of the jobs, in order: for JOB_SLICE_S (and at least one piece) while an engine has work,
        until none is left (or the loop stops) while none has."""
        deadline = time.monotonic() + JOB_SLICE_S
        while True:
            with self.wake:
                if not self._jobs or self._is_stopping:
                    return
                job, future = self._jobs[0]
            is_done, waiting_on = self._run_piece(job, future)
            if is_done:
                with self.wake:
                    self._jobs.popleft()
            elif waiting_on is not None:
                if not self._wait_for(waiting_on):
                    return
                continue
            if time.monotonic() >= deadline:
                with self.wake:
                    if self._has_engine_work():
                        return
                    self._mark_idle()  # no step is waiting for this job

    def _wait_for(self, waiting_on: concurrent.futures.Future) -> bool:
        """A job waits on `waiting_on`: False at once if an engine has work (it steps; the job is resumed
        next round), else True after sleeping until the Future ends, work arrives or JOB_SLICE_S passes."""
        with self.wake:
            if self._has_engine_work() or self._is_stopping:
                return False
            self._mark_idle()
            # NOTE: under `wake` (a re-entrant lock): a read that ends before the wait starts notifies after
            waiting_on.add_done_callback(self._notify)
            if not waiting_on.done():
                self.wake.wait(JOB_SLICE_S)
        return True

    def _notify(self, _: concurrent.futures.Future) -> None:
        with self.wake:
            self.wake.notify()

    @staticmethod
    def _run_piece(job: Job, future: concurrent.futures.Future) -> tuple[bool, concurrent.futures.Future | None]:
        """One piece of `job`: (whether it has ended, its result or exception set on `future`, or it was
        cancelled before it started; the Future the piece waits on, if it yielded one)."""
        if not future.running() and not future.set_running_or_notify_cancel():
            job.close()
            return True, None
        try:
            waiting_on = next(job)
        except StopIteration as done:
            future.set_result(done.value)
            return True, None
        except BaseException as exc:  # noqa: BLE001 - the caller gets it, whatever it is
            future.set_exception(exc)
            return True, None
        return False, waiting_on

    def _detach(self, engine: SteppedEngine) -> None:
        with self.wake:
            if engine in self._engines:
                self._engines.remove(engine)
            if self.is_private and not self._engines:
                self._is_stopping = True
        engine.detached.set()
