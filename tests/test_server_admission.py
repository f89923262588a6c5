"""Adaptive admission: the AIMD rule on a fake clock, then a live server that refuses past its limit with
a Retry-After from the measured drain rate, and exports the limit."""

import asyncio
import time

import httpx
import pytest

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.server.admission import DECREASE_FACTOR, INITIAL_LIMIT, MIN_LIMIT, AdaptiveAdmission
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


def test_a_server_over_its_target_refuses_with_retry_after_and_exports_its_limit(loaded):
    """One seat and a 1 ms target: every TTFT misses it, so the limit falls to its floor (one sample
    without its first token); with one request running and one waiting, the next is refused before it is
    parsed."""
    engine_config = EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory_gib=0.25),
                                 scheduler=SchedulerConfig(max_model_len=2048, max_num_seqs=1))
    config = ServerConfig(port=0, admission="adaptive", target_ttft=0.001, warmup=False)
    srv = BackgroundServer(engine_config, config, lambda cfg: LLMEngine(cfg, loaded=loaded)).start()
    slot = srv.state.default
    body = {"prompt": "Go on:", "max_tokens": 400, "ignore_eos": True}
    try:
        assert _metric(srv.base_url, "admission_limit") == INITIAL_LIMIT
        for _ in range(5):  # five misses, each past the 1 ms interval: 4 x 0.7^4 < 1 -> the floor, 1
            r = httpx.post(srv.base_url + "/v1/completions", json={**body, "max_tokens": 1}, timeout=60)
            assert r.status_code == 200, r.text
            time.sleep(0.01)
        assert slot.admission.limit == MIN_LIMIT and _metric(srv.base_url, "admission_limit") == MIN_LIMIT

        async def run():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
                running = asyncio.create_task(client.post("/v1/completions", json=body))
                while srv.state.engine.stats.num_running < 1:
                    await asyncio.sleep(0.01)
                waiting = asyncio.create_task(client.post("/v1/completions", json=body))
                while srv.state.engine.num_waiting < 1:
                    await asyncio.sleep(0.01)
                refused = await client.post("/v1/completions", content=b"not even JSON")
                srv.state.engine.abort_all()
                return refused, await running, await waiting

        refused, running, waiting = asyncio.run(run())
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "overloaded" and "adaptive limit 1.0" in error["message"]
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert running.status_code == 200 and waiting.status_code == 200  # ended by the abort, not refused
        assert _metric(srv.base_url, "request_rejected_total", 'reason="overloaded"') == 1
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
