"""Runs the engine's step loop in its own thread and gives each request an async stream of outputs.

Why a thread: the forward pass spends its time inside torch kernels that release the GIL, so the
asyncio loop (HTTP parsing, SSE writes) keeps running during a step, and a burst of HTTP work never
delays the next step by more than the Python slices it needs (benchmarks/http_overhead.py measures
it; `loop_stats` splits the engine thread's time into steps and everything around them). Only the
engine thread touches the LLMEngine; other threads hand it work through a locked inbox and get outputs
back through `loop.call_soon_threadsafe`, one call per step.

`launch` builds the LLMEngine on the engine thread itself, so that one thread runs all of torch's work.
Why: each thread that runs a parallel op gets its own OpenMP team, and once libgomp manages more
threads than there are cores it stops spinning between parallel regions; a 2-core server that loaded
its model on one thread and stepped it on another took 40 ms per batch-1 step instead of 26.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.engine.stats import EngineStats
from tinyserve.types import FinishReason, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float


@dataclass
class _Abort:
    request_id: str


@dataclass(frozen=True)
class LoopStats:
    """Where the engine thread's time went since start-up (seconds), for starvation measurements: a step
    loop starved by other threads shows up as a longer mean step at the same batch, or as overhead."""

    num_steps: int
    step_seconds: float  # inside LLMEngine.step()
    overhead_seconds: float  # inbox, stats, delivery and listeners, while work was pending
    max_gap_seconds: float  # longest time between the end of one step and the start of the next


class RequestStream:
    """The outputs of one submitted request, all n samples interleaved, as an async iterator that ends
    when every sample has finished. `close()` (idempotent) aborts the request if it has not finished;
    every stream must be closed, or iterated to its end, so the engine forgets it."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue, num_samples: int):
        self._engine, self.request_id, self._queue = engine, request_id, queue
        self._remaining = num_samples

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._remaining:
            self.close()
            raise StopAsyncIteration
        out = await self._queue.get()
        if isinstance(out, BaseException):  # the engine died, or refused the request: nothing to abort
            self._remaining = 0
            self.close()
            raise out
        self._remaining -= out.finished
        return out

    def close(self) -> None:
        self._engine._close_stream(self.request_id, finished=not self._remaining)


