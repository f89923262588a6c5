"""One request's run through the engine, shared by chat, completions and gRPC (server/intake/request_start.py).

A Generation owns one engine request (all its prompts) and its one stream, and numbers the outputs as
OpenAI's choice indices (prompt i, sample j -> i * n + j). Its deadline is counted from the request's
arrival and kept here, on the event loop: when it passes, every unfinished sample ends at once with
finish_reason "timeout", even if the engine thread is stuck in a step (a request still waiting is never
scheduled); the engine frees the blocks when it gets to the abort. Not streaming, the reply carries the
text so far (a 504 if no sample got a token); a stream sends those finish reasons, then an error event. A client that goes away closes the generation (streaming) or
triggers `abort()` (non-streaming), which aborts the engine request. A streaming client that reads nothing for
`write_timeout` seconds is cut off the same way (server/intake/slow_reader.py). When the run ends, one log line records it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

import anyio
from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tinyserve.engine.loop.async_engine import AsyncEngine, EngineDeadError
from tinyserve.engine.loop.request_stream import RequestStream
from tinyserve.server.intake.admission import AdmissionTicket
from tinyserve.server.errors import APIError, ServiceUnavailable, Timeout
from tinyserve.server.openai_api.responses import ChatChunk, CompletionChunk, UsageInfo
from tinyserve.server.intake.slow_reader import SlowReaderGuard
from tinyserve.types import FinishReason, RequestOutput, SamplingParams, TokenLogprob

request_log = logging.getLogger("tinyserve.requests")
SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class Choice:
    """What one choice has produced so far (the non-streaming response is built from these)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None  # its prompt's, when asked for (engine: first output)


class Generation:
    """Invariant: after `start()`, the engine request is closed by `close()` (idempotent), which the
    non-streaming path calls when it ends and the SSE response calls whatever happens to its body."""

    def __init__(self, engine: AsyncEngine, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 priority: int, arrival_time: float, timeout: float | None, http_request_id: str = "-",
                 cache_salt: str | None = None):
        self.engine, self.request_id, self.prompts, self.params = engine, request_id, prompts, params
        self.http_request_id = http_request_id  # X-Request-Id: what the client can quote
        self.priority, self.arrival_time, self.timeout = priority, arrival_time, timeout
        self.cache_salt = cache_salt
        self._ticket: AdmissionTicket | None = None  # adaptive admission's, told of the first token
        self.choices = [Choice() for _ in range(len(prompts) * params.n)]
        self._stream: RequestStream | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._logged = False
        self._first_token_time: float | None = None
        self._first_scheduled_time: float | None = None

    def start(self, ticket: AdmissionTicket | None = None) -> None:
        """Queue every prompt in the engine now: no await between the caller's admission check and this."""
        self._ticket = ticket
        self._stream = self.engine.submit(self.request_id, self.prompts, self.params, self.priority,
                                          self.arrival_time, self.cache_salt)
        if self.timeout is not None:
            self._timer = asyncio.get_running_loop().call_at(self.arrival_time + self.timeout, self._on_timeout)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def usage(self) -> UsageInfo:
        cached = sum(c.cached_tokens for c in self.choices[:: self.params.n])  # one sample per prompt
        return UsageInfo.of(self.num_prompt_tokens, self.num_completion_tokens, cached)

    def abort(self) -> None:
        """Ask the engine to finish every sample now (finish_reason abort); the outputs still arrive."""
        if self._stream is not None:
            self.engine.abort(self.request_id)

    def engine_error(self, exc: EngineDeadError | None = None) -> APIError:
        """What the client is told when the engine failed this request (500) or cannot serve (503)."""
        if exc is None:
            return APIError(f"generation failed (request id {self.http_request_id})", code="engine_error")
        return ServiceUnavailable(f"{exc} (request id {self.http_request_id})", code=exc.code, retry_after=5)

    def set_writer_blocked(self, blocked: bool) -> None:
        """The response's writes wait on a full socket (True) or flow again (False): pause or resume."""
        if self._stream is not None:
            self._stream.set_reader_blocked(blocked)

    def _on_timeout(self) -> None:
        if self._stream is not None:
            self._stream.cancel(FinishReason.TIMEOUT)

    @property
    def hit_deadline(self) -> bool:
        """Some sample was ended by the deadline (not merely: the timer fired after they all finished)."""
        return any(c.finish_reason == FinishReason.TIMEOUT.value for c in self.choices)

    def timeout_error(self) -> Timeout:
        return Timeout(f"the request timed out after {self.timeout:g}s", code="request_timeout")

    def close(self) -> None:
        """Stop listening: unfinished engine requests are aborted and their blocks freed."""
        if self._timer is not None:
            self._timer.cancel()
        if self._ticket is not None:
            self._ticket.close()
        if self._stream is not None:
            self._stream.close()
        if self._stream is not None and not self._logged:
            self._logged = True
            self._log()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) until every choice has finished; updates `choices` on the way."""
        try:
            async for out in self._stream:
                index = out.prompt_index * self.params.n + out.index
                self._record(self.choices[index], out)
                yield index, out
        finally:
            self.close()

    def _record(self, choice: Choice, out: RequestOutput) -> None:
        if out.new_token_ids and self._ticket is not None:
            self._ticket.first_token(time.monotonic() - self.arrival_time)
        if out.new_text:
            choice.text.append(out.new_text)
        choice.token_ids += out.new_token_ids
        if out.logprobs:
            choice.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            choice.finish_reason = out.finish_reason.value
            choice.error = out.error
            if out.usage is not None:
                choice.cached_tokens = out.usage.cached_tokens
            m = out.metrics
            if m is not None:
                self._first_scheduled_time = _earliest(self._first_scheduled_time, m.first_scheduled_time)
                self._first_token_time = _earliest(self._first_token_time, m.first_token_time)

    def _log(self) -> None:
        def since_arrival(t: float | None) -> str:
            return "-" if t is None else f"{t - self.arrival_time:.3f}"

        reasons = sorted({c.finish_reason or "abort" for c in self.choices})  # no final seen: client gone
        request_log.info(
            "request finished id=%s request_id=%s prompt_tokens=%d output_tokens=%d queue_s=%s ttft_s=%s "
            "total_s=%.3f finish_reason=%s", self.request_id, self.http_request_id, self.num_prompt_tokens,
            self.num_completion_tokens,
            since_arrival(self._first_scheduled_time), since_arrival(self._first_token_time),
            time.monotonic() - self.arrival_time, ",".join(reasons),
        )


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


async def collect_while_connected(generation: Generation, request: Request) -> None:
    """Non-streaming HTTP: `collect` while watching for the client's disconnect (then abort)."""
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        generation.abort()

    watcher = asyncio.create_task(watch())
    try:
        await collect(generation)
    finally:
        watcher.cancel()


