"""server/intake/slow_reader.py's guard on its own, over fake sends: a write into room never pauses, a blocked
write pauses once and resumes when it goes through, a write blocked past the timeout raises TimeoutError
still paused (the stream ends and closes the generation)."""

import asyncio

import pytest

from tinyserve.server.intake.slow_reader import WRITE_BLOCKED_S, SlowReaderGuard


def _run(send_wait_s: float, write_timeout: float) -> tuple[list[bool], list[str]]:
    pauses, sent = [], []

    async def send(message: str) -> None:
        await asyncio.sleep(send_wait_s)
        sent.append(message)

    async def main() -> None:
        guard = SlowReaderGuard(send, pauses.append, write_timeout)
        await guard.send("a")
        await guard.send("b")

    asyncio.run(main())
    return pauses, sent


def test_a_write_into_room_never_pauses():
    assert _run(0.0, 1.0) == ([], ["a", "b"])


def test_a_blocked_write_pauses_until_it_goes_through():
    assert _run(WRITE_BLOCKED_S * 4, 5.0) == ([True, False, True, False], ["a", "b"])


def test_a_write_blocked_past_the_timeout_raises_still_paused():
    pauses = []

    async def never(message: str) -> None:
        await asyncio.Event().wait()

    async def main() -> None:
        await SlowReaderGuard(never, pauses.append, WRITE_BLOCKED_S * 4).send("a")

    with pytest.raises(TimeoutError):
        asyncio.run(main())
    assert pauses == [True]
