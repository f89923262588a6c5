"""Runs the engine's step loop in its own thread and gives each request an async stream of outputs.

Why a thread: the forward pass spends its time inside torch kernels that release the GIL, so the
asyncio loop (HTTP parsing, SSE writes) keeps running during a step, and a burst of HTTP work never
delays the next step by more than the Python slices it needs (benchmarks/http_overhead.py measures
it; `loop_stats` splits the engine thread's time into steps and everything around them). Only the
engine thread touches the LLMEngine; other threads hand it work through a locked inbox and get outputs
back through `loop.call_soon_threadsafe`, one call per step.

`launch` builds the LLMEngine on the engine thread itself (in pieces, between steps: engine/loop/step_loop.py),
so that one thread runs all of torch's work.
Why: each thread that runs a parallel op gets its own OpenMP team, and once libgomp manages more
threads than there are cores it stops spinning between parallel regions, and each step got slower
(docs/PERFORMANCE.md, "Numbers behind the code's comments"). That thread is a StepLoop
(engine/loop/step_loop.py): its own by default, or one shared by several engines (several models in one
server), which it steps in turn.

Bounds, so that no client can hold the server: each stream's buffer is bounded (engine/loop/request_stream.py:
a reader that falls behind pauses its request), a stream can be ended on the event loop without the engine
thread (deadlines hold while a step hangs), and a watchdog thread fails every open stream once one step has
run longer than `stall_timeout`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.engine.loop.request_stream import RequestStream
from tinyserve.engine.observability.stats import EngineStats, LoopStats
from tinyserve.engine.loop.step_loop import StepLoop
from tinyserve.types import FinishReason, Job, RequestOutput, SamplingParams, StructuredOutput

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine cannot serve: it failed, was stopped, or is stuck (EngineStalledError). The message is
    safe to show a client: the cause is logged, not carried."""

    code = "engine_dead"


class EngineStalledError(EngineDeadError):
    code = "engine_stalled"


@dataclass
class _Add:
    request_id: str
    prompts: list[list[int]]  # token ids of each prompt, added under prompt_index 0, 1, ...
    params: SamplingParams
    priority: int
    arrival_time: float
    cache_salt: str | None = None


@dataclass
class _Abort:
    request_id: str
    reason: FinishReason = FinishReason.ABORT


@dataclass
class _Pause:
    request_id: str
    paused: bool


