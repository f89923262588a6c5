"""One request's stream of outputs on the event loop, with a bounded buffer.

A reader that falls behind pauses its request in the engine once `STREAM_HIGH_WATER` outputs per sample
wait in its buffer, or at once when the reader says its own writes are blocked (its client stopped
reading and the socket's buffers are full), and resumes it when its writes flow again and it has read the
backlog down to `STREAM_LOW_WATER`: a client that stops reading holds no seat and no blocks, and costs
only the few steps its buffers took to fill. `cancel()` ends a stream on the event
loop at once, without waiting for the engine thread, so deadlines hold even while a step hangs.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from tinyserve.types import FinishReason, RequestOutput

STREAM_HIGH_WATER = 16  # buffered outputs per sample before the request is paused
STREAM_LOW_WATER = 4  # ... and resumed


class StreamOwner(Protocol):
    """The engine that feeds a stream (AsyncEngine), as the stream sees it: it pauses and resumes the
    request there, and tells it when the stream closes (`finished`: every sample got its final output;
    otherwise the request is aborted with `reason`)."""

    def set_paused(self, request_id: str, paused: bool) -> None: ...

    def close_stream(self, request_id: str, finished: bool, reason: FinishReason = FinishReason.ABORT) -> None: ...


class RequestStream:
    """The outputs of one submitted request, every sample of each of its prompts interleaved, as an async
    iterator that ends when every sample has finished. `close()` (idempotent) aborts the request if it has not finished;
    every stream must be closed, or iterated to its end, so the engine forgets it.

    Lives on its event loop's thread: the engine thread hands it outputs through `call_soon_threadsafe`.
    Invariant: the consumer sees exactly one final output per sample, from the engine or from `cancel()`.
    """

    def __init__(self, engine: StreamOwner, request_id: str, n: int, num_prompts: int = 1):
        self._engine, self.request_id = engine, request_id
        self._queue: asyncio.Queue = asyncio.Queue()
        self._samples = [(p, i) for p in range(num_prompts) for i in range(n)]  # (prompt_index, index)
        self._num_samples = self._remaining = len(self._samples)
        self._finals_queued: set[tuple[int, int]] = set()  # samples whose final output is queued (or read)
        self._is_paused = False
        self._is_reader_blocked = False
        self._is_cancelled = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._remaining:
            self.close()
            raise StopAsyncIteration
        out = await self._queue.get()
        if self._is_paused:
            self._update_pause()
        if isinstance(out, BaseException):  # the engine died, or refused the request: nothing to abort
            self._remaining = 0
            self.close()
            raise out
        self._remaining -= out.finished
        return out

    def push(self, item: RequestOutput | BaseException) -> None:
        """Event loop thread: queue one item from the engine; pause the request when the reader lags."""
        if self._is_cancelled:
            return
        self._queue.put_nowait(item)
        if isinstance(item, RequestOutput) and item.finished:
            self._finals_queued.add((item.prompt_index, item.index))
        if not self._is_paused:
            self._update_pause()

    def set_reader_blocked(self, blocked: bool) -> None:
        """Event loop thread: the reader's writes wait (True) or flow again (False)."""
        self._is_reader_blocked = blocked
        if not self._is_cancelled:
            self._update_pause()

    def _update_pause(self) -> None:
        backlog = self._queue.qsize()
        if not self._is_paused and (self._is_reader_blocked or backlog >= STREAM_HIGH_WATER * self._num_samples):
            self._is_paused = True
            self._engine.set_paused(self.request_id, True)
        elif self._is_paused and not self._is_reader_blocked and backlog <= STREAM_LOW_WATER * self._num_samples:
            self._is_paused = False
            self._engine.set_paused(self.request_id, False)

    def cancel(self, reason: FinishReason = FinishReason.ABORT) -> None:
        """End the stream now, whatever the engine thread is doing: every sample without a final output
        gets one with `reason`, later engine outputs are dropped, and the engine is asked to abort (its
        blocks are freed when the engine thread gets there)."""
        if self._is_cancelled:
            return
        self._engine.close_stream(self.request_id, finished=False, reason=reason)
        for prompt_index, index in self._samples:
            if (prompt_index, index) not in self._finals_queued:
                self._queue.put_nowait(RequestOutput(self.request_id, index, "", [], reason,
                                                     prompt_index=prompt_index))
        self._finals_queued = set(self._samples)
        self._is_cancelled = True

    def close(self) -> None:
        self._engine.close_stream(self.request_id, finished=not self._remaining)
