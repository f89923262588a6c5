"""Runs the engine's step loop in its own thread and gives each request an async stream of outputs.

Why a thread: the forward pass spends its time inside torch kernels that release the GIL, so the
asyncio loop (HTTP parsing, SSE writes) keeps running during a step, and a burst of HTTP work never
delays the next step by more than the Python slices it needs. Only the engine thread touches the
LLMEngine; other threads hand it work through a locked inbox and get outputs back through
`loop.call_soon_threadsafe`, one call per step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
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


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._inbox: list[_Add | _Abort] = []
        self._wake = threading.Condition()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.last_progress = time.monotonic()  # last step that ran (or idle moment)
        self.stats: EngineStats = engine.stats()
        self.finished_listeners: list = []  # called in the engine thread with each final RequestOutput

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tinyserve-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def is_stalled(self, timeout: float) -> bool:
        """Work is pending but no step has finished for `timeout` seconds."""
        return bool(self._streams) and time.monotonic() - self.last_progress > timeout

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests ----------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (all n samples interleaved) until every sample has finished.
        Closing the iterator early (client gone) aborts the request."""
        if not self.is_alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        self.engine.validate(prompt_token_ids, params)  # reads config only: safe from this thread
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._post(_Add(request_id, prompt_token_ids, params, priority, arrival))
        remaining = params.n
        try:
            while remaining:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                remaining -= out.finished
                yield out
        finally:
            if self._streams.pop(request_id, None) is not None and remaining:
                self._post(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._post(_Abort(request_id))

    def _post(self, item: _Add | _Abort) -> None:
        with self._wake:
            self._inbox.append(item)
            self._wake.notify()

    # ---- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._inbox and not self.engine.has_unfinished_requests() and not self._stopping:
                        self.last_progress = time.monotonic()
                        self._wake.wait()
                    if self._stopping:
                        return
                    inbox, self._inbox = self._inbox, []
                outputs = self._apply(inbox)
                if self.engine.has_unfinished_requests():
                    outputs += self.engine.step()
                self.last_progress = time.monotonic()
                self.stats = self.engine.stats()
                self._deliver(outputs)
        except BaseException as exc:  # noqa: BLE001 - any escape kills the loop: report it everywhere
            logger.exception("engine loop died")
            self.error = exc
            self._fail_all(exc)

    def _apply(self, inbox: list[_Add | _Abort]) -> list[RequestOutput]:
        outputs = []
        for item in inbox:
            if isinstance(item, _Abort):
                outputs += self.engine.abort(item.request_id)
                continue
            try:
                self.engine.add_request(item.request_id, item.prompt_token_ids, item.params,
                                        item.priority, item.arrival_time)
            except ValueError as exc:  # validated before, so only a race (e.g. duplicate id) lands here
                self._deliver_error(item.request_id, exc)
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
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream[0].call_soon_threadsafe(_put_all, [(stream[1], exc)])

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver_error(request_id, EngineDeadError(f"engine failed: {exc!r}"))


def _put_all(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)


__all__ = ["AsyncEngine", "EngineDeadError", "FinishReason"]
