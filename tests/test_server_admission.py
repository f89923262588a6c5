"""Adaptive admission: the AIMD rule on a fake clock, then a live server that refuses past its limit with
a Retry-After from the measured drain rate, and exports the limit."""

import asyncio
import threading
import time

import httpx
import pytest

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.server.intake.admission import DECREASE_FACTOR, INITIAL_LIMIT, MIN_LIMIT, AdaptiveAdmission
from tinyserve.server.launcher import BackgroundServer


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_good_ttfts_add_one_per_limits_worth_and_bad_ones_cut_once_per_target_interval():
    clock, limits = Clock(), []
    admission = AdaptiveAdmission(target_ttft_s=2.0, max_limit=10, on_limit=limits.append, clock=clock)
    assert admission.limit == INITIAL_LIMIT and limits == [INITIAL_LIMIT]
    for _ in range(4):  # 4 good answers at limit 4: +1/4 each, one slot in all
        clock.now += 0.1
        admission.observe(1.0)
    assert admission.limit == pytest.approx(INITIAL_LIMIT + 1, abs=0.1)
    before = admission.limit
    admission.observe(1.5)  # under the target but without half of it to spare: the limit holds
    assert admission.limit == before and admission.num_increases == 4
    admission.observe(3.0)
    assert admission.limit == pytest.approx(before * DECREASE_FACTOR)
    clock.now += 1.0  # within one target interval of the cut: the same queue's late tokens count once
    admission.observe(5.0)
    assert admission.limit == pytest.approx(before * DECREASE_FACTOR) and admission.num_decreases == 1
    for _ in range(20):  # a long bad spell ends at the floor
        clock.now += 2.0
        admission.observe(9.0)
    assert admission.limit == MIN_LIMIT
    for _ in range(500):  # and a long good one at the ceiling (--max-queue)
        clock.now += 0.01
        admission.observe(0.5)
    assert admission.limit == 10 and limits[-1] == 10


def test_admits_while_pending_samples_fit_and_retry_after_follows_the_drain_rate():
    clock = Clock()
    admission = AdaptiveAdmission(target_ttft_s=1.0, max_limit=None, clock=clock)
    assert admission.retry_after() == 1  # nothing measured yet
    assert admission.admits(INITIAL_LIMIT + 10)  # alone, a request larger than the limit still goes
    tickets = [admission.ticket(1) for _ in range(4)]
    assert admission.num_pending == 4 and not admission.admits(1)
    tickets[0].first_token(0.5)  # a first token: no longer pending, and a good TTFT raises the limit
    tickets[1].close()  # ended without a token (client gone): released, no TTFT observed
    tickets[1].first_token(9.0)
    assert admission.num_pending == 2 and admission.num_increases == 1 and admission.num_decreases == 0
    assert admission.admits(2) and not admission.admits(3)
    for ticket in tickets[2:]:
        ticket.close()
    for _ in range(60):  # first tokens at 2 per second for 30 s
        clock.now += 0.5
        admission.ticket(1).first_token(0.1)
    for _ in range(10):
        admission.ticket(1)
    assert admission.retry_after() in (5, 6)  # 10 pending at ~2/s
    clock.now += 60  # no first token for a minute: the rate decays, the advice grows
    assert admission.retry_after() >= 30


def test_config_requires_a_target_with_adaptive_and_only_then():
    for kwargs in ({"admission": "adaptive"}, {"target_ttft": 1.0}, {"admission": "adaptive", "target_ttft": 0},
                   {"admission": "gradient", "target_ttft": 1.0}):
        with pytest.raises(ValueError):
            ServerConfig(**kwargs)
    assert ServerConfig(admission="adaptive", target_ttft=0.5).target_ttft == 0.5


@pytest.fixture(scope="module")
def loaded():
    from tinyserve.loader.model_loader import load_model

    return load_model("smollm2-135m", "float32", "cpu")


def _metric(base_url: str, name: str, label: str = "") -> float:
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith(f"tinyserve:{name}{{") and label in line.partition("}")[0]:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _adaptive_server(loaded, max_num_seqs: int, gate: threading.Event):
    """An adaptive server with a 1 ms target whose engine steps only while `gate` is set."""
    def build(cfg):
        engine = LLMEngine(cfg, loaded=loaded)
        step = engine.step

        def gated_step():
            gate.wait()
            return step()

        engine.step = gated_step
        return engine

    engine_config = EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory_gib=0.25),
                                 scheduler=SchedulerConfig(max_model_len=2048, max_num_seqs=max_num_seqs))
    config = ServerConfig(port=0, admission="adaptive", target_ttft=0.001, warmup=False)
    return BackgroundServer(engine_config, config, build).start()


