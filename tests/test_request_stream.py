"""RequestStream's bounded buffer: when a lagging reader pauses its request and when it resumes, with a
recording stand-in for the AsyncEngine (a StreamOwner: the stream only calls set_paused and close_stream on it)."""

from __future__ import annotations

import asyncio

from tinyserve.engine.loop.request_stream import STREAM_HIGH_WATER, STREAM_LOW_WATER, RequestStream
from tinyserve.types import FinishReason, RequestOutput

NUM_SAMPLES = 2


class _RecordingEngine:
    def __init__(self):
        self.pauses: list[bool] = []
        self.closed: list[tuple[str, bool]] = []

    def set_paused(self, request_id: str, paused: bool) -> None:
        self.pauses.append(paused)

    def close_stream(self, request_id: str, finished: bool, reason: FinishReason = FinishReason.ABORT) -> None:
        self.closed.append((request_id, finished))


def _push_tokens(stream: RequestStream, count: int) -> None:
    for i in range(count):
        stream.push(RequestOutput("r", i % NUM_SAMPLES, "x", [1], None))


async def _read(stream: RequestStream, count: int) -> None:
    for _ in range(count):
        await stream.__anext__()


def test_a_backlog_of_high_water_per_sample_pauses_and_reading_to_low_water_resumes():
    async def scenario():
        engine = _RecordingEngine()
        stream = RequestStream(engine, "r", NUM_SAMPLES)
        high, low = STREAM_HIGH_WATER * NUM_SAMPLES, STREAM_LOW_WATER * NUM_SAMPLES
        _push_tokens(stream, high - 1)
        assert engine.pauses == []
        _push_tokens(stream, 1)
        assert engine.pauses == [True]
        _push_tokens(stream, 5)  # still paused: no second call
        await _read(stream, high + 5 - low - 1)
        assert engine.pauses == [True]
        await _read(stream, 1)  # backlog now at low water
        assert engine.pauses == [True, False]

    asyncio.run(scenario())


def test_a_blocked_writer_pauses_at_once_and_resumes_only_when_its_writes_flow_and_the_backlog_is_low():
    async def scenario():
        engine = _RecordingEngine()
        stream = RequestStream(engine, "r", NUM_SAMPLES)
        _push_tokens(stream, 1)
        stream.set_reader_blocked(True)
        assert engine.pauses == [True]
        low = STREAM_LOW_WATER * NUM_SAMPLES
        _push_tokens(stream, low + 2)  # outputs of the step that was running
        await _read(stream, 1)
        assert engine.pauses == [True], "blocked writes: reading alone must not resume"
        stream.set_reader_blocked(False)
        assert engine.pauses == [True], "writes flow but the backlog is above low water"
        await _read(stream, 2)
        assert engine.pauses == [True, False]
        stream.set_reader_blocked(True)
        stream.cancel()
        stream.set_reader_blocked(False)  # a cancelled stream asks nothing more of the engine
        assert engine.pauses == [True, False, True] and engine.closed == [("r", False)]

    asyncio.run(scenario())
