"""The shutdown matrix, each case 5 times on a real server process (tests/reliability/serve_tiny.py):
SIGTERM while loading, with 64 streams in flight, twice within 1 s, SIGTERM then SIGINT, and during a
hung step. Each must exit within shutdown_timeout + 10 s with the documented code, every in-flight
client must get its text or finish_reason "abort" plus `[DONE]`, a request sent while draining gets
503, and the log holds no traceback."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from .server_process import EXIT_BUDGET_S, ServerProcess

pytestmark = pytest.mark.reliability

REPEATS = 5
NUM_STREAMS = 64


async def _stream(client: httpx.AsyncClient, started: asyncio.Event, counter: list) -> list[str]:
    body = {"prompt": "shutdown", "max_tokens": 100, "ignore_eos": True, "stream": True}
    events: list[str] = []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        counter.append(1)
                        if len(counter) == NUM_STREAMS:
                            started.set()
    except httpx.HTTPError as exc:
        events.append(f"transport error {type(exc).__name__}")
    return events


def _run_streams_then(server: ServerProcess, signals: list[tuple[float, int]], hang: bool = False):
    """Open NUM_STREAMS streams, then (optionally hang the engine and) send `signals` [(delay, signal)];
    returns every stream's events and the status of a request sent while draining."""
    async def main():
        started, counter = asyncio.Event(), []
        limits = httpx.Limits(max_connections=NUM_STREAMS + 8)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits) as client:
            tasks = [asyncio.create_task(_stream(client, started, counter)) for _ in range(NUM_STREAMS)]
            await asyncio.wait_for(started.wait(), 30)
            if hang:
                server.hang_file.touch()
                await asyncio.sleep(0.5)
            for delay, sig in signals:
                await asyncio.sleep(delay)
                server.proc.send_signal(sig)
            draining_status = None
            if len(signals) == 1:
                await asyncio.sleep(0.2)
                try:
                    r = await client.post("/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5)
                    draining_status = r.status_code
                except httpx.HTTPError:
                    draining_status = "closed"
            return await asyncio.gather(*tasks), draining_status

    return asyncio.run(main())


def _check_clients(all_events: list[list[str]]) -> None:
    for events in all_events:
        assert events and events[-1] == "[DONE]", events[-3:]
        finals = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]
                  if e.startswith("{") and json.loads(e).get("choices")]
        assert finals and finals[-1] in ("abort", "length"), events[-3:]


def _check_log(server: ServerProcess) -> None:
    log = server.log()
    assert "Traceback" not in log, log


@pytest.mark.parametrize("repeat", range(REPEATS))
def test_sigterm_while_loading(tmp_path, repeat):
    server = ServerProcess(tmp_path, "--load-delay", "30")
    try:
        assert server.wait_health({503}) == 503  # bound, still loading
        server.proc.send_signal(signal.SIGTERM)
        code, elapsed = server.wait_exit()
        assert elapsed <= EXIT_BUDGET_S and code == 0, (code, elapsed, server.log())
        _check_log(server)
    finally:
        server.close()


@pytest.mark.parametrize("hang", [False, True], ids=["streams_in_flight", "during_a_hung_step"])
@pytest.mark.parametrize("repeat", range(REPEATS))
def test_sigterm_drains_then_aborts(tmp_path, repeat, hang):
    server = ServerProcess(tmp_path, "--step-delay", "0.05")
    try:
        server.wait_health({200})
        events, draining_status = _run_streams_then(server, [(0, signal.SIGTERM)], hang=hang)
        code, elapsed = server.wait_exit()
        assert elapsed <= EXIT_BUDGET_S and code == 0, (code, elapsed)
        _check_clients(events)
        assert draining_status in (503, "closed"), draining_status
        _check_log(server)
    finally:
        server.close()


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["twice", "then_sigint"])
@pytest.mark.parametrize("repeat", range(REPEATS))
def test_second_signal_exits_at_once(tmp_path, repeat, second):
    server = ServerProcess(tmp_path, "--step-delay", "0.05")
    try:
        server.wait_health({200})
        events, _ = _run_streams_then(server, [(0, signal.SIGTERM), (0.5, second)])
        code, elapsed = server.wait_exit()
        assert elapsed <= EXIT_BUDGET_S and code == 128 + second, (code, elapsed)  # the documented code
        _check_clients(events)
        _check_log(server)
    finally:
        server.close()