def _to_the_floor(srv) -> None:
    """Five misses of the 1 ms target, each past the interval: 4 x 0.7^4 < 1, so the limit is at its floor."""
    assert _metric(srv.base_url, "admission_limit") == INITIAL_LIMIT
    for _ in range(5):
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "Go on:", "max_tokens": 1}, timeout=60)
        assert r.status_code == 200, r.text
        time.sleep(0.01)
    assert srv.state.default.admission.limit == MIN_LIMIT and _metric(srv.base_url, "admission_limit") == MIN_LIMIT


LONG = {"prompt": "Go on:", "max_tokens": 400, "ignore_eos": True}


def test_a_server_over_its_target_refuses_with_retry_after_and_exports_its_limit(loaded):
    """The limit at its floor (one sample without its first token): with one request running and one
    admitted to the free seat but not yet stepped, the next is refused before it is parsed."""
    gate = threading.Event()
    gate.set()
    srv = _adaptive_server(loaded, max_num_seqs=2, gate=gate)
    try:
        _to_the_floor(srv)

        async def run():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
                running = asyncio.create_task(client.post("/v1/completions", json=LONG))
                while srv.state.engine.stats.num_running < 1:
                    await asyncio.sleep(0.01)
                gate.clear()  # the engine stops before its next step: the next admission stays pending
                await asyncio.sleep(0.2)
                pending = asyncio.create_task(client.post("/v1/completions", json=LONG))
                while srv.state.engine.num_waiting < 1:
                    await asyncio.sleep(0.01)
                refused = await client.post("/v1/completions", content=b"not even JSON")
                srv.state.engine.abort_all()
                gate.set()
                return refused, await running, await pending

        refused, running, pending = asyncio.run(run())
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "overloaded" and "adaptive limit 1.0" in error["message"]
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert running.status_code == 200 and pending.status_code == 200  # ended by the abort, not refused
        assert _metric(srv.base_url, "request_rejected_total", 'reason="overloaded"') == 1
    finally:
        gate.set()
        srv.stop()


def test_with_every_seat_taken_only_a_request_that_preempts_is_admitted(loaded):
    """A wait for a seat lasts until a running request ends, so adaptive admission refuses it (after
    parsing, when the priority is known); a better priority than a running request's takes its seat."""
    gate = threading.Event()
    gate.set()
    srv = _adaptive_server(loaded, max_num_seqs=1, gate=gate)
    try:
        async def run():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
                running = asyncio.create_task(client.post("/v1/completions", json={**LONG, "priority": 5}))
                while srv.state.engine.stats.num_running < 1:
                    await asyncio.sleep(0.01)
                equal = await client.post("/v1/completions", json={**LONG, "max_tokens": 2, "priority": 5})
                better = await client.post("/v1/completions", json={**LONG, "max_tokens": 2, "priority": 0})
                srv.state.engine.abort_all()
                return equal, better, await running

        equal, better, running = asyncio.run(run())
        assert equal.status_code == 503, equal.text
        error = equal.json()["error"]
        assert error["code"] == "overloaded" and "every seat is taken: 1 sequences running" in error["message"]
        assert 1 <= int(equal.headers["retry-after"]) <= 60
        assert better.status_code == 200 and better.json()["usage"]["completion_tokens"] == 2, better.text
        assert running.status_code == 200
        assert _metric(srv.base_url, "num_preemptions_total") >= 1
    finally:
        srv.stop()


def test_an_admission_behind_a_request_already_past_the_target_cuts_the_limit_before_its_token():
    clock = Clock()
    admission = AdaptiveAdmission(target_ttft_s=1.0, max_limit=None, clock=clock)
    old = admission.ticket(1)
    clock.now += 0.5
    assert admission.admits(1) and admission.num_decreases == 0  # the oldest has waited 0.5 s: fine
    clock.now += 0.6
    assert admission.admits(1) and admission.limit == INITIAL_LIMIT * DECREASE_FACTOR  # 1.1 s: a miss
    old.first_token(1.2)  # its token, late, within the same interval: counted once
    assert admission.num_decreases == 1 and admission.num_pending == 0