async def collect(generation: Generation) -> None:
    """Consume every output into `generation.choices`. Raises the APIError the client gets when the run
    did not end normally. Cancelled (the client is gone), it closes the generation: the request aborts."""
    try:
        async for _ in generation.outputs():  # closes the generation when it ends, however it ends
            pass
    except EngineDeadError as exc:
        raise generation.engine_error(exc) from None
    if generation.hit_deadline and not generation.num_completion_tokens:
        raise generation.timeout_error()
    if any(c.error for c in generation.choices):
        raise generation.engine_error()


async def event_stream(generation: Generation, chunk: Callable[..., CompletionChunk | ChatChunk],
                       include_usage: bool, choice: Callable[[int, RequestOutput], BaseModel | None],
                       prelude: Iterable[BaseModel] = (), continuous_usage: bool = False) -> AsyncIterator[bytes]:
    """SSE chunks: `chunk(choices=..., usage=...)` around `prelude` choices, then `choice(index, output)`
    for each output (None: nothing to send), the usage chunk if asked, and `[DONE]`. With `continuous_usage`
    every chunk carries the whole request's usage so far. An error after the stream started becomes an
    `error` event before `[DONE]`."""
    def event(choices: list, usage: UsageInfo | None = None) -> bytes:
        body = chunk(choices=choices, usage=generation.usage() if continuous_usage else usage).dump()
        if not (include_usage or continuous_usage):
            del body["usage"]
        return sse(body)

    try:
        for item in prelude:
            yield event([item])
        async for index, out in generation.outputs():
            item = choice(index, out)
            if item is not None:
                yield event([item])
            if out.error:
                yield sse(generation.engine_error().body())
        if include_usage:
            yield event([], generation.usage())
        if generation.hit_deadline:
            yield sse(generation.timeout_error().body())
    except EngineDeadError as exc:
        yield sse(generation.engine_error(exc).body())
    except Exception:  # noqa: BLE001 - a bug mid-stream: the client still gets an error event and [DONE]
        logging.getLogger(__name__).exception("unexpected error in stream %s", generation.http_request_id)
        error = APIError(f"internal server error (request id {generation.http_request_id})", code="internal_error")
        yield sse(error.body())
    yield SSE_DONE


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """Server-sent events that listen for the client's disconnect for the whole stream, whatever ASGI
    version the server speaks, so a client gone while its request still waits is noticed at once: the
    body iterator is cancelled, which closes the engine stream and aborts the request. Its writes go
    through the slow-reader guard (server/intake/slow_reader.py): a blocked write pauses the generation, and a
    client that reads nothing for `write_timeout` seconds ends the response the same way."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], generation: Generation, write_timeout: float):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.generation = generation
        self.write_timeout = write_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guard = SlowReaderGuard(send, self.generation.set_writer_blocked, self.write_timeout)
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    try:
                        await self.stream_response(guard.send)
                    except OSError:  # the client went away mid-write, or stopped reading (TimeoutError)
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self.generation.close()  # even if the body never started: the engine must forget the request
