"""The slow-reader guard of every streaming endpoint (HTTP's server-sent events, gRPC's GenerateStream).

A client that reads nothing fills its socket (or its flow-control window) and makes a write wait. A write
that waits WRITE_BLOCKED_S pauses the request at once (its engine requests give up their seats and blocks
to others) until the writes flow again; one that waits `write_timeout` seconds raises TimeoutError, and
the endpoint ends the stream, which closes the generation: the request aborts and holds nothing. A write
into a socket with room returns without waiting, and no timer fires.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import anyio

# a stream write waiting this long means the socket's buffers are full: the client has stopped reading
WRITE_BLOCKED_S = 0.05
T = TypeVar("T")


class SlowReaderGuard(Generic[T]):
    """`send` (the transport's write of one message) under the slow-reader rules; `pause(True)` when a
    write is blocked, `pause(False)` once it went through (Generation.set_writer_blocked)."""

    def __init__(self, send: Callable[[T], Awaitable[object]], pause: Callable[[bool], None], write_timeout: float):
        self._send, self._pause, self.write_timeout = send, pause, write_timeout

    async def send(self, message: T) -> None:
        """Raises TimeoutError when the write waited `write_timeout` (the client stopped reading)."""
        is_blocked = False

        def on_blocked() -> None:
            nonlocal is_blocked
            is_blocked = True
            self._pause(True)

        timer = asyncio.get_running_loop().call_later(WRITE_BLOCKED_S, on_blocked)
        try:
            with anyio.fail_after(self.write_timeout):
                await self._send(message)
        finally:
            timer.cancel()
        if is_blocked:
            self._pause(False)
