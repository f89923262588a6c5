"""AsyncEngine's stall detection with a real hung step: the model runner's forward pass blocks on an
Event, in a live server (a tiny random Llama with the default tokenizer, so that a step takes
milliseconds and no ordinary step comes near the stall timeout).

What async_engine.py and docs/ARCHITECTURE.md promise: once one step has run longer than
`stall_timeout`, /health says 503 "engine_stalled" and the watchdog fails every open stream (the clients
get code "engine_stalled"), long before their own request timeout; the engine is not marked dead, and
when the step returns, the aborts the watchdog posted free the blocks and the engine serves again.
"""

import asyncio
import json
import logging
import threading
import time

import httpx
import pytest
from reliability.conftest import tiny_server

from tinyserve.loader.gguf.checkpoint import open_gguf
from tinyserve.loader.model_loader import resolve_model_path
from tinyserve.loader.tokenizer import Tokenizer

STALL_TIMEOUT_S = 2.0
REQUEST_TIMEOUT_S = 20.0  # the clients' own deadline: the stall must answer them well before it
WATCHDOG_SLACK_S = 1.0  # the watchdog looks every stall_timeout / 4; plus a loaded CI machine
LONG = {"prompt": "Hang on", "max_tokens": 100, "ignore_eos": True, "temperature": 0}  # greedy: the same run each time


class HangingRunner:
    """Blocks the engine's forward pass, once, at the first step that decodes both requests of the test
    (each has streamed tokens by then), until `release` is set."""

    def __init__(self):
        self.hung = threading.Event()
        self.release = threading.Event()
        self.hung_at: float | None = None

    def wrap(self, engine):
        execute = engine.runner.execute

        def hanging_execute(scheduled):
            if not self.hung.is_set() and len(scheduled) == 2 and all(r.num_output_tokens for r, _ in scheduled):
                self.hung_at = time.monotonic()
                self.hung.set()
                self.release.wait(60)
            return execute(scheduled)

        engine.runner.execute = hanging_execute
        return engine


async def _stream(client: httpx.AsyncClient) -> tuple[list[str], float]:
    """The stream's data events and when it ended."""
    async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    return events, time.monotonic()


async def _post(client: httpx.AsyncClient, body: dict) -> tuple[httpx.Response, float]:
    r = await client.post("/v1/completions", json=body)
    return r, time.monotonic()


async def _first_health_503(client: httpx.AsyncClient, hung_at: float) -> tuple[httpx.Response, list]:
    """Polls /health until it says 503; every (seconds since the hang, status) seen on the way."""
    seen = []
    while True:
        r = await client.get("/health")
        seen.append((time.monotonic() - hung_at, r.status_code))
        if r.status_code == 503:
            return r, seen
        assert seen[-1][0] < STALL_TIMEOUT_S + WATCHDOG_SLACK_S, f"/health still 200: {seen}"
        await asyncio.sleep(0.05)


def _assert_stalled_answer(body: dict) -> None:
    assert body["error"]["code"] == "engine_stalled" and "the engine stalled" in body["error"]["message"], body


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(resolve_model_path("smollm2-135m")))


def test_a_hung_step_is_reported_its_clients_answered_and_the_engine_recovers(tokenizer, caplog):
    hang = HangingRunner()
    with tiny_server(tokenizer, wrap_engine=hang.wrap, stall_timeout=STALL_TIMEOUT_S,
                     request_timeout=REQUEST_TIMEOUT_S) as server:
        finish_reasons = []  # of each sample the engine finished, in order
        server.state.engine.step_listeners.append(
            lambda outputs, now: finish_reasons.extend(o.finish_reason.value for o in outputs if o.finished))

        async def during_the_hang():
            async with httpx.AsyncClient(base_url=server.base_url, timeout=REQUEST_TIMEOUT_S + 10) as client:
                streamed = asyncio.create_task(_stream(client))
                held = asyncio.create_task(_post(client, LONG))
                assert await asyncio.to_thread(hang.hung.wait, 30), "the two requests never shared a step"
                assert server.state.engine.num_in_flight == 2
                health, seen = await _first_health_503(client, hang.hung_at)
                # a request that arrives during the hang is admitted, then failed at the watchdog's next look
                sent_at = time.monotonic()
                late, late_end = await _post(client, {"prompt": "Hi", "max_tokens": 2})
                return health, seen, await asyncio.gather(streamed, held), late, late_end - sent_at

        try:
            with caplog.at_level(logging.ERROR, logger="tinyserve.engine.loop.async_engine"):
                health, seen, (streamed, held), late, late_wait_s = asyncio.run(during_the_hang())
        finally:
            hang.release.set()

        assert health.json() == {"status": "engine_stalled"} and health.headers["retry-after"] == "5"
        assert STALL_TIMEOUT_S - 0.5 <= seen[-1][0] <= STALL_TIMEOUT_S + WATCHDOG_SLACK_S, seen
        assert all(code == 200 for _, code in seen[:-1])  # not before the stall timeout
        (events, stream_end), (held, held_end) = streamed, held
        for end in (stream_end, held_end):  # both waiting clients answered, long before their own timeout
            assert end - hang.hung_at <= STALL_TIMEOUT_S + WATCHDOG_SLACK_S, f"answered {end - hang.hung_at:.1f}s in"
        assert events[-1] == "[DONE]" and json.loads(events[0])["choices"][0]["text"]  # tokens, then the hang
        _assert_stalled_answer(json.loads(events[-2]))
        assert held.status_code == 503 and held.headers["retry-after"] == "5"
        _assert_stalled_answer(held.json())
        assert late.status_code == 503 and late_wait_s <= WATCHDOG_SLACK_S
        _assert_stalled_answer(late.json())
        stalled_logs = [r.getMessage() for r in caplog.records if "engine stalled" in r.getMessage()]
        assert stalled_logs == [f"engine stalled: one step has run for over {STALL_TIMEOUT_S:.0f}s"]  # once

        # released: the hung step returns, the aborts the watchdog posted free everything, and it serves again
        deadline = time.monotonic() + 10
        while httpx.get(server.base_url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "not healthy again after the hang"
            time.sleep(0.05)
        after = httpx.post(server.base_url + "/v1/completions", timeout=30,
                           json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
        assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"
        # listeners run on the engine thread after the step's outputs went to the event loop: the response
        # can come back first
        deadline = time.monotonic() + 5
        while len(finish_reasons) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        # the two hung requests were aborted, not run on to max_tokens; the late one never reached the engine
        assert sorted(finish_reasons) == ["abort", "abort", "length"], finish_reasons
        engine = server.state.engine
        assert engine.is_alive and engine.error is None and engine.num_in_flight == 0
        assert not server.llm_engine.has_unfinished_requests()
        assert server.num_free_blocks == server.num_blocks
        time.sleep(STALL_TIMEOUT_S + WATCHDOG_SLACK_S)  # idle that long is no stall
        assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