class AsyncEngine:
    """Owns the engine thread. Invariant: a stream in `_streams` gets every output of its request and
    then ends, or gets an exception (engine dead or stopped); it is removed by its consumer."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._inbox: list[_Add | _Abort] = []
        self._num_unapplied = 0  # samples posted in the inbox and not yet in engine.stats().num_waiting
        self._wake = threading.Condition()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.last_progress = time.monotonic()  # last step that ran (or idle moment)
        self.stats: EngineStats = engine.stats()
        self.finished_listeners: list[Callable[[RequestOutput], None]] = []  # engine thread, each final output
        # engine thread, once per step with all its outputs and the time they were produced (monotonic)
        self.step_listeners: list[Callable[[list[RequestOutput], float], None]] = []
        self._step_s = self._overhead_s = self._max_gap_s = 0.0
        self._num_loop_steps = 0
        self._last_step_end: float | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------

    @classmethod
    async def launch(cls, build: Callable[[], LLMEngine]) -> AsyncEngine:
        """Build an engine with `build` on a new engine thread and run its step loop there."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[AsyncEngine] = loop.create_future()

        def settle(result: AsyncEngine | None, error: BaseException | None) -> None:
            if ready.done():  # the caller was cancelled
                return
            if error is not None:
                ready.set_exception(error)
            else:
                ready.set_result(result)

        def main() -> None:
            try:
                engine = cls(build())
            except BaseException as exc:  # noqa: BLE001 - the caller gets it, whatever it is
                loop.call_soon_threadsafe(settle, None, exc)
                return
            engine._thread = threading.current_thread()
            loop.call_soon_threadsafe(settle, engine, None)
            engine._run()

        threading.Thread(target=main, name="tinyserve-engine", daemon=True).start()
        return await ready

    def stop(self) -> None:
        """Stop the loop after its current step; streams still open get EngineDeadError."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._fail_all(EngineDeadError("engine stopped"))

    @property
    def is_alive(self) -> bool:
        return (self.error is None and not self._stopping and self._thread is not None
                and self._thread.is_alive())

    def is_stalled(self, timeout: float) -> bool:
        """Work is pending but no step has finished for `timeout` seconds."""
        return bool(self._streams) and time.monotonic() - self.last_progress > timeout

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

    # ---- requests ----------------------------------------------------------------------------------

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               priority: int = 0, arrival_time: float | None = None) -> RequestStream:
        """Queue a request now (synchronously, from the event loop's thread) and return its stream.
        Raises ValueError (the engine's validation) or EngineDeadError before anything is queued."""
        if not self.is_alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        self.engine.validate(prompt_token_ids, params)  # reads config only: safe from this thread
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._post(_Add(request_id, prompt_token_ids, params, priority, arrival))
        return RequestStream(self, request_id, queue, params.n)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (all n samples interleaved) until every sample has finished.
        Closing the iterator early (client gone) aborts the request."""
        stream = self.submit(request_id, prompt_token_ids, params, priority, arrival_time)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _close_stream(self, request_id: str, finished: bool) -> None:
        if self._streams.pop(request_id, None) is not None and not finished:
            self._post(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        """Finish the request with FinishReason.ABORT at the next step; its stream gets the final outputs."""
        self._post(_Abort(request_id))

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self._post(_Abort(request_id))

    def _post(self, item: _Add | _Abort) -> None:
        with self._wake:
            self._inbox.append(item)
            if isinstance(item, _Add):
                self._num_unapplied += item.params.n
            self._wake.notify()

    # ---- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._inbox and not self.engine.has_unfinished_requests() and not self._stopping:
                        self.last_progress = time.monotonic()
                        self._last_step_end = None
                        self._wake.wait()
                    if self._stopping:
                        return
                    inbox, self._inbox = self._inbox, []
                self._iterate(inbox)
        except BaseException as exc:  # noqa: BLE001 - any escape kills the loop: report it everywhere
            logger.exception("engine loop died")
            self.error = exc
            self._fail_all(EngineDeadError(f"engine failed: {exc!r}"))

    def _iterate(self, inbox: list[_Add | _Abort]) -> None:
        """Apply the inbox, run one step if there is work, publish stats and outputs."""
        start = time.perf_counter()
        outputs = self._apply(inbox)
        step_s = 0.0
        if self.engine.has_unfinished_requests():
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

    def _apply(self, inbox: list[_Add | _Abort]) -> list[RequestOutput]:
        outputs = []
        num_added = 0
        for item in inbox:
            if isinstance(item, _Abort):
                outputs += self.engine.abort(item.request_id)
                continue
            num_added += item.params.n
            try:
                self.engine.add_request(item.request_id, item.prompt_token_ids, item.params,
                                        item.priority, item.arrival_time)
            except ValueError as exc:  # validated before, so only a race (e.g. duplicate id) lands here
                self._deliver_error(item.request_id, exc)
        if num_added:
            self.stats = self.engine.stats()  # the new samples now count in stats.num_waiting
            with self._wake:
                self._num_unapplied -= num_added
        return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            if out.finished:
                for listener in self.finished_listeners:
                    listener(out)
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in by_loop.items():
            _call_soon(loop, items)
        if outputs:
            now = time.monotonic()
            for listener in self.step_listeners:
                listener(outputs, now)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            _call_soon(stream[0], [(stream[1], exc)])

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver_error(request_id, exc)


def _call_soon(loop: asyncio.AbstractEventLoop, items: list) -> None:
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass


def _put_all(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)


__all__ = ["AsyncEngine", "EngineDeadError", "FinishReason", "LoopStats", "RequestStream"]