class AsyncEngine:
    """Owns the engine thread. Invariant: a stream in `_streams` gets every output of its request and
    then ends, or gets an exception (engine dead, stopped or stalled); it is removed by its consumer (or
    by `cancel()`). Registration and failing all streams hold `_streams_lock`, so a stream registered
    just as the engine dies is either refused or failed, never left waiting."""

    def __init__(self, engine: LLMEngine, step_loop: StepLoop):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.step_loop = step_loop
        self._inbox: list[_Add | _Abort | _Pause] = []
        self._num_unapplied = 0  # samples posted in the inbox and not yet in engine.stats().num_waiting
        self._wake = step_loop.wake  # shared by every engine on the loop: a post wakes its thread
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, RequestStream]] = {}
        self._streams_lock = threading.Lock()
        self._thread: threading.Thread = step_loop.thread
        self._stopping = False
        self._stopped = threading.Event()
        self.detached = threading.Event()  # set by the loop once it no longer steps this engine
        self.error: BaseException | None = None
        self.last_progress = time.monotonic()  # last step that ran (or idle moment)
        self._busy_since: float | None = None  # monotonic start of the iteration now running, if any
        self._is_stall_reported = False
        self.stats: EngineStats = engine.stats()
        # engine thread, once per step with all its outputs and the time they were produced (monotonic)
        self.step_listeners: list[Callable[[list[RequestOutput], float], None]] = []
        self._step_s = self._overhead_s = self._max_gap_s = 0.0
        self._num_loop_steps = 0
        self._last_step_end: float | None = None

    @classmethod
    async def launch(cls, build: Job[LLMEngine], stall_timeout: float | None = None,
                     step_loop: StepLoop | None = None) -> AsyncEngine:
        """Run the job `build` (LLMEngine.build_in_pieces, or `as_job` of a function) on the thread of
        `step_loop` (by default a new one of its own), piece by piece between the steps of the engines
        already there, and step the engine it returns there; with a `stall_timeout`, a watchdog fails
        every open stream once a step has run that long."""
        loop = step_loop if step_loop is not None else StepLoop(is_private=True)

        def build_and_attach() -> Job[AsyncEngine]:
            engine = cls((yield from build), loop)
            if stall_timeout is not None:
                threading.Thread(target=engine._watch, args=(stall_timeout,), name="tinyserve-watchdog",
                                 daemon=True).start()
            loop.attach(engine)
            return engine

        try:
            return await asyncio.wrap_future(loop.run(build_and_attach()))
        except BaseException:
            if loop.is_private:
                loop.stop()
            raise

    def stop(self, join_timeout: float = 5.0) -> None:
        """Stop stepping after the current step; streams still open get EngineDeadError. Waits at most
        `join_timeout` seconds for a step in progress (a hung one is left to the daemon thread)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self.detached.wait(timeout=join_timeout)
            if self.step_loop.is_private:
                self._thread.join(timeout=join_timeout)
        self._fail_all(EngineDeadError("the engine stopped"))

    @property
    def is_alive(self) -> bool:
        return self.error is None and not self._stopping and not self.detached.is_set() and self._thread.is_alive()

    def is_stalled(self, timeout: float) -> bool:
        """One iteration of the loop (a step) has been running for more than `timeout` seconds."""
        busy_since = self._busy_since
        return busy_since is not None and time.monotonic() - busy_since > timeout

    @property
    def num_in_flight(self) -> int:
        """Requests with an open stream (queued, running, or finishing delivery)."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Samples not yet scheduled: the engine's queue plus what is still in the inbox."""
        return self.stats.num_waiting + self._num_unapplied

    @property
    def loop_stats(self) -> LoopStats:
        return LoopStats(self._num_loop_steps, self._step_s, self._overhead_s, self._max_gap_s)

    def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
               priority: int = 0, arrival_time: float | None = None,
               cache_salt: str | None = None) -> RequestStream:
        """Queue a request of one or more prompts now (synchronously, from the event loop's thread) and
        return its one stream, every prompt's samples interleaved (RequestOutput.prompt_index, .index).
        Each prompt must have passed `validate` (the server's intake runs it, once). Raises
        EngineDeadError before anything is queued."""
        stream = RequestStream(self, request_id, params.n, len(prompts))
        with self._streams_lock:
            if not self.is_alive:
                raise EngineDeadError("the engine is not running")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._post(_Add(request_id, prompts, params, priority, arrival, cache_salt))
        return stream

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, arrival_time: float | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Validate and stream a one-prompt request's outputs (all n samples interleaved) until every
        sample has finished. Closing the iterator early (client gone) aborts the request."""
        self.validate(prompt_token_ids, params)
        stream = self.submit(request_id, [prompt_token_ids], params, priority, arrival_time, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The engine's checks (InvalidRequest); they read config only, so any thread may run them."""
        self.engine.validate(prompt_token_ids, params)

    async def compile_structured_output(self, spec: StructuredOutput) -> None:
        """Compile (and cache) a grammar on a worker thread, so that the event loop and the engine thread
        never wait for it; InvalidRequest if it cannot be compiled."""
        await asyncio.to_thread(self.engine.structured_outputs.compile, spec)

    def close_stream(self, request_id: str, finished: bool, reason: FinishReason = FinishReason.ABORT) -> None:
        """A stream is done with (RequestStream.close or .cancel): forget it; abort its request unless
        `finished`."""
        with self._streams_lock:
            entry = self._streams.pop(request_id, None)
        if entry is not None and not finished:
            self._post(_Abort(request_id, reason))

    def set_paused(self, request_id: str, paused: bool) -> None:
        """Stop (or restart) generating for a request whose reader has fallen behind."""
        self._post(_Pause(request_id, paused))

    def abort(self, request_id: str) -> None:
        """Finish the request with FinishReason.ABORT at the next step; its stream gets the final outputs."""
        self._post(_Abort(request_id))

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self._post(_Abort(request_id))

    def cancel_all(self) -> None:
        """End every open stream now with finish_reason abort, even while a step hangs (shutdown); the
        engine aborts their requests when its thread gets there."""
        with self._streams_lock:
            entries = list(self._streams.values())
        for loop, stream in entries:
            _call_soon(loop, stream.cancel)

    def _post(self, item: _Add | _Abort | _Pause) -> None:
        with self._wake:
            self._inbox.append(item)
            if isinstance(item, _Add):
                self._num_unapplied += item.params.n * len(item.prompts)
            self._wake.notify()

    # the engine thread

    def has_work(self) -> bool:
        """Called by the loop holding `_wake`."""
        return bool(self._inbox) or self._stopping or self.engine.has_schedulable_requests()

    def mark_idle(self, now: float) -> None:
        """Called by the loop holding `_wake` before it waits: an idle engine is not stalled."""
        self.last_progress = now
        self._last_step_end = None

    def run_once(self) -> bool:
        """The loop's turn for this engine: apply the inbox and run one step if there is work. False
        once the engine is stopping or has failed, and the loop detaches it."""
        with self._wake:
            stopping = self._stopping
            inbox, self._inbox = ([], self._inbox) if stopping else (self._inbox, [])
        if stopping:
            self._close_engine()
            return False
        try:
            if not inbox and not self.engine.has_schedulable_requests():
                if self.engine.has_ranks:  # idle: check that the other ranks are still there
                    self.engine.keep_alive()
                return True
            self._busy_since = time.monotonic()
            self._iterate(inbox)
        except BaseException as exc:  # noqa: BLE001 - any escape kills this engine: report it everywhere
            logger.exception("engine loop died")
            self._busy_since = None  # dead, not stalled
            with self._streams_lock:
                self.error = exc
            self._fail_all(EngineDeadError("the engine failed"))
            self._close_engine()
            return False
        self._busy_since = None
        return True

    def _close_engine(self) -> None:
        """The engine's last act on this thread: send its other ranks home (tensor / pipeline parallel)."""
        try:
            self.engine.close()
        except Exception:  # noqa: BLE001 - the ranks may be gone already: nothing is left to release
            logger.exception("closing the engine failed")

    def _iterate(self, inbox: list[_Add | _Abort | _Pause]) -> None:
        """Apply the inbox, run one step if there is work, publish stats and outputs."""
        start = time.perf_counter()
        outputs = self._apply(inbox)
        step_s = 0.0
        if self.engine.has_schedulable_requests():
            step_start = time.perf_counter()
            if self._last_step_end is not None:
                self._max_gap_s = max(self._max_gap_s, step_start - self._last_step_end)
            outputs += self.engine.step()
            self._last_step_end = time.perf_counter()
            step_s = self._last_step_end - step_start
            self._step_s += step_s
            self._num_loop_steps += 1
        self.last_progress = time.monotonic()
        self.stats = self.engine.stats()
        self._deliver(outputs)
        self._overhead_s += time.perf_counter() - start - step_s

    def _apply(self, inbox: list[_Add | _Abort | _Pause]) -> list[RequestOutput]:
        outputs = []
        num_added = 0
        for item in inbox:
            if isinstance(item, _Abort):
                outputs += self.engine.abort(item.request_id, item.reason)
            elif isinstance(item, _Pause):
                self.engine.set_paused(item.request_id, item.paused)
            else:
                num_added += item.params.n * len(item.prompts)
                self._add(item)
        if num_added:
            self.stats = self.engine.stats()  # the new samples now count in stats.num_waiting
            with self._wake:
                self._num_unapplied -= num_added
        return outputs

    def _add(self, item: _Add) -> None:
        if item.request_id not in self._streams:  # its client left (or its deadline passed) while queued
            return
        try:
            for prompt_index, prompt_token_ids in enumerate(item.prompts):
                self.engine.add_validated(item.request_id, prompt_token_ids, item.params, item.priority,
                                          item.arrival_time, item.cache_salt, prompt_index)
        except ValueError as exc:  # validated before, so only a race (e.g. duplicate id) lands here
            if prompt_index:  # the prompts queued before it go too: the stream ends with the error
                self.engine.abort(item.request_id)
            self._deliver_error(item.request_id, exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], out))
        for loop, items in by_loop.items():
            _call_soon(loop, _push_all, items)
        if outputs:
            now = time.monotonic()
            for listener in self.step_listeners:
                listener(outputs, now)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            _call_soon(entry[0], _push_all, [(entry[1], exc)])

    def _fail_all(self, exc: BaseException) -> None:
        with self._streams_lock:
            entries = list(self._streams.items())
        for request_id, (loop, stream) in entries:
            _call_soon(loop, _push_all, [(stream, exc)])

    # the watchdog thread

    def _watch(self, stall_timeout: float) -> None:
        """Fails the open streams (with an abort posted for each, so their blocks are freed once the
        engine moves again) when one step has run longer than `stall_timeout`; /health reads the same
        condition through `is_stalled`."""
        while not self._stopped.wait(min(1.0, stall_timeout / 4)) and self.error is None:
            if not self.is_stalled(stall_timeout):
                self._is_stall_reported = False
                continue
            if not self._is_stall_reported:
                logger.error("engine stalled: one step has run for over %.0fs", stall_timeout)
                self._is_stall_reported = True
            with self._streams_lock:
                request_ids = list(self._streams)
            for request_id in request_ids:
                self._post(_Abort(request_id))
            self._fail_all(EngineStalledError("the engine stalled"))


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args) -> None:
    """`fn(*args)` on that loop's thread, unless the loop is closed (nobody is listening any more)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _push_all(items: list) -> None:
    for stream, item in items:
        stream.push(item)


__all__ = ["AsyncEngine", "EngineDeadError", "EngineStalledError", "FinishReason", "LoopStats", "RequestStream"]
